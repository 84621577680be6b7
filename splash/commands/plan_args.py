"""What every `splash plan` subcommand shares: the model and dtype options, the sizes they give, the
table and JSON output, and the checks of numbers (splash/commands/plan.py, plan_capacity.py)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from splash.core.layouts import LAYOUTS, Layout
from splash.core.model_config import ConfigError, ModelConfig, normalize_dtype
from splash.core.presets import PRESETS, resolve_model_config
from splash.core.sizes import AttentionSizes

# Presets whose published checkpoints are FP8 (GLM-5: zai-org/GLM-5-FP8, the precision the paper serves
# GLM-5 in; its BF16 weights alone overflow an H200 at T = 8).
FP8_NATIVE = ("deepseek-v3", "deepseek-v3.2", "kimi-k2", "glm-5")
KV_DTYPE_HELP = ("KV element format (--kv-cache-dtype's names): bf16 (2 bytes a value, default), fp8 (= "
                 "fp8_ds_mla, the paper's layout: FP8 latent and indexer key with a float32 scale per 128 "
                 "values, BF16 rotary key), fp8_e4m3 (every latent value FP8, one scale per layer), fp16, "
                 "fp32, fp64")


# ---- shared helpers (also used by `splash simulate`) ----------------------------------------------
def emit(args: argparse.Namespace, obj: dict[str, Any], text: str) -> int:
    print(json.dumps(obj, default=float) if args.json else text)
    return 0


MAX_PAGES = 2**22  # plan switches: rows of one manifest (B x pages per request)
MAX_SCAN_K = 16384.0  # plan crossovers: --hi-k, in 1024 tokens


def need(value: float | int, name: str, minimum: float = 1) -> None:
    if value < minimum:
        raise ConfigError(f"{name} must be >= {minimum:g}, got {value:g}")


def weight_dtype(cfg: ModelConfig, dtype: str | None) -> str:
    """`auto`: FP8 where the published checkpoint is FP8 (`FP8_NATIVE`, or its config says so), else bf16."""
    if dtype in (None, "auto"):
        q = cfg.quantization_config or {}
        fp8 = cfg.name in FP8_NATIVE or (isinstance(q, dict) and q.get("quant_method") == "fp8")
        return "fp8" if fp8 else "bf16"
    return normalize_dtype(dtype)


def add_model_args(p: argparse.ArgumentParser, dtype_default: str = "bf16",
                   model_default: str | None = "deepseek-v3", ranks_default: int | None = 8) -> None:
    p.add_argument("--model", default=model_default,
                   help=f"preset ({', '.join(PRESETS)}), checkpoint dir, config.json"
                        + (f" (default {model_default})" if model_default else ""))
    p.add_argument("--ranks", "-T", type=int, default=ranks_default,
                   help="ranks T in the attention group"
                        + (f" (default {ranks_default})" if ranks_default else ""))
    p.add_argument("--dtype", default=dtype_default,
                   help=f"weight dtype bf16|fp16|fp8|fp32|auto (default {dtype_default})")
    p.add_argument("--kv-dtype", default="bf16", help=KV_DTYPE_HELP)
    p.add_argument("--fp8-scales", action="store_true", help="count FP8 128x128 block scales (fp32)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def sizes_from(args: argparse.Namespace, ranks: int | None = None) -> AttentionSizes:
    cfg = resolve_model_config(args.model)
    T = args.ranks if ranks is None else ranks
    need(T, "--ranks")
    cfg.check_ranks(T)
    return AttentionSizes(cfg, weight_dtype(cfg, args.dtype), args.kv_dtype, args.fp8_scales)


def kv_summary(sizes: AttentionSizes) -> dict[str, Any]:
    """KV bytes per token of a model (the core's one rule, `splash.core.sizes`), for JSON output."""
    per_layer = sizes.kv_layer_bytes
    kinds = sorted(set(per_layer), reverse=True)
    return {"kv_dtype": sizes.kv_dtype, "kv_bytes_per_token": sizes.k,
            "kv_bytes_per_token_layer": {f"{b:g}": per_layer.count(b) for b in kinds}}


def kv_line(sizes: AttentionSizes) -> str:
    """'KV fp8: 48,068 bytes per token (788 per layer x 61 layers)': what one context token costs."""
    per_layer = sizes.kv_layer_bytes
    parts = [f"{b:,g} per layer x {per_layer.count(b)} layers"
             for b in sorted(set(per_layer), reverse=True) if b]  # (a hybrid's KDA layers hold no KV)
    return f"KV {sizes.kv_dtype}: {sizes.k:,.0f} bytes per token ({' + '.join(parts)})"


def state_summary(sizes: AttentionSizes) -> dict[str, Any]:
    """A hybrid's per-request KDA state (the core's rule, `splash.core.stores`), for JSON output."""
    if not sizes.cfg.is_hybrid:
        return {}
    return {"mla_layers": len(sizes.mla_layers), "kda_layers": len(sizes.kda_layers),
            "state_bytes_per_request": sizes.z, "state_bytes_per_request_layer": sizes.state_layer_bytes,
            "state_stores_per_layer": sizes.state_store_bytes()}


def state_line(sizes: AttentionSizes) -> str:
    """'; KDA state: 43,417,600 bytes per request (2,170,880 per layer x 20 KDA layers)', or ''."""
    if not sizes.cfg.is_hybrid:
        return ""
    return (f"; KDA state: {sizes.z:,.0f} bytes per request ({sizes.state_layer_bytes:,.0f} per layer x "
            f"{len(sizes.kda_layers)} KDA layers, whatever the context)")


def table(rows: list[list[Any]], header: list[str]) -> str:
    cells = [[str(c) for c in header]] + [[str(c) for c in r] for r in rows]
    w = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w[i]) if i else c.ljust(w[i]) for i, c in enumerate(r)) for r in cells]
    lines.insert(1, "  ".join("-" * x for x in w))
    return "\n".join(lines)


def parse_layout_map(text: str, what: str) -> dict[Layout, float]:
    """'TP=1000,DP=2000,CP=..,DOP=..' -> {Layout: value}; all four layouts required."""
    out: dict[Layout, float] = {}
    for part in text.split(","):
        if not part.strip():
            continue
        if "=" not in part:
            raise ConfigError(f"{what}: expected LAYOUT=VALUE pairs like TP=1000832, got {part!r}")
        k, v = part.split("=", 1)
        try:
            out[Layout.parse(k)] = float(v)
        except ValueError:
            raise ConfigError(f"{what}: {v!r} is not a number") from None
    missing = [lay.label for lay in LAYOUTS if lay not in out]
    if missing:
        raise ConfigError(f"{what}: missing {', '.join(missing)} (give all of TP, DP, CP, DOP)")
    if any(v < 0 for v in out.values()):
        raise ConfigError(f"{what}: values must be >= 0")
    return out


# ---- weights --------------------------------------------------------------------------------------
