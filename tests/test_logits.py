"""A row's own requests on its logits (splash/engine/logits.py), each against a loop written from its
definition, in vLLM's order: logit_bias added, then CTRL's repetition rule over prompt + output, then
OpenAI's presence/frequency over the output; min_p relative to the most likely token. The grammar mask:
float64 logits (masked by splash) get exactly float32's allowed set (masked by xgrammar's kernel); a
length-bounded JSON string never takes a raw control character."""

from __future__ import annotations

import json
import math

import pytest
import torch

from splash.engine.logits import SampleRow, apply_min_p, process
from splash.engine.sampling import SamplingParams, StructuredOutputs

V = 40


def row(prompt=(), output=(), **kw) -> SampleRow:
    return SampleRow(params=SamplingParams(**kw), num_generated=len(output), prompt_ids=list(prompt),
                     output_ids=list(output))


def by_definition(x: list[float], prompt, output, rep=1.0, presence=0.0, frequency=0.0, bias=None):
    y = list(x)
    for t, b in (bias or {}).items():  # (vLLM's order: the bias, then the penalties)
        y[t] += b
    for t in set(prompt) | set(output):
        y[t] = y[t] / rep if y[t] > 0 else y[t] * rep
    for t in set(output):
        y[t] -= frequency * output.count(t) + presence
    return y


def test_penalties_and_bias_follow_their_definitions():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, V, generator=g, dtype=torch.float64) * 3
    rows = [row([1, 2, 3], [3, 3, 7, 9], repetition_penalty=1.7),
            row([1, 2], [5, 5, 5, 6], presence_penalty=0.5, frequency_penalty=0.25),
            row([4], [4, 8], repetition_penalty=0.8, presence_penalty=-0.3, logit_bias={8: 2.0, 0: -1.5}),
            row([1], [2])]  # asks nothing: untouched
    out = process(logits, rows, eos_ids=[39])
    want = [by_definition(logits[0].tolist(), [1, 2, 3], [3, 3, 7, 9], rep=1.7),
            by_definition(logits[1].tolist(), [1, 2], [5, 5, 5, 6], presence=0.5, frequency=0.25),
            by_definition(logits[2].tolist(), [4], [4, 8], rep=0.8, presence=-0.3, bias={8: 2.0, 0: -1.5}),
            logits[3].tolist()]
    assert torch.allclose(out, torch.tensor(want, dtype=torch.float64), atol=1e-12, rtol=0)
    assert process(logits, [row(), row(), row(), row()], eos_ids=[39]) is logits  # nothing asked: no copy


def test_min_tokens_blocks_eos_and_stop_ids_until_reached():
    logits = torch.zeros(2, V)
    out = process(logits, [row(output=[1], min_tokens=3, stop_token_ids=[7]), row(output=[1, 2, 3],
                                                                                   min_tokens=3)], [39])
    assert math.isinf(out[0, 39]) and math.isinf(out[0, 7]) and not torch.isinf(out[1]).any()


def test_min_p_keeps_tokens_at_least_min_p_of_the_top():
    scaled = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.5, 0.3, 0.15, 0.05]]))
    out = apply_min_p(scaled, torch.tensor([0.35, 0.0]))
    assert torch.isinf(out[0]).tolist() == [False, False, True, True]  # 0.15 < 0.35 * 0.5
    assert not torch.isinf(out[1]).any()


@pytest.fixture(scope="module")
def backend(tmp_path_factory):
    pytest.importorskip("xgrammar")
    from helpers_agent import write_agent_checkpoint

    from splash.engine.grammar import GrammarBackend
    from splash.tokenizer import load_tokenizer

    path = write_agent_checkpoint(tmp_path_factory.mktemp("grammar") / "ckpt")
    vocab = json.load(open(f"{path}/config.json"))["vocab_size"]
    tok = load_tokenizer(path)
    return GrammarBackend(tok, vocab, [tok.eos_token_id]), tok


def test_float64_mask_equals_xgrammars_float32_mask(backend):
    gb, _ = backend
    spec = StructuredOutputs(json={"type": "object", "properties": {"a": {"type": "integer"}}})
    guides = [gb.guide(spec), gb.guide(StructuredOutputs(regex="[a-c]+"))]
    bitmask = gb.allocate(2)
    for j, g in enumerate(guides):
        assert g.fill(bitmask, j)
    base = torch.randn(3, gb.vocab_size, dtype=torch.float64)
    f64, f32 = base.clone(), base.float()
    gb.apply(f64, bitmask.clone(), [0, 2])
    gb.apply(f32, bitmask.clone(), [0, 2])
    assert torch.equal(torch.isinf(f64), torch.isinf(f32)) and torch.isinf(f64[0]).any()
    assert not torch.isinf(f64[1]).any()  # (row 1 has no guide)
    kept = ~torch.isinf(f64)
    assert torch.equal(f64[kept], base[kept])


def test_bounded_json_string_refuses_raw_control_characters(backend):
    gb, tok = backend
    spec = StructuredOutputs(json={"type": "object", "properties": {"s": {"type": "string", "maxLength": 6}},
                                   "required": ["s"]})
    for text, ok in (('{"s": "abc"}', True), ('{"s": "a\x01b"}', False), ('{"s": "abcdefg"}', False)):
        g = gb.guide(spec)
        ids = tok.encode(text, add_special_tokens=False)
        assert (g.accept(ids) == len(ids)) == ok, text
