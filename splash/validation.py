"""What a valid `EngineConfig` is: the choices of its fields, the parsers of their text forms, the
defaults that depend on the rank count, and the checks `EngineConfig.__post_init__` runs (they also
normalise a few values in place: SGLang's and vLLM's spellings, vLLM's --speculative-config JSON).

Split from splash/config.py so that module reads as the one field table; these functions take the
config object itself (untyped here: splash/config.py imports this module, never the other way).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from splash import env
from splash.core.layouts import LAYOUT_NAMES
from splash.core.model_config import ConfigError
from splash.core.sizes import parse_bytes
from splash.core.stores import kv_format
from splash.flags import REASONING_SPELLINGS

AUTO_START = "dop"  # where --layout auto starts: the most KV a budget allows, sharded projections
FORMS = ("auto", "absorbed", "mha")  # MLA attention forms of a chunk (splash/attention/mha.py)
SWITCH_MODES = ("overlapped", "blocking")
EXPERT_PARALLEL = ("auto", "ep", "tp")
ATTENTION_KERNELS = ("auto", "torch", "native", "triton")  # splash/attention/kernels.py
UPCAST = ("auto", "on", "off")  # bf16/fp16 CPU GEMMs through float32 (splash/model/gemm.py)
CPU_COMMS = ("shm", "gloo")  # the CPU ranks' data plane (splash/distributed/shm.py)
CPU_BINDS = ("auto", "off")  # CPU ranks on their own cores (splash/distributed/affinity.py)
PD_MODES = ("null", "prefill", "decode")  # --disaggregation-mode (SGLang's names)
# SGLang's other transfer backends, refused by name (`--disaggregation-transfer-backend`)
PD_BACKENDS_REFUSED = {
    "nixl": "NVIDIA's NIXL library is not part of this build",
    "ascend": "Ascend NPUs' transfer library is not part of this build",
    "fake": "SGLang's fake backend moves no KV (a decode would run on an empty cache)",
}

# Environment overrides of fields (tests and benchmarks): variable -> (field, what it does); the field
# rows of splash/env.py's table of every variable.
ENV_OVERRIDES: dict[str, tuple[str, str]] = {v.name: (v.field, v.doc) for v in env.VARS if v.field}


def parse_sizes(text: str | Sequence[int] | None) -> tuple[int, ...] | None:
    """'8, 2,1' -> (1, 2, 8): batch sizes, sorted and unique; None/'' -> None."""
    if text is None or text == "":
        return None
    items = text.split(",") if isinstance(text, str) else list(text)
    try:
        sizes = sorted({int(x) for x in items if str(x).strip()})
    except ValueError:
        raise ConfigError(f"cuda_graph_sizes: expected comma-separated batch sizes, got {text!r}") from None
    if not sizes or sizes[0] < 1:
        raise ConfigError(f"cuda_graph_sizes: batch sizes must be >= 1, got {text!r}")
    return tuple(sizes)


def parse_schedule(text: str | Sequence[tuple[int, str]] | None) -> list[tuple[int, str]]:
    """'8:dp,20:cp' -> [(8, 'dp'), (20, 'cp')] (sorted by step); ConfigError with the fix otherwise."""
    if text is None or text == "":
        return []
    if not isinstance(text, str):
        items = [(int(s), str(lay).lower()) for s, lay in text]
    else:
        items = []
        for part in text.replace(" ", "").split(","):
            if not part:
                continue
            step, sep, lay = part.partition(":")
            try:
                n = int(step)
            except ValueError:
                n = -1
            if not sep or n < 0:
                raise ConfigError(f"--switch-schedule: cannot read {part!r}; write STEP:LAYOUT pairs, e.g. "
                                  "'8:dp,20:cp' (STEP a non-negative engine step)")
            items.append((n, lay.lower()))
    for n, lay in items:
        if lay not in LAYOUT_NAMES:
            raise ConfigError(f"--switch-schedule: unknown layout {lay!r} at step {n}; choose one of "
                              f"{', '.join(LAYOUT_NAMES)}")
    steps = [n for n, _ in items]
    if len(set(steps)) != len(steps):
        raise ConfigError("--switch-schedule: a step appears twice; one switch per step")
    return sorted(items)


def default_max_num_seqs(world: int, serving: bool) -> int:
    """`max_num_seqs` when none is given: a server takes vLLM's CPU server default, 128 x T, so a client
    that opens 128 streams (an RL rollout through the HTTP API) has them all running rather than half of
    them queued (at concurrency 128 on `small`: +8% output tok/s, mean TTFT 1.9 s against 7.1 s, each
    step longer); offline engines keep 64 (tests and benchmarks pass their own)."""
    return 128 * world if serving else 64


def default_token_budget(world: int, max_num_seqs: int, serving: bool) -> int:
    """`max_num_batched_tokens` when none is given.

    A server takes vLLM's CPU server default, 2048 x T: a wave of prompts arriving together is prefilled
    in one step instead of a chunk per step, so streams that started decoding after the first chunk
    are not held back by the rest of their own wave (that made P99 inter-token latency ~5x vLLM's at 512).
    The price is a longer single stall when one long prompt arrives (docs/performance.md, "TTFT vs
    ITL"). Offline engines keep max(512, max_num_seqs): without streams there is no ITL to protect and
    it keeps the activation reserve small.
    """
    if serving:
        return max(2048 * world, max_num_seqs)
    return max(512, max_num_seqs)


def read_speculative_config(c: Any) -> None:
    """vLLM's --speculative-config JSON into the SGLang-named fields (one source of truth)."""
    import json

    try:
        cfg = json.loads(c.speculative_config) if isinstance(c.speculative_config, str) \
            else dict(c.speculative_config)
    except (json.JSONDecodeError, TypeError, ValueError) as e:
        raise ConfigError(f"--speculative-config is not a JSON object: {e}") from None
    if not isinstance(cfg, dict):
        raise ConfigError("--speculative-config must be a JSON object such as {\"method\": \"ngram\", "
                          "\"num_speculative_tokens\": 3}")
    known = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"}
    extra = sorted(set(cfg) - known)
    if extra:
        raise ConfigError(f"--speculative-config: {', '.join(extra)} not supported; splash reads "
                          f"{', '.join(sorted(known))}")
    method = str(cfg.get("method", "ngram")).upper()
    n = cfg.get("num_speculative_tokens", 3)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ConfigError(f"--speculative-config: num_speculative_tokens must be >= 1, got {n!r}")
    kw = {"speculative_algorithm": {"DEEPSEEK_MTP": "MTP"}.get(method, method),
          "speculative_num_steps": n, "speculative_num_draft_tokens": n + 1}
    if "prompt_lookup_max" in cfg:
        kw["speculative_ngram_max_match"] = cfg["prompt_lookup_max"]
    if "prompt_lookup_min" in cfg:
        kw["speculative_ngram_min_match"] = cfg["prompt_lookup_min"]
    for k, v in kw.items():
        object.__setattr__(c, k, v)


def check_speculative(c: Any) -> None:
    algo = c.speculative_algorithm
    if algo is None:
        if c.speculative_num_draft_tokens or c.speculative_num_steps:
            raise ConfigError("--speculative-num-draft-tokens / --speculative-num-steps need "
                              "--speculative-algorithm NGRAM or MTP")
        return
    algo = str(algo).upper()
    object.__setattr__(c, "speculative_algorithm", algo)
    if algo in ("EAGLE", "NEXTN"):  # (SGLang's names for drafting with the checkpoint's MTP layers)
        algo = "MTP"
        object.__setattr__(c, "speculative_algorithm", algo)
    if algo not in ("NGRAM", "MTP"):
        raise ConfigError(f"unknown --speculative-algorithm {algo!r}; splash has NGRAM, MTP (EAGLE)")
    steps, drafts = c.speculative_num_steps, c.speculative_num_draft_tokens
    if steps is not None and drafts is not None and drafts != steps + 1:
        raise ConfigError(f"--speculative-num-draft-tokens ({drafts}) must be --speculative-num-steps "
                          f"({steps}) + 1 for a chain (topk 1); give one of them")
    lo, hi = c.speculative_ngram_min_match, c.speculative_ngram_max_match
    for name, v in (("min", lo), ("max", hi)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"--speculative-ngram-{name}-match-window-size must be >= 1, got {v!r}")
    if lo > hi:
        raise ConfigError(f"the n-gram window {lo}..{hi} is empty: min must not exceed max")

# ---- the checks --------------------------------------------------------------------------------
def check(c: Any) -> None:
    if c.kv_cache_dtype not in ("auto", None, ""):
        object.__setattr__(c, "kv_cache_dtype", kv_format(c.kv_cache_dtype))
    if c.reasoning_parser in REASONING_SPELLINGS:  # vLLM's names of SGLang's parsers
        object.__setattr__(c, "reasoning_parser", REASONING_SPELLINGS[c.reasoning_parser])
    def positive(name: str, none_ok: bool = True) -> None:
        v = getattr(c, name)
        if v is None and none_ok:
            return
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"{name} must be a positive integer, got {v!r}")

    for name in ("page_size", "num_kv_pages", "num_state_slots", "max_num_seqs", "max_num_batched_tokens",
                 "max_model_len", "threads", "max_total_tokens"):
        positive(name)
    if c.num_kv_pages is not None and c.max_total_tokens is not None:
        raise ConfigError("--num-kv-pages sets the KV pool and --max-total-tokens caps it; give one")
    f = c.mem_fraction_static
    if f is not None and (isinstance(f, bool) or not isinstance(f, int | float) or not 0 < f <= 1):
        raise ConfigError(f"mem_fraction_static (--mem-fraction-static, --gpu-memory-utilization) must "
                          f"be a fraction in (0, 1], got {f!r}")
    if c.page_size is None:
        raise ConfigError("page_size must be a positive integer, got None")
    if isinstance(c.arrival_gap_ms, bool) or not 0 <= float(c.arrival_gap_ms) < float("inf"):
        raise ConfigError(f"arrival_gap_ms must be a non-negative number, got {c.arrival_gap_ms!r}")
    if not isinstance(c.long_prefill_token_threshold, int) or c.long_prefill_token_threshold < 0:
        raise ConfigError(f"long_prefill_token_threshold must be 0 (off) or a positive integer, got "
                          f"{c.long_prefill_token_threshold!r}")
    if c.max_model_len is not None and c.max_model_len < 2:
        raise ConfigError(f"max_model_len must be >= 2, got {c.max_model_len}")
    if c.tp is not None and (isinstance(c.tp, bool) or not isinstance(c.tp, int) or c.tp < 1):
        raise ConfigError(f"tp must be >= 1, got {c.tp!r}")
    if c.layout is not None and str(c.layout).lower() not in (*LAYOUT_NAMES, "auto"):
        raise ConfigError(f"unknown layout {c.layout!r}; choose auto or one of "
                          f"{', '.join(LAYOUT_NAMES)}")
    if c.switch_mode not in SWITCH_MODES:
        raise ConfigError(f"--switch-mode must be one of {', '.join(SWITCH_MODES)}, got "
                          f"{c.switch_mode!r}")
    if c.attention_form not in FORMS:
        raise ConfigError(f"unknown attention form {c.attention_form!r}; choose one of "
                          f"{', '.join(FORMS)}")
    for name, choices in (("attention_kernel", ATTENTION_KERNELS), ("bf16_upcast", UPCAST),
                          ("cpu_comm", CPU_COMMS), ("cpu_bind", CPU_BINDS)):
        if getattr(c, name) not in choices:
            var = next(v for v, (f, _) in ENV_OVERRIDES.items() if f == name)
            raise ConfigError(f"{name} (--{name.replace('_', '-')}, {var}) must be one of "
                              f"{', '.join(choices)}, got {getattr(c, name)!r}")
    if c.expert_parallel not in EXPERT_PARALLEL:
        raise ConfigError(f"expert_parallel must be one of {', '.join(EXPERT_PARALLEL)}, got "
                          f"{c.expert_parallel!r}")
    if not 0 <= float(c.switch_margin) < 1:
        raise ConfigError(f"switch_margin must be in [0, 1), got {c.switch_margin!r}")
    if not isinstance(c.min_dwell_steps, int) or c.min_dwell_steps < 0:
        raise ConfigError(f"min_dwell_steps must be a non-negative integer, got {c.min_dwell_steps!r}")
    if c.collective_timeout_s is not None and not 0 < float(c.collective_timeout_s) < float("inf"):
        raise ConfigError(f"collective_timeout_s must be a positive number, got "
                          f"{c.collective_timeout_s!r}")
    check_disaggregation(c)
    if c.memory_per_rank is not None:
        parse_bytes(c.memory_per_rank)  # (ConfigError naming the fix)
    parse_schedule(c.switch_schedule)  # refused here, before any rank starts
    if c.cuda_graph_sizes is not None and not isinstance(c.cuda_graph_sizes, tuple):
        object.__setattr__(c, "cuda_graph_sizes", parse_sizes(c.cuda_graph_sizes))
    if c.dtype is not None and not isinstance(c.dtype, str):  # a torch dtype given in Python
        object.__setattr__(c, "dtype", str(c.dtype).removeprefix("torch."))


def check_disaggregation(c: Any) -> None:
    mode, backend = c.disaggregation_mode, c.disaggregation_transfer_backend
    if mode not in PD_MODES:
        raise ConfigError(f"--disaggregation-mode must be one of {', '.join(PD_MODES)}, got {mode!r}")
    if backend in PD_BACKENDS_REFUSED:
        raise ConfigError(f"--disaggregation-transfer-backend {backend}: {PD_BACKENDS_REFUSED[backend]}; "
                          "use mooncake (the default)")
    if backend != "mooncake":
        raise ConfigError(f"unknown --disaggregation-transfer-backend {backend!r}; splash has mooncake")
    port = c.disaggregation_bootstrap_port
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise ConfigError(f"--disaggregation-bootstrap-port must be a port in [1, 65535], got {port!r}")
    positive = c.num_reserved_decode_tokens
    if isinstance(positive, bool) or not isinstance(positive, int) or positive < 1:
        raise ConfigError(f"num_reserved_decode_tokens must be a positive integer, got {positive!r}")
    if mode == "decode" and c.enable_prefix_caching is None:  # SGLang's decode default: off
        keep = bool(c.disaggregation_decode_enable_radix_cache)
        object.__setattr__(c, "enable_prefix_caching", keep)
    if mode != "null" and getattr(c, "nnodes", 1) > 1:  # (each rank's transfer engine binds loopback)
        raise ConfigError(f"--disaggregation-mode {mode} with --nnodes {c.nnodes}: a PD side spans one "
                          "node for now; run each side's ranks on one host (--tp up to its devices)")
