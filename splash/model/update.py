"""Replacing a loaded model's weights in place, on whatever share of them this rank holds now.

A weight update names checkpoint tensors (`model.layers.3.self_attn.kv_b_proj.weight`, full shapes,
as a trainer or a checkpoint has them). Each name maps to one or more *targets*: a live buffer of
this rank and the block of the full tensor it holds, given as the loader's spans (`rows`, `cols`,
`mid`, exactly as the module's `load` reads it) plus an optional reshaping (kv_b -> W_UK / W_UV).
The spans come from the live modules (`mla.heads`, `moe.experts`, `mlp.cols`, the vocabulary rows),
so an update lands in the layout that runs now: the head slice TP/DOP hold, the replicas of DP/CP,
the expert and vocabulary shards fixed at load.

Updates are all or nothing: `stage` reads every block into new tensors and checks it (raising
`WeightUpdateError` naming the tensor) before `commit` copies anything; copies are in place, so
fused views (q_a/kv_a, gate/up) and every reference to a buffer stay valid.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from splash.model.loader import Span, checkpoint_name, internal_name, span_index

FLOAT_DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16,
                "float16": torch.float16}


class WeightUpdateError(ValueError):
    """A weight update that cannot be applied (nothing was changed)."""


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """"bfloat16" / "torch.bfloat16" / a torch dtype -> torch dtype (floating types only)."""
    if isinstance(name, torch.dtype):
        if name in FLOAT_DTYPES.values():
            return name
        raise WeightUpdateError(f"dtype {name} is not a floating type splash can load")
    key = str(name).removeprefix("torch.")
    key = {"fp64": "float64", "fp32": "float32", "bf16": "bfloat16", "fp16": "float16",
           "half": "float16", "float": "float32", "double": "float64"}.get(key, key)
    if key not in FLOAT_DTYPES:
        raise WeightUpdateError(f"dtype {name!r} is not supported; use one of {', '.join(FLOAT_DTYPES)}")
    return FLOAT_DTYPES[key]


class TensorReader:
    """`CheckpointReader`'s interface over full tensors held in memory, so the loader's spans apply."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self.tensors = dict(tensors)
        self.path = "<tensors>"

    def keys(self) -> list[str]:
        return list(self.tensors)

    def has(self, name: str) -> bool:
        return name in self.tensors

    def shape(self, name: str) -> list[int]:
        return list(self.tensors[name].shape)

    def get(self, name: str, dtype: torch.dtype, device: torch.device | str | None = None,
            rows: Span = None, cols: Span = None, mid: Span = None) -> torch.Tensor:
        t = self.tensors[name]
        t = t[span_index(t.dim(), rows, cols, mid)].to(dtype)
        return (t.to(device) if device is not None else t).contiguous()

    def close(self) -> None:
        self.tensors.clear()


@dataclass
class Target:
    """Where (part of) one checkpoint tensor lives on this rank."""

    dst: torch.Tensor                      # the live buffer (or a view of it) to overwrite
    rows: Span = None
    cols: Span = None
    mid: Span = None
    post: Callable[[torch.Tensor], torch.Tensor] | None = None  # block -> dst's form


def _span(r: range, n: int) -> Span:
    return None if (r.start, r.stop) == (0, n) else (r.start, r.stop)


