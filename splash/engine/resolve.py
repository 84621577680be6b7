"""The one resolve stage (rank 0): `EngineConfig` + the checkpoint -> a frozen `RuntimeSpec`.

Everything that is derived rather than asked for is derived here, once: the checkpoint's directory and
`ModelConfig` (parsed once), the batch bounds for the rank count, the torch dtype, the KV element
format ("auto" resolved), the theta prior, the prefix-cache default, the sampling defaults of the
checkpoint's generation_config.json and the end-of-sequence tokens. The ranks and rank 0's engine build
from the spec (splash/engine/build.py, splash/worker/load.py) and parse nothing again.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Any

from splash.config import EngineConfig
from splash.core.model_config import ConfigError, ModelConfig, dtype_name
from splash.core.stores import kv_format
from splash.runtime_spec import RuntimeSpec

log = logging.getLogger("splash.engine")

GENERATION_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def resolve(config: EngineConfig, world: int) -> RuntimeSpec:
    """The spec of `config` on `world` ranks (see the module docstring); ConfigError naming the fix for
    what cannot run, before any rank starts. The tokenizer's end token is not read here
    (`resolve_engine` reads it with the tokenizer it loads)."""
    return _resolve(config, world, tokenizer=False)[0]


def resolve_engine(config: EngineConfig, world: int) -> tuple[RuntimeSpec, Any]:
    """`resolve`, plus the checkpoint's tokenizer (None when it ships none), loaded once: its end token
    joins the spec's `eos_token_ids`."""
    return _resolve(config, world, tokenizer=True)


def _resolve(config: EngineConfig, world: int, tokenizer: bool) -> tuple[RuntimeSpec, Any]:
    from splash.distributed.groups import parse_device
    from splash.model import resolve_dtype, resolve_model_path
    from splash.model.tiny import BUILTIN_MODELS

    path = resolve_model_path(config.model)
    cfg = ModelConfig.from_hf(path).with_draft(config.speculative_algorithm == "MTP")
    if world > 1:
        cfg.check_ranks(world)  # refuse before starting any process
    dev = parse_device(config.device)
    rc = config.resolved(world, cfg.max_position_embeddings)
    model = config.model if config.model in BUILTIN_MODELS else os.path.abspath(path)
    rc = dataclasses.replace(rc, model=model, device=dev.type if config.device is None else config.device)
    if rc.max_model_len > cfg.max_position_embeddings:  # (vLLM refuses; benchmarks here may want it)
        log.warning(
            "max_model_len %d exceeds the model's %d positions (max_position_embeddings): positions past "
            "it are extrapolated and the model was not trained on them", rc.max_model_len,
            cfg.max_position_embeddings)
    dtype = resolve_dtype(rc.dtype, dev)
    fmt = element_format(rc.kv_cache_dtype, dtype)
    theta, theta_source = None, ""
    if rc.auto or rc.depth_policy:  # the layout and depth policies' prior, loaded once
        from splash.core.prior import load_or_default_theta

        theta, theta_source = load_or_default_theta(rc.theta, world, cfg, dtype_name(dtype), dev.type)
    tok = load_tokenizer(path) if tokenizer else None
    eos = set(cfg.eos_token_ids)
    tok_eos = getattr(tok, "eos_token_id", None)
    if isinstance(tok_eos, int):
        eos.add(tok_eos)
    spec = RuntimeSpec.of(
        rc, model=cfg, dtype=dtype, device=dev.type, kv_format=fmt, model_path=os.path.abspath(path),
        model_name=model_name(config.model), theta=theta, theta_source=theta_source,
        prefix_cache=prefix_cache_default(cfg, rc.enable_prefix_caching),
        generation_defaults=generation_defaults(rc.generation_config, path), eos_token_ids=tuple(sorted(eos)))
    return spec, tok


def model_name(model: str) -> str:
    """The name the API reports: "tiny", or the checkpoint folder's name."""
    return "tiny" if model == "tiny" else os.path.basename(os.path.normpath(os.fspath(model)))


def element_format(kv_cache_dtype: str | None, dtype: Any) -> str:
    """The KV pool's element format: `--kv-cache-dtype`, or the model's dtype for "auto" (the one place
    "auto" is resolved; everything downstream takes the core's format name)."""
    return dtype_name(dtype) if kv_cache_dtype in (None, "", "auto") else kv_format(kv_cache_dtype)


def prefix_cache_default(cfg: ModelConfig, asked: bool | None) -> bool:
    """Whether the engine runs the prefix cache: on unless turned off, as in vLLM and SGLang. For a model
    whose requests keep per-request state (the recurrent state of KDA layers) a cached prefix carries a
    snapshot of that state at its end (splash/kv/snapshots.py), so hybrids get it too."""
    return True if asked is None else bool(asked)


def generation_defaults(choice: str, path: str) -> dict[str, Any]:
    """The sampling defaults of a checkpoint's generation_config.json (vLLM's `--generation-config`):
    "auto" reads the model's, "vllm" none, a folder that one's; only the keys both peers apply."""
    if choice == "vllm":
        return {}
    folder = path if choice == "auto" else choice
    file = os.path.join(folder, "generation_config.json")
    if not os.path.isfile(file):
        if choice != "auto":
            raise ConfigError(f"--generation-config {choice!r}: no generation_config.json there; give a "
                              f"folder holding one, or auto / vllm")
        return {}
    with open(file, encoding="utf-8") as f:
        d = json.load(f)
    return {k: d[k] for k in GENERATION_KEYS
            if isinstance(d.get(k), (int, float)) and not isinstance(d[k], bool)}


def load_tokenizer(path: str) -> Any:
    """The checkpoint's tokenizer, or None when it ships none (then only token ids work)."""
    if not os.path.isfile(os.path.join(path, "tokenizer.json")):
        return None
    from splash.tokenizer import load_tokenizer as load  # (the `tokenizers` package, only when shipped)

    return load(path)
