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
pending, top-p replay, routed experts) decode one token at a time. A KDA hybrid's verify rows advance
its recurrent and conv state: the ranks snapshot the verify slices' slots as each layer first reads
them, and on a rejection rank 0 has the snapshot put back and replays the known row, the accepted drafts
and the new token as a chunk (`Speculation.verify` in splash/engine/stages/speculation.py,
`StatePool.arm_snapshot`).
"""

from __future__ import annotations

from collections import deque
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


class DepthPolicy:
    """`--speculative-policy auto`: the depth (0 = off) of the next step, chosen as splash/core/spec_depth.py
    prices it, from the live decoding batch, each request's measured acceptance and the engine's own
    step times.

    Acceptance: per request, accepted drafts and rejections (a verify that stopped short), shrunk towards
    the engine-wide rate (starting at 0.5). Step times: per batch-size bucket and depth, the ratio of
    measured to predicted time of the pure-decode steps run there (median of the last KEEP); a depth not
    yet run in a bucket borrows another bucket's or the nearest depth's ratio and is priced `explore`
    times lower, so the policy tries a depth the prior misjudges once instead of never (then its own
    measurements decide). Re-priced every EVERY steps. Rank 0 only."""

    KEEP = 7
    STALE = 256
    EVERY = 4  # steps between decisions

    def __init__(self, sizes: Any, theta: Any, cfg: Any, explore: float = 0.8) -> None:
        self.sizes, self.theta, self.cfg = sizes, theta, cfg
        self.explore = explore
        self.k = cfg.max_depth  # start speculating: acceptance is measured only by trying
        self.steps_at = 0
        self.accepted = 0  # engine-wide drafts accepted / verifies that stopped at a rejection
        self.rejected = 0
        # (bucket, depth) -> the last few measured / predicted ratios and the decision they were last
        # fed at: the median rules (one slow warm-up step does not condemn a depth), and a ratio not
        # refreshed for STALE decisions is forgotten, so a depth turned off is tried again later
        self.samples: dict[tuple[int, int], tuple[deque[float], int]] = {}
        self.decisions = 0
        self.changes = 0
        self._memo: dict[tuple[Any, ...], dict[int, float]] = {}

    @property
    def prior(self) -> float:
        return (self.accepted + 2.0) / (self.accepted + self.rejected + 4.0)

    def verified(self, rec: Any, drafts: int, accepted: int) -> None:
        """Count one verify of a request (`rec`: its record, whose `spec_rejected` it counts too): `accepted`
        of `drafts` drafts."""
        self.accepted += accepted
        self.rejected += int(accepted < drafts)
        rec.spec_rejected += int(accepted < drafts)

    @property
    def ratio(self) -> dict[tuple[int, int], float]:
        """The ratio in force per (bucket, depth): the median of its recent samples, if fresh."""
        return {key: float(np.median(rs)) for key, (rs, at) in self.samples.items()
                if self.decisions - at <= self.STALE}

    def _ratios(self, b: int) -> dict[int, float]:
        """The ratio to apply at each depth in bucket `b`: its own where measured; else the depth's ratio
        in the other buckets, scaled by how this bucket's measured depths compare with theirs (the
        shape carries over as the batch narrows), else the nearest measured depth's; both `explore`
        lower, so a depth not yet run in this bucket is tried once rather than judged by others."""
        fresh = self.ratio
        here = {k: r for (bb, k), r in fresh.items() if bb == b}
        pooled: dict[int, list[float]] = {}
        for (_, k), r in fresh.items():
            pooled.setdefault(k, []).append(r)
        anywhere = {k: float(np.median(v)) for k, v in pooled.items()}
        common = [j for j in here if j in anywhere]
        scale = float(np.median([here[j] / anywhere[j] for j in common])) if common else 1.0
        out = {}
        for k in range(self.cfg.max_depth + 1):
            if k in here:
                out[k] = here[k]
            elif k in anywhere:  # (not measured in this bucket: optimistic, so it is tried here once)
                out[k] = anywhere[k] * scale * self.explore
            elif anywhere:
                near = min(anywhere, key=lambda j: (abs(j - k), j))
                out[k] = anywhere[near] * scale * self.explore
            else:
                out[k] = 1.0 if k == self.k else self.explore
        return out

    def decide(self, decoding: list[Any], other_rows: int, layout: str) -> int:
        """The depth of the next step for these decoding requests (their records: `spec_accepted`,
        `spec_rejected`, `num_computed`) and `other_rows` prefill rows."""
        from splash.core.correction import bucket
        from splash.core.spec_depth import acceptance_rate, choose_depth, prices

        self.steps_at += 1
        if not decoding:
            return self.k
        if self.steps_at % self.EVERY and self.steps_at > 1:
            return self.k  # (re-priced every EVERY steps: a batch changes slowly; pricing is host time)
        prior = self.prior
        acc = [acceptance_rate(s.spec_accepted, s.spec_rejected, prior) for s in decoding]
        b = bucket(len(decoding))
        ctx = sum(s.num_computed for s in decoding) // len(decoding)
        times = self._times(layout, len(decoding), ctx, other_rows)
        k = choose_depth(prices(times, acc, self._ratios(b)), self.k, self.steps_at, self.cfg)
        self.decisions += 1
        if k != self.k:
            self.k, self.steps_at = k, 0
            self.changes += 1
        return self.k

    def _times(self, layout: str, batch: int, ctx: int, others: int = 0) -> dict[int, float]:
        """Predicted step seconds at each depth for `batch` decoding requests of context ~`ctx` (a
        uniform batch, rounded to 64 tokens; memoised: the cost model is host time every step)."""
        from splash.core.layouts import Layout
        from splash.core.spec_depth import depth_times

        key = (layout, batch, (ctx + 63) // 64, (others + 63) // 64)
        got = self._memo.get(key)
        if got is None:
            if len(self._memo) > 4096:
                self._memo.clear()
            got = self._memo[key] = depth_times(self.sizes, self.theta, Layout(layout),
                                                [64 * key[2]] * batch, self.cfg, others=64 * key[3])
        return got

    def observe(self, contexts: list[int], rows: list[int], measured_s: float, layout: str) -> None:
        """A pure decode step ran: `rows[i]` rows (1 + its drafts) of a request reaching `contexts[i]`
        tokens, in `measured_s` seconds (drafting included); the ratio to its prediction goes to its
        (bucket, depth)."""
        from splash.core.correction import bucket

        if not contexts or measured_s <= 0:
            return
        B = len(contexts)
        d = min(self.cfg.max_depth, max(0, round(sum(rows) / B) - 1))
        t = self._times(layout, B, sum(contexts) // B - d - 1)[d]
        key = (bucket(B), d)
        rs = self.samples.get(key, (deque(maxlen=self.KEEP), 0))[0]
        rs.append(measured_s / t)
        self.samples[key] = (rs, self.decisions)
