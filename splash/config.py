"""`EngineConfig`: every engine option in one frozen, typed object, validated once.

Built once - from the CLI (`add_cli_args` / `from_cli_args`, shared by every command), from
`LLM(**kwargs)` / `Engine(**kwargs)` / `build_engine(**kwargs)` (`from_kwargs`: SGLang's and vLLM's
names accepted, an unknown key refused naming the nearest valid one), or from Python - and passed whole
to the builder, every rank (each builds its share from it), the scheduler and the switch controller.
`resolved(world)` fills what depends on the rank count (the layout to load, the batch bounds). Each
field's flag, help and group are in its metadata, so the CLI, the docs and `/get_server_info` read one
table. Environment variables that override a field (a test or benchmark needs them) are listed in
`ENV_OVERRIDES`, the only ones read; they apply when a config is made, on rank 0, never on a rank.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from splash.argtypes import positive_float, positive_int
from splash.core.model_config import ConfigError
from splash.core.sizes import parse_bytes
from splash.core.stores import kv_format

LAYOUT_NAMES = ("tp", "dp", "cp", "dop")  # the runtime's names of the core's layouts (core.layouts.LAYOUTS)
AUTO_START = "dop"  # where --layout auto starts: the most KV a budget allows, sharded projections
FORMS = ("auto", "absorbed", "mha")  # MLA attention forms of a chunk (splash/attention/mha.py)
SWITCH_MODES = ("overlapped", "blocking")
EXPERT_PARALLEL = ("auto", "ep", "tp")

# Environment overrides of fields (tests and benchmarks): variable -> (field, how its text reads).
ENV_OVERRIDES: dict[str, tuple[str, str]] = {
    "SPLASH_ATTN_FORM": ("attention_form", "auto | absorbed | mha"),
    "SPLASH_NATIVE": ("enforce_eager", "0 = --enforce-eager (no native kernel, no CUDA graphs)"),
    "SPLASH_CUDA_GRAPHS": ("cuda_graphs", "0 = --disable-cuda-graph"),
    "SPLASH_CUDA_GRAPH_SIZES": ("cuda_graph_sizes", "comma-separated batch sizes"),
    "SPLASH_CHECK_BOOKS": ("check_books", "1 = prove the KV books after every step (the test suite)"),
}
_OFF = ("0", "false", "off", "no")


def _opt(default: Any, group: str, flag: str | None, help: str, **cli: Any) -> Any:
    """A field with its CLI flag (None: no flag), help line and group in the metadata."""
    return field(default=default, metadata={"group": group, "flag": flag, "help": help, **cli})


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


@dataclass(frozen=True)
class KernelConfig:
    """How attention runs on a rank (the kernels' share of EngineConfig, handed to every layout)."""

    attention_form: str = "auto"  # "auto" | "absorbed" | "mha" (splash/attention/mha.py)
    enforce_eager: bool = False  # plain torch ops: no native CPU kernel, no Triton, no CUDA graphs
    cuda_graphs: bool = True
    cuda_graph_sizes: tuple[int, ...] | None = None  # None: the runner's default buckets


@dataclass(frozen=True)
class EngineConfig:
    """Every engine option (see the module docstring). Groups: model, cache, scheduler, parallel,
    switching, kernels, debug; `describe()` prints them, `server_args()` gives SGLang's names."""

    # ---- model
    model: str = _opt("tiny", "model", "--model", "Hugging Face checkpoint directory, or a built-in model "
                      "(tiny, small, tiny-dsa, ...)")
    dtype: str | None = _opt(None, "model", "--dtype", "float32 | bfloat16 | float64 (default: per device)")
    device: str | None = _opt(None, "model", "--device", "cpu | cuda[:i] (default: cuda if present)")
    seed: int | None = _opt(None, "model", "--random-seed", "torch seed on every rank before loading "
                            "(SGLang's --random-seed)", type=int, dest="random_seed")
    expert_parallel: str = _opt("auto", "model", "--expert-parallel", "how routed experts split over ranks: "
                                "auto, ep (whole experts per rank), tp (every expert sliced)",
                                choices=EXPERT_PARALLEL)
    # ---- KV cache
    page_size: int = _opt(16, "cache", "--page-size", "tokens per KV page", type=positive_int)
    num_kv_pages: int | None = _opt(None, "cache", "--num-kv-pages", "KV pool size in pages per rank, "
                                    "overriding --memory-per-rank (tests, demos)", type=positive_int)
    memory_per_rank: int | str | None = _opt(None, "cache", "--memory-per-rank", "memory budget per rank for "
                                             "weights + KV cache, e.g. 2GiB (default: from the machine)")
    enable_prefix_caching: bool | None = _opt(
        None, "cache", "--enable-prefix-caching", "share full prompt pages between requests by content "
        "(default on, as in vLLM and SGLang; off for KDA hybrids, whose per-request state a cached prefix "
        "cannot give)", action=argparse.BooleanOptionalAction,
        also=(("--disable-radix-cache", {"action": "store_false", "help": "SGLang's name for "
                                         "--no-enable-prefix-caching"}),))
    kv_cache_dtype: str = _opt(
        "auto", "cache", "--kv-cache-dtype", "KV cache element format: auto (the model's dtype), bfloat16, "
        "float32, float64, fp8_e4m3 (latent and rotary key FP8, one scale per layer: the checkpoint's "
        "k_scale, else 1.0), fp8_ds_mla (DeepSeek-V3.2's 656-byte token: FP8 latent in tiles of 128 with "
        "float32 scales, BF16 rotary key), fp8 (= fp8_ds_mla); a DSA indexer's keys are FP8 in both FP8 "
        "formats")
    num_state_slots: int | None = _opt(None, "cache", "--num-state-slots", "KDA hybrids: requests whose "
                                       "recurrent state a rank holds at once (default --max-num-seqs)",
                                       type=positive_int)
    # ---- scheduler
    max_num_seqs: int | None = _opt(None, "scheduler", "--max-num-seqs", "bound on the running batch "
                                    "(default 64 offline; a server 128 x ranks, vLLM's CPU default)",
                                    type=positive_int, aliases=("--max-running-requests",))
    max_num_batched_tokens: int | None = _opt(
        None, "scheduler", "--max-num-batched-tokens", "token budget per step (default max(512, "
        "max-num-seqs) offline; a server 2048 x ranks)", type=positive_int,
        aliases=("--chunked-prefill-size",))
    max_model_len: int | None = _opt(None, "scheduler", "--max-model-len", "context length (default: the "
                                     "model's)", type=positive_int, aliases=("--context-length",))
    long_prefill_token_threshold: int = _opt(
        0, "scheduler", "--long-prefill-token-threshold", "at most N prompt tokens per request per step, so "
        "several prompts share a step's budget (vLLM's flag; 0: only the budget caps a chunk)", type=int,
        metavar="N")
    serving: bool = _opt(False, "scheduler", None, "a server's defaults for the batch bounds (set by "
                         "`splash serve`)")
    # ---- parallel
    tp: int | None = _opt(None, "parallel", "--tp", "number of ranks T serving the model (default: 1, or "
                          "WORLD_SIZE under torchrun)", type=int,
                          aliases=("--ranks", "--tensor-parallel-size", "--tp-size"))
    nnodes: int = _opt(1, "parallel", "--nnodes", "machines sharing the T ranks", type=int)
    node_rank: int = _opt(0, "parallel", "--node-rank", "this machine's index, 0..nnodes-1", type=int)
    dist_init_addr: str | None = _opt(None, "parallel", "--dist-init-addr", "HOST:PORT where the ranks meet "
                                      "(needed with --nnodes > 1)")
    collective_timeout_s: float | None = _opt(None, "parallel", "--collective-timeout", "seconds before a "
                                              "dead or hung rank fails the engine (default 300)",
                                              type=positive_float, metavar="S")
    threads: int | None = _opt(None, "parallel", "--threads", "torch threads per rank (default: the cores "
                               "this node's ranks share)", type=positive_int)
    # ---- switching
    layout: str | None = _opt(None, "switching", "--layout", "attention layout; auto (the default when T > "
                              "1) lets the layout policy switch live, tp otherwise",
                              choices=(*LAYOUT_NAMES, "auto"))
    switch_schedule: str | None = _opt(None, "switching", "--switch-schedule", "force live switches at these "
                                       "engine steps, e.g. '8:dp,20:cp' (T > 1)", metavar="STEP:LAYOUT,...")
    switch_mode: str = _opt("overlapped", "switching", "--switch-mode", "overlapped (default): layer i+1's "
                            "state moves while layer i computes; blocking: all transfers first",
                            choices=SWITCH_MODES)
    theta: str | None = _opt(None, "switching", "--theta", "the prior --layout auto starts from: a "
                             "calibrated theta (`splash calibrate --out FILE`) or a hardware profile (cpu, "
                             "h200, b200, dcu); default the device's built-in prior", metavar="FILE|PROFILE")
    switch_margin: float = _opt(0.05, "switching", "--switch-margin", "auto: switch when another feasible "
                                "layout is predicted this fraction faster", type=float)
    min_dwell_steps: int = _opt(8, "switching", "--min-dwell-steps", "auto: steps to stay in a layout "
                                "before a voluntary switch", type=int)
    # ---- kernels
    attention_form: str = _opt("auto", "kernels", "--attention-form", "MLA attention form of each chunk: "
                               "auto (the cheaper one per chunk), or one pinned everywhere (measurements)",
                               choices=FORMS)
    enforce_eager: bool = _opt(False, "kernels", "--enforce-eager", "plain torch ops only: no native CPU "
                               "attention kernel, no CUDA graphs (vLLM's flag; for comparisons)",
                               action="store_true")
    cuda_graphs: bool = _opt(True, "kernels", "--disable-cuda-graph", "no CUDA graphs of the decode step "
                             "(SGLang's flag)", action="store_false")
    cuda_graph_sizes: tuple[int, ...] | None = _opt(None, "kernels", "--cuda-graph-sizes", "decode batch "
                                                    "sizes to capture (vLLM's flag), e.g. 1,2,4,8",
                                                    type=str)
    # ---- chat front end (the server and splash.Engine)
    chat_template: str | None = _opt(
        None, "frontend", "--chat-template", "the chat template to use instead of the checkpoint's: a file "
        "path or the Jinja text itself")
    tool_call_parser: str | None = _opt(
        None, "frontend", "--tool-call-parser", "tool-call format of the model (deepseekv3, deepseekv31, "
        "deepseekv32, glm45, kimi_k2; vLLM's spellings too); default: detected from the chat template")
    reasoning_parser: str | None = _opt(
        None, "frontend", "--reasoning-parser", "reasoning format (deepseek-r1, deepseek-v3, glm45, "
        "kimi_k2); default: detected from the chat template")
    enable_auto_tool_choice: bool = _opt(
        False, "frontend", "--enable-auto-tool-choice", "vLLM's flag, accepted: tool_choice auto is on "
        "whenever a tool-call format is known", action="store_true")
    grammar_backend: str = _opt(
        "xgrammar", "frontend", "--grammar-backend", "structured-output backend (SGLang's flag); xgrammar, "
        "or none to refuse structured outputs", choices=("xgrammar", "none"))
    generation_config: str = _opt(
        "auto", "frontend", "--generation-config", "sampling defaults: auto (the checkpoint's "
        "generation_config.json, vLLM's default), vllm (none), or a folder holding a generation_config.json")
    # ---- speculative decoding (splash/engine/spec.py)
    speculative_algorithm: str | None = _opt(
        None, "speculative", "--speculative-algorithm", "draft tokens to verify each decode step: NGRAM "
        "(looked up in the request's own prompt and output; any model), or EAGLE / MTP (the same: drafts "
        "by the checkpoint's own MTP layers, DeepSeek-V3/V3.2 and GLM-5)", type=str.upper,
        choices=("NGRAM", "EAGLE", "MTP"))
    speculative_num_draft_tokens: int | None = _opt(
        None, "speculative", "--speculative-num-draft-tokens", "rows verified per speculating request and "
        "step: its last token plus this minus one drafts (SGLang's meaning; default 4)", type=positive_int)
    speculative_num_steps: int | None = _opt(
        None, "speculative", "--speculative-num-steps", "drafts per step of a chain (SGLang's topk 1): "
        "num_draft_tokens - 1", type=positive_int)
    speculative_policy: str = _opt(
        "auto", "speculative", "--speculative-policy", "auto: the scheduler picks the depth (0 = off) each "
        "step from the cost model, the requests' measured acceptance and the engine's step times (on in "
        "a narrow tail, off while the batch is wide); always: every decode step verifies the full depth "
        "(SGLang's and vLLM's behaviour)", choices=("auto", "always"))
    speculative_ngram_min_match: int = _opt(
        1, "speculative", "--speculative-ngram-min-match-window-size", "NGRAM: the shortest suffix looked "
        "up (vLLM's prompt_lookup_min)", type=positive_int)
    speculative_ngram_max_match: int = _opt(
        4, "speculative", "--speculative-ngram-max-match-window-size", "NGRAM: the longest suffix looked "
        "up, tried first (vLLM's prompt_lookup_max)", type=positive_int)
    speculative_config: str | None = _opt(
        None, "speculative", "--speculative-config", "vLLM's JSON form, e.g. '{\"method\": \"ngram\", "
        "\"num_speculative_tokens\": 3, \"prompt_lookup_max\": 4}'")
    # ---- RL and debugging
    enable_memory_saver: bool | None = _opt(
        None, "debug", "--enable-memory-saver", "allow /release_memory_occupation (SGLang's flag; off in a "
        "server and splash.Engine as in SGLang, on in LLM: vLLM's sleep/wake_up)", action="store_true")
    check_books: bool = _opt(False, "debug", "--check-books", "prove every KV page and state slot is "
                             "accounted for after each step (slow; the test suite and `bench soak`)",
                             action="store_true")

    def __post_init__(self) -> None:
        if self.speculative_config:
            self._read_speculative_config()
        self._check()
        self._check_speculative()

    def _read_speculative_config(self) -> None:
        """vLLM's --speculative-config JSON into the SGLang-named fields (one source of truth)."""
        import json

        try:
            cfg = json.loads(self.speculative_config) if isinstance(self.speculative_config, str) \
                else dict(self.speculative_config)
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
            object.__setattr__(self, k, v)

    def _check_speculative(self) -> None:
        algo = self.speculative_algorithm
        if algo is None:
            if self.speculative_num_draft_tokens or self.speculative_num_steps:
                raise ConfigError("--speculative-num-draft-tokens / --speculative-num-steps need "
                                  "--speculative-algorithm NGRAM or MTP")
            return
        algo = str(algo).upper()
        object.__setattr__(self, "speculative_algorithm", algo)
        if algo == "EAGLE":  # (SGLang's name for drafting with the checkpoint's MTP layers)
            algo = "MTP"
            object.__setattr__(self, "speculative_algorithm", algo)
        if algo not in ("NGRAM", "MTP"):
            raise ConfigError(f"unknown --speculative-algorithm {algo!r}; splash has NGRAM, MTP (EAGLE)")
        steps, drafts = self.speculative_num_steps, self.speculative_num_draft_tokens
        if steps is not None and drafts is not None and drafts != steps + 1:
            raise ConfigError(f"--speculative-num-draft-tokens ({drafts}) must be --speculative-num-steps "
                              f"({steps}) + 1 for a chain (topk 1); give one of them")
        lo, hi = self.speculative_ngram_min_match, self.speculative_ngram_max_match
        for name, v in (("min", lo), ("max", hi)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"--speculative-ngram-{name}-match-window-size must be >= 1, got {v!r}")
        if lo > hi:
            raise ConfigError(f"the n-gram window {lo}..{hi} is empty: min must not exceed max")

    # ---- validation --------------------------------------------------------------------------------
    def _check(self) -> None:
        if self.kv_cache_dtype not in ("auto", None, ""):
            object.__setattr__(self, "kv_cache_dtype", kv_format(self.kv_cache_dtype))
        def positive(name: str, none_ok: bool = True) -> None:
            v = getattr(self, name)
            if v is None and none_ok:
                return
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"{name} must be a positive integer, got {v!r}")

        for name in ("page_size", "num_kv_pages", "num_state_slots", "max_num_seqs", "max_num_batched_tokens",
                     "max_model_len", "threads"):
            positive(name)
        if self.page_size is None:
            raise ConfigError("page_size must be a positive integer, got None")
        if not isinstance(self.long_prefill_token_threshold, int) or self.long_prefill_token_threshold < 0:
            raise ConfigError(f"long_prefill_token_threshold must be 0 (off) or a positive integer, got "
                              f"{self.long_prefill_token_threshold!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.tp is not None and (isinstance(self.tp, bool) or not isinstance(self.tp, int) or self.tp < 1):
            raise ConfigError(f"tp must be >= 1, got {self.tp!r}")
        if self.layout is not None and str(self.layout).lower() not in (*LAYOUT_NAMES, "auto"):
            raise ConfigError(f"unknown layout {self.layout!r}; choose auto or one of "
                              f"{', '.join(LAYOUT_NAMES)}")
        if self.switch_mode not in SWITCH_MODES:
            raise ConfigError(f"--switch-mode must be one of {', '.join(SWITCH_MODES)}, got "
                              f"{self.switch_mode!r}")
        if self.attention_form not in FORMS:
            raise ConfigError(f"unknown attention form {self.attention_form!r}; choose one of "
                              f"{', '.join(FORMS)}")
        if self.expert_parallel not in EXPERT_PARALLEL:
            raise ConfigError(f"expert_parallel must be one of {', '.join(EXPERT_PARALLEL)}, got "
                              f"{self.expert_parallel!r}")
        if not 0 <= float(self.switch_margin) < 1:
            raise ConfigError(f"switch_margin must be in [0, 1), got {self.switch_margin!r}")
        if not isinstance(self.min_dwell_steps, int) or self.min_dwell_steps < 0:
            raise ConfigError(f"min_dwell_steps must be a non-negative integer, got {self.min_dwell_steps!r}")
        if self.collective_timeout_s is not None and not 0 < float(self.collective_timeout_s) < float("inf"):
            raise ConfigError(f"collective_timeout_s must be a positive number, got "
                              f"{self.collective_timeout_s!r}")
        if self.memory_per_rank is not None:
            parse_bytes(self.memory_per_rank)  # (ConfigError naming the fix)
        parse_schedule(self.switch_schedule)  # refused here, before any rank starts
        if self.cuda_graph_sizes is not None and not isinstance(self.cuda_graph_sizes, tuple):
            object.__setattr__(self, "cuda_graph_sizes", parse_sizes(self.cuda_graph_sizes))
        if self.dtype is not None and not isinstance(self.dtype, str):  # a torch dtype given in Python
            object.__setattr__(self, "dtype", str(self.dtype).removeprefix("torch."))

    # ---- derived facts (one holder each) ---------------------------------------------------------------
    @property
    def world(self) -> int:
        """The rank count (1 until `resolved`)."""
        return self.tp or 1

    @property
    def auto(self) -> bool:
        """--layout auto on T > 1 ranks: the policy switches live."""
        return self.world > 1 and (self.layout is None or str(self.layout).lower() == "auto")

    @property
    def schedule(self) -> list[tuple[int, str]]:
        return parse_schedule(self.switch_schedule)

    @property
    def start_layout(self) -> str:
        """The layout every rank loads: auto starts in DOP; one rank runs TP's rules."""
        lay = str(self.layout or "auto").lower()
        if self.world == 1:
            return "tp" if lay == "auto" else lay
        return AUTO_START if lay == "auto" else lay

    @property
    def switching(self) -> bool:
        """Live switches can happen (auto or a schedule): pools leave room for projection replicas."""
        return self.world > 1 and (self.auto or bool(self.schedule))

    @property
    def num_drafts(self) -> int:
        """Draft tokens per speculating request and step (0: speculative decoding off)."""
        if self.speculative_algorithm is None:
            return 0
        if self.speculative_num_steps is not None:
            return self.speculative_num_steps
        return (self.speculative_num_draft_tokens or 4) - 1

    @property
    def kernels(self) -> KernelConfig:
        graphs = self.cuda_graphs and not self.enforce_eager
        return KernelConfig(self.attention_form, self.enforce_eager, graphs, self.cuda_graph_sizes)

    def resolved(self, world: int, max_position_embeddings: int) -> EngineConfig:
        """Every default that depends on the ranks or the model filled in (what the ranks receive)."""
        if world == 1 and self.switch_schedule:
            raise ConfigError("--switch-schedule needs T > 1 ranks (one rank has one layout); add --tp 2")
        seqs = self.max_num_seqs or default_max_num_seqs(world, self.serving)
        budget = self.max_num_batched_tokens or default_token_budget(world, seqs, self.serving)
        return dataclasses.replace(self, tp=world, max_num_seqs=seqs, max_num_batched_tokens=budget,
                                   max_model_len=int(self.max_model_len or max_position_embeddings))

    # ---- construction --------------------------------------------------------------------------------
    @classmethod
    def from_kwargs(cls, **kw: Any) -> EngineConfig:
        """From Python keywords: splash's names, SGLang's (`model_path`, `tp_size`, ...) and vLLM's
        (`tensor_parallel_size`); an unknown key is refused naming the nearest valid one."""
        kw = dict(kw)
        for alias, name in _KW_ALIASES.items():
            if alias in kw:
                v = kw.pop(alias)
                if name in kw and kw[name] != v:
                    raise ConfigError(f"{alias}={v!r} disagrees with {name}={kw[name]!r}; give one of them")
                kw[name] = v
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = [k for k in kw if k not in names]
        if unknown:
            k = unknown[0]
            near = difflib.get_close_matches(k, [*names, *_KW_ALIASES], n=1)
            hint = f"; did you mean {near[0]!r}?" if near else f"; valid options: {', '.join(sorted(names))}"
            raise ConfigError(f"unknown engine option {k!r}{hint}")
        return cls(**{**env_defaults(), **kw})

    @classmethod
    def add_cli_args(cls, p: argparse.ArgumentParser, skip: Sequence[str] = (),
                     defaults: Mapping[str, Any] | None = None) -> None:
        """Every field's flag (SGLang's and vLLM's spellings as aliases), grouped; `skip` names fields a
        command does not take; `defaults` overrides a default shown by the command (e.g. a server's)."""
        defaults = dict(defaults or {})
        groups: dict[str, argparse._ArgumentGroup] = {}
        for f in dataclasses.fields(cls):
            md = f.metadata
            if md.get("flag") is None or f.name in skip:
                continue
            g = groups.get(md["group"])
            if g is None:
                g = groups[md["group"]] = p.add_argument_group(f"engine: {md['group']}")
            kw: dict[str, Any] = {"dest": md.get("dest", f.name), "help": md["help"], "default": None}
            for key in ("type", "choices", "metavar", "action"):
                if key in md:
                    kw[key] = md[key]
            if kw.get("action") in ("store_true", "store_false"):
                kw.pop("type", None)
            g.add_argument(md["flag"], *md.get("aliases", ()), **kw)
            for flag, extra in md.get("also", ()):
                g.add_argument(flag, dest=md.get("dest", f.name), default=None, **extra)
        p.set_defaults(_engine_defaults=defaults)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace, **overrides: Any) -> EngineConfig:
        """The options the user gave (unset ones keep the defaults), plus `overrides`."""
        kw: dict[str, Any] = dict(getattr(args, "_engine_defaults", {}) or {})
        for f in dataclasses.fields(cls):
            v = getattr(args, f.metadata.get("dest", f.name), None) if f.metadata.get("flag") else None
            if v is not None:
                kw[f.name] = v
        kw.update(overrides)
        return cls(**{**env_defaults(), **kw})

    # ---- reports -------------------------------------------------------------------------------------
    def describe(self) -> dict[str, dict[str, Any]]:
        """The options by group (what `/get_server_info` prints under `engine_config`)."""
        out: dict[str, dict[str, Any]] = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            out.setdefault(f.metadata["group"], {})[f.name] = list(v) if isinstance(v, tuple) else v
        return out

    def server_args(self) -> dict[str, Any]:
        """SGLang's ServerArgs names of the options that have one (slime compares some of them)."""
        return {"model_path": self.model, "dtype": self.dtype, "tp_size": self.world, "nnodes": self.nnodes,
                "node_rank": self.node_rank, "dist_init_addr": self.dist_init_addr,
                "context_length": self.max_model_len, "page_size": self.page_size,
                "kv_cache_dtype": self.kv_cache_dtype or "auto",
                "max_running_requests": self.max_num_seqs,
                "chunked_prefill_size": self.max_num_batched_tokens,
                "random_seed": self.seed, "enable_memory_saver": bool(self.enable_memory_saver),
                "disable_cuda_graph": not self.kernels.cuda_graphs}


