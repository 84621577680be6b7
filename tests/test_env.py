"""splash/env.py: every environment variable splash reads is a row of one table, read nowhere else; those
that override an engine option set an EngineConfig field when a config is made (rank 0), and the ranks'
kernels (splash/attention/kernels.py) are an object per rank, never process state read on each step."""

from __future__ import annotations

import ast
import dataclasses
import pathlib
import re
from types import SimpleNamespace

import pytest
import torch

from splash import env
from splash.attention.kernels import Kernels
from splash.config import ENV_OVERRIDES, EngineConfig, KernelConfig, env_defaults

SRC = pathlib.Path(__file__).resolve().parent.parent / "splash"
DOCS = SRC.parent / "docs"
# modules that touch os.environ without reading a variable: a child process's environment built from
# this one's, or a library's own variable set for this process (Mooncake's glog level)
COPIES_ENV = {"bench/peer.py", "bench/serve_peer.py", "bench/soak.py", "bench/pd_serve.py",
              "bench/pd_transfer.py"}


def _sources() -> dict[str, str]:
    return {str(p.relative_to(SRC)): p.read_text(encoding="utf-8") for p in sorted(SRC.rglob("*.py"))}


def test_the_table_lists_every_splash_variable_in_the_source():
    names = set()
    for text in _sources().values():
        names |= set(re.findall(r"\bSPLASH_[A-Z0-9_]*[A-Z0-9]\b", text))
    assert names, "the scan found nothing: is SRC right?"
    missing = sorted(names - set(env.TABLE))
    assert not missing, f"read through splash/env.py's table, add a row for: {missing}"
    assert len(env.VARS) == len(env.TABLE)  # one row per name
    for v in env.VARS:
        assert v.doc and v.kind, v.name
        assert (v.field is None) == (v.to_field is None), v.name


def test_no_module_but_env_reads_the_environment():
    offenders = []
    for rel, text in _sources().items():
        if rel == "env.py":
            continue
        tree = ast.parse(text)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv") and \
                    isinstance(node.value, ast.Name) and node.value.id == "os":
                if node.attr == "getenv" or rel not in COPIES_ENV:
                    offenders.append(f"{rel}:{node.lineno}")
            # a SPLASH_ variable read from any mapping (os.environ.get("SPLASH_X"), env["SPLASH_X"])
            if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and \
                    str(node.slice.value).startswith("SPLASH_"):
                offenders.append(f"{rel}:{node.lineno}")
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                    node.func.attr in ("get", "getenv", "pop", "setdefault") and node.args and \
                    isinstance(node.args[0], ast.Constant) and str(node.args[0].value).startswith("SPLASH_"):
                offenders.append(f"{rel}:{node.lineno}")
    assert not offenders, f"read the environment through splash/env.py: {offenders}"


def test_a_variable_sets_its_field_and_an_explicit_option_wins(monkeypatch):
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    for v in env.VARS:
        assert v.field is None or v.field in fields, v.name
    assert ENV_OVERRIDES == {v.name: (v.field, v.doc) for v in env.VARS if v.field}
    for var in ENV_OVERRIDES:
        monkeypatch.delenv(var, raising=False)
    assert env_defaults() == {} and EngineConfig.from_kwargs().attention_kernel == "auto"
    got = env_defaults({"SPLASH_ATTN_KERNEL": " Torch ", "SPLASH_BF16_UPCAST": "1", "SPLASH_COMM": "gloo",
                        "SPLASH_CPU_BIND": "0", "SPLASH_MALLOC_TUNE": "0", "SPLASH_CACHE": "/x"})
    assert got == {"attention_kernel": "torch", "bf16_upcast": "on", "cpu_comm": "gloo", "cpu_bind": "off",
                   "malloc_tune": False}  # (SPLASH_CACHE is a process setting, no engine option)
    monkeypatch.setenv("SPLASH_ATTN_KERNEL", "torch")
    c = EngineConfig.from_kwargs()
    assert c.attention_kernel == "torch" and c.kernels.attention_kernel == "torch"
    assert EngineConfig.from_kwargs(attention_kernel="native").attention_kernel == "native"
    monkeypatch.setenv("SPLASH_COMM", "carrier-pigeon")
    with pytest.raises(ValueError, match="SPLASH_COMM"):
        EngineConfig.from_kwargs()


def test_the_docs_table_names_every_variable():
    text = (DOCS / "runtime.md").read_text(encoding="utf-8")
    missing = [row for row in env.markdown() if row not in text.splitlines()]
    assert not missing, f"docs/runtime.md's environment table differs from splash/env.py: {missing}"


def _failing_triton() -> SimpleNamespace:
    def boom(*a, **k):
        raise RuntimeError("no compiler for this dtype")

    return SimpleNamespace(paged_attention=boom, DTYPES=(torch.float32,))


def test_two_kernels_objects_keep_separate_failure_sets():
    a, b = Kernels(), Kernels()
    a._triton = _failing_triton()
    q = torch.zeros(2, 1, 4)
    assert a.attention("triton", q, q, q, q, q, q, 1.0) is None  # the torch path takes it
    assert a.failed == {torch.float32} and b.failed == set()  # not the process's: only `a` gave up
    assert a.rows_arange(torch.device("cpu"), 3) is a.rows_arange(torch.device("cpu"), 3)
    assert b.rows_arange(torch.device("cpu"), 3) is not a.rows_arange(torch.device("cpu"), 3)


def test_a_ranks_layouts_share_its_kernels():
    from splash.attention.registry import NAMES, make_layout

    k = Kernels(KernelConfig(attention_form="absorbed"))
    assert all(make_layout(n, k).kernels is k for n in (*NAMES, "local"))
    assert make_layout("tp").kernels is not make_layout("tp").kernels  # built alone: its own


def test_bf16_upcast_is_an_option_set_at_load():
    from splash.model import gemm

    try:
        gemm.set_upcast("on")
        assert gemm.upcast_half()
        gemm.set_upcast("off")
        assert not gemm.upcast_half()
        with pytest.raises(ValueError, match="auto, on, off"):
            gemm.set_upcast("sometimes")
    finally:
        gemm.set_upcast("auto")


@pytest.mark.parametrize("model", ["tiny", "tiny-dsa"])
def test_no_environment_lookup_on_the_step_path(monkeypatch, model):
    from splash.engine.build import build_engine
    from splash.engine.sampling import SamplingParams

    eng = build_engine(model=model, dtype="float32", num_kv_pages=32, max_num_seqs=2, device="cpu")
    try:
        def refuse(*a, **k):
            raise AssertionError("the environment was read during a step")

        for name in ("text", "is_set", "field_overrides", "triton_interpret"):
            monkeypatch.setattr(env, name, refuse)
        prompt = [3 + i % 50 for i in range(40)]  # (tiny-dsa: longer than its top-k, the sparse path)
        eng.add_request("a", prompt_token_ids=prompt, params=SamplingParams(max_tokens=4))
        while eng.has_unfinished():
            eng.step()
    finally:
        monkeypatch.undo()
        eng.shutdown()
