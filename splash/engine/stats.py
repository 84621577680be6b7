"""What `LLMEngine.stats()` reports, in one place: the queue, the KV pool and state slots (per rank and in
all), the scheduler's bounds and preemptions, the steps and the step message's size, then what each
stage adds (token counters, the switcher's, speculation's), the prefix cache's counters and RL control's
state. Read by the server's /metrics and /get_server_info, routers' load polls and the benchmarks."""

from __future__ import annotations

from typing import Any


def engine_stats(eng: Any) -> dict[str, Any]:
    a, sch = eng.allocator, eng.scheduler
    used, total = a.num_used, a.num_total
    probe = getattr(eng.runner, "decode_plan_bytes_p50", None)
    out = {
        **eng.info,
        "num_running": len(sch.running),
        "num_waiting": len(sch.waiting),
        "num_waiting_tokens": sum(s.num_tokens for s in sch.waiting),  # (routers' load)
        "num_requests": len(eng.requests),
        "kv_pages_used": sum(used),
        "kv_pages_total": sum(total),
        "kv_pages_used_per_rank": used,
        "kv_usage": (max(u / t for u, t in zip(used, total)) if total and min(total) else 0.0),
        "kv_pool_tokens": eng.kv_pool_tokens,
        "kv_distinct_tokens": eng.kv_pool_tokens,
        "kv_pool_tokens_per_rank": [t * a.page_size for t in total],
        # KDA hybrids: state slots (one per admitted request; 0 / 0 without per-request state)
        "state_slots_used": a.slots.num_used if a.slots is not None else 0,
        "state_slots_total": a.slots.num_slots if a.slots is not None else 0,
        "max_request_tokens": eng.max_request_tokens,
        "page_size": a.page_size,
        "layout": a.layout,
        "ranks": a.world,
        "max_model_len": eng.max_model_len,
        "max_num_seqs": sch.cfg.max_num_seqs,
        "max_num_batched_tokens": sch.cfg.max_num_batched_tokens,
        "num_preemptions": sch.num_preemptions,
        "prompt_tokens_computed": sch.prompt_tokens_computed,  # (what the prefix cache saves shows here)
        "steps": eng.steps,
        # median bytes of the step message rank 0 sends (splash/step/wire.py) over forward steps with
        # no prefill rows; None before any such step
        "decode_plan_bytes_p50": probe() if probe is not None else None,
    }
    for hook in eng.stages.stats:  # token counters, the switcher's, speculation's
        out.update(hook())
    return {**out, **(a.cache.stats() if a.cache is not None else {}),
            "prefix_caching": a.cache is not None, **eng.rl.rl_stats()}


def comm_stats(runner: Any) -> dict[str, Any]:
    """Bytes each collective sent, per rank, per step and layer tag (gathered from every rank now).

    -> {"ranks": [{"rank", "steps": {step: {(op, tag): bytes}}, "total": {...}}, ...],
        "rows": {step: rows N of that step}} for the recent steps each rank keeps."""
    ranks = runner.comm_stats() if hasattr(runner, "comm_stats") else []
    rows = dict(getattr(runner, "step_rows", {}) or {})
    return {"ranks": ranks, "rows": rows}
