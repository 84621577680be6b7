"""SGLang's and vLLM's launch flags that are not splash's own, so a command copied from their recipes runs.

A recipe for DeepSeek-V3/V3.2, GLM-5 or Kimi-K2 (`python -m sglang.launch_server ...`, `vllm serve ...`)
passes flags of two kinds. A synonym of a splash option is an alias in EngineConfig's field table
(`--model-path`, `-tp`, `--gpu-memory-utilization`, ...: splash/config.py). Every other one is a row of
`PEER_FLAGS` here: what it means in splash (the options it sets, checked against the ones given), or a
refusal by name with the reason and splash's equivalent (`ConfigError`). `EngineConfig.add_cli_args`
puts the rows on every engine command (group "engine: SGLang / vLLM launch flags"), `from_cli_args` and
`from_kwargs` apply them (the keyword of `--dp-size` is `dp_size`, as in SGLang's ServerArgs and
vLLM's EngineArgs). The rows run in table order, so the data-parallel ones fix the rank count before
the expert-parallel ones read it.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from splash.argtypes import positive_int
from splash.core.model_config import ConfigError

# A row's effect: (flag, value, every peer value given by keyword, the splash options so far) -> None;
# it sets options in the last (through `_set`, which refuses a contradiction) or raises ConfigError.
Apply = Callable[[str, Any, Mapping[str, Any], dict[str, Any]], None]


@dataclass(frozen=True)
class PeerFlag:
    """One of SGLang's / vLLM's flags: its spellings (the first names it in messages), what it means in
    splash, how it is applied, and its argparse form (store_true when `arg` is empty)."""

    flags: tuple[str, ...]
    help: str
    apply: Apply
    arg: Mapping[str, Any] = field(default_factory=dict)

    @property
    def keys(self) -> tuple[str, ...]:
        """Its Python keywords: each `--long-spelling` as `long_spelling`."""
        return tuple(f[2:].replace("-", "_") for f in self.flags if f.startswith("--"))

    @property
    def dest(self) -> str:
        return "peer_" + self.keys[0]


def _set(kw: dict[str, Any], flag: str, name: str, value: Any) -> None:
    """Set option `name` for `flag`, refusing a different value given for it explicitly."""
    have = kw.get(name)
    if have is not None and have != value:
        raise ConfigError(f"{flag} means {name}={value!r}, but {name}={have!r} is given too; drop one")
    kw[name] = value


def _accept(flag: str, value: Any, given: Mapping[str, Any], kw: dict[str, Any]) -> None:
    """Accepted with no effect: splash already does what the flag asks, or has nothing it turns off."""


def _refuse(why: str) -> Apply:
    def apply(flag: str, value: Any, given: Mapping[str, Any], kw: dict[str, Any]) -> None:
        raise ConfigError(f"{flag}: {why}")
    return apply


def _only(ok: Any, why: str) -> Apply:
    """Accept the value `ok` (the peer's default, a no-op here), refuse any other naming `why`."""
    def apply(flag: str, value: Any, given: Mapping[str, Any], kw: dict[str, Any]) -> None:
        if str(value).lower() != str(ok):
            raise ConfigError(f"{flag} {value}: {why}")
    return apply


# ---- data and expert parallelism ---------------------------------------------------------------------

def _dp_size(flag: str, n: int, given: Mapping[str, Any], kw: dict[str, Any]) -> None:
    """SGLang: DP attention in N groups of T/N ranks (N = T: every rank owns whole requests)."""
    if n == 1:
        return
    if not given.get("enable_dp_attention"):
        raise ConfigError(f"{flag} {n} without --enable-dp-attention runs {n} copies of the engine behind "
                          "SGLang's router; splash runs one engine over T ranks: add --enable-dp-attention "
                          f"(splash's --layout dp over {n} ranks), or start {n} splash servers")
    tp = kw.get("tp")
    if tp is not None and tp != n:
        raise ConfigError(f"{flag} {n} with --tp {tp}: DP attention in {n} groups of {tp // max(n, 1)} ranks "
                          f"is a hybrid splash does not have; give --dp-size {tp} (splash's --layout dp: "
                          "every rank owns whole requests) or drop --dp-size (--layout tp, cp, dop or auto)")
    _set(kw, flag, "tp", n)
    _set(kw, flag, "layout", "dp")


def _data_parallel_size(flag: str, n: int, given: Mapping[str, Any], kw: dict[str, Any]) -> None:
    """vLLM: N engines of --tensor-parallel-size ranks each; with TP 1, that is splash's DP layout."""
    if n == 1:
        return
    tp = kw.get("tp")
    if tp not in (None, 1):
        raise ConfigError(f"{flag} {n} with --tensor-parallel-size {tp} is vLLM's {n} engines of {tp}-way "
                          f"TP ({n * tp} ranks); splash runs one engine over T ranks: give --tp T with "
                          "--layout dp (whole requests per rank) or --layout tp")
    kw["tp"] = n  # (vLLM's TP 1 per engine: T = N ranks)
    _set(kw, flag, "layout", "dp")


def _enable_expert_parallel(flag: str, value: Any, given: Mapping[str, Any], kw: dict[str, Any]) -> None:
    _set(kw, flag, "expert_parallel", "ep")


def _ep_size(flag: str, n: int, given: Mapping[str, Any], kw: dict[str, Any]) -> None:
    """SGLang: routed experts split over N ranks (1, its default: every expert sliced over the TP ranks)."""
    tp = kw.get("tp")
    if tp is None and n > 1:
        kw["tp"] = tp = n
    if n == (tp or 1) and n > 1:
        _set(kw, flag, "expert_parallel", "ep")
    elif n == 1:
        if (tp or 1) > 1:
            _set(kw, flag, "expert_parallel", "tp")
    else:
        raise ConfigError(f"{flag} {n} with --tp {tp}: splash splits the experts over all T ranks, whole or "
                          "sliced; "
                          f"give --ep-size {tp} (whole experts per rank, --expert-parallel ep) or --ep-size "
                          "1 (every expert sliced, --expert-parallel tp)")


# ---- kernels -----------------------------------------------------------------------------------------

# SGLang's attention backends splash has an equivalent of: its --attention-kernel, or its default (nsa:
# a DSA model's sparse attention, which splash runs on its own kernels without being asked).
_KERNEL_OF_BACKEND = {"triton": "triton", "torch_native": "torch", "intel_amx": "native", "nsa": None}
_GPU_BACKENDS = ("fa3", "fa4", "flashinfer", "flashmla", "flashmla_sparse", "flashmla_kv", "flashmla_auto",
                 "cutlass_mla", "trtllm_mla", "trtllm_mha", "trtllm", "aiter", "wave", "tilelang", "alter",
                 "ascend", "intel_xpu", "flex_attention", "dual_chunk_flash_attn")


def _attention_backend(flag: str, value: str, given: Mapping[str, Any], kw: dict[str, Any]) -> None:
    name = str(value).lower()
    if name in _KERNEL_OF_BACKEND:
        if _KERNEL_OF_BACKEND[name] is not None:
            _set(kw, flag, "attention_kernel", _KERNEL_OF_BACKEND[name])
        return
    what = "a GPU attention kernel this build does not have" if name in _GPU_BACKENDS else \
        "an attention backend splash does not know"
    raise ConfigError(f"{flag} {value}: {what}; splash picks its own kernel per device (--attention-kernel "
                      "auto: its native C kernel on CPU, Triton on CUDA; a DSA model's sparse kernel): drop "
                      "the flag, or give triton, torch_native (plain torch) or intel_amx (the CPU kernel)")


def _cuda_graph_max_bs(flag: str, n: int, given: Mapping[str, Any], kw: dict[str, Any]) -> None:
    """Capture decode graphs for batch sizes 1, 2, 4, ... below N, and N."""
    sizes = tuple(b for b in (2 ** i for i in range(n.bit_length())) if b < n) + (n,)
    _set(kw, flag, "cuda_graph_sizes", sizes)


def _speculative_eagle_topk(flag: str, k: int, given: Mapping[str, Any], kw: dict[str, Any]) -> None:
    if k != 1:
        raise ConfigError(f"{flag} {k}: tree drafts are not supported (splash verifies one chain of drafts "
                          "per request); give --speculative-eagle-topk 1")


_TOKENIZER_MODES = ("auto", "hf", "slow", "deepseek_v32")


def _tokenizer_mode(flag: str, value: str, given: Mapping[str, Any], kw: dict[str, Any]) -> None:
    if str(value).lower() not in _TOKENIZER_MODES:
        raise ConfigError(f"{flag} {value}: splash reads the checkpoint's tokenizer.json (and DeepSeek-V3.2's"
                          f" chat encoding by itself); accepted: {', '.join(_TOKENIZER_MODES)}")


# vLLM's spellings of SGLang's --reasoning-parser names (the ones splash.chat registers).
REASONING_SPELLINGS = {"deepseek_r1": "deepseek-r1", "deepseek_v3": "deepseek-v3"}

_MULTI_NODE = ("vLLM's multi-node data parallelism (--data-parallel-size-local, --data-parallel-address, "
               "--data-parallel-rpc-port, --data-parallel-start-rank, --headless) is not splash's: start the "
               "same command on every machine with --nnodes N --node-rank R --dist-init-addr HOST:PORT, "
               "--tp T counting every machine's ranks")
_INT = {"type": positive_int, "metavar": "N"}
_STR = {"metavar": "NAME"}

PEER_FLAGS: tuple[PeerFlag, ...] = (
    # ---- parallelism (data parallel first: it fixes T, which --ep-size reads)
    PeerFlag(("--enable-dp-attention",), "SGLang's DP attention: with --dp-size N = T, splash's --layout dp "
             "(each rank owns whole requests' KV; projections replicated)", _accept),
    PeerFlag(("--dp-size", "--dp"), "SGLang's attention DP size N with --enable-dp-attention: N = T ranks "
             "is --layout dp (sets --tp N when not given); 1 is no DP attention", _dp_size, _INT),
    PeerFlag(("--data-parallel-size", "-dp"), "vLLM's DP over N ranks of TP 1: splash's --layout dp on "
             "--tp N", _data_parallel_size, _INT),
    PeerFlag(("--enable-expert-parallel", "-ep", "--enable-ep-moe"), "routed experts whole per rank "
             "(--expert-parallel ep)", _enable_expert_parallel),
    PeerFlag(("--ep-size", "--ep", "--expert-parallel-size"), "SGLang's expert-parallel size: T (every "
             "rank) is --expert-parallel ep, 1 is tp (every expert sliced)", _ep_size, _INT),
    PeerFlag(("--moe-a2a-backend",), "SGLang's MoE all-to-all: none (splash's expert parallelism moves "
             "tokens with its own collectives); deepep, mooncake, ... refused",
             _only("none", "a GPU all-to-all library this build does not have; splash's expert parallelism "
                   "(--expert-parallel ep) uses its own collectives: drop the flag"), _STR),
    PeerFlag(("--pipeline-parallel-size", "--pp-size", "-pp"), "1 only: splash has no pipeline parallelism",
             _only(1, "splash has no pipeline parallelism (every rank holds every layer); spread the model "
                   "over more ranks with --tp T (--nnodes for more machines)"), _INT),
    PeerFlag(("--data-parallel-size-local", "--data-parallel-address", "--data-parallel-rpc-port",
              "--data-parallel-start-rank"), "refused: " + _MULTI_NODE, _refuse(_MULTI_NODE), _STR),
    PeerFlag(("--headless",), "refused: " + _MULTI_NODE, _refuse(_MULTI_NODE)),
    PeerFlag(("--enable-nsa-prefill-context-parallel",), "refused: splash's context parallelism is a layout",
             _refuse("splash's context parallelism is a layout: --layout cp (KV by position; or --layout "
                     "auto, which switches to it when it pays)")),
    # ---- kernels
    PeerFlag(("--attention-backend",), "SGLang's attention backend: triton, torch_native, intel_amx set "
             "--attention-kernel triton / torch / native; nsa is splash's DSA default; GPU backends (fa3, "
             "flashinfer, flashmla, cutlass_mla, trtllm_mla, ...) refused", _attention_backend, _STR),
    PeerFlag(("--prefill-attention-backend",), "as --attention-backend (one kernel for both phases)",
             _attention_backend, _STR),
    PeerFlag(("--decode-attention-backend",), "as --attention-backend (one kernel for both phases)",
             _attention_backend, _STR),
    PeerFlag(("--nsa-prefill-backend",), "DeepSeek-V3.2's sparse prefill kernel: as --attention-backend",
             _attention_backend, _STR),
    PeerFlag(("--nsa-decode-backend",), "DeepSeek-V3.2's sparse decode kernel: as --attention-backend",
             _attention_backend, _STR),
    PeerFlag(("--cuda-graph-max-bs",), "SGLang's: capture decode CUDA graphs for batch sizes 1, 2, 4, ... "
             "below N and N (--cuda-graph-sizes)", _cuda_graph_max_bs, _INT),
    PeerFlag(("--enable-torch-compile",), "accepted: splash does not torch.compile; its decode step runs "
             "its own kernels and CUDA graphs", _accept),
    PeerFlag(("--torch-compile-max-bs",), "accepted with --enable-torch-compile (no effect)", _accept, _INT),
    PeerFlag(("--quantization",), "refused: splash reads the checkpoint's own quantization",
             _refuse("splash reads the checkpoint's own quantization_config (FP8 block scales of "
                     "DeepSeek-V3/V3.2, GLM-5-FP8, Kimi-K2) and quantizes nothing on the fly; drop the flag"),
             _STR),
    # ---- speculative decoding
    PeerFlag(("--speculative-eagle-topk",), "SGLang's draft tree width: 1 (a chain) only",
             _speculative_eagle_topk, _INT),
    # ---- model, front end, server
    PeerFlag(("--trust-remote-code",), "accepted: no remote code is ever run (a checkpoint is read as "
             "config.json, safetensors and tokenizer.json)", _accept),
    PeerFlag(("--tokenizer-mode",), "vLLM's: auto, hf, slow, deepseek_v32 accepted (splash reads "
             "tokenizer.json, DeepSeek-V3.2's chat encoding by itself)", _tokenizer_mode, _STR),
    PeerFlag(("--enable-metrics",), "accepted: /metrics is always served", _accept),
    PeerFlag(("--enable-custom-logit-processor",), "accepted: a request's custom_logit_processor is "
             "refused (splash runs no code from requests)", _accept),
    PeerFlag(("--disable-overlap-schedule",), "accepted: splash's scheduler has no overlap mode to turn "
             "off", _accept),
    PeerFlag(("--enable-chunked-prefill",), "accepted: prompts longer than --max-num-batched-tokens are "
             "always chunked", _accept),
    PeerFlag(("--disable-log-requests",), "accepted: splash does not log requests", _accept),
)
PEER_KEYS: dict[str, PeerFlag] = {k: p for p in PEER_FLAGS for k in p.keys}


def add_peer_flags(p: argparse.ArgumentParser) -> None:
    """Every row on `p`, in one group; a given flag lands in the row's `dest` (None when absent)."""
    g = p.add_argument_group("engine: SGLang / vLLM launch flags (splash's meaning)")
    for row in PEER_FLAGS:
        kw: dict[str, Any] = {"dest": row.dest, "default": None, "help": row.help}
        kw.update(row.arg if row.arg else {"action": "store_true"})
        g.add_argument(*row.flags, **kw)


def cli_values(args: argparse.Namespace) -> dict[str, Any]:
    """The peer flags given on a command line, by keyword (store_true ones only when given)."""
    out = {}
    for row in PEER_FLAGS:
        v = getattr(args, row.dest, None)
        if v is not None and v is not False:
            out[row.keys[0]] = v
    return out


def apply_peer_flags(given: Mapping[str, Any], kw: dict[str, Any]) -> dict[str, Any]:
    """Options `kw` with the peer flags `given` (by any of their keywords) applied in table order;
    ConfigError names a refused flag, its reason and splash's equivalent."""
    canon: dict[str, Any] = {}  # each row's value under its first keyword
    for key, value in given.items():
        first = PEER_KEYS[key].keys[0]
        if first in canon and canon[first] != value:
            raise ConfigError(f"{key}={value!r} disagrees with {first}={canon[first]!r}; give one of them")
        canon[first] = value
    for row in PEER_FLAGS:
        value = canon.get(row.keys[0])
        if value is not None and value is not False:
            row.apply(row.flags[0], value, canon, kw)
    return kw
