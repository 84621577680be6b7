"""`EngineConfig`: every engine option in one frozen, typed object, validated once.

Built once - from the CLI (`add_cli_args` / `from_cli_args`, shared by every command), from
`LLM(**kwargs)` / `Engine(**kwargs)` / `build_engine(**kwargs)` (`from_kwargs`: SGLang's and vLLM's
names accepted, an unknown key refused naming the nearest valid one), or from Python - and passed whole
to the builder. `resolved(world)` fills what depends on the rank count (the layout to load, the batch
bounds); the builder resolves it with the checkpoint, once, into `splash.runtime_spec.RuntimeSpec`, which
every rank, the scheduler and the switch controller build from. Each
field's flag, help and group are in its metadata, so the CLI, the docs and `/get_server_info` read one
table; SGLang's and vLLM's launch flags that are not a field's alias are splash/flags.py's rows (what each
sets, or why it is refused), applied by the CLI and `from_kwargs` alike. Environment variables that
override a field (a test or benchmark needs them) are rows of splash/env.py's one table of every
variable (`ENV_OVERRIDES` here is its field part); they apply when a config is made, on rank 0, never on
a rank.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from splash import env
from splash.argtypes import positive_float, positive_int, ranged
from splash.core.layouts import DEFAULT_PAGE_SIZE, LAYOUT_NAMES
from splash.core.model_config import ConfigError
from splash.flags import PEER_KEYS, add_peer_flags, apply_peer_flags, cli_values
from splash.validation import (  # (re-exported: callers import them from here)
    ATTENTION_KERNELS,
    AUTO_START,
    CPU_BINDS,
    CPU_COMMS,
    ENV_OVERRIDES,
    EXPERT_PARALLEL,
    FORMS,
    PD_MODES,
    SWITCH_MODES,
    UPCAST,
    check,
    check_speculative,
    default_max_num_seqs,
    default_token_budget,
    parse_schedule,
    parse_sizes,
    read_speculative_config,
)

__all__ = ["ENV_OVERRIDES", "EngineConfig", "KernelConfig", "default_max_num_seqs", "default_token_budget",
           "env_defaults", "parse_schedule", "parse_sizes"]


def _opt(default: Any, group: str, flag: str | None, help: str, **cli: Any) -> Any:
    """A field with its CLI flag (None: no flag), help line and group in the metadata."""
    return field(default=default, metadata={"group": group, "flag": flag, "help": help, **cli})


@dataclass(frozen=True)
class KernelConfig:
    """How attention runs on a rank (the kernels' share of EngineConfig, handed to every layout)."""

    attention_form: str = "auto"  # "auto" | "absorbed" | "mha" (splash/attention/mha.py)
    enforce_eager: bool = False  # plain torch ops: no native CPU kernel, no Triton, no CUDA graphs
    cuda_graphs: bool = True
    cuda_graph_sizes: tuple[int, ...] | None = None  # None: the runner's default buckets
    attention_kernel: str = "auto"  # "auto" | "torch" | "native" | "triton": pinned where it can run
    bf16_upcast: str = "auto"  # "auto" | "on" | "off" (splash/model/gemm.py)


@dataclass(frozen=True)
class EngineConfig:
    """Every engine option (see the module docstring). Groups: model, cache, scheduler, parallel,
    switching, kernels, debug; `describe()` prints them, `server_args()` gives SGLang's names."""

    # ---- model
    model: str = _opt("tiny", "model", "--model", "Hugging Face checkpoint directory, or a built-in model "
                      "(tiny, small, tiny-dsa, ...)", aliases=("--model-path",))
    dtype: str | None = _opt(None, "model", "--dtype", "float32 | bfloat16 | float64 (default: per device)")
    device: str | None = _opt(None, "model", "--device", "cpu | cuda[:i] (default: cuda if present)")
    seed: int | None = _opt(None, "model", "--random-seed", "torch seed on every rank before loading "
                            "(SGLang's --random-seed)", type=int, dest="random_seed")
    expert_parallel: str = _opt("auto", "model", "--expert-parallel", "how routed experts split over ranks: "
                                "auto, ep (whole experts per rank), tp (every expert sliced)",
                                choices=EXPERT_PARALLEL)
    # ---- KV cache
    page_size: int = _opt(DEFAULT_PAGE_SIZE, "cache", "--page-size", "tokens per KV page", type=positive_int,
                          aliases=("--block-size",))
    num_kv_pages: int | None = _opt(None, "cache", "--num-kv-pages", "KV pool size in pages per rank, "
                                    "overriding --memory-per-rank (tests, demos)", type=positive_int)
    memory_per_rank: int | str | None = _opt(None, "cache", "--memory-per-rank", "memory budget per rank for "
                                             "weights + KV cache, e.g. 2GiB (default: from the machine)")
    enable_prefix_caching: bool | None = _opt(
        None, "cache", "--enable-prefix-caching", "share full prompt pages between requests by content "
        "(default on, as in vLLM and SGLang; KDA hybrids keep their state at each prompt's cacheable end "
        "with it)", action=argparse.BooleanOptionalAction,
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
    num_state_snapshots: int | None = _opt(
        None, "cache", "--num-state-snapshots", "KDA hybrids with the prefix cache: cached prefixes whose "
        "KDA state a rank keeps (snapshots at each prompt's cacheable end, LRU; default --num-state-slots; "
        "0: no hybrid prefix hits)", type=int)
    mem_fraction_static: float | None = _opt(
        None, "cache", "--mem-fraction-static", "share of a GPU's memory for this rank's weights + KV cache "
        "when no --memory-per-rank is given (SGLang's flag; vLLM's --gpu-memory-utilization); a CPU keeps "
        "its default pool", type=ranged(float, lambda v: 0 < v <= 1, "a fraction in (0, 1]"), metavar="F",
        aliases=("--gpu-memory-utilization",))
    max_total_tokens: int | None = _opt(None, "cache", "--max-total-tokens", "cap on a rank's KV pool in "
                                        "tokens (SGLang's flag: at most ceil(N / page size) pages)",
                                        type=positive_int, metavar="N")
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
    arrival_gap_ms: float = _opt(0.0, "scheduler", None, "an idle engine woken by a request waits for the "
                                 "rest of its burst (requests less than this apart, up to 10 x) before "
                                 "stepping; 0 steps at once (`splash serve --arrival-gap-ms`, default 3)")
    # ---- parallel
    tp: int | None = _opt(None, "parallel", "--tp", "number of ranks T serving the model (default: 1, or "
                          "WORLD_SIZE under torchrun)", type=int,
                          aliases=("--ranks", "--tensor-parallel-size", "--tp-size", "-tp"))
    nnodes: int = _opt(1, "parallel", "--nnodes", "machines sharing the T ranks", type=int)
    node_rank: int = _opt(0, "parallel", "--node-rank", "this machine's index, 0..nnodes-1", type=int)
    dist_init_addr: str | None = _opt(None, "parallel", "--dist-init-addr", "HOST:PORT where the ranks meet "
                                      "(needed with --nnodes > 1)")
    collective_timeout_s: float | None = _opt(None, "parallel", "--collective-timeout", "seconds before a "
                                              "dead or hung rank fails the engine (default 300)",
                                              type=positive_float, metavar="S")
    threads: int | None = _opt(None, "parallel", "--threads", "torch threads per rank (default: the cores "
                               "this node's ranks share)", type=positive_int)
    cpu_comm: str = _opt("shm", "parallel", "--cpu-comm", "CPU ranks' collectives on one host: shm (through "
                         "a shared-memory segment) or gloo", choices=CPU_COMMS)
    cpu_bind: str = _opt("auto", "parallel", "--cpu-bind", "auto: each CPU rank on its own cores when "
                         "they fit; off: leave it to the OS", choices=CPU_BINDS)
    malloc_tune: bool = _opt(True, "parallel", "--malloc-tune", "CPU ranks keep freed activation blocks "
                             "in glibc's heap for the next step (--no-malloc-tune: malloc as it is)",
                             action=argparse.BooleanOptionalAction)
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
                                                    type=str,
                                                    also=(("--cuda-graph-bs", {
                                                        "nargs": "+", "type": positive_int, "metavar": "B",
                                                        "help": "SGLang's form: --cuda-graph-bs 1 2 4 8"}),))
    attention_kernel: str = _opt("auto", "kernels", "--attention-kernel", "paged-attention kernel: auto "
                                 "(native C on CPU, Triton on CUDA), or one pinned where it can run "
                                 "(kernel tests, measurements)", choices=ATTENTION_KERNELS)
    bf16_upcast: str = _opt("auto", "kernels", "--bf16-upcast", "bf16/fp16 GEMMs on CPU through float32: "
                            "auto (when the CPU lacks native bf16), on, off", choices=UPCAST)
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
        "by the checkpoint's own MTP layers, DeepSeek-V3/V3.2 and GLM-5; SGLang's NEXTN too)", type=str.upper,
        choices=("NGRAM", "EAGLE", "MTP", "NEXTN"), aliases=("--speculative-config.method",))
    speculative_num_draft_tokens: int | None = _opt(
        None, "speculative", "--speculative-num-draft-tokens", "rows verified per speculating request and "
        "step: its last token plus this minus one drafts (SGLang's meaning; default 4)", type=positive_int)
    speculative_num_steps: int | None = _opt(
        None, "speculative", "--speculative-num-steps", "drafts per step of a chain (SGLang's topk 1): "
        "num_draft_tokens - 1", type=positive_int, aliases=("--speculative-config.num_speculative_tokens",))
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
    # ---- prefill/decode disaggregation (SGLang's flags; splash/server/pd*.py, splash/disagg/)
    disaggregation_mode: str = _opt(
        "null", "disaggregation", "--disaggregation-mode", "null: one server prefills and decodes; prefill "
        "or decode: this server is one side of a disaggregated pair behind sglang-router's "
        "--pd-disaggregation (T = 1 per side for now)", choices=PD_MODES)
    disaggregation_transfer_backend: str = _opt(
        "mooncake", "disaggregation", "--disaggregation-transfer-backend", "how the KV moves from prefill to "
        "decode: mooncake (Mooncake's transfer engine; TCP here, RDMA where present)")
    disaggregation_bootstrap_port: int = _opt(
        8998, "disaggregation", "--disaggregation-bootstrap-port", "prefill: the port of its bootstrap "
        "server (what the router's --prefill URL PORT names)", type=positive_int)
    disaggregation_ib_device: str | None = _opt(
        None, "disaggregation", "--disaggregation-ib-device", "RDMA devices for the transfer engine "
        "(accepted; the transfer runs over TCP on this build)")
    disaggregation_decode_enable_radix_cache: bool = _opt(
        False, "disaggregation", "--disaggregation-decode-enable-radix-cache", "decode: keep the prefix "
        "cache on (SGLang's flag; a decode server runs without one by default, as in SGLang, unless "
        "--enable-prefix-caching is given)", action="store_true")
    num_reserved_decode_tokens: int = _opt(
        512, "disaggregation", "--num-reserved-decode-tokens", "decode: KV tokens kept free per running "
        "request for its growth before another transfer is admitted (SGLang's flag)", type=positive_int)
    # ---- RL and debugging
    enable_memory_saver: bool | None = _opt(
        None, "debug", "--enable-memory-saver", "allow /release_memory_occupation (SGLang's flag; off in a "
        "server and splash.Engine as in SGLang, on in LLM: vLLM's sleep/wake_up)", action="store_true")
    check_books: bool = _opt(False, "debug", "--check-books", "prove every KV page and state slot is "
                             "accounted for after each step (slow; the test suite and `bench soak`)",
                             action="store_true")

    def __post_init__(self) -> None:
        if self.speculative_config:
            read_speculative_config(self)
        check(self)
        check_speculative(self)

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
    def depth_policy(self) -> bool:
        """Speculation on with `--speculative-policy auto`: the scheduler picks each step's depth."""
        return self.num_drafts > 0 and self.speculative_policy == "auto"

    @property
    def kernels(self) -> KernelConfig:
        graphs = self.cuda_graphs and not self.enforce_eager
        return KernelConfig(self.attention_form, self.enforce_eager, graphs, self.cuda_graph_sizes,
                            self.attention_kernel, self.bf16_upcast)

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
        peers = {k: kw.pop(k) for k in list(kw) if k in PEER_KEYS}  # SGLang's / vLLM's (splash/flags.py)
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = [k for k in kw if k not in names]
        if unknown:
            k = unknown[0]
            near = difflib.get_close_matches(k, [*names, *_KW_ALIASES, *PEER_KEYS], n=1)
            hint = f"; did you mean {near[0]!r}?" if near else f"; valid options: {', '.join(sorted(names))}"
            raise ConfigError(f"unknown engine option {k!r}{hint}")
        return cls(**{**env_defaults(), **apply_peer_flags(peers, kw)})

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
        add_peer_flags(p)  # SGLang's and vLLM's other launch flags (splash/flags.py)
        p.set_defaults(_engine_defaults=defaults)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace, **overrides: Any) -> EngineConfig:
        """The options the user gave (unset ones keep the defaults), plus `overrides`."""
        kw: dict[str, Any] = dict(getattr(args, "_engine_defaults", {}) or {})
        for f in dataclasses.fields(cls):
            v = getattr(args, f.metadata.get("dest", f.name), None) if f.metadata.get("flag") else None
            if v is not None:
                kw[f.name] = v
        kw = apply_peer_flags(cli_values(args), kw)
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
               "max_running_requests": "max_num_seqs", "chunked_prefill_size": "max_num_batched_tokens",
               "gpu_memory_utilization": "mem_fraction_static", "cuda_graph_bs": "cuda_graph_sizes"}


def env_defaults(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The fields `ENV_OVERRIDES` set from the environment (tests, benchmarks; splash/env.py reads and
    parses them); explicit options win. The config validates them as any option."""
    return env.field_overrides(environ)
