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

    Acceptance: per request, accepted drafts and rejections (a verify that stopped short), each verify's
    counts weighing DECAY times the next one's, shrunk towards the engine-wide rate (starting at 0.5,
    its verifies decayed by PRIOR_DECAY). A request's acceptance moves as it generates (the first
    tokens after a prompt are drafted worst: on the trained MTP checkpoint ~0.3 for the first dozen
    tokens, ~0.75 after), and a lifetime count lagged it by tens of steps at the wrong depth; the
    engine-wide rate is what a new request starts from, so a warm-up's few verifies fade.

    Step times: per batch-size bucket, the pure-decode steps run there at each depth (the last KEEP).
    Once a bucket has steps at two depths whose rows differ by SPREAD, its line through them (seconds
    = fixed + per_row x rows, through each depth's medians: a slow step does not bend it) prices it: a
    depth run there at its own median time, moved along the line to this batch's rows, a depth not
    run there on the line. These are the engine's own rates whatever theta says (the built-in CPU prior
    put a row at a quarter of its cost on an AMD host, and its ratios then favoured drafts at wide
    batches). Depth 0 is run once in each bucket (a probe of one dwell): a draft phase has a fixed cost
    that depth 0 skips, so a line through depths >= 1 overprices depth 0, the baseline. Before a bucket
    has a line, the line through every bucket's steps prices it (`measured_times(None, ...)`); before any
    line, the prior's time at each depth is scaled by the measured/predicted ratio of the depths
    run there (else of other buckets, else of the nearest depth), a depth not run here priced `explore`
    times lower, and once the current depth has dwelt, the nearest depth whose rows differ by SPREAD
    is run so that the line exists. A sample not refreshed for STALE decisions is forgotten, so a depth
    turned off is tried again later. Re-priced every EVERY steps. Rank 0 only."""

    KEEP = 7
    STALE = 256
    EVERY = 4  # steps between decisions
    SPREAD = 1.5  # rows at two depths of a bucket that differ this much give its line
    DECAY = 0.8  # a request's acceptance: about its last 5 verifies
    PRIOR_DECAY = 0.98  # the engine-wide rate: about the last 50 verifies
    FADE = 0.9  # per decision at depth 0 (no verifies): what was measured fades towards no data

    def __init__(self, sizes: Any, theta: Any, cfg: Any, explore: float = 0.8) -> None:
        self.sizes, self.theta, self.cfg = sizes, theta, cfg
        self.explore = explore
        self.k = cfg.max_depth  # start speculating: acceptance is measured only by trying
        self.steps_at = 0
        self.accepted = 0.0  # engine-wide drafts accepted / verifies that stopped at a rejection (decayed)
        self.rejected = 0.0
        # (bucket, depth) -> the last few steps' (rows, seconds, measured / predicted) and the decision
        # they were last fed at
        self.samples: dict[tuple[int, int], tuple[deque[tuple[int, float, float]], int]] = {}
        self.decisions = 0
        self.changes = 0
        self._memo: dict[tuple[Any, ...], dict[int, float]] = {}

    @property
    def prior(self) -> float:
        return (self.accepted + 2.0) / (self.accepted + self.rejected + 4.0)

    def verified(self, rec: Any, drafts: int, accepted: int) -> None:
        """Count one verify of a request (`rec`: its record, whose `spec_rejected` and recent counts it
        keeps too): `accepted` of `drafts` drafts."""
        rejected = int(accepted < drafts)
        self.accepted = self.accepted * self.PRIOR_DECAY + accepted
        self.rejected = self.rejected * self.PRIOR_DECAY + rejected
        rec.spec_rejected += rejected
        rec.recent_accepted = rec.recent_accepted * self.DECAY + accepted
        rec.recent_rejected = rec.recent_rejected * self.DECAY + rejected

    def _fresh(self) -> dict[tuple[int, int], deque[tuple[int, float, float]]]:
        return {key: rs for key, (rs, at) in self.samples.items() if self.decisions - at <= self.STALE}

    @property
    def ratio(self) -> dict[tuple[int, int], float]:
        """The measured / predicted ratio in force per (bucket, depth): the median of its recent steps."""
        return {key: float(np.median([r for _, _, r in rs])) for key, rs in self._fresh().items()}

    def medians(self, b: int) -> dict[int, tuple[float, float]]:
        """Depth -> (rows, seconds) of the steps measured at that depth in bucket `b`: the median rows and
        the lower quartile of seconds (a shared VM's noise only ever slows a step: a burst of slow steps
        at the depth running then, compared with depths measured in a quieter minute, had turned a
        batch-1 depth 3 down to 1 at 0.8x of its speed)."""
        return {k: (float(np.median([r for r, _, _ in rs])), float(np.quantile([t for _, t, _ in rs], 0.25)))
                for (bb, k), rs in self._fresh().items() if bb == b}

    def line(self, b: int | None) -> tuple[float, float] | None:
        """(fixed seconds, seconds per row) of bucket `b`'s steps (None: of every bucket's, pooled):
        least squares through each measured (bucket,) depth's median (rows, seconds); None until two of
        them differ in rows by SPREAD."""
        if b is None:
            pts = [pt for bb in {bb for bb, _ in self._fresh()} for pt in self.medians(bb).values()]
        else:
            pts = list(self.medians(b).values())
        rows = [r for r, _ in pts]
        if len(pts) < 2 or max(rows) < self.SPREAD * min(rows):
            return None
        per_row, fixed = np.polyfit(rows, [t for _, t in pts], 1)
        per_row = max(float(per_row), 0.0)
        fixed = max(float(np.mean([t - per_row * r for r, t in pts])), 0.0)
        return fixed, per_row

    def measured_times(self, b: int | None, batch: int) -> dict[int, float] | None:
        """Step seconds at each depth for `batch` decoding requests, from bucket `b`'s own steps (see the
        class docstring), or with b None from the line through every bucket's (a wider batch read off
        narrower ones: on a CPU VM the prior's per-row cost was 3.5x too low, and a bucket's first steps
        at depth 3 cost what its line later showed); None before there is a line."""
        line = self.line(b)
        if line is None:
            return None
        fixed, per_row = line
        at = self.medians(b) if b is not None else {}
        out = {}
        for k in range(self.cfg.max_depth + 1):
            t = fixed + per_row * batch * (k + 1)
            if k in at:
                rows, secs = at[k]
                t = secs * t / max(fixed + per_row * rows, 1e-12)
            out[k] = t
        return out

    def _ratios(self, b: int) -> dict[int, float]:
        """The ratio to apply at each depth in bucket `b` before it has a line: its own where measured;
        else the depth's ratio in the other buckets, scaled by how this bucket's measured depths compare
        with theirs (the shape carries over as the batch narrows), else the nearest measured depth's;
        both `explore` lower, so a depth not yet run in this bucket is tried once rather than judged by
        others."""
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

    def _probe(self, b: int, lined: bool) -> int | None:
        """The depth to run next in bucket `b` to learn it: 0 where it has a line but no depth-0 steps;
        else, so that it gets a line, the nearest depth to the current one (the lower on a tie) whose
        rows differ from those of every depth measured there by SPREAD; None when the current depth
        has no steps there yet, or nothing is to learn."""
        here = [k for (bb, k) in self._fresh() if bb == b]
        if self.k not in here:
            return None
        if lined:
            return 0 if 0 not in here else None
        far = [j for j in range(self.cfg.max_depth + 1)
               if all(max(j, k) + 1 >= self.SPREAD * (min(j, k) + 1) for k in here)]
        return min(far, key=lambda j: (abs(j - self.k), j)) if far else None

    def decide(self, decoding: list[Any], joining: int, layout: str) -> int:
        """The depth of the next step for these decoding requests (their records: `recent_accepted`,
        `recent_rejected`, `num_computed`) and `joining` more still prefilling. A step that mixes in
        prefill rows is priced as the pure decode step of the whole batch (joining included, at the
        engine-wide acceptance): its token budget is fixed, so verify rows take the place of prefill
        rows, which then take a later step, and the drafts' price is what they cost the batch being
        built (on a CPU VM, 64 requests speculating at depth 3 while the others prefilled stretched
        that phase from 17 steps of 85 ms to 22 of 100 ms, for nothing when the batch decodes at 0)."""
        from splash.core.correction import bucket
        from splash.core.spec_depth import acceptance_rate, choose_depth, could_pay, prices

        self.steps_at += 1
        if not decoding:
            return self.k
        if self.steps_at % self.EVERY and self.steps_at > 1:
            return self.k  # (re-priced every EVERY steps: a batch changes slowly; pricing is host time)
        if self.k == 0:
            self._fade(decoding)
        prior = self.prior
        acc = [acceptance_rate(s.recent_accepted, s.recent_rejected, prior) for s in decoding]
        acc += [prior] * joining
        B = len(acc)
        b = bucket(B)
        times = self.measured_times(b, B)
        lined = times is not None
        if times is None:  # not lined here yet: every bucket's steps on one line (a row costs alike)
            times = self.measured_times(None, B)
        if times is not None:
            k = choose_depth(prices(times, acc), self.k, self.steps_at, self.cfg)
        else:
            ctx = sum(s.num_computed for s in decoding) // len(decoding)
            k = choose_depth(prices(self._times(layout, B, ctx), acc, self._ratios(b)), self.k, self.steps_at,
                             self.cfg)
        probe = self._probe(b, lined) if self.steps_at >= self.cfg.min_dwell else None
        if probe and not could_pay(acc, self.cfg.max_depth, self.cfg.gain):
            probe = None  # (no depth could pay at this acceptance: its step time is not worth drafts)
        k = k if probe is None or k != self.k else probe
        self.decisions += 1
        if k != self.k:
            self.k, self.steps_at = k, 0
            self.changes += 1
        return self.k

    def _fade(self, decoding: list[Any]) -> None:
        """At depth 0 nothing is verified, so acceptance measured before would hold for good: on the
        trained MTP checkpoint a request's first dozen tokens are drafted worst (~0.3), a batch-1 policy
        turned off there never saw the ~0.75 after, and ran 1.0x where depth 3 gave 1.7x. Fading the
        counts (engine-wide and the decoding requests') by FADE a decision returns the estimate to the
        prior's in ~20 decisions (~80 steps), so the depth is tried again; where drafts truly lose, that
        try is one dwell in so many steps."""
        self.accepted *= self.FADE
        self.rejected *= self.FADE
        for s in decoding:
            s.recent_accepted *= self.FADE
            s.recent_rejected *= self.FADE

    def _times(self, layout: str, batch: int, ctx: int) -> dict[int, float]:
        """Predicted step seconds at each depth for `batch` decoding requests of context ~`ctx` (a
        uniform batch, rounded to 64 tokens; memoised: the cost model is host time every step)."""
        from splash.core.layouts import Layout
        from splash.core.spec_depth import depth_times

        key = (layout, batch, (ctx + 63) // 64)
        got = self._memo.get(key)
        if got is None:
            if len(self._memo) > 4096:
                self._memo.clear()
            got = self._memo[key] = depth_times(self.sizes, self.theta, Layout(layout), [64 * key[2]] * batch,
                                                self.cfg)
        return got

    def observe(self, contexts: list[int], rows: list[int], measured_s: float, layout: str) -> None:
        """A pure decode step ran: `rows[i]` rows (1 + its drafts) of a request reaching `contexts[i]`
        tokens, in `measured_s` seconds (drafting included); it joins its (bucket, depth)."""
        from splash.core.correction import bucket

        if not contexts or measured_s <= 0:
            return
        B, n = len(contexts), sum(rows)
        d = min(self.cfg.max_depth, max(0, round(n / B) - 1))
        t = self._times(layout, B, sum(contexts) // B - d - 1)[d]
        key = (bucket(B), d)
        rs = self.samples.get(key, (deque(maxlen=self.KEEP), 0))[0]
        rs.append((n, measured_s, measured_s / t))
        self.samples[key] = (rs, self.decisions)
