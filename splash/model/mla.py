"""Multi-head latent attention (MLA) over a set of held heads: absorbed form here, MHA form's pieces too.

The per-token work every rank repeats (`prepare`: q_a + norm or the raw x, kv_a -> normed c_kv ++
roped k_pe) is separate from the per-head work (`q_heads`, `out_heads`) so a layout can run the head
part over all heads (DP, CP) or a slice of them (TP, DOP), and `set_heads` swaps the slice when the
layout switches. Absorbed: q_lat = q_nope W_UK, so scores are q_lat . c_kv + q_pe . k_pe against the
cached latent directly, and the output latent goes through W_UV then o_proj. The MHA form of long
chunks (splash/attention/mha.py) uses the parts instead: `q_parts` (q_nope, q_pe) against keys and
values decompressed with w_uk / w_uv, values straight to `o_proj`.

Head-tensor layout for switching (`head_tensors` / `set_heads`): "q_b" [h, d_nope+d_rope, q_in],
"w_uk" [h, d_nope, d_c], "w_uv" [h, d_c, d_v] (all head-major), "o" [d, h, d_v] (o_proj columns).
"""

from __future__ import annotations

import torch
from torch import nn

from splash.core.model_config import ModelConfig
from splash.model import gemm
from splash.model.layers import RMSNorm, fusable, fused_rows
from splash.model.loader import CheckpointReader
from splash.model.rope import Rotary, softmax_scale


