"""Time real engine steps of each layout on this deployment, one grid point at a time.

For each layout the engine is loaded on the T ranks (one rank group reused across layouts), then for
each (B, s, q) point a step plan is built by hand: B requests owned round-robin (as the cost model's
`Batch.balanced` assumes), each holding pages for s positions under the layout's placement rule, each
contributing q new rows at positions [s - q, s). The same plan is executed repeatedly through the
engine's runner, so one timing is exactly one forward step over the T ranks (plan broadcast, every
layer's attention and collectives, logits of the sampled rows) with nothing else in it. The KV pool
starts zeroed and the token ids are random (seeded), so the MoE routes the rows as real text would.

Noise control (the machine may be shared): a warm-up step first, then `reps` timings per point. The
grid is cut into blocks of a few points; the layouts take turns on each block (one engine load per
turn, the first layout rotating from block to block), and `rounds` passes repeat the whole schedule,
so every layout is measured in many short windows spread over the run and a burst of load from
another process does not land on one layout only. The statistic is the median over all rounds'
timings; the interquartile spread is kept as the point's noise.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from splash.calibration.grid import GridPoint
from splash.config import ConfigError


@dataclass
class Timing:
    """All repetitions of one (layout, point), seconds."""

    layout: str
    point: GridPoint
    times: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    @property
    def spread(self) -> float:
        """Interquartile range / median: the noise of this measurement."""
        if len(self.times) < 2:
            return 0.0
        q1, q3 = np.percentile(self.times, [25, 75])
        return float((q3 - q1) / self.median) if self.median > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"layout": self.layout, **self.point.to_dict(), "median_s": self.median,
                "spread": self.spread, "times_s": list(self.times)}


def pages_needed(points: Sequence[GridPoint], page_size: int) -> int:
    """Pages per rank that hold the largest point in the worst placement (TP replicates everything)."""
    return max(p.B * -(-p.s // page_size) for p in points) + 1


def build_plan(point: GridPoint, layout: str, alloc: Any, rng: np.random.Generator, vocab: int,
               step: int = 0) -> tuple[Any, list[list[list[int]]]]:
    """A step plan for `point` with pages taken from `alloc` (release the returned tables after)."""
    from splash.engine.plan import SeqSlice, StepPlan
    from splash.layouts import round_robin_owners

    owners = round_robin_owners(point.B, alloc.world)
    tables, seqs = [], []
    for i, owner in enumerate(owners):
        t = alloc.empty_table()
        alloc.grow(t, point.s, owner)
        tables.append(t)
        seqs.append(SeqSlice(req_id=i, start=point.s - point.q, num_new=point.q, owner=owner, pages=t,
                             sample=True))
    ids = rng.integers(0, vocab, size=point.rows).tolist()
    return StepPlan(step=step, layout=layout, input_ids=ids, seqs=seqs), tables


def blocks(points: Sequence[GridPoint], size: int) -> list[list[GridPoint]]:
    """Consecutive runs of `size` sorted points: the unit the layouts take turns on."""
    pts = sorted(points)
    return [pts[i:i + size] for i in range(0, len(pts), max(1, size))]


def _time_point(eng: Any, point: GridPoint, layout: str, rng: np.random.Generator, warmup: int, reps: int,
                step: int) -> list[float]:
    """`reps` timings of one forward step of `point` (after `warmup` untimed ones); pages released."""
    plan, tables = build_plan(point, layout, eng.allocator, rng, eng.vocab_size or 2, step)
    times = []
    try:
        for k in range(warmup + reps):
            plan.step = step + k
            t0 = time.perf_counter()
            eng.runner.execute(plan)
            if k >= warmup:
                times.append(time.perf_counter() - t0)
    finally:
        for t in tables:
            eng.allocator.release(t)
    return times


def measure(points: Sequence[GridPoint], layouts: Sequence[str], ranks: int, *, model: str = "tiny",
            dtype: str = "float32", page_size: int = 16, reps: int = 3, warmup: int = 1, rounds: int = 3,
            block: int = 6, device: str | None = None, seed: int = 0,
            progress: bool = True) -> dict[tuple[str, GridPoint], Timing]:
    """Timings of one forward step per (layout, point) on `ranks` ranks (see the module docstring)."""
    import torch

    from splash.engine.group import RankGroup
    from splash.engine.runner import build_engine

    if ranks < 2:
        raise ConfigError("calibration compares layouts, which needs --tp 2 or more ranks")
    if reps < 1 or warmup < 0 or rounds < 1 or block < 1:
        raise ConfigError("need reps >= 1, warmup >= 0, rounds >= 1, block >= 1")
    points = sorted(points)
    engine_kw = dict(dtype=dtype, tp=ranks, num_kv_pages=pages_needed(points, page_size), page_size=page_size,
                     max_num_seqs=max(p.B for p in points),
                     max_num_batched_tokens=max(512, max(p.rows for p in points)),
                     max_model_len=max(p.s for p in points) + 1, device=device, seed=seed)
    torch.set_num_threads(1)
    out: dict[tuple[str, GridPoint], Timing] = {(lay, p): Timing(lay, p) for lay in layouts for p in points}
    bar = None
    if progress:
        import sys

        from tqdm.auto import tqdm

        bar = tqdm(total=rounds * len(layouts) * len(points), desc="calibrate", unit="pt", file=sys.stderr)
    group = RankGroup.start(ranks, device=device, threads=1)
    rng = np.random.default_rng(seed)
    step, turn = 0, 0
    try:
        for _ in range(rounds):
            for pts in blocks(points, block):
                k = turn % len(layouts)
                turn += 1
                for lay in [*layouts[k:], *layouts[:k]]:  # each block starts at the next layout
                    if bar is not None:
                        bar.set_description(f"calibrate {lay}")
                    eng = build_engine(model, layout=lay, rank_group=group, **engine_kw)
                    try:
                        for p in pts:
                            out[(lay, p)].times += _time_point(eng, p, lay, rng, warmup, reps, step)
                            step += warmup + reps
                            if bar is not None:
                                bar.update(1)
                    finally:
                        eng.shutdown()
    finally:
        if bar is not None:
            bar.close()
        group.close()
    return out
