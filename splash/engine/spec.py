"""Speculative decoding on rank 0 (`--speculative-algorithm NGRAM`): draft tokens proposed from the
request's own prompt and output (vLLM's prompt lookup, SGLang's NGRAM without its cross-request trie),
verified by the target in the next step's forward as extra rows of the request (a short prefill chunk:
every layout already runs those), then accepted.

- Greedy requests keep the longest prefix of the drafts that equals the target's argmax at each row,
  plus the target's token after it: the tokens are exactly those of decoding one at a time.
- Sampled requests use exact rejection sampling for a deterministic draft (q one-hot on draft d):
  accept d with probability p(d) under the target's processed distribution p (temperature, min-p,
  top-k, top-p); on rejection draw from p without d; after every accepted draft, draw the bonus token
  from p. Each emitted token is distributed as non-speculative sampling's.

The KV of rejected rows stays in the request's pages past its computed length and is overwritten when
those positions are computed for real; the pages beyond the next row are returned (KVAllocator.shrink);
the prefix cache only ever registers pages of accepted tokens (the scheduler counts a verify slice as
one computed row until acceptance says more). Requests whose next-token rule depends on the tokens
before it in ways a batch of rows cannot see (a grammar, penalties, logit bias, min_tokens still
pending, top-p replay, routed experts) and models with per-request
recurrent state (KDA hybrids: rejected rows would leave the state advanced) decode one token at a time.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch


def ngram_propose(tokens: Sequence[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to `k` tokens that followed the latest earlier occurrence of the longest suffix of `tokens`
    (lengths max_n down to min_n) that occurred before; [] when none did."""
    n_tok = len(tokens)
    if k < 1 or n_tok < min_n + 1:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    for n in range(min(max_n, n_tok - 1), min_n - 1, -1):
        suffix = arr[n_tok - n:]
        # windows starting at i <= n_tok - 1 - n: each has at least one token after it
        win = np.lib.stride_tricks.sliding_window_view(arr[: n_tok - 1], n)
        hits = np.flatnonzero((win == suffix).all(axis=1))
        if hits.size:
            i = int(hits[-1]) + n
            return arr[i:i + k].tolist()
    return []


def can_speculate(params: Any, num_generated: int, guide: Any) -> bool:
    """Whether a request's next tokens may be verified several at a time (see the module docstring)."""
    return (guide is None and not params.penalized and not params.logit_bias
            and num_generated >= params.min_tokens and not params.return_top_p_token_ids
            and not params.return_routed_experts)


def accept_greedy(targets: Sequence[int], draft: Sequence[int]) -> int:
    """Drafts accepted: the longest prefix of `draft` equal to the target's tokens row by row."""
    m = 0
    while m < len(draft) and targets[m] == draft[m]:
        m += 1
    return m


def target_probs(logits: torch.Tensor, params: Any) -> torch.Tensor:
    """[rows, V] the distribution non-speculative sampling draws from at each row (temperature, min-p,
    top-k, top-p: the sampler's own filters), in float64 for the acceptance test."""
    from splash.engine.logits import apply_min_p
    from splash.engine.sampler import _filter_top_k_top_p

    x = logits.double() / params.temperature
    rows, vocab = x.shape
    x = apply_min_p(x, torch.full((rows,), float(params.min_p), dtype=x.dtype))
    k = params.top_k if params.top_k > 0 else vocab
    filtered, order = _filter_top_k_top_p(x, torch.full((rows,), k), torch.full((rows,), float(params.top_p),
                                                                                 dtype=x.dtype))
    return torch.zeros_like(x).scatter_(1, order, filtered.softmax(dim=-1))


def accept_sampled(probs: torch.Tensor, draft: Sequence[int], generator: torch.Generator | None
                   ) -> list[int]:
    """The tokens rejection sampling emits for `draft` (a one-hot proposal per row) under the target's
    `probs` [len(draft) + 1, V]: the accepted drafts, then one drawn token (see the module docstring)."""
    out: list[int] = []
    for j, d in enumerate(draft):
        u = torch.rand((), dtype=torch.float64, generator=generator).item()
        if u < float(probs[j, d]):
            out.append(int(d))
            continue
        residual = probs[j].clone()
        residual[d] = 0.0
        out.append(int(torch.multinomial(residual, 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(probs[len(draft)], 1, generator=generator)))
    return out


def row_logprobs(row: torch.Tensor, token: int, params: Any) -> dict[int, float]:
    """{token: logprob} plus the `params.logprobs` most likely, as the sampler reports them: of the raw
    logits (vLLM's default) or, with `logprob_temperature` (SGLang's /generate), of the logits over the
    temperature (nothing else touches a speculating request's logits)."""
    top = params.logprobs or 0
    x = row.float() if row.dtype in (torch.bfloat16, torch.float16) else row
    if params.logprob_temperature:
        x = x / (params.temperature or 1.0)
    lp = torch.log_softmax(x, dim=-1)
    d = {token: float(lp[token])}
    if top:
        v, i = lp.topk(top)
        for t, x in zip(i.tolist(), v.tolist()):
            d.setdefault(t, x)
    return d