def full_shapes(model: Any) -> dict[str, tuple[int, ...]]:
    """Every checkpoint tensor name this model can take, with its full (unsharded) shape. Routed
    experts are accepted both per expert (`experts.J.gate_proj.weight`) and stacked
    (`experts.gate_up_proj`, transformers 5)."""
    cfg = model.cfg
    d, v = cfg.hidden_size, cfg.vocab_size
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,)}
    if model.lm_head is not None:
        out["lm_head.weight"] = (v, d)
    for m in getattr(model, "mtp", ()):  # served MTP layers: their own tensors (their blocks below)
        p = f"model.layers.{m.idx}"
        out.update({f"{p}.enorm.weight": (d,), f"{p}.hnorm.weight": (d,), f"{p}.eh_proj.weight": (d, 2 * d),
                    f"{p}.shared_head.norm.weight": (d,), f"{p}.embed_tokens.weight": (v, d)})
        if m.head is not None:
            out[f"{p}.shared_head.head.weight"] = (v, d)
    for layer in model.attn_layers():
        i = layer.idx
        p = f"model.layers.{i}"
        out[f"{p}.input_layernorm.weight"] = (d,)
        out[f"{p}.post_attention_layernorm.weight"] = (d,)
        a = layer.self_attn
        s = f"{p}.self_attn"
        if layer.kind == "kda":  # a hybrid's KDA layer: its own tensors
            out.update(a.full_shapes(s))
            _mlp_block_shapes(out, layer, f"{p}.mlp", d)
            continue
        h, dq, dkv = a.total_heads, a.d_nope + a.d_rope, a.d_nope + a.d_v
        if a.q_lora:
            out[f"{s}.q_a_proj.weight"] = (a.q_lora, d)
            out[f"{s}.q_a_layernorm.weight"] = (a.q_lora,)
            out[f"{s}.q_b_proj.weight"] = (h * dq, a.q_lora)
            if a.q_a_bias is not None:
                out[f"{s}.q_a_proj.bias"] = (a.q_lora,)
        else:
            out[f"{s}.q_proj.weight"] = (h * dq, d)
        out[f"{s}.kv_a_proj_with_mqa.weight"] = (a.d_c + a.d_rope, d)
        if a.kv_a_bias is not None:
            out[f"{s}.kv_a_proj_with_mqa.bias"] = (a.d_c + a.d_rope,)
            out[f"{s}.o_proj.bias"] = (d,)
        out[f"{s}.kv_a_layernorm.weight"] = (a.d_c,)
        out[f"{s}.kv_b_proj.weight"] = (h * dkv, a.d_c)
        out[f"{s}.o_proj.weight"] = (d, h * a.d_v)
        ix = layer.indexer
        if ix is not None:
            hd = ix.head_dim
            out.update({f"{s}.indexer.wq_b.weight": tuple(ix.wq_b.shape), f"{s}.indexer.wk.weight": (hd, d),
                        f"{s}.indexer.k_norm.weight": (hd,), f"{s}.indexer.k_norm.bias": (hd,),
                        f"{s}.indexer.weights_proj.weight": (ix.n_heads, d)})
        _mlp_block_shapes(out, layer, f"{p}.mlp", d)
    if cfg.model_type == "kimi_linear":  # the checkpoint's names (block_sparse_moe, experts' w1/w2/w3)
        return {checkpoint_name(cfg.model_type, k): v for k, v in out.items()}
    return out


def _mlp_block_shapes(out: dict[str, tuple[int, ...]], layer: Any, mp: str, d: int) -> None:
    m = layer.mlp
    if layer.is_moe:
        e, inter = m.e, m.inter
        out[f"{mp}.gate.weight"] = (e, d)
        if m.gate.v3:
            out[f"{mp}.gate.e_score_correction_bias"] = (e,)
        out[f"{mp}.experts.gate_up_proj"] = (e, 2 * inter, d)
        out[f"{mp}.experts.down_proj"] = (e, d, inter)
        for j in range(e):
            out[f"{mp}.experts.{j}.gate_proj.weight"] = (inter, d)
            out[f"{mp}.experts.{j}.up_proj.weight"] = (inter, d)
            out[f"{mp}.experts.{j}.down_proj.weight"] = (d, inter)
        if m.shared is not None:
            _mlp_shapes(out, f"{mp}.shared_experts", m.shared.inter, d)
    else:
        _mlp_shapes(out, mp, m.inter, d)


def _mlp_shapes(out: dict[str, tuple[int, ...]], prefix: str, inter: int, d: int) -> None:
    out[f"{prefix}.gate_proj.weight"] = (inter, d)
    out[f"{prefix}.up_proj.weight"] = (inter, d)
    out[f"{prefix}.down_proj.weight"] = (d, inter)


