"""Sampling math (greedy, temperature, top-k, top-p, seeds, min_tokens, logprobs) and incremental
detokenization with stop strings."""

import math

import pytest
import torch

from splash.engine.detokenizer import IncrementalDetokenizer
from splash.engine.sampler import Sampler, SampleRow
from splash.engine.sampling import SamplingParams

EOS = 3


def rows(n, gen=None, done=5, **kw):
    return [SampleRow(params=SamplingParams(**kw), num_generated=done, generator=gen) for _ in range(n)]


def test_greedy_is_argmax_and_top_k_1_is_greedy():
    torch.manual_seed(0)
    logits = torch.randn(6, 40, dtype=torch.float64)
    want = logits.argmax(-1).tolist()
    s = Sampler([EOS])
    assert [x.token_id for x in s(logits, rows(6, temperature=0.0))] == want
    assert [x.token_id for x in s(logits, rows(6, temperature=1.3, top_k=1))] == want


def frequencies(logits_row, n=20000, **kw):
    torch.manual_seed(1)
    out = Sampler([EOS])(logits_row.repeat(n, 1), rows(n, **kw))
    counts = torch.bincount(torch.tensor([o.token_id for o in out]), minlength=logits_row.numel())
    return (counts.double() / n).tolist()


def test_temperature_top_k_top_p_distributions():
    p = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64)
    logits = p.log()
    f = frequencies(logits, temperature=1.0)
    assert all(abs(a - b) < 0.015 for a, b in zip(f, p.tolist()))
    hot = (logits / 2).softmax(-1).tolist()
    f = frequencies(logits, temperature=2.0)
    assert all(abs(a - b) < 0.015 for a, b in zip(f, hot))
    f = frequencies(logits, temperature=1.0, top_k=2)
    assert f[2] == f[3] == 0 and abs(f[0] - 0.625) < 0.015
    f = frequencies(logits, temperature=1.0, top_p=0.7)  # nucleus {0, 1}: mass ahead of token 2 is 0.8
    assert f[2] == f[3] == 0 and abs(f[0] - 0.625) < 0.015
    f = frequencies(logits, temperature=1.0, top_p=0.85)
    assert f[3] == 0 and f[2] > 0.1


def test_seeded_rows_do_not_depend_on_batch_company():
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    def draw(order):
        gens = {i: torch.Generator().manual_seed(1234 + i) for i in range(4)}
        out = []
        for _ in range(5):
            rs = [SampleRow(SamplingParams(temperature=1.0, seed=1234 + i), 0, gens[i]) for i in order]
            res = Sampler()(logits[order], rs)
            out.append({i: r.token_id for i, r in zip(order, res)})
        return out
    a, b = draw([0, 1, 2, 3]), draw([3, 1])
    assert all(x[i] == y[i] for x, y in zip(a, b) for i in (1, 3))


def test_min_tokens_blocks_eos_and_stop_ids_then_releases():
    logits = torch.zeros(1, 10)
    logits[0, EOS] = 5.0
    logits[0, 7] = 4.0
    logits[0, 2] = 3.0
    s = Sampler([EOS])
    r = [SampleRow(SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[7]), num_generated=1)]
    assert s(logits, r)[0].token_id == 2
    r[0].num_generated = 2
    assert s(logits, r)[0].token_id == EOS


def test_logprobs_chosen_plus_top_k():
    torch.manual_seed(0)
    logits = torch.randn(2, 30, dtype=torch.float64)
    lp = logits.log_softmax(-1)
    out = Sampler()(logits, rows(2, temperature=0.0, logprobs=3))
    for i, o in enumerate(out):
        top = lp[i].topk(3).indices.tolist()
        assert list(o.logprobs) == [o.token_id] + [t for t in top if t != o.token_id]
        assert all(math.isclose(v, float(lp[i, t])) for t, v in o.logprobs.items())
    none = Sampler()(logits, rows(2, temperature=0.0))
    assert none[0].logprobs is None
    zero = Sampler()(logits, rows(2, temperature=0.0, logprobs=0))
    assert list(zero[0].logprobs) == [zero[0].token_id]


class ByteTok:
    """Byte-level toy tokenizer: id = byte value + 10; ids < 10 are special and skipped."""

    def decode(self, ids, skip_special_tokens=True):
        data = bytes(i - 10 for i in ids if i >= 10)
        return data.decode("utf-8", errors="replace")

    def encode(self, text):
        return [b + 10 for b in text.encode()]


def test_incremental_detokenizer_handles_multibyte_and_matches_full_decode():
    tok = ByteTok()
    text = "héllo wörld — 漢字 🙂!"
    ids = tok.encode(text)
    d = IncrementalDetokenizer(tok, tok.encode("prompt "))
    deltas = [d.add(i) for i in ids]
    assert "".join(deltas) == text == d.text
    assert all("\ufffd" not in x for x in deltas)


@pytest.mark.parametrize("stop,want", [(["wor"], "hello "), (["o", "ll"], "he"), (["zzz"], None)])
def test_stop_strings_truncate_and_hold_back(stop, want):
    tok = ByteTok()
    d = IncrementalDetokenizer(tok, [], stop=stop)
    hit = None
    for i in tok.encode("hello world"):
        delta = d.add(i)
        hit = d.find_stop(len(delta))
        if hit:
            break
        # Text that was shown while running is never taken back later.
        assert "hello world".startswith(d.visible_text(False))
        assert len(d.visible_text(False)) <= max(0, len(d.text) - (max(map(len, stop)) - 1))
    if want is None:
        assert hit is None and d.visible_text(True) == "hello world"
    else:
        assert hit in stop and d.text == want


@pytest.mark.parametrize("kw,field", [
    ({"temperature": float("nan")}, "temperature"), ({"temperature": float("inf")}, "temperature"),
    ({"temperature": -0.1}, "temperature"), ({"temperature": "0.5"}, "temperature"),
    ({"top_p": 0.0}, "top_p"), ({"top_p": float("nan")}, "top_p"),
    ({"top_k": -2}, "top_k"), ({"top_k": 2.5}, "top_k"),
    ({"n": 0}, "n"), ({"n": True}, "n"),
    ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": True}, "max_tokens"),
    ({"min_tokens": 1.5}, "min_tokens"), ({"min_tokens": 20, "max_tokens": 4}, "min_tokens"),
    ({"logprobs": True}, "logprobs"), ({"logprobs": 21}, "logprobs"),
    ({"seed": 2**70}, "seed"), ({"seed": "abc"}, "seed"), ({"seed": 1.5}, "seed"),
    ({"ignore_eos": "no"}, "ignore_eos"), ({"stop": [""]}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
])
def test_bad_sampling_params_are_refused_up_front(kw, field):
    """Before anything is queued: NaN temperature sampled garbage, logprobs=True crashed the whole step,
    a huge seed failed only in add_request."""
    with pytest.raises(ValueError, match=f"^{field} "):
        SamplingParams(**kw)


def test_good_edge_sampling_params_pass():
    for kw in ({"temperature": 0}, {"temperature": 2}, {"top_p": 1}, {"seed": -5}, {"seed": 2**62},
               {"logprobs": 0}, {"max_tokens": None}, {"top_k": 0}):
        SamplingParams(**kw)
