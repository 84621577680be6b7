"""Kimi-Linear (MLA + KDA) fixtures: a tiny transformers-made float64 checkpoint and its reference.

transformers computes the KDA core (`chunk_kimi_delta_attention`, `recurrent_kimi_delta_attention`)
in float32 even for a float64 model; splash computes it in float64 for a float64 model. To hold the
float64 standard the reference's two KDA functions are re-made with float64 in place of float32
(`kda_core_float64`: their own source with the dtype swapped, nothing else); the forget gate, the
gated norm and the router keep transformers' float32, which splash reproduces op for op. Against the
unpatched reference only greedy tokens are compared.

Layers 1, 2 and 4 (1-based, as Kimi's config writes them) are KDA, layer 3 is NoPE MLA; 4 KDA heads of
8 and 4 MLA heads, so T = 2 and 4 split both kinds of heads.
"""

from __future__ import annotations

import contextlib
import inspect
import os
from collections.abc import Iterator
from typing import Any

import torch
from helpers_ckpt import save_random

KIMI: dict[str, Any] = dict(
    vocab_size=97, hidden_size=48, intermediate_size=80, moe_intermediate_size=24, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=24, qk_nope_head_dim=12, qk_rope_head_dim=32,
    v_head_dim=10, num_experts=32, num_shared_experts=1, num_experts_per_token=3, first_k_dense_replace=1,
    q_lora_rank=None, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    linear_attn_config={"num_heads": 4, "head_dim": 8, "short_conv_kernel_size": 4, "kda_layers": [1, 2, 4],
                        "full_attn_layers": [3]},
    moe_layer_freq=1,
)
CORE = ("recurrent_kimi_delta_attention", "chunk_kimi_delta_attention")


def build_kimi(path: str | os.PathLike[str], seed: int = 0, **overrides: Any) -> str:
    """Write a tiny random float64 KimiLinearForCausalLM checkpoint to `path`."""
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    return save_random(KimiLinearForCausalLM, KimiLinearConfig(**{**KIMI, **overrides}), path, seed)


def kimi_reference(path: str | os.PathLike[str]):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(os.fspath(path), dtype=torch.float64,
                                                experts_implementation="eager",
                                                attn_implementation="sdpa").eval()


def _source(module: Any, name: str) -> str:
    """The source of a module-level function without its decorators (newer transformers wrap the KDA
    core in a hub-kernel object that `inspect` cannot read)."""
    import ast

    text = inspect.getsource(module)
    for node in ast.parse(text).body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            node.decorator_list = []
            return ast.unparse(node)
    raise LookupError(f"{name} is not defined in {module.__name__}")


@contextlib.contextmanager
def kda_core_float64() -> Iterator[None]:
    """transformers' two KDA core functions computing in float64 (their source, float32 -> float64)."""
    import transformers.models.kimi_linear.modeling_kimi_linear as m

    saved = {n: getattr(m, n) for n in CORE}
    try:
        for n in CORE:
            src = _source(m, n).replace("torch.float32", "torch.float64")
            src = src.replace(".float()", ".double()")
            assert "float32" not in src and ".float()" not in src
            exec(compile(src, m.__file__, "exec"), m.__dict__)  # noqa: S102 - the reference's own code
        yield
    finally:
        for n, f in saved.items():
            setattr(m, n, f)