def required_names(model: Any, stacked_experts: bool) -> set[str]:
    """The names a *complete* checkpoint provides (what `load_weights` reads), in one expert form."""
    names = set()
    for n in full_shapes(model):
        if n.startswith("model.layers.") and n.endswith(".embed_tokens.weight"):
            continue  # an MTP layer's copy of the embedding: accepted, not read
        if ".experts." in n:
            stacked = n.endswith(("experts.gate_up_proj", "experts.down_proj"))
            if stacked != stacked_experts:
                continue
        names.add(n)
    return names


def targets(model: Any, name: str) -> list[Target]:
    """This rank's targets of checkpoint tensor `name` (empty when it holds none of it, e.g. another
    rank's expert). The spans are those the modules' `load` reads, from the live modules' shares."""
    name = internal_name(model.cfg.model_type, name)  # (Kimi-Linear's MoE names -> splash's)
    if name == "model.embed_tokens.weight":
        return [Target(model.embed, rows=_span(model.embed_rows, model.vocab_size))]
    if name == "lm_head.weight":
        return [Target(model.lm_head, rows=_span(model.head_rows, model.vocab_size))]
    if name == "model.norm.weight":
        return [Target(model.norm.weight)]
    parts = name.split(".")
    rest = ".".join(parts[3:])
    idx = int(parts[2])
    if idx >= len(model.layers):  # a served MTP layer's own tensors
        m = model.mtp[idx - len(model.layers)]
        own = {"enorm.weight": m.enorm.weight, "hnorm.weight": m.hnorm.weight, "eh_proj.weight": m.eh_proj,
               "shared_head.norm.weight": m.head_norm.weight, "shared_head.head.weight": m.head}
        if rest == "embed_tokens.weight":
            return []  # (a copy of the model's embedding, which the MTP layer reads)
        if rest in own and own[rest] is not None:
            return [Target(own[rest])]
    layer = model.layer(idx)
    if rest == "input_layernorm.weight":
        return [Target(layer.input_layernorm.weight)]
    if rest == "post_attention_layernorm.weight":
        return [Target(layer.post_attention_layernorm.weight)]
    if rest.startswith("self_attn.indexer.") and layer.indexer is not None:  # replicated on every rank
        names = {"wq_b.weight": "wq_b", "wk.weight": "wk", "k_norm.weight": "k_norm_w",
                 "k_norm.bias": "k_norm_b", "weights_proj.weight": "weights_proj"}
        return [Target(layer.indexer._buffers[names[rest.removeprefix("self_attn.indexer.")]])]
    if rest.startswith("self_attn.") and layer.kind == "kda":
        return [Target(v, rows=r, cols=c, post=post) for v, r, c, post in
                layer.self_attn.targets(rest.removeprefix("self_attn."))]
    if rest.startswith("self_attn."):
        return _attn_targets(layer.self_attn, rest.removeprefix("self_attn."))
    if rest.startswith("mlp."):
        sub = rest.removeprefix("mlp.")
        if not layer.is_moe:
            return _mlp_targets(layer.mlp, sub)
        return _moe_targets(layer.mlp, sub)
    raise KeyError(name)


