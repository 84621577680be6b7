"""A colocated trainer's side of `/update_weights_from_tensor`, as a separate process on the same host.

It does what slime's `--colocate` weight push does (read from slime's update_weight_from_tensor.py, written
anew): every tensor of a checkpoint pickled by torch's ForkingPickler (so the bytes carry shared-memory
handles, not the data), base64 text, one payload per engine rank, either a list of (name, tensor) or a
flattened bucket whose metadata class lives in SGLang's module (a stand-in module is registered here, as
the trainer would have SGLang installed). The process must outlive the request: the receiver maps its
segments.

    python tensor_sender.py CKPT FORMAT STRATEGY COPIES post URL VERSION   # POST it, print the reply
    python tensor_sender.py CKPT FORMAT STRATEGY COPIES print              # print it, wait for stdin EOF
"""

from __future__ import annotations

import base64
import dataclasses
import io
import json
import sys
import types
from multiprocessing.reduction import ForkingPickler

import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file


def _metadata_class() -> type:
    mod = types.ModuleType("sglang.srt.weight_sync.tensor_bucket")

    @dataclasses.dataclass
    class FlattenedTensorMetadata:
        name: str
        shape: torch.Size
        dtype: torch.dtype
        start_idx: int
        end_idx: int
        numel: int

    FlattenedTensorMetadata.__module__ = mod.__name__
    FlattenedTensorMetadata.__qualname__ = "FlattenedTensorMetadata"
    mod.FlattenedTensorMetadata = FlattenedTensorMetadata
    for name in ("sglang", "sglang.srt", "sglang.srt.weight_sync"):
        sys.modules.setdefault(name, types.ModuleType(name))
    sys.modules[mod.__name__] = mod
    return FlattenedTensorMetadata


def payload(ckpt: str, fmt: str) -> object:
    tensors = sorted(load_file(f"{ckpt}/model.safetensors").items())
    if fmt == "direct":
        return tensors
    meta_cls, parts, metas, at = _metadata_class(), [], [], 0
    for name, t in tensors:  # one uint8 buffer, sliced by byte (SGLang's bucket of several dtypes)
        raw = t.contiguous().reshape(-1).view(torch.uint8)
        metas.append(meta_cls(name, t.shape, t.dtype, at, at + raw.numel(), t.numel()))
        parts.append(raw)
        at += raw.numel()
    return {"flattened_tensor": torch.cat(parts), "metadata": metas}


def serialize(obj: object) -> str:
    buf = io.BytesIO()
    ForkingPickler(buf).dump(obj)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def main(argv: list[str]) -> int:
    ckpt, fmt, strategy, copies, mode = argv[:5]
    mp.set_sharing_strategy(strategy)
    obj = payload(ckpt, fmt)
    body = {"serialized_named_tensors": [serialize(obj) for _ in range(int(copies))],
            "load_format": None if fmt == "direct" else "flattened_bucket", "flush_cache": True}
    if mode == "print":
        print(json.dumps(body), flush=True)
        sys.stdin.read()  # keep the segments alive until the receiver is done
        return 0
    import httpx

    url, version = argv[5], argv[6]
    r = httpx.post(url + "/update_weights_from_tensor", json={**body, "weight_version": version}, timeout=120)
    print(json.dumps({"status": r.status_code, "body": r.json()}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
