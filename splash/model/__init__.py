"""The DeepSeek-V2/V3 MLA model: loading a checkpoint into one rank's share of it."""

from __future__ import annotations

import os

import torch

from splash.core.model_config import ConfigError, ModelConfig
from splash.model.context import ForwardContext, SliceCtx
from splash.model.deepseek import DeepseekForCausalLM, held_heads

TORCH_DTYPES: dict[str, torch.dtype] = {"fp64": torch.float64, "fp32": torch.float32,
                                        "bf16": torch.bfloat16, "fp16": torch.float16}

__all__ = ["DeepseekForCausalLM", "ForwardContext", "SliceCtx", "held_heads", "load_model", "resolve_dtype",
           "resolve_model_path"]


def resolve_dtype(dtype: str | torch.dtype | None, device: str | torch.device | None = None) -> torch.dtype:
    """A dtype name ("float32", "bf16", ...) or torch dtype -> torch dtype; None means the device's
    default (float32 on CPU, bfloat16 on GPU)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None or dtype == "auto":
        return torch.bfloat16 if torch.device(device or "cpu").type == "cuda" else torch.float32
    from splash.core.model_config import normalize_dtype

    key = normalize_dtype(dtype)
    if key not in TORCH_DTYPES:
        raise ConfigError(f"dtype {dtype!r} cannot run the model; use float32, bfloat16 or float64")
    return TORCH_DTYPES[key]


def resolve_model_path(model: str | os.PathLike[str]) -> str:
    """'tiny' or 'small' -> that built-in model (created on first use); otherwise a checkpoint directory."""
    from splash.model.tiny import BUILTIN_MODELS, ensure_builtin_model

    m = os.fspath(model)
    if m in BUILTIN_MODELS:
        return ensure_builtin_model(m)
    if m == "trained-mtp":  # the benchmark model with an MTP layer (splash/training/mtp.py), trained once
        from splash.training.mtp import ensure_trained_model

        return ensure_trained_model()
    if not os.path.isdir(m) or not os.path.isfile(os.path.join(m, "config.json")):
        raise ConfigError(f"model {m!r} is not a checkpoint directory with config.json "
                          f"(or a built-in model: {', '.join(BUILTIN_MODELS)}, trained-mtp)")
    return m


def load_model(path: str | os.PathLike[str], dtype: str | torch.dtype | None = None, rank: int = 0,
               world: int = 1, attn_sharded: bool = True, device: str | torch.device | None = None, *,
               expert_parallel: str = "auto", shard_lm_head: bool = False,
               cfg: ModelConfig | None = None) -> DeepseekForCausalLM:
    """Load one rank's share of a DeepSeek-family checkpoint ('tiny' for the built-in model).

    Outside attention the share is fixed (see DeepseekForCausalLM): `expert_parallel` "auto" | "ep" |
    "tp" picks how routed experts split; `shard_lm_head` makes the LM head vocab-parallel (then every
    rank must call `compute_logits(rows, comm)`). `cfg`: the checkpoint's config as served (its MTP
    layers loaded when `cfg.draft_layers`), read from the checkpoint when None."""
    p = resolve_model_path(path)
    cfg = cfg or ModelConfig.from_hf(p)
    return DeepseekForCausalLM.from_pretrained(p, resolve_dtype(dtype, device), rank=rank, world=world,
                                               attn_sharded=attn_sharded, device=device, cfg=cfg,
                                               expert_parallel=expert_parallel, shard_lm_head=shard_lm_head)
