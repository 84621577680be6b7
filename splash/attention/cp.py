"""CP: projections held whole on every rank, each request's history sharded by position (page j on rank
j % T); a step's rows computed in two ways by their attention form (`AttentionLayout.forms`).

Decode rows and short chunks (the absorbed form): every rank runs all of them for all heads against the
keys it stores, giving a partial output and its log-sum-exp. The merge is split by heads: an all-to-all
gives rank j every rank's partials for head slice j, rank j merges them exactly (`kernel.merge`, in rank
order), and an all-gather of the merged slices gives every rank the same full [n, H, d_c] -
bit-identical on all ranks, so each runs the same W_UV/o_proj and no reduce is needed. Per rank this
sends about 2(T-1)/T * n*H*d_c elements instead of the (T-1) * n*H*d_c an all-gather of whole partials
would.

Prefill chunks (the MHA form) are split by tokens, as SGLang's prefill context parallelism does: each
rank all-gathers the chunk's context latent (the keys every rank holds of it, new rows included, as
stored: an FP8 cache's bytes), takes its share of the chunk's query rows (`token_split`: 2T pieces, rank
j the j-th and the (2T-1-j)-th, so causal work is even) and runs q_b, attention over the whole context,
W_UV and o_proj on those rows only; an all-gather of the [rows, d] outputs completes the step. The
projections, the bulk of a prefill, are divided by T instead of repeated on every rank; what each rank
holds (and so every switch, transfer and capacity rule) is unchanged. DSA steps (sparse, absorbed
throughout) take the first way. `core/costmodel.py` prices both (`spread_chunks`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from splash.attention import mha, sparse
from splash.attention.base import AttentionLayout
from splash.attention.kernel import merge
from splash.attention.rows import check_heads
from splash.core.layouts import Layout, token_split
from splash.model.context import ForwardContext
from splash.model.mla import MLA


def _by_head_slice(t: torch.Tensor, world: int) -> torch.Tensor:
    """[N, H, *rest] -> [world * N, H/world, *rest]: block j holds head slice j of every row."""
    n, h = t.shape[0], t.shape[1] // world
    rest = tuple(t.shape[2:])
    return t.reshape(n, world, h, *rest).transpose(0, 1).reshape(world * n, h, *rest)


@dataclass
class TokenSplit:
    """One step's token split of its MHA-form chunks, the same on every rank (from the plan and the
    positions of the keys each rank holds, gathered once per step). A chunk's context is its earlier
    keys, gathered from the ranks holding them, then its own new rows, which every rank has computed."""

    slots: torch.Tensor         # this rank's held earlier keys of every split chunk, chunk after chunk
    key_counts: list[int]       # keys each rank contributes to the per-layer gather
    keys: list[torch.Tensor]    # per chunk: indices into the gathered keys, in position order ...
    key_pos: list[torch.Tensor]  # ... and the positions of its whole context (ascending, new rows last)
    new: list[slice]            # per chunk: its new rows (step rows)
    rows: list[torch.Tensor]    # per chunk: this rank's query rows (step row ids, ascending)
    row_counts: list[int]       # query rows each rank computes
    order: torch.Tensor         # step row ids of the gathered outputs, rank after rank
    mine: torch.Tensor          # this rank's query rows of every chunk (torch.cat(rows)) ...
    mine_pos: torch.Tensor      # ... and their positions (one tensor a step: the rotary memo's key)
    scoring: tuple[torch.Tensor, torch.Tensor]  # rows whose DSA index queries this rank scores, positions

    def contexts(self, earlier: torch.Tensor, new: torch.Tensor) -> list[torch.Tensor]:
        """Per chunk its whole context [m, width] in position order, from the gathered earlier keys and
        every step row's new values [N, width] (as stored)."""
        return [torch.cat([earlier[k], new[r]]) for k, r in zip(self.keys, self.new)]

    @classmethod
    def of(cls, split: mha.FormSplit, ctx: ForwardContext) -> TokenSplit:
        world, rank, dev = ctx.world, ctx.rank, ctx.positions.device
        slots, pos, chunk = [], [], []
        for i, k in enumerate(split.mha):
            s = ctx.seqs[k]
            sl, ps = s.key_slots()
            before = ps < s.start
            slots.append(sl[before])
            pos.append(ps[before])
            chunk.append(torch.full_like(pos[-1], i))
        mine_pos, mine_chunk = torch.cat(pos), torch.cat(chunk)
        counts = [int(c) for c in ctx.comm.all_gather(torch.tensor([mine_pos.numel()], device=dev)).view(-1)]
        meta = ctx.comm.all_gather_var(torch.stack([mine_chunk, mine_pos], dim=1), tag="cp.split",
                                       sizes=counts)
        keys, key_pos = [], []
        for i, r in enumerate(split.mha_rows):
            at = torch.nonzero(meta[:, 0] == i).view(-1)
            p, o = torch.sort(meta[at, 1], stable=True)
            keys.append(at[o])
            key_pos.append(torch.cat([p, ctx.positions[r]]))
        rows: list[torch.Tensor] = []
        per_rank: list[list[torch.Tensor]] = [[] for _ in range(world)]
        for r in split.mha_rows:
            ids = torch.arange(r.start, r.stop, device=dev)
            for j, (a, b) in enumerate(token_split(r.stop - r.start, world)):
                per_rank[j].append(torch.cat([ids[lo:hi] for lo, hi in (a, b)]))
            rows.append(per_rank[rank][-1])
        flat = [torch.cat(p) for p in per_rank]
        mine = torch.cat(rows)
        scoring = torch.sort(torch.cat([split.abs_rows, mine])).values
        return cls(torch.cat(slots), counts, keys, key_pos, list(split.mha_rows), rows,
                   [int(f.numel()) for f in flat], torch.cat(flat), mine, ctx.positions[mine],
                   (scoring, ctx.positions[scoring]))