def _attn_targets(a: Any, sub: str) -> list[Target]:
    b = a._buffers
    plain = {"q_a_proj.weight": "q_a", "q_a_proj.bias": "q_a_bias", "kv_a_proj_with_mqa.weight": "kv_a",
             "kv_a_proj_with_mqa.bias": "kv_a_bias", "o_proj.bias": "o_bias"}
    if sub in plain:
        return [Target(b[plain[sub]])]
    if sub == "q_a_layernorm.weight":
        return [Target(a.q_a_norm.weight)]
    if sub == "kv_a_layernorm.weight":
        return [Target(a.kv_a_norm.weight)]
    h0, h1 = a.heads.start, a.heads.stop
    dq, dkv, dv = a.d_nope + a.d_rope, a.d_nope + a.d_v, a.d_v
    if sub in ("q_b_proj.weight", "q_proj.weight"):
        return [Target(b["q_b"], rows=(h0 * dq, h1 * dq))]
    if sub == "o_proj.weight":
        return [Target(b["o_w"], cols=(h0 * dv, h1 * dv))]
    if sub == "kv_b_proj.weight":
        h, dn, dc = h1 - h0, a.d_nope, a.d_c
        rows = (h0 * dkv, h1 * dkv)
        return [Target(b["w_uk"], rows=rows, post=lambda t: t.view(h, dkv, dc)[:, :dn]),
                Target(b["w_uv"], rows=rows, post=lambda t: t.view(h, dkv, dc)[:, dn:].transpose(1, 2))]
    raise KeyError(sub)


def _mlp_targets(m: Any, sub: str) -> list[Target]:
    sp = _span(m.cols, m.inter)
    b = m._buffers
    if sub in ("gate_proj.weight", "up_proj.weight"):
        return [Target(b[sub.split(".")[0]], rows=sp)]
    if sub == "down_proj.weight":
        return [Target(b["down_proj"], cols=sp)]
    raise KeyError(sub)


def _moe_targets(m: Any, sub: str) -> list[Target]:
    if sub == "gate.weight":
        return [Target(m.gate.weight)]
    if sub == "gate.e_score_correction_bias":
        return [Target(m.gate.bias)]
    if sub.startswith("shared_experts."):
        return _mlp_targets(m.shared, sub.removeprefix("shared_experts."))
    i, ni = m.inter, len(m.cols)
    ex, cs = _span(m.experts, m.e), _span(m.cols, i)
    b = m._buffers
    if sub == "experts.gate_up_proj":
        if cs is None:
            return [Target(b["gate_up"], rows=ex)]
        c0, c1 = cs
        return [Target(b["gate_up"][:, :ni], rows=ex, mid=(c0, c1)),
                Target(b["gate_up"][:, ni:], rows=ex, mid=(i + c0, i + c1))]
    if sub == "experts.down_proj":
        return [Target(b["down"], rows=ex, cols=cs)]
    parts = sub.split(".")  # experts.J.gate_proj.weight
    if len(parts) == 4 and parts[0] == "experts" and parts[1].isdigit():
        j = int(parts[1])
        if j not in m.experts:
            return []
        k = j - m.experts.start
        if parts[2] == "gate_proj":
            return [Target(b["gate_up"][k, :ni], rows=cs)]
        if parts[2] == "up_proj":
            return [Target(b["gate_up"][k, ni:], rows=cs)]
        if parts[2] == "down_proj":
            return [Target(b["down"][k], cols=cs)]
    raise KeyError(sub)


def check_names(model: Any, shapes: Mapping[str, Iterable[int]]) -> None:
    """Refuse (WeightUpdateError naming the tensor) an unknown name or a wrong full shape."""
    known = full_shapes(model)
    for name, shape in shapes.items():
        want = known.get(name)
        if want is None:
            raise WeightUpdateError(f"tensor {name!r} is not a weight of this model (names are the "
                                    f"checkpoint's, e.g. 'model.layers.0.self_attn.kv_b_proj.weight')")
        got = tuple(int(x) for x in shape)
        if got != want:
            raise WeightUpdateError(f"tensor {name!r} has shape {list(got)}, this model's is {list(want)}")


STAGE_DEVICE = torch.device("cpu")  # staged blocks wait in host memory: an update never doubles the
# device's weight memory, whatever its size (commit copies them in)


