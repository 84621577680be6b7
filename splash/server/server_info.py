"""What `/get_server_info` (`/server_info`), `/v1/loads` and `/get_load` say: SGLang's names, splash's values.

slime's `--rollout-external` compares its own launch options with the server's info key by key
(`enable_memory_saver` always; `enable_return_routed_experts`, `dtype` when it sets them) and reads
`tp_size`/`pp_size`/`ep_size` to plan weight transfers; routers read `disaggregation_mode`; slime waits
for an idle engine by polling `/v1/loads?include=core`; SGLang's router (sglang-router) polls `/get_load`
for its power-of-two policy and its own `/get_loads`. Every value here is what splash does: a flag
splash has no counterpart for is reported only where SGLang's default describes splash's behaviour
(no remote code, one scheduler), and left out otherwise; speculative decoding
reports its algorithm (NGRAM) and draft count when on.
The live layout has no SGLang flag; splash's own keys (`layout`, `layout_mode`, ...) sit beside these.
"""

from __future__ import annotations

import time
import weakref
from typing import Any

from splash.server.errors import APIError

LOAD_SECTIONS = ("core", "memory", "spec", "lora", "disagg", "queues", "all")


def llm_engine(engine: Any) -> Any:
    """The rank-0 LLMEngine behind the server's engine (an AsyncEngine wraps one)."""
    return getattr(engine, "engine", engine)


_FACTS: weakref.WeakKeyDictionary[Any, dict[str, Any]] = weakref.WeakKeyDictionary()


def _facts(model: Any) -> dict[str, Any]:
    if model in _FACTS:
        return _FACTS[model]
    layers = list(model.layers)
    moe = [i for i, layer in enumerate(layers) if getattr(layer, "is_moe", False)]
    modes = {getattr(layers[i].mlp, "mode", "tp") for i in moe}
    _FACTS[model] = {"num_layers": len(layers), "moe_layers": moe, "expert_parallel": "ep" in modes,
                     "top_k": int(model.cfg.num_experts_per_tok or 0)}
    return _FACTS[model]


def model_facts(engine: Any) -> dict[str, Any]:
    """Layers, MoE layers, top-k and expert parallelism of the served model (fixed at load)."""
    from splash.engine.weights import local_model

    return _facts(local_model(llm_engine(engine)))


def server_args(engine: Any, stats: dict[str, Any], model_name: str, launch: dict[str, Any] | None) -> dict:
    """SGLang's ServerArgs fields that splash has a true value for."""
    eng = llm_engine(engine)
    facts = model_facts(engine)
    world = int(stats.get("ranks", 1))
    tok = getattr(eng, "tokenizer", None)
    path = str(getattr(eng, "model_name", model_name))
    out = {
        "model_path": path, "tokenizer_path": path if tok is not None else None,
        "served_model_name": model_name, "skip_tokenizer_init": tok is None, "trust_remote_code": False,
        "load_format": "auto", "dtype": stats.get("dtype"),
        "kv_cache_dtype": stats.get("kv_cache_dtype", "auto"),
        "device": str(stats.get("device", "cpu")).split(":")[0],
        "context_length": stats.get("max_model_len"), "page_size": stats.get("page_size"),
        "max_running_requests": stats.get("max_num_seqs"),
        "chunked_prefill_size": stats.get("max_num_batched_tokens"),
        "max_prefill_tokens": stats.get("max_num_batched_tokens"),
        "max_total_num_tokens": stats.get("kv_pool_tokens"),
        "tp_size": world, "pp_size": 1, "dp_size": 1, "moe_dp_size": 1,
        "ep_size": world if facts["expert_parallel"] else 1,
        "nnodes": int(stats.get("nnodes", 1) or 1), "node_rank": 0,
        "enable_memory_saver": bool(getattr(eng, "memory_saver", False)),
        "enable_return_routed_experts": bool(facts["moe_layers"]),
        "disable_radix_cache": not stats.get("prefix_caching", False),
        "schedule_policy": "fcfs", "stream_interval": 1,
        "speculative_algorithm": stats.get("speculative_algorithm"),
        "speculative_num_draft_tokens": stats.get("speculative_num_draft_tokens"),
        "speculative_policy": stats.get("speculative_policy"),
        "speculative_depth": stats.get("speculative_depth"),
        **pd_args(getattr(eng, "config", None)), "encoder_only": False, "enable_metrics": True,
        "skip_server_warmup": True,
        "weight_version": getattr(eng, "weight_version", "default"),
        # the chat front end: the template's kind (jinja | deepseek_v32 | plain | None: no chat format, and
        # why), the tool-call and reasoning formats in use, structured outputs' backend
        "chat_format": getattr(tok, "chat_format", None),
        "chat_format_warning": getattr(tok, "chat_format_warning", None),
    }
    for k, v in (launch or {}).items():  # host, port, dist_init_addr as the server was started
        if v is not None:
            out[k] = v
    return out