class CPLayout(AttentionLayout):
    name = "cp"
    core = Layout.CP

    def select(self, layer_idx: int, idx: list[int] | None, ctx: ForwardContext, sp: sparse.SparseStep
               ) -> torch.Tensor:
        """DSA under CP: no rank holds every key, so each rank's top-k candidates among the keys it
        holds (score, global position) are all-gathered and merged by (score desc, position asc) into
        the global top-k, which equals the one-rank selection; each rank then keeps the selected keys
        it holds as local slots (-1 for the others)."""
        assert sp.rows is not None
        k, P = sp.k, ctx.page_size
        if ctx.world == 1:
            return super().select(layer_idx, idx, ctx, sp)
        sc, ps, _, seg = sparse.subset_candidates(layer_idx, idx, sp.rows, ctx, k)
        gpos = merge_candidates(ctx.comm.all_gather(sc.contiguous(), tag=layer_idx),
                                ctx.comm.all_gather(ps.contiguous(), tag=layer_idx), k)
        held = ctx.page_table[seg[:, None], (gpos // P).clamp(min=0)]  # this rank's page, or -1
        return torch.where((gpos >= 0) & (held >= 0), held * P + gpos % P, -1)

    def attention(self, layer_idx: int, mla: MLA, q_in: torch.Tensor, latent_new: torch.Tensor,
                  ctx: ForwardContext) -> torch.Tensor:
        check_heads(mla, ctx, self)
        if ctx.world == 1:
            return self.attend_out(layer_idx, mla, q_in, latent_new, ctx)
        self.write_kv(layer_idx, latent_new, ctx)
        split, ts = self._plan(ctx, mla)
        if split is None or ts is None:  # (both or neither)
            q_lat, q_pe = mla.q_heads(q_in, ctx.positions)
            return mla.out_heads(self._merged(layer_idx, None, "all", q_lat, q_pe, ctx, mla))
        out = q_in.new_empty(q_in.shape[0], mla.cfg.hidden_size)
        if split.absorbed:
            r = split.abs_rows
            q_lat, q_pe = mla.q_heads(q_in[r], ctx.positions[r])
            out[r] = mla.out_heads(self._merged(layer_idx, split.absorbed, "abs", q_lat, q_pe, ctx, mla))
        kv = ctx.kv
        held = kv.flat_layer(layer_idx)[ts.slots]  # as stored: an FP8 cache's bytes cross as bytes
        earlier = kv.decode(layer_idx, ctx.comm.all_gather_var(held, tag=layer_idx, sizes=ts.key_counts))
        contexts = ts.contexts(earlier, kv.as_stored(layer_idx, latent_new))
        mine = ts.mine
        sp = ctx.sparse
        if sp is not None and sp.active:
            vals = mla.uv(self._sparse_rows(layer_idx, mla, q_in, contexts, ts, ctx))
        else:
            q_nope, q_pe = mla.q_parts(q_in[mine], ts.mine_pos)
            vals = q_nope.new_empty(mine.numel(), q_nope.shape[1], mla.d_v)
            chunks, at = [], 0
            for context, key_pos, rows in zip(contexts, ts.key_pos, ts.rows):
                r = slice(at, at + rows.numel())
                if rows.numel():
                    chunks.append(mha.Chunk(q_nope[r], q_pe[r], context, key_pos, ctx.positions[rows],
                                            vals[r]))
                at += rows.numel()
            mha.attend_many(mla, chunks, mla.softmax_scale)
        out[ts.order] = ctx.comm.all_gather_var(mla.o_proj(vals), tag=layer_idx, sizes=ts.row_counts)
        return out

    def index_rows(self, mla: MLA, ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A split chunk's indexer queries are scored by the rank computing the row: this rank's share
        of them, and every whole (absorbed) row (each rank scores those against the keys it holds)."""
        if ctx.world == 1:
            return None
        _, ts = self._plan(ctx, mla)
        return None if ts is None else ts.scoring

    def _plan(self, ctx: ForwardContext, mla: MLA) -> tuple[mha.FormSplit | None, TokenSplit | None]:
        """The step's chunks split by form (the split ones: those taking the MHA form by the one rule,
        sparse steps too, which then attend their selected keys absorbed) and their token split; per
        step, from the plan alone."""
        got = self.__dict__.get("_plan_of")
        if got is None or got[0] is not ctx:
            sp = ctx.sparse
            if sp is not None and sp.active:
                split: mha.FormSplit | None = mha.FormSplit.of(ctx, None, mla,
                                                               self.kernels.config.attention_form)
                split = split if split.mha else None
            else:
                split = self.forms(ctx, "all", None, mla)
            got = self.__dict__["_plan_of"] = (ctx, split, TokenSplit.of(split, ctx) if split else None)
        return got[1], got[2]

    def _sparse_rows(self, layer_idx: int, mla: MLA, q_in: torch.Tensor, contexts: list[torch.Tensor],
                     ts: TokenSplit, ctx: ForwardContext) -> torch.Tensor:
        """DSA for this rank's rows of the split chunks -> [n, H, d_c]: a full layer scores them over the
        gathered index keys of the whole context and keeps the top-k by the one rule (score desc,
        position asc: `sparse.top_keys`); a shared layer reuses the last full layer's; then absorbed
        attention over the selected keys of the gathered latent."""
        sp = ctx.sparse
        assert sp is not None
        got = self.__dict__.get("_cols")
        kv = ctx.kv
        if sp.rows is not None:
            held = kv.store_flat("index_k", layer_idx)[ts.slots]
            earlier = kv.codecs["index_k"].decode(ctx.comm.all_gather_var(held, tag=layer_idx,
                                                                           sizes=ts.key_counts))
            index_keys = ts.contexts(earlier, kv.as_stored(layer_idx, sp.rows.k_new, "index_k"))
            cols, at = [], 0
            for keys, key_pos, rows in zip(index_keys, ts.key_pos, ts.rows):
                sc = sparse.index_scores(sp.rows.q[rows], sp.rows.w[rows], keys)
                sc.masked_fill_(key_pos[None, :] > ctx.positions[rows][:, None], float("-inf"))  # causal
                best, col = sparse.top_keys(sc, sp.k)
                cols.append((col + at).masked_fill(torch.isinf(best), -1))  # into the chunks' contexts
                at += keys.shape[0]
            got = self.__dict__["_cols"] = (ctx, torch.cat(cols))
        elif got is None or got[0] is not ctx:
            raise RuntimeError(f"layer {layer_idx} shares the top-k of a layer that did not select")
        flat = torch.cat(contexts)
        q_lat, q_pe = mla.q_heads(q_in[ts.mine], ts.mine_pos)
        return sparse.attend_rows(q_lat, q_pe, got[1], lambda sl: flat[sl], mla.softmax_scale)[0]

    def _merged(self, layer_idx: int, idx: list[int] | None, key: str, q_lat: torch.Tensor,
                q_pe: torch.Tensor, ctx: ForwardContext, mla: MLA) -> torch.Tensor:
        """The absorbed rows of the slices `idx` over every rank's keys -> [n, H, d_c], the same on
        every rank: partials over the held keys, merged exactly by head slice."""
        # The kernel keeps the lse in float32 for bf16/fp16 models; so does the wire.
        out, lse = self.attend_slices(layer_idx, idx, key, q_lat, q_pe, ctx, mla.softmax_scale, lse=True)
        assert lse is not None
        world = ctx.world
        n, heads, d_c = out.shape
        h = heads // world
        comm, counts = ctx.comm, [n] * world
        h_o = comm.all_to_all_var_async(_by_head_slice(out, world), counts, layer_idx, counts)
        h_l = comm.all_to_all_var_async(_by_head_slice(lse, world), counts, layer_idx, counts)
        parts_o = h_o.wait().view(world, n, h, d_c).unbind(0)
        parts_l = h_l.wait().view(world, n, h).unbind(0)
        mine = merge(list(parts_o), list(parts_l))  # [n, h, d_c]: my head slice, merged exactly
        full = comm.all_gather(mine, tag=layer_idx)  # [world, n, h, d_c]
        return full.transpose(0, 1).reshape(n, heads, d_c)


def merge_candidates(scores: torch.Tensor, positions: torch.Tensor, k: int) -> torch.Tensor:
    """Every rank's top-k candidates, scores / positions [T, n, k] (-inf / -1 padded), merged into the
    global top-k positions [n, k] (-1 padded) by (score descending, position ascending): the rule a
    single rank applies to all the keys, so the result is the single-rank selection."""
    world, n, _ = scores.shape
    sc = scores.permute(1, 0, 2).reshape(n, world * k)
    ps = positions.permute(1, 0, 2).reshape(n, world * k)
    by_pos = torch.sort(ps, dim=-1, stable=True).indices  # ties in score then go to the earlier key
    sc, ps = sc.gather(1, by_pos), ps.gather(1, by_pos)
    best, col = sparse.top_keys(sc, k)
    return ps.gather(1, col).masked_fill(torch.isinf(best), -1)