# Python keyword aliases: SGLang's ServerArgs names and vLLM's -> the field
_KW_ALIASES = {"model_path": "model", "tp_size": "tp", "tensor_parallel_size": "tp", "ranks": "tp",
               "random_seed": "seed", "context_length": "max_model_len",
               "max_running_requests": "max_num_seqs", "chunked_prefill_size": "max_num_batched_tokens"}


def env_defaults(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The fields `ENV_OVERRIDES` set from the environment (tests, benchmarks); explicit options win."""
    env = os.environ if env is None else env
    out: dict[str, Any] = {}
    if env.get("SPLASH_ATTN_FORM", "").strip():
        out["attention_form"] = env["SPLASH_ATTN_FORM"].strip().lower()
    if env.get("SPLASH_NATIVE", "1").strip().lower() in _OFF:
        out["enforce_eager"] = True
    if env.get("SPLASH_CUDA_GRAPHS", "1").strip().lower() in _OFF:
        out["cuda_graphs"] = False
    if env.get("SPLASH_CUDA_GRAPH_SIZES", "").strip():
        out["cuda_graph_sizes"] = parse_sizes(env["SPLASH_CUDA_GRAPH_SIZES"])
    if env.get("SPLASH_CHECK_BOOKS", "0").strip().lower() not in ("", *_OFF):
        out["check_books"] = True
    return out
