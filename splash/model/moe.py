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

from splash.config import ConfigError, ModelConfig
from splash.model.layers import MLP
from splash.model.loader import CheckpointReader
from splash.model.shard import even_range, moe_mode, span

V3_TYPES = ("deepseek_v3", "kimi_k2")


def _padded_rows(n: int, width: int, vec: int = 64, least: int = 8) -> int:
    """Smallest row count >= max(n, least) whose [rows, width] float32 tensor is whole 64-float vectors
    (BLAS takes other code paths, with other summation orders, for fewer than ~4 rows)."""
    step = vec // math.gcd(vec, width)
    return -(-max(n, least) // step) * step


def _pad(x: torch.Tensor, rows: int) -> torch.Tensor:
    return x if rows == x.shape[0] else torch.cat([x, x.new_zeros(rows - x.shape[0], x.shape[1])])


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
        if self.v3:
            # Float32 results here depend on the batch shape: a GEMM of a few rows sums in another order
            # than a long one, and sigmoid's scalar tail rounds differently from its vector body. Routing
            # weights stay float32, so pad the rows: each row then gets what a long batch gives it, and a
            # decode step reproduces the full-sequence forward (and transformers) to float64 precision
            # in float64 tests instead of ~1e-7.
            scores = F.linear(_pad(xf, _padded_rows(n, self.e)), self.weight).sigmoid()[:n]
        else:
            logits = F.linear(_pad(xf, max(n, 8)), self.weight)[:n]
            scores = logits.softmax(dim=-1, dtype=torch.float32)  # row-wise kernel: shape-independent
        per = self.e // self.groups
        if self.v3:
            choice = scores + self.bias
            gscores = choice.view(-1, self.groups, per).topk(2, dim=-1)[0].sum(dim=-1)
            choice = choice.masked_fill(~self._group_mask(gscores, per), float("-inf"))
            idx = torch.topk(choice, k=self.k, dim=-1, sorted=False)[1]
            w = scores.gather(1, idx)
            if self.norm:
                # left-to-right, as torch's sum does for k = 3 or 8 at any batch size (not for all k)
                total = w[:, :1]
                for j in range(1, self.k):
                    total = total + w[:, j:j + 1]
                w = w / (total + 1e-20)
        else:
            if self.method == "group_limited_greedy":
                gscores = scores.view(-1, self.groups, per).max(dim=-1).values
                scores = scores.masked_fill(~self._group_mask(gscores, per), 0.0)
            w, idx = torch.topk(scores, k=self.k, dim=-1, sorted=False)
        return w * self.scale, idx

    def _group_mask(self, gscores: torch.Tensor, per: int) -> torch.Tensor:
        gidx = torch.topk(gscores, k=self.topk_group, dim=-1, sorted=False)[1]
        gmask = torch.zeros_like(gscores)
        gmask.scatter_(1, gidx, 1)
        return gmask.unsqueeze(-1).expand(-1, self.groups, per).reshape(-1, self.e).bool()


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
        """x [N, d] -> [N, d]: routed + shared experts (this rank's partial sum when `partial`)."""
        w, idx = self.gate(x)
        k = idx.shape[1]
        flat = idx.reshape(-1)
        ne = len(self.experts)
        if ne == self.e:
            order = torch.argsort(flat, stable=True)  # grouped by expert, ascending
            counts = torch.bincount(flat, minlength=self.e).tolist()
        else:  # expert-parallel: only the (token, choice) pairs routed to this rank's experts
            local = flat - self.experts.start
            key = torch.where((local >= 0) & (local < ne), local, ne)
            counts = torch.bincount(key, minlength=ne + 1).tolist()[:ne]
            order = torch.argsort(key, stable=True)[:sum(counts)]
        tok = order // k
        xs = x[tok]
        ys = torch.empty_like(xs)
        a = 0
        for j, c in enumerate(counts):
            if not c:
                continue
            g, u = F.linear(xs[a:a + c], self.gate_up[j]).chunk(2, dim=-1)
            ys[a:a + c] = F.linear(F.silu(g) * u, self.down[j])
            a += c
        ys = (ys * w.reshape(-1)[order, None]).to(x.dtype)
        out = torch.zeros_like(x).index_add_(0, tok, ys)
        if self.shared is not None:
            out = out + self.shared(x)
        return out
