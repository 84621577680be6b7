"""The AttentionLayout interface: how one MLA layer's attention is split over the ranks.

A layout receives the replicated per-token parts computed by the model (`q_in`, `latent_new`) and
returns the attention output for *all* N rows, complete and replicated on every rank. Which heads the
rank's MLA holds (`shards_projections`) and which ranks store which tokens' latent (`kv_ownership`,
realised by the step plan's page tables) are not the class's to choose: they are those of its
analytical-core layout (`core`, a `splash.core.layouts.Layout`; the runtime's layout table, one row per
layout, is splash/attention/registry.py). Each chunk is attended in the form that costs least
(`splash.attention.mha`): decode rows absorbed over the latent, long prefill chunks in MHA form over
decompressed keys; a step whose slices all take the absorbed form runs exactly as before.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import ClassVar

import torch

from splash.attention import mha, sparse
from splash.attention.batched import BatchCache
from splash.attention.kernel import acc_dtype, attend
from splash.attention.kernels import Kernels, RowCache
from splash.attention.rows import OwnerRows, check_heads
from splash.core.layouts import Layout, Ownership, StatePlacement
from splash.model.context import ForwardContext, SliceCtx
from splash.model.kda import KDA
from splash.model.mla import MLA


class AttentionLayout(ABC):
    name: ClassVar[str]
    core: ClassVar[Layout | None]  # the core's layout this class runs; None: the one-rank layout (T = 1)
    batch_slices: ClassVar[bool] = True  # attend the step's slices in batched groups (False: one by one)

    def __init__(self, kernels: Kernels | None = None) -> None:
        # how this rank attends (forms, eager, the kernels and their state): the rank's one Kernels object,
        # built from the engine's KernelConfig (a layout built alone gets its own, with the defaults)
        self.kernels = kernels if kernels is not None else Kernels()

    @property
    def shards_projections(self) -> bool:
        """Each rank holds H/T heads' q_b/W_UK/W_UV/o_proj (TP, DOP)."""
        return self.core is not None and self.core.sharded

    @property
    def kv_ownership(self) -> Ownership:
        """Which ranks hold a request's pages (one rank holds them all at T = 1)."""
        return Ownership.REPLICATED if self.core is None else self.core.ownership

    @abstractmethod
    def attention(self, layer_idx: int, mla: MLA, q_in: torch.Tensor, latent_new: torch.Tensor,
                  ctx: ForwardContext) -> torch.Tensor:
        """-> [N, d]: this layer's attention output for every row of the step."""

    def linear_attention(self, layer_idx: int, kda: KDA, x: torch.Tensor, ctx: ForwardContext
                         ) -> torch.Tensor:
        """-> [N, d]: a KDA layer's output for every row of the step (hybrid models), from the normed
        rows x [N, d], reading and writing the requests' state slots. Who computes what follows the
        core's one rule, `Layout.state_placement`: head-sharded (TP, DOP) -> every rank runs every row
        for its heads and o_proj's partials are all-reduced; owner (DP) -> each owner runs its requests'
        rows for all heads and the rows are all-gathered; replicated (CP) -> every rank runs every row
        for all heads (the same ops on the same inputs: identical on every rank), nothing exchanged."""
        if self.core is None or ctx.world == 1:
            return kda.forward(x, ctx)
        check_heads(kda, ctx, self)
        kind = self.core.state_placement
        if kind is StatePlacement.HEAD_SHARDED:
            return ctx.comm.all_reduce(kda.forward(x, ctx), tag=layer_idx)
        if kind is StatePlacement.REPLICATED:
            return kda.forward(x, ctx)
        cache = self.__dict__.get("_kda_own")
        if cache is None or cache[0] is not ctx:
            own = OwnerRows.of(ctx)
            sub = ctx.state.subset([ctx.seqs[k] for k in own.mine], x.device) if ctx.state else None
            cache = self.__dict__["_kda_own"] = (ctx, own, sub)
        _, own, sub = cache
        rows = own.mine_rows
        mine = kda.forward(x[rows], ctx, sub) if rows.numel() else x.new_zeros(0, x.shape[1])
        gathered = ctx.comm.all_gather_var(mine, tag=layer_idx, sizes=own.counts)
        out = torch.empty_like(gathered)
        out[own.order] = gathered
        return out

    def sparse_step(self, topk: int, ctx: ForwardContext) -> sparse.SparseStep:
        """A DSA model's step state: index rows and top-k selections (splash/attention/sparse.py)."""
        return sparse.SparseStep(topk, ctx, self.kernels)

    def index_rows(self, mla: MLA, ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rows, positions) whose DSA indexer queries this rank scores; None: every row of the step
        (each layout but CP, which splits a prefill chunk's rows)."""
        return None

    # Helpers every layout uses -----------------------------------------------------------------------
    @staticmethod
    def write_kv(layer_idx: int, latent_new: torch.Tensor, ctx: ForwardContext) -> None:
        """Store new rows' latent where this rank's page tables say (slot p % P of global page p // P)."""
        if ctx.kv is not None and ctx.write_slots is not None:
            ctx.kv.write(layer_idx, ctx.write_slots, latent_new[ctx.write_rows])

    @staticmethod
    def keys(layer_idx: int, s: SliceCtx, ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys [m, D], positions [m]) of slice `s` that this rank holds, new rows included."""
        slots, pos = s.key_slots()
        return ctx.kv.gather(layer_idx, slots), pos

    def attend_slices(self, layer_idx: int, idx: list[int] | None, key: str, q_lat: torch.Tensor,
                      q_pe: torch.Tensor, ctx: ForwardContext, scale: float, lse: bool = False
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Attention of the slices `idx` (positions in ctx.seqs, batch order; None: all) over the pages
        this rank holds -> (out [n, h, d_c], lse [n, h] or None). The query rows q_lat [n, h, d_c] and
        q_pe [n, h, d_r] are laid out slice after slice in that order; `key` names the subset for the
        per-step cache of batched groups. A DSA step attends each row's selected keys only."""
        sp = ctx.sparse
        if sp is not None and sp.active:
            slots = sp.selection(self, layer_idx, idx, key, ctx)
            return sparse.attend_selected(q_lat, q_pe, ctx.kv, layer_idx, slots, scale, lse, self.kernels)
        kernels = self.kernels
        kernel = kernels.kernel_for(q_lat) if self.batch_slices else "torch"
        if kernel != "torch" and ctx.page_table is not None and ctx.kv is not None:
            cache = self.__dict__.get("_native")
            if cache is None:
                cache = self.__dict__["_native"] = RowCache(kernels)
            row_seq, row_pos = cache.get_on(ctx, key, idx, q_lat.device)
            got = kernels.attention(kernel, q_lat, q_pe, ctx.kv.layer(layer_idx), ctx.page_table, row_seq,
                                    row_pos, scale, lse, ctx.kv.kernel_format(layer_idx))
            if got is not None:
                return got
        if self.batch_slices:
            cache = self.__dict__.get("_batches")
            if cache is None:
                cache = self.__dict__["_batches"] = BatchCache()
            return cache.get(ctx, key, idx, q_lat.shape[1]).attend(layer_idx, q_lat, q_pe, ctx, scale, lse)
        out = torch.empty_like(q_lat)
        total = None
        if lse:
            total = torch.empty(q_lat.shape[:2], dtype=acc_dtype(q_lat.dtype), device=q_lat.device)
        at = 0
        for s in (ctx.seqs if idx is None else [ctx.seqs[k] for k in idx]):
            keys, pos = self.keys(layer_idx, s, ctx)
            r = slice(at, at + s.num_new)
            o, t = attend(q_lat[r], q_pe[r], keys, pos, ctx.positions[s.rows], scale, lse=lse)
            out[r] = o
            if total is not None:
                total[r] = t
            at += s.num_new
        return out, total

    def select(self, layer_idx: int, idx: list[int] | None, ctx: ForwardContext, sp: sparse.SparseStep
               ) -> torch.Tensor:
        """DSA: [n, k] local slots of the top-k keys of each row of the slices `idx` (None: all), rows
        slice after slice. Here every key a slice sees is on this rank (one rank, TP, DP and DOP
        owners); CP overrides this with the merge of every rank's candidates."""
        assert sp.rows is not None
        return sparse.subset_candidates(layer_idx, idx, sp.rows, ctx, sp.k)[2]

    def forms(self, ctx: ForwardContext, key: str, idx: list[int] | None, mla: MLA) -> mha.FormSplit | None:
        """The slices `idx` (None: all) split by attention form, cached per step under `key`; None when
        all take the absorbed form. Depends on the plan alone, so every rank splits alike. A sparse DSA
        step takes the absorbed form throughout (each row reads its own selected keys)."""
        if ctx.sparse is not None and ctx.sparse.active:
            return None
        cache = self.__dict__.get("_forms")
        if cache is None:
            cache = self.__dict__["_forms"] = mha.FormCache()
        return cache.get(ctx, key, idx, mla, self.kernels.config.attention_form)

    def attend_v(self, layer_idx: int, mla: MLA, q_in: torch.Tensor, positions: torch.Tensor,
                 split: mha.FormSplit, key: str, ctx: ForwardContext, lse: bool = False,
                 latent_of: Callable[[int], tuple[torch.Tensor, torch.Tensor]] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Both forms for the rows of `split`'s slices (q_in [n, q_in], positions [n], slice after slice)
        over the keys this rank holds -> (values [n, h, d_v] before o_proj, lse [n, h] or None).
        Absorbed slices go through `attend_slices` then W_UV; MHA slices one by one over their context
        latent: `latent_of(k)` -> (latent [m, D], positions [m]) of slice k, default this rank's pool."""
        q_nope, q_pe = mla.q_parts(q_in, positions)
        n, h = q_nope.shape[:2]
        out = q_nope.new_empty(n, h, mla.d_v)
        total = torch.empty(n, h, dtype=acc_dtype(q_nope.dtype), device=q_nope.device) if lse else None
        scale = mla.softmax_scale
        if split.absorbed:
            r = split.abs_rows
            o, t = self.attend_slices(layer_idx, split.absorbed, key + ".abs", mla.absorb(q_nope[r]), q_pe[r],
                                      ctx, scale, lse)
            out[r] = mla.uv(o)
            if total is not None:
                total[r] = t
        chunks = []
        for k, rows in zip(split.mha, split.mha_rows):
            s = ctx.seqs[k]
            lat, pos = latent_of(k) if latent_of is not None else self.keys(layer_idx, s, ctx)
            chunks.append(mha.Chunk(q_nope[rows], q_pe[rows], lat, pos, ctx.positions[s.rows], out[rows]))
        for rows, (_, t) in zip(split.mha_rows, mha.attend_many(mla, chunks, scale, lse)):
            if total is not None:  # (the values went straight into `out`)
                total[rows] = t
        return out, total

    def attend_out(self, layer_idx: int, mla: MLA, q_in: torch.Tensor, latent_new: torch.Tensor,
                   ctx: ForwardContext) -> torch.Tensor:
        """Store the step's latent, attend every slice over the pages this rank holds for the heads it
        holds, through o_proj -> [N, d] (a partial sum if heads are sharded). TP and the one-rank layout
        are exactly this plus their reduce."""
        split = self.forms(ctx, "all", None, mla)
        if split is None:
            return mla.out_heads(self.attend_held(layer_idx, mla, q_in, latent_new, ctx))
        self.write_kv(layer_idx, latent_new, ctx)
        return mla.o_proj(self.attend_v(layer_idx, mla, q_in, ctx.positions, split, "all", ctx)[0])

    def attend_held(self, layer_idx: int, mla: MLA, q_in: torch.Tensor, latent_new: torch.Tensor,
                    ctx: ForwardContext) -> torch.Tensor:
        """Store the step's latent, then attend every slice over the pages this rank holds, for the heads
        it holds -> [N, h, d_c]. TP and the one-rank layout are exactly this plus their output step."""
        self.write_kv(layer_idx, latent_new, ctx)
        q_lat, q_pe = mla.q_heads(q_in, ctx.positions)
        return self.attend_slices(layer_idx, None, "all", q_lat, q_pe, ctx, mla.softmax_scale)[0]
