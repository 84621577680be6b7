"""Time real engine steps of each layout on this deployment, one grid point at a time.

Every layout gets its own engine, resident for the whole run: one driver process per layout holds a
rank group of T ranks (its rank 0 plus T - 1 spawned workers) with the model loaded in that layout.
For each (B, s, q) point each driver builds a step plan by hand: B requests owned round-robin (as the
cost model's `Batch.balanced` assumes), each holding pages for s positions under the layout's
placement rule, each contributing q new rows at positions [s - q, s). The same plan is executed
repeatedly through the engine's runner, so one timing is exactly one forward step over the T ranks
(plan broadcast, every layer's attention and collectives, logits of the sampled rows) and nothing
else. The KV pool starts zeroed and the token ids are random (seeded), so the MoE routes the rows as
real text would.

Noise control (the machine may be shared): the layouts take turns *step by step* - one timed step of
each layout, in an order that rotates every repetition - so a burst of load from another process
lands on all layouts alike instead of on whichever was being measured. Untimed warm-up steps per
layout and point come first; `rounds` passes repeat the grid. The statistic is the median over all
timings of a (layout, point): one step of a 2-rank CPU engine varies by 10-40% (interquartile range /
median) on a shared VM (other processes take turns on its cores), so the estimate needs many
steps; its standard error (`Timing.se`) says how decisive a comparison between layouts is.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from splash.calibration.grid import GridPoint
from splash.core.layouts import DEFAULT_PAGE_SIZE
from splash.core.model_config import ConfigError


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

    @property
    def se(self) -> float:
        """Relative standard error of the median (normal approximation: 1.2533 sigma / sqrt(n), sigma
        from the interquartile range): how far the median itself may be off, unlike `spread`, which is
        the noise of one step."""
        n = len(self.times)
        return 1.2533 * self.spread / 1.349 / n ** 0.5 if n > 1 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"layout": self.layout, **self.point.to_dict(), "median_s": self.median,
                "spread": self.spread, "se": self.se, "times_s": list(self.times)}


def pages_needed(points: Sequence[GridPoint], page_size: int, layout: str = "tp", ranks: int = 1) -> int:
    """Pages per rank that hold the largest point under `layout`'s placement (TP replicates all)."""
    from splash.core.layouts import round_robin_owners
    from splash.kv.allocator import KVAllocator

    need = 0
    for p in points:
        alloc = KVAllocator(p.B * -(-p.s // page_size) + 1, page_size, world=ranks, layout=layout)
        for owner in round_robin_owners(p.B, ranks):
            alloc.grow(alloc.empty_table(), p.s, owner)
        need = max(need, *alloc.num_used)
    return need + 1


def build_plan(point: GridPoint, layout: str, alloc: Any, rng: np.random.Generator, vocab: int,
               step: int = 0, first_id: int = 0, dropped: list[int] | None = None
               ) -> tuple[Any, list[list[list[int]]]]:
    """A step plan for `point` with pages taken from `alloc` (release the returned tables after).
    Requests are numbered from `first_id`: ranks keep tables by request id, so a new plan's requests
    need new ids, and `dropped` names the released ones the ranks may forget."""
    from splash.core.layouts import round_robin_owners
    from splash.step.plan import SeqSlice, StepPlan

    owners = round_robin_owners(point.B, alloc.world)
    tables, seqs = [], []
    for i, owner in enumerate(owners):
        t = alloc.empty_table()
        alloc.grow(t, point.s, owner)
        tables.append(t)
        seqs.append(SeqSlice(req_id=first_id + i, start=point.s - point.q, num_new=point.q, owner=owner,
                             pages=t, sample=True))
    ids = rng.integers(0, vocab, size=point.rows).tolist()
    return StepPlan(step=step, layout=layout, input_ids=ids, seqs=seqs, dropped=list(dropped or [])), tables


class _Driver:
    """Rank 0 of one layout's engine, in its own process (it spawns that engine's worker ranks)."""

    def __init__(self, ctx: Any, layout: str, ranks: int, engine_kw: dict[str, Any], model: str,
                 seed: int, timeout_s: float) -> None:
        self.layout, self.timeout_s = layout, timeout_s
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_driver_main, name=f"splash-calibrate-{layout}",
                                args=(child, layout, ranks, engine_kw, model, seed), daemon=False)
        self.proc.start()
        child.close()

    def ask(self, *msg: Any) -> Any:
        self.conn.send(msg)
        return self.reply()

    def reply(self) -> Any:
        if not self.conn.poll(self.timeout_s):
            raise TimeoutError(f"calibration engine for {self.layout} did not answer in {self.timeout_s:g} s")
        try:
            kind, value = self.conn.recv()
        except EOFError:
            raise RuntimeError(f"calibration engine for {self.layout} exited (code {self.proc.exitcode})"
                               ) from None
        if kind == "error":
            raise RuntimeError(f"calibration engine for {self.layout}: {value}")
        return value

    def close(self) -> None:
        try:
            if self.proc.is_alive():
                self.conn.send(None)
                self.proc.join(30)
        except (OSError, BrokenPipeError):
            pass
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(5)
        self.conn.close()


def _driver_main(conn: Any, layout: str, ranks: int, engine_kw: dict[str, Any], model: str,
                 seed: int) -> None:
    """Driver loop: ("plan", point) builds a step plan, ("step",) times one step, ("release",) frees
    the plan's pages, None stops. Every answer is ("ok", value) or ("error", message)."""
    import torch

    torch.set_num_threads(1)
    try:
        from splash.engine.build import build_engine

        eng = build_engine(model, layout=layout, threads=1, **engine_kw)
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which raises it
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    rng = np.random.default_rng(seed)
    cuda = eng.runner.device.type == "cuda"  # kernels are asynchronous there: wait for the step's end
    plan, tables, step, next_id, released = None, [], 0, 0, []
    try:
        conn.send(("ok", None))
        while (msg := conn.recv()) is not None:
            if msg[0] == "plan":
                plan, tables = build_plan(msg[1], layout, eng.allocator, rng, eng.vocab_size or 2, step,
                                          first_id=next_id, dropped=released)
                next_id += len(tables)
                conn.send(("ok", None))
            elif msg[0] == "step":
                plan.step = step
                step += 1
                t0 = time.perf_counter()
                eng.runner.execute(plan)
                if cuda:
                    torch.cuda.synchronize(eng.runner.device)
                conn.send(("ok", time.perf_counter() - t0))
            elif msg[0] == "release":
                for t in tables:
                    eng.allocator.release(t)
                released = [s.req_id for s in plan.seqs] if plan is not None else []
                plan, tables = None, []
                conn.send(("ok", None))
    except (EOFError, KeyboardInterrupt):
        pass
    except BaseException as e:  # noqa: BLE001
        conn.send(("error", f"{type(e).__name__}: {e}"))
    finally:
        eng.shutdown()


def measure(points: Sequence[GridPoint], layouts: Sequence[str], ranks: int, *, model: str = "tiny",
            dtype: str = "float32", page_size: int = DEFAULT_PAGE_SIZE, reps: int = 16, warmup: int = 2,
            rounds: int = 2, device: str | None = None, seed: int = 0, progress: bool = True,
            timeout_s: float = 600.0) -> dict[tuple[str, GridPoint], Timing]:
    """Timings of one forward step per (layout, point) on `ranks` ranks (see the module docstring)."""
    import multiprocessing as mp

    if ranks < 2:
        raise ConfigError("calibration compares layouts, which needs --tp 2 or more ranks")
    if reps < 1 or warmup < 0 or rounds < 1:
        raise ConfigError("need reps >= 1, warmup >= 0, rounds >= 1")
    if not layouts:
        raise ConfigError("no layouts to calibrate")
    points = sorted(points)
    base_kw = dict(dtype=dtype, tp=ranks, page_size=page_size, max_num_seqs=max(p.B for p in points),
                   max_num_batched_tokens=max(512, max(p.rows for p in points)),
                   max_model_len=max(p.s for p in points) + 1, device=device, seed=seed)
    out: dict[tuple[str, GridPoint], Timing] = {(lay, p): Timing(lay, p) for lay in layouts for p in points}
    bar = None
    if progress:

        from splash.progress import progress_bar

        bar = progress_bar(rounds * len(points), f"calibrate {'/'.join(layouts)}", "pt")
    ctx = mp.get_context("spawn")
    drivers: list[_Driver] = []
    try:
        for i, lay in enumerate(layouts):
            kw = {**base_kw, "num_kv_pages": pages_needed(points, page_size, lay, ranks)}
            drivers.append(_Driver(ctx, lay, ranks, kw, model, seed + i, timeout_s))
        for d in drivers:
            d.reply()  # engine loaded
        turn = 0
        for _ in range(rounds):
            for p in points:
                for d in drivers:
                    d.ask("plan", p)
                for k in range(warmup + reps):
                    order = drivers[turn % len(drivers):] + drivers[:turn % len(drivers)]
                    turn += 1
                    for d in order:
                        dt = d.ask("step")
                        if k >= warmup:
                            out[(d.layout, p)].times.append(dt)
                for d in drivers:
                    d.ask("release")
                if bar is not None:
                    bar.update(1)
    finally:
        if bar is not None:
            bar.close()
        for d in drivers:
            d.close()
    return out
