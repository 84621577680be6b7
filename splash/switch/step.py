"""Every rank's switching step: a "switch" plan runs the step in the destination layout while each
layer's state arrives (`SwitchExecutor` through `SwitchLayout`); afterwards the runner's layout, and the
model's form, are the destination. The worker runs it like a forward step (splash/worker/runner.py)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from splash.attention.registry import make_layout
from splash.step.plan import StepPlan
from splash.switch.executor import SwitchExecutor
from splash.switch.layout import SwitchLayout


@dataclass
class SwitchTiming:
    """One rank's view of a switching step (rank 0's goes into the engine's switch log)."""

    exposed_s: float  # time inside the executor: start() + per-layer waits/installs + finish() (CUDA: on
    # the compute stream, event-timed: its stalls on transfers plus the installs)
    total_s: float  # start() .. finish()
    wait_s: list[float]
    max_in_flight: int
    freed: list[int]


def run_switch_step(runner: Any, plan: StepPlan) -> torch.Tensor:
    """Run a "switch" plan on this rank -> hidden states [N, d] of every row (as a forward step)."""
    sw = plan.payload
    comm = getattr(runner, "switch_comm", None) or runner.comm
    ex = SwitchExecutor(sw, runner.model, runner.pool, comm, state=getattr(runner, "state", None))
    dst = make_layout(sw.dst, runner.kernels)  # (the rank's one Kernels: its state carries over)
    layout = SwitchLayout(ex, dst)
    # The context first (the step message has already replaced this rank's tables by the destination's):
    # building it zeroes the state slots of requests that start this step (KDA hybrids), and that must
    # happen before any layer's state blocks are read for sending.
    ctx = runner.context(plan, layout) if plan.seqs else None
    t0 = time.perf_counter()
    ex.start()
    start_s = time.perf_counter() - t0
    if ctx is not None:
        hidden = runner.model(runner.input_ids(plan), ctx.positions, ctx)
    else:
        hidden = torch.zeros(0, runner.model.cfg.hidden_size, dtype=runner.pool.dtype, device=runner.device)
    t1 = time.perf_counter()
    result = ex.finish()
    finish_s = time.perf_counter() - t1
    runner.layout = dst
    exposed = result.exposed_gpu_s if result.exposed_gpu_s is not None else start_s + layout.hook_s + finish_s
    runner.last_switch = SwitchTiming(exposed, result.total_s, list(result.wait_s),
                                      result.max_in_flight, list(result.freed))
    return hidden
