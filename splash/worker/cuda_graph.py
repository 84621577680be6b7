"""CUDA graphs of the one-rank decode step's forward, one per batch-size bucket (vLLM's capture sizes).

A decode step on a GPU launches a few hundred small kernels; replaying them as one captured graph
removes the launch cost, which dominates at small batch. What makes the forward capturable: every
tensor it reads lives in a static buffer (token ids, positions, KV write slots, page tables) that the
step's real values are copied into; nothing in it syncs with the host (the attention kernel reads its
bounds from device memory, `splash/attention/triton_mla.py`; the MoE runs its sync-free dense form on CUDA,
`MoE._dense`); and its launches depend on the batch size only. A batch of B rows runs the graph of the
smallest bucket >= B; the padding rows repeat the last real row (same token, position, page table and
KV slot), so they compute and write exactly what that row does and touch nothing else.

Only where it is safe: T = 1 (collectives are not captured), decode steps (one row per request, every
page held), the paged Triton kernel in use (the rank's `Kernels`, handed over by the runner), contexts
within the static table. Anything else, a bucket
whose capture failed, `--enforce-eager` / `SPLASH_NATIVE=0` or `SPLASH_CUDA_GRAPHS=0`, runs eagerly.
Buckets are captured lazily at their first step (a warm-up run, then the capture, then the replay; the
warm-up writes the same KV rows the replay writes). `capture=False` runs the same padded static-buffer
forward eagerly, which is how CPU tests check the padding and buffers (no CUDA graph on a CPU).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from splash.config import KernelConfig
from splash.model.context import ForwardContext, SliceCtx

if TYPE_CHECKING:
    from splash.attention.kernels import Kernels

log = logging.getLogger("splash.engine")
DEFAULT_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


def enabled(kernels: KernelConfig) -> bool:
    """CUDA graphs wanted: not turned off by --disable-cuda-graph nor by `--enforce-eager`."""
    return kernels.cuda_graphs and not kernels.enforce_eager


def capture_sizes(kernels: KernelConfig) -> tuple[int, ...]:
    """Bucket sizes (--cuda-graph-sizes 1,2,4,8 overrides the default)."""
    return kernels.cuda_graph_sizes or DEFAULT_SIZES


def for_runner(runner: Any) -> DecodeGraphs | None:
    """The runner's decode graphs, or None where they do not apply (CPU, T > 1, turned off, a DSA model:
    its selected-key count follows the step's longest context, a shape a captured graph cannot take)."""
    if (runner.device.type != "cuda" or runner.world != 1 or runner.pool is None
            or not enabled(runner.kernels.config)):
        return None
    if getattr(runner.model.cfg, "is_sparse", False):
        return None
    # KDA hybrids (not yet): a decode step gathers and scatters its requests' state slots by index, and
    # the StateStep's row/slot tensors are built per step; capturing it needs static slot buffers too.
    if getattr(runner.model.cfg, "is_hybrid", False):
        return None
    return DecodeGraphs(runner.model, runner.pool, runner.kernels)


class _Bucket:
    def __init__(self, graph: Any, out: torch.Tensor) -> None:
        self.graph, self.out = graph, out