def stage(model: Any, reader: Any, names: Iterable[str]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Read this rank's block of every named tensor into new (host) tensors in the live buffers' form:
    [(live buffer view, new value)]. Raises WeightUpdateError (nothing changed) on any mismatch."""
    staged = []
    for name in names:
        try:
            tg = targets(model, name)
        except (KeyError, IndexError, ValueError):
            raise WeightUpdateError(f"tensor {name!r} is not a weight of this model") from None
        for t in tg:
            block = reader.get(name, t.dst.dtype, STAGE_DEVICE, rows=t.rows, cols=t.cols, mid=t.mid)
            if t.post is not None:
                block = t.post(block)
            if tuple(block.shape) != tuple(t.dst.shape):
                raise WeightUpdateError(f"tensor {name!r}: this rank's block has shape {list(block.shape)}, "
                                        f"the live weight's is {list(t.dst.shape)}")
            if block.is_floating_point() and not bool(torch.isfinite(block).all()):
                raise WeightUpdateError(f"tensor {name!r} holds NaN or infinite values")
            staged.append((t.dst, block))
    return staged


@torch.inference_mode()  # (weights installed by a layout switch are inference tensors)
def commit(staged: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Copy staged values into the live buffers (in place: views and references stay valid)."""
    for dst, new in staged:
        dst.copy_(new)


# ---- releasing and restoring weight memory ---------------------------------------------------------
_FUSED = ("_qkv_a", "_gate_up")  # fused bases of views (MLA.fuse, MLP.fuse)


def weight_buffers(model: Any) -> dict[str, torch.Tensor]:
    """Every weight buffer (rotary tables excluded: they are derived, and small)."""
    return {n: b for n, b in model.named_buffers() if b is not None and not n.startswith("rotary.")}


def release_weights(model: Any, backup_dir: str | None, host_copy: bool = False) -> dict[str, Any]:
    """Free this rank's weight tensors. `host_copy` (weights on an accelerator): keep a copy in host
    memory, as vLLM's sleep level 1 does; else with `backup_dir` save them there (one file per rank:
    on a CPU engine only a file really frees the memory); else discard them.
    Returns what `restore_weights` needs (the buffers' shapes, dtypes and the backup)."""
    bufs = weight_buffers(model)
    meta = {n: (tuple(b.shape), b.dtype) for n, b in bufs.items()}
    path, host = None, None
    if host_copy:
        host = {n: b.detach().to("cpu") for n, b in bufs.items()}
    elif backup_dir is not None:
        os.makedirs(backup_dir, exist_ok=True)
        path = os.path.join(backup_dir, f"rank{model.rank}.pt")
        torch.save({n: b.detach().to("cpu") for n, b in bufs.items()}, path)
    for n in bufs:
        mod, _, leaf = n.rpartition(".")
        owner = model.get_submodule(mod) if mod else model
        owner._buffers[leaf] = torch.empty(0, dtype=bufs[n].dtype, device=bufs[n].device)
    for mod in model.modules():
        for attr in _FUSED:
            if getattr(mod, attr, None) is not None:
                setattr(mod, attr, None)
    return {"meta": meta, "path": path, "host": host, "device": model.device}


def restore_weights(model: Any, saved: dict[str, Any], reload: Callable[[], Any] | None = None) -> None:
    """Give back the buffers `release_weights` freed: from its backup, else re-read by `reload()`
    (a reader over the checkpoint last loaded), else zero-filled (the caller must update them)."""
    dev = saved["device"]
    if saved.get("host") is not None:
        data = {n: t.to(dev) for n, t in saved["host"].items()}
    else:
        data = torch.load(saved["path"], map_location=dev) if saved["path"] else {}
    for n, (shape, dtype) in saved["meta"].items():
        mod, _, leaf = n.rpartition(".")
        owner = model.get_submodule(mod) if mod else model
        t = data.get(n)
        owner._buffers[leaf] = t if t is not None else torch.zeros(shape, dtype=dtype, device=dev)
    if saved["path"]:
        os.unlink(saved["path"])
    elif saved.get("host") is None and reload is not None:
        reader = reload()
        try:
            names = [n for n in reader.keys() if not n.endswith("_scale_inv")]
            known = full_shapes(model)
            commit(stage(model, reader, [n for n in names if n in known]))
        finally:
            reader.close()
    model.fuse()
