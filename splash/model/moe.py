"""Mixture of experts: the V3 and V2 routers, routed experts and shared experts.

Routers run in float32 whatever the model dtype (transformers keeps the gate in float32); the routing
weights stay float32 until each expert's output is scaled, then the sum is cast to the model dtype,
experts being added in ascending expert order (the reference's order, which matters for top-k >= 3).
On T ranks the experts are expert- or tensor-parallel and each rank returns a partial sum (see MoE).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from splash.core.model_config import ConfigError, ModelConfig
from splash.model import gemm
from splash.model.layers import MLP
from splash.model.loader import CheckpointReader
from splash.model.shard import even_range, moe_mode, span

# sigmoid + bias + group top-k
V3_TYPES = ("deepseek_v3", "kimi_k2", "deepseek_v32", "glm_moe_dsa", "kimi_linear")
_GROUPED = hasattr(torch, "_grouped_mm")
_GROUPED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
DENSE_MAX = 1 << 14  # rows x held experts up to which CUDA runs every expert on every row (`MoE._dense`)
# ... and a CPU: routing a few rows costs ~20 small ops and two host reads (argsort, bincount, gathers,
# grouped GEMMs), more than reading every held expert once when there are few of them. Per MoE layer,
# rows 1/2/4/8, routed against every expert (gate and shared expert included in both), measured on an
# AMD EPYC (AVX-512 BF16), 2 threads: the trained MTP checkpoint (8 experts of 128 x 64, float32) 168/211/
# 247/273 us against ~106/128/138/160; `small` (8 experts of 512 x 256, bf16) 502/705/742/822 against
# ~503/512/566/670 (one bf16 row keeps `_one_row`: the same time, and its own measurements).
DENSE_MAX_CPU = 64


# Fewest rows a router GEMM runs on: MKL's float32 GEMM sums in another order below ~4 rows on AVX2 and
# below 16 rows on AVX-512 (measured: 1..15 rows differ from a long batch there, 16+ never did up to 600).
MIN_ROUTER_ROWS = 16


def _padded_rows(n: int, width: int, vec: int = 64, least: int = MIN_ROUTER_ROWS) -> int:
    """Smallest row count >= max(n, least) whose [rows, width] float32 tensor is whole 64-float vectors
    (BLAS takes other code paths, with other summation orders, for a few rows: `MIN_ROUTER_ROWS`)."""
    step = vec // math.gcd(vec, width)
    return -(-max(n, least) // step) * step


def _pad(x: torch.Tensor, rows: int) -> torch.Tensor:
    return x if rows == x.shape[0] else F.pad(x, (0, 0, 0, rows - x.shape[0]))


class Router(nn.Module):
    """Top-k expert choice. V3: sigmoid + e_score_correction_bias + group top-k ("noaux_tc").
    V2: softmax, "greedy" or "group_limited_greedy" (transformers' V2 never renormalises)."""

    def __init__(self, cfg: ModelConfig, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.e = int(cfg.n_routed_experts or 0)
        self.k = int(cfg.num_experts_per_tok or 0)
        self.groups = int(cfg.n_group or 1)
        self.topk_group = int(cfg.topk_group or 1)
        self.v3 = cfg.model_type in V3_TYPES
        self.method = "noaux_tc" if self.v3 else cfg.topk_method
        if self.method not in ("noaux_tc", "greedy", "group_limited_greedy"):
            raise ConfigError(f"topk_method {cfg.topk_method!r} is not supported for {cfg.model_type}")
        if self.e % self.groups:
            raise ConfigError(f"n_routed_experts={self.e} is not divisible by n_group={self.groups}")
        self.norm = bool(cfg.norm_topk_prob)
        self.scale = float(cfg.routed_scaling_factor)
        f32 = torch.float32
        self.register_buffer("weight", torch.zeros(self.e, cfg.hidden_size, dtype=f32, device=device))
        self.register_buffer("bias", torch.zeros(self.e, dtype=f32, device=device) if self.v3 else None)

    def load(self, reader: CheckpointReader, prefix: str, dev: torch.device) -> None:
        self.weight = reader.get(f"{prefix}.weight", torch.float32, dev)
        if self.v3:
            self.bias = reader.get(f"{prefix}.e_score_correction_bias", torch.float32, dev)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, d] -> (weights [N, k] float32, expert ids [N, k])."""
        n = x.shape[0]
        xf = x.type(torch.float32)
        weight = self._buffers["weight"]
        if self.v3:
            # Float32 results here depend on the batch shape: a GEMM of a few rows sums in another order
            # than a long one, and sigmoid's scalar tail rounds differently from its vector body. Routing
            # weights stay float32, so pad the rows: each row then gets what a long batch gives it, and a
            # decode step reproduces the full-sequence forward (and transformers) to float64 precision
            # in float64 tests instead of ~1e-7.
            scores = F.linear(_pad(xf, _padded_rows(n, self.e)), weight).sigmoid()[:n]
        else:
            logits = F.linear(_pad(xf, max(n, MIN_ROUTER_ROWS)), weight)[:n]
            scores = logits.softmax(dim=-1, dtype=torch.float32)  # row-wise kernel: shape-independent
        per = self.e // self.groups
        limited = self.topk_group < self.groups  # else every group is allowed: no mask to build
        if self.v3:
            choice = scores + self._buffers["bias"]
            if limited:
                gscores = choice.view(-1, self.groups, per).topk(2, dim=-1)[0].sum(dim=-1)
                choice = self._mask_groups(choice, gscores, per, float("-inf"))
            idx = torch.topk(choice, k=self.k, dim=-1, sorted=False)[1]
            w = scores.gather(1, idx)
            if self.norm:
                # left-to-right, as torch's sum does for k = 3 or 8 at any batch size (not for all k);
                # for k <= 2 there is only one order, and sum is one op
                if self.k <= 2:
                    total = w.sum(dim=-1, keepdim=True)
                else:
                    total = w[:, :1]
                    for j in range(1, self.k):
                        total = total + w[:, j:j + 1]
                w = w.div_(total.add_(1e-20))
        else:
            if self.method == "group_limited_greedy" and limited:
                gscores = scores.view(-1, self.groups, per).max(dim=-1).values
                scores = self._mask_groups(scores, gscores, per, 0.0)
            w, idx = torch.topk(scores, k=self.k, dim=-1, sorted=False)
        return w.mul_(self.scale), idx

    def _mask_groups(self, scores: torch.Tensor, gscores: torch.Tensor, per: int, fill: float
                     ) -> torch.Tensor:
        """`scores` with every expert outside each row's top `topk_group` groups set to `fill`."""
        gidx = torch.topk(gscores, k=self.topk_group, dim=-1, sorted=False)[1]
        drop = torch.ones(gscores.shape, dtype=torch.bool, device=gscores.device).scatter_(1, gidx, False)
        n = scores.shape[0]
        return scores.view(n, self.groups, per).masked_fill(drop[:, :, None], fill).view(n, self.e)


class MoE(nn.Module):
    """Routed experts (stacked [E, 2I, d] / [E, d, I]) plus the always-on shared experts.

    On T ranks (fixed, whatever the attention layout): the router is replicated, so every rank computes
    the same routing from the same replicated rows; routed experts are expert-parallel (`mode` "ep":
    this rank holds experts `experts`, a contiguous E/T block, whole) or tensor-parallel ("tp": every
    expert, intermediate slice `cols`); shared experts are tensor-parallel. `forward` returns this
    rank's partial sum (routed + shared), which the layer all-reduces once. At T = 1 it holds
    everything and the sum is complete.
    """

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str | None = None,
                 rank: int = 0, world: int = 1, mode: str = "auto") -> None:
        super().__init__()
        e, d, i = int(cfg.n_routed_experts), cfg.hidden_size, cfg.moe_intermediate_size
        self.e, self.inter = e, i
        self.mode = moe_mode(mode, e, world)
        self.experts = even_range(e, rank, world) if self.mode == "ep" else range(e)
        self.cols = even_range(i, rank, world) if self.mode == "tp" else range(i)
        ne, ni = len(self.experts), len(self.cols)
        self.gate = Router(cfg, device)
        self.register_buffer("gate_up", torch.empty(ne, 2 * ni, d, dtype=dtype, device=device))
        self.register_buffer("down", torch.empty(ne, d, ni, dtype=dtype, device=device))
        n_shared = int(cfg.n_shared_experts or 0)
        si = i * n_shared
        self.shared = MLP(d, si, dtype, device, cols=even_range(si, rank, world)) if n_shared else None
        self.batched_experts = True  # `_batched` where routing is balanced enough (tests turn it off)

    def load(self, reader: CheckpointReader, prefix: str, dev: torch.device) -> None:
        """Read the router whole and only this rank's experts / intermediate slice of the rest."""
        self.gate.load(reader, f"{prefix}.gate", dev)
        dt = self.gate_up.dtype
        i, ni = self.inter, len(self.cols)
        ex, cs = span(self.experts, self.e), span(self.cols, i)
        if reader.has(f"{prefix}.experts.gate_up_proj"):  # transformers-5 fused layout
            name = f"{prefix}.experts.gate_up_proj"
            if cs is None:
                gate_up = reader.get(name, dt, dev, rows=ex)
            else:  # this slice of the gate half, then the same slice of the up half
                c0, c1 = cs
                gate_up = torch.cat([reader.get(name, dt, dev, rows=ex, mid=(c0, c1)),
                                     reader.get(name, dt, dev, rows=ex, mid=(i + c0, i + c1))], dim=1)
            down = reader.get(f"{prefix}.experts.down_proj", dt, dev, rows=ex, cols=cs)
        else:
            gate_up = torch.empty(self.gate_up.shape, dtype=dt, device=dev)
            down = torch.empty(self.down.shape, dtype=dt, device=dev)
            for k, j in enumerate(self.experts):
                p = f"{prefix}.experts.{j}"
                gate_up[k, :ni] = reader.get(f"{p}.gate_proj.weight", dt, dev, rows=cs)
                gate_up[k, ni:] = reader.get(f"{p}.up_proj.weight", dt, dev, rows=cs)
                down[k] = reader.get(f"{p}.down_proj.weight", dt, dev, cols=cs)
        if gate_up.shape != self.gate_up.shape or down.shape != self.down.shape:
            raise ValueError(f"{prefix}.experts: weight shapes do not match config.json")
        self.gate_up, self.down = gate_up, down
        if self.shared is not None:
            self.shared.load(reader, f"{prefix}.shared_experts", dev)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, d] -> [N, d]: routed + shared experts (this rank's partial sum on T ranks)."""
        w, idx = self._modules["gate"].forward(x)
        cuda = x.device.type == "cuda"
        if cuda and x.shape[0] * len(self.experts) <= DENSE_MAX:
            return self._dense_shared(x, w, idx)  # no host sync: CUDA decode steps, CUDA graphs
        if x.shape[0] == 1 and gemm.gemv(x):
            return self._one_row(x, w, idx)
        if not cuda and x.shape[0] * len(self.experts) <= DENSE_MAX_CPU:
            return self._dense_shared(x, w, idx)  # a few decode rows (verify slices, MTP chains)
        k = idx.shape[1]
        flat = idx.reshape(-1)
        ne = len(self.experts)
        if ne == self.e:
            order = torch.argsort(flat, stable=True)  # grouped by expert, ascending
            counts = torch.bincount(flat, minlength=self.e)
        else:  # expert-parallel: only the (token, choice) pairs routed to this rank's experts
            local = flat - self.experts.start
            key = torch.where((local >= 0) & (local < ne), local, ne)
            counts = torch.bincount(key, minlength=ne + 1)[:ne]
            order = torch.argsort(key, stable=True)[:int(counts.sum())]
        tok = order // k
        wo = w.reshape(-1).index_select(0, order)[:, None]
        fast = self._use_grouped(x)
        ys = self._batched(x, tok, counts) if fast else None
        if ys is None:
            xs = x.index_select(0, tok)
            ys = self._grouped(xs, counts) if fast else self._looped(xs, counts)
        if fast:  # float32 weights: the same products as `ys * wo`, without its mixed-dtype copies
            ys = ys.to(torch.float32).mul_(wo).to(x.dtype)
        else:
            ys = (ys * wo).to(x.dtype)
        out = torch.zeros_like(x).index_add_(0, tok, ys)
        shared = self._modules.get("shared")
        if shared is not None:
            out.add_(shared.forward(x))
        return out

    def _one_row(self, x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """One bf16/fp16 row on CPU (a batch-1 decode step): its k chosen experts one after another as
        matrix-vector products, in ascending expert order like the routed paths, each output scaled in
        float32 and summed in the model's dtype as they do. The grouped GEMM spent ~0.45 ms a layer on
        `small` at one row (~3 GB/s of expert weights); four `mv`s read the same weights at ~15 GB/s."""
        b, v, start, ne = self._buffers, x[0], self.experts.start, len(self.experts)
        ids = idx[0].tolist()
        out = torch.zeros_like(v)
        for j in sorted(range(len(ids)), key=ids.__getitem__):
            e = ids[j] - start
            if 0 <= e < ne:  # (expert-parallel: another rank's expert adds nothing here)
                g, u = gemm.mv(b["gate_up"][e], v).chunk(2)
                y = gemm.mv(b["down"][e], F.silu(g).mul_(u))
                out.add_(y.to(torch.float32).mul_(w[0, j]).to(x.dtype))
        out = out.unsqueeze(0)
        shared = self._modules.get("shared")
        return out.add_(shared.forward(x)) if shared is not None else out

    def _dense_shared(self, x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        out = self._dense(x, w, idx)
        shared = self._modules.get("shared")
        return out.add_(shared.forward(x)) if shared is not None else out

    def _dense(self, x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """Every held expert over every row, each weighted by its routing weight (0 where not chosen):
        static shapes and no host sync (the routed paths read the expert counts on the host), at
        E_held/k times the routed path's FLOPs, so only while rows x experts <= DENSE_MAX (a decode
        batch). Equal to the routed paths to rounding (experts summed in ascending order)."""
        b = self._buffers
        ne = len(self.experts)
        local = idx - self.experts.start  # [N, k]; outside [0, ne): another rank's expert
        pick = local[:, :, None] == torch.arange(ne, device=x.device)  # [N, k, ne]
        wm = (w[:, :, None] * pick).sum(dim=1)  # [N, ne] each held expert's weight per row
        g, u = gemm.bmm(x.expand(ne, *x.shape), b["gate_up"].transpose(1, 2)).chunk(2, dim=-1)
        y = gemm.bmm(F.silu(g) * u, b["down"].transpose(1, 2))  # [ne, N, d]
        return (y * wm.t()[:, :, None]).to(x.dtype).sum(dim=0)

    def _use_grouped(self, x: torch.Tensor) -> bool:
        # torch._grouped_mm runs each group's matmul as its own GEMM: bit-identical to the per-expert
        # loop (tests/test_moe.py), in two calls instead of ~6 ops per expert. It has no float64.
        return _GROUPED and x.device.type == "cpu" and x.dtype in _GROUPED_DTYPES

    def _batched(self, x: torch.Tensor, tok: torch.Tensor, counts: torch.Tensor) -> torch.Tensor | None:
        """Expert outputs [M, d] (unweighted) of rows x[tok] (sorted by expert, `counts` per expert) as two
        batched GEMMs over [E, c_max, d], each expert's rows padded to the busiest expert's count: on
        CPU about twice as fast as the grouped GEMM (which runs one small GEMM per expert). None when
        padding would more than double the rows (skewed routing: use `_grouped`). The rows are
        gathered straight into the padded layout; a padding row repeats row 0 and its output is never
        read (GEMM rows are independent). Results equal the per-expert loop to rounding (not bit for
        bit: a batched GEMM blocks its rows differently). Also None when fewer than half the experts
        have rows (a decode step of a few requests): a GEMM of a few rows is bound by reading its
        weights, and the padded GEMM reads every expert's while the grouped GEMM reads only the routed
        ones' (on `small`, bf16, one core: 1.3-1.8x faster at B=1-2)."""
        m, ne = tok.shape[0], counts.shape[0]
        cmax = int(counts.max()) if m else 0
        if (m == 0 or ne * cmax > 2 * m + 8 * ne or 2 * int(torch.count_nonzero(counts)) < ne
                or not self.batched_experts):
            return None
        b = self._buffers
        starts = counts.cumsum(0) - counts
        expert = torch.repeat_interleave(torch.arange(ne), counts, output_size=m)
        slot = expert * cmax + torch.arange(m) - starts.index_select(0, expert)
        rows = tok.new_zeros(ne * cmax).index_copy_(0, slot, tok)
        x3 = x.index_select(0, rows).view(ne, cmax, -1)
        g, u = gemm.bmm(x3, b["gate_up"].transpose(1, 2)).chunk(2, dim=-1)
        y3 = gemm.bmm(F.silu(g).mul_(u), b["down"].transpose(1, 2))
        return y3.view(ne * cmax, -1).index_select(0, slot)

    def _grouped(self, xs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Rows sorted by expert [M, d] -> expert outputs [M, d] (unweighted), two grouped GEMMs."""
        b = self._buffers
        offs = counts.cumsum(0).to(torch.int32)
        gu, down = b["gate_up"].transpose(1, 2), b["down"].transpose(1, 2)
        if gemm.upcasts(xs, xs.shape[0], gemm.GROUPED_ROWS):  # (splash/model/gemm.py; as `_looped`)
            dt = xs.dtype  # each product rounded to the model's dtype, as the native kernel's
            g, u = torch._grouped_mm(xs.float(), gu.float(), offs=offs).to(dt).chunk(2, dim=-1)
            return torch._grouped_mm(F.silu(g).mul_(u).float(), down.float(), offs=offs).to(dt)
        g, u = torch._grouped_mm(xs, gu, offs=offs).chunk(2, dim=-1)
        return torch._grouped_mm(F.silu(g).mul_(u), down, offs=offs)

    def _looped(self, xs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """The same, one expert at a time (float64, accelerators); experts without rows are skipped."""
        ys = torch.empty_like(xs)
        up = gemm.upcasts(xs, xs.shape[0], gemm.GROUPED_ROWS)  # as `_grouped` decides: bit for bit
        a = 0
        for j, c in enumerate(counts.tolist()):
            if not c:
                continue
            if up:
                dt = xs.dtype
                g, u = F.linear(xs[a:a + c].float(), self.gate_up[j].float()).to(dt).chunk(2, dim=-1)
                ys[a:a + c] = F.linear((F.silu(g) * u).float(), self.down[j].float()).to(dt)
            else:
                g, u = F.linear(xs[a:a + c], self.gate_up[j]).chunk(2, dim=-1)
                ys[a:a + c] = F.linear(F.silu(g) * u, self.down[j])
            a += c
        return ys