class DecodeGraphs:
    """Static buffers shared by every bucket, the captured graphs, the buckets that failed."""

    def __init__(self, model: Any, pool: Any, kernels: Kernels, sizes: tuple[int, ...] | None = None,
                 capture: bool = True) -> None:
        self.model, self.kv = model, pool
        self.kernels = kernels  # the rank's: which kernel decode rows take (and the config's sizes)
        self.sizes = tuple(sorted(sizes or capture_sizes(kernels.config)))
        self.capture = capture
        P = pool.page_size
        cap = min(int(model.cfg.max_position_embeddings), pool.num_pages * P)
        self.width = -(-cap // P)  # table columns: a context of `cap` tokens at most
        self.cap = self.width * P
        dev, n = pool.device, self.sizes[-1]
        self.ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.pos = torch.zeros(n, dtype=torch.long, device=dev)
        self.slots = torch.zeros(n, dtype=torch.long, device=dev)
        self.table = torch.full((n, self.width), -1, dtype=torch.long, device=dev)
        self.rows = torch.arange(n, dtype=torch.long, device=dev)
        self._probe = torch.empty(0, dtype=pool.dtype, device=dev)  # what `Kernels.kernel_for` looks at
        self.graphs: dict[int, _Bucket] = {}
        self.failed: set[int] = set()
        self.mempool: Any = None
        self.replays = 0  # steps served by a graph (or, capture=False, by the static forward)

    def bucket(self, ctx: ForwardContext) -> int | None:
        """The bucket that serves this step, None when it must run eagerly."""
        B = len(ctx.seqs)
        if (B == 0 or ctx.num_rows != B or not ctx.all_held or ctx.max_end > self.cap or B > self.sizes[-1]
                or ctx.page_table is None or ctx.page_table.shape[1] > self.width
                or self.kernels.config.attention_form == "mha"):
            return None
        if self.capture and self.kernels.kernel_for(self._probe) != "triton":
            return None
        size = next(s for s in self.sizes if s >= B)
        return None if size in self.failed else size

    def run(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor | None:
        """Hidden states [B, d] of a decode step through its bucket's graph; None: run it eagerly."""
        size = self.bucket(ctx)
        if size is None:
            return None
        self._fill(size, input_ids, ctx)
        if not self.capture:
            self.replays += 1
            return self.model(self.ids[:size], self.pos[:size], self._static_ctx(size, ctx))[:len(ctx.seqs)]
        b = self.graphs.get(size)
        if b is None:
            try:
                b = self.graphs[size] = self._capture(size, ctx)
            except Exception as e:  # a sync or an unsupported op inside the forward: eager from now on
                log.warning("CUDA graph capture of decode batch %d failed (%s); it runs eagerly", size, e)
                self.failed.add(size)
                torch.cuda.synchronize()
                return None
        b.graph.replay()
        self.replays += 1
        return b.out[:len(ctx.seqs)]

    def reset(self) -> None:
        """Drop every graph (weights or KV pool reallocated: the graphs point at the old memory)."""
        self.graphs.clear()
        self.failed.clear()
        self.mempool = None

    # ---- internals ------------------------------------------------------------------------------
    def _fill(self, size: int, input_ids: torch.Tensor, ctx: ForwardContext) -> None:
        """Copy the step into the static buffers; rows B..size-1 repeat row B-1 (device copies only)."""
        B, W = len(ctx.seqs), ctx.page_table.shape[1]
        for dst, src in ((self.ids, input_ids), (self.pos, ctx.positions), (self.slots, ctx.write_slots)):
            dst[:B].copy_(src)
            if size > B:
                dst[B:size].copy_(src[B - 1:B].expand(size - B))
        t = self.table
        t[:B, :W].copy_(ctx.page_table)
        t[:size, W:].fill_(-1)
        if size > B:
            t[B:size].copy_(t[B - 1:B].expand(size - B, -1))

    def _static_ctx(self, size: int, ctx: ForwardContext) -> ForwardContext:
        """The step's context over the static buffers, padded to `size` rows (host data from the step:
        on a GPU only the capture reads it)."""
        seqs = []
        for k in range(size):
            s = ctx.seqs[min(k, len(ctx.seqs) - 1)]
            seqs.append(SliceCtx(s.req_id, s.start, 1, 0, True, k, None, None, ctx.page_size,
                                 table=(self.table, k, self.width)))
        return ForwardContext(positions=self.pos[:size], seqs=seqs, kv=ctx.kv, layout=ctx.layout,
                              comm=ctx.comm, rank=ctx.rank, world=ctx.world, stats=ctx.stats,
                              write_rows=self.rows[:size], write_slots=self.slots[:size],
                              page_table=self.table[:size], max_end=self.cap, page_size=ctx.page_size,
                              all_held=True)

    def _capture(self, size: int, ctx: ForwardContext) -> _Bucket:
        sctx = self._static_ctx(size, ctx)
        ids, pos = self.ids[:size], self.pos[:size]
        self.model.rotary.reserve(self.cap)  # the rotary table must never grow under a captured graph
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: Triton compiles, cuBLAS picks its kernels
            for _ in range(2):
                self.model(ids, pos, sctx)
        torch.cuda.current_stream().wait_stream(side)
        if self.mempool is None:
            self.mempool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.mempool):
            out = self.model(ids, pos, sctx)
        log.info("captured the decode step for batch %d as a CUDA graph", size)
        return _Bucket(graph, out)
