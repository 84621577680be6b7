"""SGLang's serialized named tensors (`/update_weights_from_tensor`), read without running the sender's code.

A colocated trainer (slime's `--colocate`, verl) hands the engine its weights by reference: torch's
`ForkingPickler` pickles each tensor as a handle to shared memory (CPU: a named segment under the
`file_system` sharing strategy; CUDA: an IPC handle), base64-encoded, one string per engine rank. The
payload is either `[(name, tensor), ...]` (`load_format` None or "direct") or a flattened bucket
(`load_format` "flattened_bucket": `{"flattened_tensor": t, "metadata": [FlattenedTensorMetadata]}`,
sliced by element or, for a uint8 buffer of several dtypes, by byte).

Unpickling a request body would run whatever it names, so the unpickler here resolves only the few
globals those payloads use (torch's rebuild functions, storage types, dtypes, `torch.Size`, the metadata
class, mapped to a local stand-in since SGLang is not installed) and refuses anything else with a
`TensorPayloadError` (a 400). Under the `file_descriptor` strategy (torch's default) a tensor reaches
only processes that share the sender's authkey; an unrelated process (a trainer) must send with
`torch.multiprocessing.set_sharing_strategy("file_system")`.
"""

from __future__ import annotations

import base64
import binascii
import io
import pickle
from dataclasses import dataclass
from typing import Any

import torch

LOAD_FORMATS = (None, "direct", "flattened_bucket")

_REDUCTIONS = {"rebuild_tensor", "rebuild_typed_storage", "rebuild_storage_filename", "rebuild_storage_fd",
               "rebuild_cuda_tensor", "rebuild_storage_empty", "rebuild_typed_storage_child"}
_METADATA_MODULES = {"sglang.srt.weight_sync.tensor_bucket", "sglang.srt.model_executor.model_runner"}


class TensorPayloadError(ValueError):
    """The body's tensors cannot be read (bad encoding, a forbidden global, a broken bucket)."""


@dataclass
class FlattenedTensorMetadata:
    """Stand-in for SGLang's class of that name: where one tensor lies in a flattened bucket."""

    name: str = ""
    shape: Any = ()
    dtype: Any = None
    start_idx: int = 0
    end_idx: int = 0
    numel: int = 0


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module == "torch.multiprocessing.reductions" and name in _REDUCTIONS:
            import torch.multiprocessing.reductions as red

            return getattr(red, name)
        if module == "torch" and (name in ("Tensor", "Size", "UntypedStorage")
                                  or isinstance(getattr(torch, name, None), torch.dtype)):
            return getattr(torch, name)
        if (module, name) in (("torch.storage", "UntypedStorage"), ("torch.storage", "TypedStorage"),
                              ("torch.nn.parameter", "Parameter"), ("collections", "OrderedDict"),
                              ("multiprocessing.resource_sharer", "DupFd")):
            return super().find_class(module, name)
        if module in _METADATA_MODULES and name == "FlattenedTensorMetadata":
            return FlattenedTensorMetadata
        raise TensorPayloadError(f"the tensor payload names {module}.{name}, which is not a tensor, storage, "
                                 f"dtype or bucket type; refused")


def loads(data: str | bytes) -> Any:
    """One rank's payload (base64 text or raw bytes) -> the object the sender pickled."""
    if isinstance(data, str):
        try:
            data = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError):
            raise TensorPayloadError("serialized_named_tensors holds a string that is not base64") from None
    try:
        return _Unpickler(io.BytesIO(data)).load()
    except TensorPayloadError:
        raise
    except Exception as e:  # noqa: BLE001 - a handle that no longer opens, truncated data, ...
        hint = ""
        if "digest" in str(e) or "AuthenticationError" in type(e).__name__:
            hint = ("; a tensor shared by file descriptor opens only in processes with the sender's authkey: "
                    "send with torch.multiprocessing.set_sharing_strategy('file_system')")
        raise TensorPayloadError(f"the tensors cannot be opened ({type(e).__name__}: {e}){hint}") from None


def named_tensors(obj: Any, load_format: str | None) -> list[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs of one payload, checked for shape."""
    if load_format == "flattened_bucket":
        return _unflatten(obj)
    if not isinstance(obj, (list, tuple)) or not all(
            isinstance(x, (list, tuple)) and len(x) == 2 and isinstance(x[0], str) for x in obj):
        raise TensorPayloadError("a payload must be a list of (name, tensor) pairs (load_format "
                                 "'flattened_bucket' for a bucket)")
    bad = next((n for n, t in obj if not isinstance(t, torch.Tensor)), None)
    if bad is not None:
        raise TensorPayloadError(f"tensor {bad!r} is not a torch.Tensor")
    return [(n, t) for n, t in obj]


def _unflatten(obj: Any) -> list[tuple[str, torch.Tensor]]:
    if not isinstance(obj, dict) or not isinstance(obj.get("flattened_tensor"), torch.Tensor) \
            or not isinstance(obj.get("metadata"), list):
        raise TensorPayloadError("a flattened bucket must be {'flattened_tensor': tensor, 'metadata': [...]}")
    flat, out = obj["flattened_tensor"].reshape(-1), []
    for m in obj["metadata"]:
        if not isinstance(m, FlattenedTensorMetadata) or not isinstance(m.dtype, torch.dtype):
            raise TensorPayloadError("a flattened bucket's metadata must be FlattenedTensorMetadata entries")
        shape = tuple(int(x) for x in m.shape)
        n = 1
        for x in shape:
            n *= x
        a, b = int(m.start_idx), int(m.end_idx)
        by_bytes = flat.dtype == torch.uint8 and m.dtype != torch.uint8
        want = n * (m.dtype.itemsize if by_bytes else 1)
        if not 0 <= a <= b <= flat.numel() or b - a != want or int(m.numel) != n:
            raise TensorPayloadError(f"tensor {m.name!r}: bucket span [{a}, {b}) does not hold shape {shape} "
                                     f"of {m.dtype} in a buffer of {flat.numel()} {flat.dtype} elements")
        part = flat[a:b]
        t = part.view(m.dtype) if by_bytes else part
        out.append((str(m.name), (t if t.dtype == m.dtype else t.to(m.dtype)).reshape(shape)))
    return out


def read_payloads(payloads: list[str | bytes], load_format: str | None) -> list[tuple[str, torch.Tensor]]:
    """Every rank's payload merged by name (SGLang sends one per engine rank; an expert-parallel trainer
    sends each rank only its experts, so all of them are read; a name sent twice keeps the first)."""
    if load_format not in LOAD_FORMATS:
        raise TensorPayloadError(f"load_format {load_format!r} is not supported; use one of "
                                 f"{', '.join(repr(f) for f in LOAD_FORMATS)}")
    if not payloads:
        raise TensorPayloadError("serialized_named_tensors is empty; send one payload per engine rank")
    merged: dict[str, torch.Tensor] = {}
    for data in payloads:
        seen: set[str] = set()
        for name, t in named_tensors(loads(data), load_format):
            if name in seen:
                raise TensorPayloadError(f"tensor {name!r} is given twice in one payload")
            seen.add(name)
            merged.setdefault(name, t)
    return list(merged.items())
