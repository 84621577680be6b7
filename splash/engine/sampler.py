"""Turning a step's logits into next tokens: greedy, temperature, min-p, top-k, top-p, seeds, logprobs
(after each row's own requests on its logits - grammar, min_tokens, bias, penalties: logits.py).

Batched over rows: one argmax for greedy rows, one sort for the rest. Random draws use the
exponential-race trick (argmax of p / E, E ~ Exp(1)), which samples exactly from p and lets each
seeded request draw from its own `torch.Generator`, so its tokens do not depend on batch company.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from splash.engine.logits import SampleRow, apply_min_p, process


@dataclass
class Sampled:
    token_id: int
    logprobs: dict[int, float] | None = None  # chosen token + top-k, when the request asked
    # return_top_p_token_ids: the tokens the draw was made from (top-k/top-p kept set, most likely
    # first; greedy: the token itself), which an RL trainer replays as the same truncation
    top_p_ids: list[int] | None = None


def _filter_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted (descending) logits with tokens outside top-k / the top-p nucleus set to -inf."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    rank = torch.arange(vocab, device=logits.device).unsqueeze(0)
    sorted_logits = sorted_logits.masked_fill(rank >= top_k.unsqueeze(1), float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass strictly ahead of each token
    drop = (before >= top_p.unsqueeze(1)) & (rank > 0)  # always keep the best token
    return sorted_logits.masked_fill(drop, float("-inf")), order


class Sampler:
    def __init__(self, eos_token_ids: Sequence[int] = ()) -> None:
        self.eos_token_ids = tuple(eos_token_ids)
        self.grammar: Any = None  # the engine's GrammarBackend, once a request asks for structured output

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, rows: Sequence[SampleRow]) -> list[Sampled]:
        if logits.shape[0] != len(rows):
            raise ValueError(f"{logits.shape[0]} logit rows for {len(rows)} sequences")
        if logits.dtype in (torch.bfloat16, torch.float16):
            logits = logits.float()
        raw = logits
        logits = process(logits, rows, self.eos_token_ids, self.grammar)

        tokens = logits.argmax(dim=-1)
        rand = [i for i, r in enumerate(rows) if not r.params.greedy]
        kept: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # row -> (its filtered sorted logits, order)
        if rand:
            idx = torch.tensor(rand, device=logits.device)
            temp = torch.tensor([rows[i].params.temperature for i in rand], dtype=logits.dtype,
                                device=logits.device)
            vocab = logits.shape[1]
            top_k = torch.tensor([rows[i].params.top_k if rows[i].params.top_k > 0 else vocab
                                  for i in rand], device=logits.device)
            top_p = torch.tensor([rows[i].params.top_p for i in rand], dtype=logits.dtype,
                                 device=logits.device)
            scaled = logits.index_select(0, idx) / temp.unsqueeze(1)
            min_p = torch.tensor([rows[i].params.min_p for i in rand], dtype=logits.dtype,
                                 device=logits.device)
            scaled = apply_min_p(scaled, min_p)
            filtered, order = _filter_top_k_top_p(scaled, top_k, top_p)
            probs = filtered.softmax(dim=-1)
            noise = torch.empty_like(probs).exponential_()
            for j, i in enumerate(rand):
                if rows[i].generator is not None:
                    noise[j].exponential_(generator=rows[i].generator)
            choice = (probs / noise).argmax(dim=-1, keepdim=True)
            tokens[idx] = order.gather(1, choice).squeeze(1)
            for j, i in enumerate(rand):
                if rows[i].params.return_top_p_token_ids:
                    kept[i] = (filtered[j], order[j])

        token_list = tokens.tolist()
        out = [Sampled(token_id=t) for t in token_list]
        for i, r in enumerate(rows):
            if r.params.return_top_p_token_ids:
                f = kept.get(i)
                out[i].top_p_ids = ([token_list[i]] if f is None else
                                    f[1][torch.isfinite(f[0])].tolist())
        want = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        if want:
            lp = _logprobs(raw, logits, rows, want, kept)
            kmax = max(rows[i].params.logprobs or 0 for i in want)
            top_v, top_i = lp.topk(kmax, dim=-1) if kmax else (None, None)
            for j, i in enumerate(want):
                t = token_list[i]
                d = {t: float(lp[j, t])}
                k = rows[i].params.logprobs or 0
                if k:
                    for tok, v in zip(top_i[j, :k].tolist(), top_v[j, :k].tolist()):
                        d.setdefault(tok, v)
                out[i].logprobs = d
        return out


def _logprobs(raw: torch.Tensor, masked: torch.Tensor, rows: Sequence[SampleRow], want: list[int],
              kept: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """[len(want), V]: the distribution each row's logprobs are of, one batched op per kind of row. Raw
    logits by default (vLLM's default); `logprob_temperature` (SGLang's /generate): the distribution drawn
    from before top-k/top-p, i.e. after min_tokens masking and temperature; `return_top_p_token_ids` too:
    that distribution renormalised over the kept set, as an RL trainer replaying the truncation does."""
    out = torch.empty(len(want), raw.shape[1], dtype=raw.dtype, device=raw.device)
    plain = [j for j, i in enumerate(want) if not rows[i].params.logprob_temperature]
    scaled = [j for j, i in enumerate(want) if rows[i].params.logprob_temperature and i not in kept]
    trunc = [j for j, i in enumerate(want) if rows[i].params.logprob_temperature and i in kept]
    dev = raw.device
    if plain:
        idx = torch.tensor([want[j] for j in plain], device=dev)
        out[plain] = torch.log_softmax(raw.index_select(0, idx), dim=-1)
    if scaled:
        idx = torch.tensor([want[j] for j in scaled], device=dev)
        temp = torch.tensor([rows[want[j]].params.temperature or 1.0 for j in scaled], dtype=raw.dtype,
                            device=dev)
        out[scaled] = torch.log_softmax(masked.index_select(0, idx) / temp.unsqueeze(1), dim=-1)
    if trunc:
        filtered = torch.stack([kept[want[j]][0] for j in trunc])
        order = torch.stack([kept[want[j]][1] for j in trunc])
        out[trunc] = torch.full_like(filtered, float("-inf")).scatter_(
            1, order, torch.log_softmax(filtered, dim=-1))
    return out