def pd_args(config: Any) -> dict[str, Any]:
    """SGLang's disaggregation fields: the mode (sglang-router reads it at registration), the transfer
    backend and the prefill's bootstrap port."""
    mode = getattr(config, "disaggregation_mode", "null")
    out: dict[str, Any] = {"disaggregation_mode": mode}
    if mode != "null":
        out.update(disaggregation_transfer_backend=config.disaggregation_transfer_backend,
                   disaggregation_bootstrap_port=config.disaggregation_bootstrap_port,
                   disaggregation_decode_enable_radix_cache=config.disaggregation_decode_enable_radix_cache,
                   num_reserved_decode_tokens=config.num_reserved_decode_tokens)
    return out


def server_info(engine: Any, stats: dict[str, Any], model_name: str, launch: dict[str, Any] | None) -> dict:
    """The whole `/get_server_info` body: splash's stats, then SGLang's names (which win on a clash)."""
    from splash.version import __version__

    config = getattr(llm_engine(engine), "config", None)
    return {**stats, **server_args(engine, stats, model_name, launch), "version": __version__,
            "engine_config": config.describe() if config is not None else None, "internal_states": [stats]}


def used_tokens(stats: dict[str, Any]) -> int:
    """Distinct tokens the KV pages of live requests hold (TP's replicas count once). Prefix-cache pages no
    request holds count as free, as SGLang leaves its evictable tokens out of the load."""
    from splash.core.layouts import Layout

    page = int(stats.get("page_size", 1))
    per_rank, layout = stats.get("kv_pages_used_per_rank"), stats.get("layout")
    if per_rank and layout:
        return Layout.named(layout).distinct([int(u) * page for u in per_rank])
    return int(stats.get("kv_pages_used", 0)) * page


def get_load(stats: dict[str, Any]) -> list[dict[str, Any]]:
    """`/get_load`: SGLang's older load route, one entry per DP rank (splash has one scheduler). The router
    sums `num_tokens` over the entries for power-of-two and its `/get_loads` (-1 when the route fails):
    the KV tokens live requests hold plus the tokens of those still waiting, as SGLang counts them."""
    running, waiting = int(stats.get("num_running", 0)), int(stats.get("num_waiting", 0))
    return [{"dp_rank": 0, "num_reqs": running + waiting, "num_waiting_reqs": waiting,
             "num_tokens": used_tokens(stats) + int(stats.get("num_waiting_tokens", 0))}]


def loads(stats: dict[str, Any], include: str | None) -> dict[str, Any]:
    """`/v1/loads`: one scheduler (dp_rank 0); `include` a comma list of LOAD_SECTIONS (core always)."""
    asked = {s.strip() for s in (include or "core").split(",") if s.strip()}
    bad = sorted(asked - set(LOAD_SECTIONS))
    if bad:
        raise APIError(f"include={bad[0]!r} is unknown; use a comma list of {', '.join(LOAD_SECTIONS)}",
                       param="include")
    running, waiting = int(stats.get("num_running", 0)), int(stats.get("num_waiting", 0))
    used = used_tokens(stats)
    load: dict[str, Any] = {
        "dp_rank": 0, "num_running_reqs": running, "num_waiting_reqs": waiting,
        "num_total_reqs": running + waiting, "num_used_tokens": used,
        "max_total_num_tokens": stats.get("kv_pool_tokens"), "token_usage": float(stats.get("kv_usage", 0.0)),
        "max_running_requests": stats.get("max_num_seqs"), "paused": bool(stats.get("paused", False))}
    if asked & {"memory", "all"}:
        load["memory"] = {"weight_bytes_per_rank": stats.get("weight_bytes_per_rank"),
                          "kv_pages_total": stats.get("kv_pages_total"),
                          "kv_pages_used": stats.get("kv_pages_used"),
                          "memory_released": stats.get("memory_released", [])}
    if asked & {"queues", "all"}:
        load["queues"] = {"waiting": waiting, "running": running}
    return {"timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "dp_rank_count": 1,
            "loads": [load],
            "aggregate": {"total_running_reqs": running, "total_waiting_reqs": waiting,
                          "total_reqs": running + waiting, "avg_token_usage": load["token_usage"]}}