class MLA(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: Rotary, heads: range, dtype: torch.dtype,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.cfg, self.rotary = cfg, rotary
        d = cfg.hidden_size
        self.total_heads = cfg.num_attention_heads
        self.d_nope, self.d_rope, self.d_v = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.d_c = cfg.kv_lora_rank
        self.q_lora = cfg.q_lora_rank
        self.q_in_dim = self.q_lora or d
        self.softmax_scale: float = softmax_scale(cfg)
        bias = cfg.attention_bias

        def buf(name: str, *shape: int) -> None:
            self.register_buffer(name, torch.empty(*shape, dtype=dtype, device=device) if shape else None)

        if self.q_lora:
            buf("q_a", self.q_lora, d)
            buf("q_a_bias", *((self.q_lora,) if bias else ()))
            self.q_a_norm = RMSNorm(self.q_lora, 1e-6, dtype, device)
        buf("kv_a", self.d_c + self.d_rope, d)
        buf("kv_a_bias", *((self.d_c + self.d_rope,) if bias else ()))
        self.kv_a_norm = RMSNorm(self.d_c, 1e-6, dtype, device)
        buf("o_bias", *((d,) if bias else ()))
        self.heads = range(0)
        self._alloc_heads(heads, dtype, device)
        self._qkv_a: tuple[torch.Tensor, torch.Tensor | None] | None = None  # fused [q_a; kv_a] (+ bias)

    # ---- held heads -----------------------------------------------------------------------------
    def _alloc_heads(self, heads: range, dtype: torch.dtype, device) -> None:
        h = len(heads)
        self.heads = heads
        self.register_buffer("q_b", torch.empty(h * (self.d_nope + self.d_rope), self.q_in_dim,
                                                dtype=dtype, device=device))
        self.register_buffer("w_uk", torch.empty(h, self.d_nope, self.d_c, dtype=dtype, device=device))
        self.register_buffer("w_uv", torch.empty(h, self.d_c, self.d_v, dtype=dtype, device=device))
        self.register_buffer("o_w", torch.empty(self.cfg.hidden_size, h * self.d_v, dtype=dtype,
                                                device=device))

    @property
    def num_heads(self) -> int:
        return len(self.heads)

    def head_tensors(self, sub: range | None = None) -> dict[str, torch.Tensor]:
        """Views of the projection blocks of held heads `sub` (default all held), for a switch."""
        sub = self.heads if sub is None else sub
        if sub.step != 1 or sub.start < self.heads.start or sub.stop > self.heads.stop:
            raise ValueError(f"heads {sub} are not within the held heads {self.heads}")
        a, b = sub.start - self.heads.start, sub.stop - self.heads.start
        h, d = self.num_heads, self.cfg.hidden_size
        return {
            "q_b": self.q_b.view(h, self.d_nope + self.d_rope, self.q_in_dim)[a:b],
            "w_uk": self.w_uk[a:b],
            "w_uv": self.w_uv[a:b],
            "o": self.o_w.view(d, h, self.d_v)[:, a:b],
        }

    def set_heads(self, heads: range, tensors: dict[str, torch.Tensor]) -> None:
        """Hold `heads` from now on, with their projection blocks (layout as in `head_tensors`)."""
        h, d = len(heads), self.cfg.hidden_size
        q_b, w_uk, w_uv, o = (tensors[k] for k in ("q_b", "w_uk", "w_uv", "o"))
        if q_b.shape[0] != h or w_uk.shape[0] != h or w_uv.shape[0] != h or o.shape[1] != h:
            raise ValueError(f"set_heads({heads}): tensors hold a different number of heads")
        dev, dt = self.w_uk.device, self.w_uk.dtype
        self.heads = heads
        self.q_b = q_b.reshape(h * (self.d_nope + self.d_rope), self.q_in_dim).to(dev, dt).contiguous()
        self.w_uk = w_uk.to(dev, dt).contiguous()
        self.w_uv = w_uv.to(dev, dt).contiguous()
        self.o_w = o.reshape(d, h * self.d_v).to(dev, dt).contiguous()

    # ---- loading --------------------------------------------------------------------------------
    def load(self, reader: CheckpointReader, prefix: str, dev: torch.device) -> None:
        dt = self.kv_a.dtype
        get = reader.get
        if self.q_lora:
            self.q_a = get(f"{prefix}.q_a_proj.weight", dt, dev)
            if self.q_a_bias is not None:
                self.q_a_bias = get(f"{prefix}.q_a_proj.bias", dt, dev)
            self.q_a_norm.load(reader, f"{prefix}.q_a_layernorm.weight", dev)
        self.kv_a = get(f"{prefix}.kv_a_proj_with_mqa.weight", dt, dev)
        if self.kv_a_bias is not None:
            self.kv_a_bias = get(f"{prefix}.kv_a_proj_with_mqa.bias", dt, dev)
            self.o_bias = get(f"{prefix}.o_proj.bias", dt, dev)
        self.kv_a_norm.load(reader, f"{prefix}.kv_a_layernorm.weight", dev)
        a, b = self.heads.start, self.heads.stop
        dq, dkv = self.d_nope + self.d_rope, self.d_nope + self.d_v
        qn = f"{prefix}.q_b_proj.weight" if self.q_lora else f"{prefix}.q_proj.weight"
        self.q_b = get(qn, dt, dev, rows=(a * dq, b * dq))
        kv_b = get(f"{prefix}.kv_b_proj.weight", dt, dev, rows=(a * dkv, b * dkv)).view(b - a, dkv, self.d_c)
        self.w_uk = kv_b[:, : self.d_nope].contiguous()
        self.w_uv = kv_b[:, self.d_nope:].transpose(1, 2).contiguous()
        self.o_w = get(f"{prefix}.o_proj.weight", dt, dev, cols=(a * self.d_v, b * self.d_v))

    def fuse(self) -> None:
        """Run q_a and kv_a (same input) as one GEMM where that is bit-identical (see `fusable`):
        `q_a` / `kv_a` become views of one tensor, biases likewise."""
        b = self._buffers
        if not self.q_lora or not fusable(b["q_a"], b["kv_a"]):
            return
        if (b["q_a_bias"] is None) != (b["kv_a_bias"] is None):
            return
        w, (self.q_a, self.kv_a) = fused_rows(b["q_a"], b["kv_a"])
        bias = None
        if b["q_a_bias"] is not None:
            bias, (self.q_a_bias, self.kv_a_bias) = fused_rows(b["q_a_bias"], b["kv_a_bias"])
        self._qkv_a = (w, bias)

    def _project_a(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x q_a^T + bias [N, q_lora], x kv_a^T + bias [N, d_c + d_rope]), fused when possible."""
        b, f = self._buffers, self._qkv_a
        if f is not None and b["q_a"]._base is f[0] and b["kv_a"]._base is f[0]:
            y = gemm.linear(x, f[0], f[1])
            return y[:, :self.q_lora], y[:, self.q_lora:]
        return gemm.linear(x, b["q_a"], b["q_a_bias"]), gemm.linear(x, b["kv_a"], b["kv_a_bias"])

    # ---- compute --------------------------------------------------------------------------------
    # Weights are read from `_buffers` / `_modules` and norms called through `.forward`: nn.Module's
    # attribute lookup and call machinery cost about as much as a small op, and a decode step is
    # mostly small ops. No hooks are ever registered on these modules.
    def prepare(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Replicated part: x [N, d] -> (q_in [N, q_in], latent_new [N, d_c + d_rope])."""
        b, m, d_c, rot = self._buffers, self._modules, self.d_c, self.rotary
        if self.q_lora:
            q, kv = self._project_a(x)
            q_in = m["q_a_norm"].forward(q)
        else:
            q_in, kv = x, gemm.linear(x, b["kv_a"], b["kv_a_bias"])
        k_pe = rot.apply(kv[:, d_c:], rot.tables(positions))
        return q_in, torch.cat([m["kv_a_norm"].forward(kv[:, :d_c]), k_pe], dim=-1)

    def q_parts(self, q_in: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Held heads' queries before absorption: (q_nope [N, h, d_nope], roped q_pe [N, h, d_rope]);
        the MHA form (splash/attention/mha.py) scores them against decompressed keys."""
        b, dn, rot = self._buffers, self.d_nope, self.rotary
        q = gemm.linear(q_in, b["q_b"]).view(q_in.shape[0], len(self.heads), dn + self.d_rope)
        return q[..., :dn], rot.apply(q[..., dn:], rot.tables(positions))

    def absorb(self, q_nope: torch.Tensor) -> torch.Tensor:
        """q_nope [N, h, d_nope] -> q_lat = q_nope W_UK [N, h, d_c], scored against the latent directly."""
        return gemm.heads(q_nope, self._buffers["w_uk"])

    def q_heads(self, q_in: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Held heads' absorbed queries: (q_lat [N, h, d_c], roped q_pe [N, h, d_rope])."""
        q_nope, q_pe = self.q_parts(q_in, positions)
        return self.absorb(q_nope), q_pe

    def uv(self, o_lat: torch.Tensor) -> torch.Tensor:
        """o_lat [N, h, d_c] -> per-head values [N, h, d_v] (W_UV)."""
        return gemm.heads(o_lat, self._buffers["w_uv"])

    def o_proj(self, v: torch.Tensor) -> torch.Tensor:
        """v [N, h, d_v] -> [N, d] over held heads (a partial sum if sharded; the o_proj bias, if any, is
        added by the rank holding head 0)."""
        b = self._buffers
        v = v.reshape(v.shape[0], len(self.heads) * self.d_v)
        return gemm.linear(v, b["o_w"], b["o_bias"] if self.heads.start == 0 else None)

    def out_heads(self, o_lat: torch.Tensor) -> torch.Tensor:
        """o_lat [N, h, d_c] -> [N, d]: W_UV then o_proj over held heads."""
        return self.o_proj(self.uv(o_lat))
