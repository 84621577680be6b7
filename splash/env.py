"""Every environment variable splash reads, in one table: its name, type, default, what it does, and the
`EngineConfig` field it overrides (if any). Nothing else in splash reads the environment (a source scan
in tests/test_env.py holds every module to that), so this table is the whole list.

Two kinds of SPLASH_* variables:
- *overrides of an engine option* (`field` set): read once, on rank 0, when an `EngineConfig` is made
  (`field_overrides`, which `EngineConfig.from_kwargs` / `from_cli_args` apply under the options given
  explicitly); the ranks receive the resolved config and never read them. Tests and benchmarks set them
  where passing a flag through is awkward.
- *process settings* that are no engine option (`field` None): where the built-in models are cached, the
  benchmark peer's venv. Read through `text` where they are needed.
Then the variables of other programs splash looks at (the C compiler, Triton's interpreter, torchrun's
rank facts): listed so that every read of the environment is in one place too.

A leaf module (no splash imports): the config and every layer above read from it; values are parsed
into what the field takes (the config validates them with its own errors).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

OFF = ("0", "false", "off", "no")  # what turns a boolean variable off


@dataclass(frozen=True)
class Var:
    """One environment variable: how its text reads and what it sets."""

    name: str
    kind: str  # the values it takes, as a user reads them (comma-separated: the docs' table shows it)
    default: str  # the text an unset variable reads as
    doc: str
    field: str | None = None  # the EngineConfig field it overrides; None: a process setting
    # text -> the field's value, or None to leave the field alone (only for `field` variables)
    to_field: Callable[[str], Any] | None = None


def _word(text: str) -> str | None:
    t = text.strip().lower()
    return t or None


def _raw(text: str) -> str | None:
    t = text.strip()
    return t or None


def _off(text: str) -> bool | None:
    """True where the variable is off (the option it stands for is then on, e.g. --enforce-eager)."""
    return True if text.strip().lower() in OFF else None


def _on(text: str) -> bool | None:
    return True if text.strip().lower() not in ("", *OFF) else None


def _false_if_off(text: str) -> bool | None:
    return False if text.strip().lower() in OFF else None


def _bind(text: str) -> str:
    t = text.strip().lower()
    return "auto" if t in ("", "auto", "on", "1") else "off" if t in ("off", "0", "none") else t


def _upcast(text: str) -> str | None:
    t = text.strip()
    return {"0": "off", "1": "on"}.get(t)  # anything else: the CPU decides (as before)


# ---- the table -------------------------------------------------------------------------------------
VARS: tuple[Var, ...] = (
    # overrides of EngineConfig fields (kernels, parallel, debug groups)
    Var("SPLASH_ATTN_FORM", "auto, absorbed, mha", "", "MLA attention form of every chunk "
        "(--attention-form)", "attention_form", _word),
    Var("SPLASH_ATTN_KERNEL", "auto, torch, native, triton", "", "pin the paged-attention kernel where "
        "it can run (--attention-kernel; kernel tests; triton on CPU only under TRITON_INTERPRET=1)",
        "attention_kernel", _word),
    Var("SPLASH_NATIVE", "0, 1", "1", "0 = --enforce-eager (no native kernel, no Triton, no CUDA graphs)",
        "enforce_eager", _off),
    Var("SPLASH_CUDA_GRAPHS", "0, 1", "1", "0 = --disable-cuda-graph", "cuda_graphs", _false_if_off),
    Var("SPLASH_CUDA_GRAPH_SIZES", "comma-separated batch sizes", "", "decode batch sizes to capture "
        "(--cuda-graph-sizes)", "cuda_graph_sizes", _raw),
    Var("SPLASH_BF16_UPCAST", "0, 1", "", "bf16/fp16 CPU GEMMs through float32: 1 always, 0 never "
        "(--bf16-upcast on/off; unset: when the CPU lacks native bf16)", "bf16_upcast", _upcast),
    Var("SPLASH_COMM", "shm, gloo", "shm", "the CPU ranks' data plane: gloo turns the shared-memory "
        "collectives off (--cpu-comm)", "cpu_comm", _word),
    Var("SPLASH_CPU_BIND", "auto, off", "auto", "bind each CPU rank to its own cores when they fit; off "
        "to stop (--cpu-bind)", "cpu_bind", _bind),
    Var("SPLASH_MALLOC_TUNE", "0, 1", "1", "0 = --no-malloc-tune (glibc's malloc left as it is on CPU "
        "ranks)", "malloc_tune", _false_if_off),
    Var("SPLASH_CHECK_BOOKS", "0, 1", "0", "1 = prove the KV books after every step (the test suite; "
        "--check-books)", "check_books", _on),
    # process settings (no engine option)
    Var("SPLASH_CACHE", "folder", "", "where built-in models, tokenizers and compiled kernels are cached "
        "(default ~/.cache/splash)"),
    Var("SPLASH_PEER_VENV", "folder", "", "the vLLM peer venv of `bench --peer vllm` (default .venv-vllm)"),
    # other programs' variables that splash reads
    Var("CC", "program", "", "the C compiler the native CPU kernels are built with (default cc, gcc)"),
    Var("TRITON_INTERPRET", "0, 1", "0", "Triton's CPU interpreter: lets SPLASH_ATTN_KERNEL=triton run "
        "on CPU tensors (tests)"),
    Var("RANK", "int", "", "torchrun: this process's global rank"),
    Var("WORLD_SIZE", "int", "", "torchrun: the rank count T (`--tp` must agree)"),
    Var("TORCHELASTIC_RUN_ID", "text", "", "torchrun: set when it started this process"),
    Var("LOCAL_RANK", "int", "", "torchrun: this process's rank on its node (its GPU)"),
    Var("LOCAL_WORLD_SIZE", "int", "", "torchrun: the ranks on this node"),
)
TORCHRUN = ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
TABLE: dict[str, Var] = {v.name: v for v in VARS}


def text(name: str, environ: Mapping[str, str] | None = None) -> str:
    """The variable's text, its default when unset; KeyError for a name not in the table (add it there)."""
    var = TABLE[name]
    env = os.environ if environ is None else environ
    return env.get(name, var.default)


def is_set(name: str, environ: Mapping[str, str] | None = None) -> bool:
    TABLE[name]  # (only the table's names)
    return name in (os.environ if environ is None else environ)


def field_overrides(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """EngineConfig field -> value for every override variable that is set (what a config made now takes
    under its explicit options); read on rank 0 only."""
    env = os.environ if environ is None else environ
    out: dict[str, Any] = {}
    for var in VARS:
        if var.field is None or var.to_field is None or var.name not in env:
            continue
        value = var.to_field(env[var.name])
        if value is not None:
            out[var.field] = value
    return out


def torchrun() -> dict[str, str]:
    """torchrun's variables that are set (what `resolve_launch` reads when it is given no mapping)."""
    return {name: os.environ[name] for name in TORCHRUN if name in os.environ}


def triton_interpret() -> bool:
    """Triton's interpreter is on (TRITON_INTERPRET=1): the Triton kernel may run on CPU tensors."""
    return text("TRITON_INTERPRET") == "1"


def markdown() -> list[str]:
    """The table as docs/runtime.md prints it, a row per variable (tests/test_env.py keeps them equal)."""
    return [f"| `{v.name}` | {v.kind} | {v.default or '-'} | {f'`{v.field}`' if v.field else '-'} | {v.doc} |"
            for v in VARS]
