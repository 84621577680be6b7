"""Kimi Delta Attention (KDA), the linear-attention layer of Kimi-Linear hybrids, over a set of held heads.

Per token (transformers' `KimiLinearDeltaAttention`, FLA's `chunk_kda` / `fused_recurrent_kda`):
```
q, k, v = silu(conv(W_q x)), silu(conv(W_k x)), silu(conv(W_v x))   (causal depthwise, K taps)
g = -exp(A_log) * softplus(f_b(f_a(x)) + dt_bias)      (float32, per channel)
beta = sigmoid(W_b x);  q, k L2-normalised;  q *= d^-1/2
S = S * exp(g) ;  S = S + k (beta * (v - k^T S))^T ;  o = q^T S     (per head, S [d_k, d_v])
out = o_proj(RMSNormGated(o, g_b(g_a(x))))             (the norm in float32, sigmoid gate)
```
A request's state is its conv window (the last K-1 inputs of every q/k/v channel) and `S` per head;
both live in the rank's `StatePool` (splash/kv/state.py) at the request's slot, the same slot in every
KDA layer. Prefill chunks run the chunked form (chunks of `CHUNK` tokens, WY representation: the
intra-chunk triangular system solved exactly, the state carried between chunks) one sequence at a
time; decode rows run the recurrent form batched over requests and heads. The core (conv states
aside) computes in float64 for a float64 model, else float32 (the state stays float32 for bf16, as
vLLM keeps it); the forget gate and the gated norm take transformers' float32 casts exactly.

Head tensors for a layout switch (`head_tensors` / `set_heads`, head on dim 0 unless said):
"qkv" [3, h, d, D] (q/k/v rows), "conv" [3, h, d, K] (q/k/v conv channels), "f_b" [h, d, d_f],
"dt_bias" [h, d] (float32), "A_log" [h], "b" [h, D], "g_b" [h, d, d_f], "o" [D, h, d] (o_proj
columns, head on dim 1). f_a, g_a and o_norm are replicated.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from splash.core.model_config import ConfigError, ModelConfig
from splash.kv.state import core_dtype
from splash.model import gemm
from splash.model.loader import CheckpointReader, Span

if TYPE_CHECKING:
    from splash.kv.state import StateStep
    from splash.model.context import ForwardContext

CHUNK = 64  # tokens per chunk of the chunked form (FLA's and transformers' chunk size)
SUB = 4  # rows of a sub-block of a steeply decaying chunk, whose channel products are summed explicitly
_SPAN = {torch.float32: 80.0, torch.float64: 1000.0}  # decay span a chunk may factor about its midpoint


def vector_path(fn: Callable[[torch.Tensor], torch.Tensor], t: torch.Tensor, vec: int = 64) -> torch.Tensor:
    """Elementwise float32 `fn` (exp, log, sigmoid) of t through torch's vectorised CPU loop for every
    element: the loop leaves a tail of fewer than two vectors to scalar code, which rounds differently,
    so a rank holding few heads (h*d small) would round otherwise than transformers' [S, H*d] pass.
    Padding the flat tensor to whole `vec`-element blocks makes the result independent of the shape."""
    n = t.numel()
    pad = -n % vec
    if t.device.type != "cpu" or pad == 0:
        return fn(t)
    return fn(F.pad(t.reshape(-1), (0, pad)))[:n].view(t.shape)


def conv_acc(dtype: torch.dtype) -> torch.dtype:
    """What the short convolution accumulates in: float32 for 16-bit activations, else their dtype."""
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


def causal_taps(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Depthwise causal conv without padding, time-major: x [.., L, C], w [C, K] -> [.., L - K + 1, C],
    y[t, c] = sum_k w[c, k] x[t + k, c], tap by tap in x's dtype (the caller casts to `conv_acc`).
    K shifted multiply-adds over whole rows: torch's grouped conv1d runs one small GEMM per channel
    group on CPU for 16-bit inputs (thousands of calls a layer), and channel-major needs transposes."""
    K = w.shape[-1]
    n = x.shape[-2] - K + 1
    wt = w.to(x.dtype).t()  # [K, C]
    y = x[..., 0:n, :] * wt[0]
    for j in range(1, K):
        y.addcmul_(x[..., j:j + n, :], wt[j])  # in place: no fresh [n, C] buffer (page faults) per tap
    return y


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (FLA's l2norm, as transformers writes it)."""
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _pair_block(left: torch.Tensor, k: torch.Tensor, Gi: torch.Tensor, Gj: torch.Tensor,
                diagonal: bool) -> torch.Tensor:
    """sum_d left_i k_j exp(G_i - G_j) over a diagonal block (rows i and keys j the same sub-block,
    j <= i, or j < i when not `diagonal`), explicit per channel: [.., s, d] x [.., s, d] -> [.., s, s]."""
    s = Gi.shape[-2]
    keep = torch.tril(torch.ones(s, s, dtype=torch.bool, device=Gi.device), diagonal=0 if diagonal else -1)
    diff = (Gi[..., :, None, :] - Gj[..., None, :, :]).masked_fill(~keep[:, :, None], float("-inf"))
    return (left[..., :, None, :] * k[..., None, :, :] * vector_path(torch.exp, diff)).sum(dim=-1)


def _factored_products(q: torch.Tensor, kb: torch.Tensor, k: torch.Tensor, G: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """`_decayed_products` of blocks whose decay spans little: exp(G_i - G_j) = exp(G_i - m) exp(m - G_j)
    about the midpoint m of the block's range, both factors within exp(+-span/2): two matmuls."""
    mid = (G[:, :1] + G[:, -1:]) * 0.5
    lead = vector_path(torch.exp, G - mid)
    right = (k * vector_path(torch.exp, mid - G)).transpose(-1, -2)
    return ((kb * lead) @ right).tril(-1), ((q * lead) @ right).tril(0)


def _sub_blocked_products(q: torch.Tensor, kb: torch.Tensor, k: torch.Tensor, G: torch.Tensor, sub: int
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """`_decayed_products` of steeply decaying blocks, by sub-blocks of `sub` rows: keys of sub-block J
    against later rows factor at J's last row r (exp(G_i - G_r) exp(G_r - G_j), both <= 1), the
    diagonal sub-blocks are summed per channel."""
    P, c, _ = k.shape
    A, QK = q.new_zeros(P, c, c), q.new_zeros(P, c, c)
    for j0 in range(0, c, sub):
        j1 = min(c, j0 + sub)
        Gj, kj = G[:, j0:j1], k[:, j0:j1]
        A[:, j0:j1, j0:j1] = _pair_block(kb[:, j0:j1], kj, Gj, Gj, diagonal=False)
        QK[:, j0:j1, j0:j1] = _pair_block(q[:, j0:j1], kj, Gj, Gj, diagonal=True)
        if j1 < c:
            ref = G[:, j1 - 1:j1]
            right = (kj * vector_path(torch.exp, ref - Gj)).transpose(-1, -2)  # [P, d, s]
            lead = vector_path(torch.exp, G[:, j1:] - ref)                     # [P, c - j1, d]
            A[:, j1:, j0:j1] = (kb[:, j1:] * lead) @ right
            QK[:, j1:, j0:j1] = (q[:, j1:] * lead) @ right
    return A, QK


def _decayed_products(q: torch.Tensor, kb: torch.Tensor, k: torch.Tensor, G: torch.Tensor, sub: int
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """For blocks [P, c, d] of c rows: (A, QK) [P, c, c] with A_ij = sum_d kb_i k_j exp(G_i - G_j) for
    j < i and QK_ij = sum_d q_i k_j exp(G_i - G_j) for j <= i (zero above).

    A block whose decay spans little (G_0 - G_last <= `_SPAN[dtype]` in every channel; G falls, g <= 0)
    takes `_factored_products`, one that spans more `_sub_blocked_products` (no exp overflows either
    way). The choice is per block (one head's chunk), so it does not depend on which heads a rank holds."""
    fast = (G[:, 0] - G[:, -1]).amax(dim=-1) <= _SPAN.get(G.dtype, 80.0)
    if bool(fast.all()):
        return _factored_products(q, kb, k, G)
    P, c, _ = k.shape
    A, QK = q.new_zeros(P, c, c), q.new_zeros(P, c, c)
    for idx, steep in ((fast.nonzero()[:, 0], False), ((~fast).nonzero()[:, 0], True)):
        if idx.numel():
            blocks = (q[idx], kb[idx], k[idx], G[idx])
            A[idx], QK[idx] = _sub_blocked_products(*blocks, sub) if steep else _factored_products(*blocks)
    return A, QK


def chunked_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       state: torch.Tensor, chunk: int = CHUNK, sub: int = SUB
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's rows: q, k, v, g [h, n, d] (q scaled and normed, k normed), beta [h, n], state
    [h, d_k, d_v] (the state before the first row) -> (o [h, n, d_v], state after the last row).

    Per chunk of c rows with G = cumsum(g) inside it, decay(i, j) = exp(G_i - G_j) (j <= i, <= 1):
    T = (I + strict_lower(beta_i k_i . k_j decay))^-1, W = T (beta k exp(G)), U = T (beta v), then
    v_new = U - W S, o = (q exp(G)) S + causal(q_i . k_j decay) v_new and
    S = exp(G_last) S + (k exp(G_last - G))^T v_new: the delta rule's recurrence, row for row.

    Every chunk's intra-chunk part is computed at once (`_decayed_products`, the triangular solve);
    only the state is carried chunk to chunk. Padding rows (k = v = beta = 0, g = 0) change nothing:
    they add zeros and leave G, hence the state's decay, as it was."""
    h, n, dk = k.shape
    dv = v.shape[-1]
    c = min(chunk, n)
    nc = -(-n // c)
    pad = nc * c - n
    if pad:
        q, k, v, g = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v, g))
        beta = F.pad(beta, (0, pad))
    q, k, v, g = (t.reshape(h * nc, c, t.shape[-1]) for t in (q, k, v, g))
    beta = beta.reshape(h * nc, c, 1)
    G = g.cumsum(dim=1)
    kb = k * beta
    A, QK = _decayed_products(q, kb, k, G, sub)
    eye = torch.eye(c, dtype=q.dtype, device=q.device)
    t = torch.linalg.solve_triangular(A + eye, eye.expand(h * nc, c, c), upper=False, unitriangular=True)
    eg = vector_path(torch.exp, G)
    w = (t @ (kb * eg)).view(h, nc, c, dk)
    u = (t @ (v * beta)).view(h, nc, c, dv)
    qe = (q * eg).view(h, nc, c, dk)
    QK = QK.view(h, nc, c, c)
    last = G[:, -1:]                                                                    # [h*nc, 1, d]
    kd = (k * vector_path(torch.exp, last - G)).transpose(-1, -2).reshape(h, nc, dk, c)
    decay = vector_path(torch.exp, last).transpose(-1, -2).reshape(h, nc, dk, 1)
    out = v.new_empty(h, nc, c, dv)
    for i in range(nc):
        v_new = u[:, i] - w[:, i] @ state
        out[:, i] = qe[:, i] @ state + QK[:, i] @ v_new
        state = state * decay[:, i] + kd[:, i] @ v_new
    return out.reshape(h, nc * c, dv)[:, :n], state


def recurrent_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                         beta: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One row of each of B requests, all heads at once: q, k, v, g [B, h, d], beta [B, h], state
    [B, h, d_k, d_v] -> (o [B, h, d_v], new state)."""
    state = state * g.exp()[..., None]
    kv_mem = (k[:, :, None, :] @ state)[:, :, 0]  # k^T S [B, h, d_v]
    delta = (v - kv_mem) * beta[..., None]
    state = state + k[..., None] * delta[:, :, None, :]
    return (q[:, :, None, :] @ state)[:, :, 0], state


class KDA(nn.Module):
    """One KDA layer over the heads a rank holds (`heads`, a range of global head ids)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, heads: range, dtype: torch.dtype,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.cfg, self.layer_idx = cfg, layer_idx
        self.total_heads, self.d, self.K = cfg.linear_num_heads, cfg.linear_head_dim, cfg.linear_conv_kernel
        self.hidden = cfg.hidden_size
        self.eps = cfg.rms_norm_eps
        self.dtype, self.cdtype = dtype, core_dtype(dtype)
        d, D = self.d, self.hidden

        def buf(name: str, *shape: int, dt: torch.dtype = dtype) -> None:
            self.register_buffer(name, torch.empty(*shape, dtype=dt, device=device))

        buf("f_a", d, D)
        buf("g_a", d, D)
        buf("o_norm", d)
        self.heads = range(0)
        self._alloc_heads(heads, device)

    def _alloc_heads(self, heads: range, device) -> None:
        h, d, D, dt = len(heads), self.d, self.hidden, self.dtype
        self.heads = heads
        for name, shape, t in (("qkv", (3 * h * d, D), dt), ("conv", (3 * h * d, self.K), dt),
                               ("f_b", (h * d, d), dt), ("dt_bias", (h * d,), torch.float32),
                               ("A_log", (h,), dt), ("b_w", (h, D), dt), ("g_b", (h * d, d), dt),
                               ("o_w", (D, h * d), dt)):
            self.register_buffer(name, torch.empty(*shape, dtype=t, device=device))

    @property
    def num_heads(self) -> int:
        return len(self.heads)

    @property
    def conv_dim(self) -> int:
        """Channels of this rank's conv state: q, k and v of every held head."""
        return 3 * self.num_heads * self.d

    def fuse(self) -> None:
        """Nothing to fuse (q, k and v already run as one GEMM)."""

    # ---- held heads -----------------------------------------------------------------------------
    def head_tensors(self, sub: range | None = None) -> dict[str, torch.Tensor]:
        """Views of the head-sliced blocks of held heads `sub` (default all held), for a switch."""
        sub = self.heads if sub is None else sub
        if sub.step != 1 or sub.start < self.heads.start or sub.stop > self.heads.stop:
            raise ValueError(f"heads {sub} are not within the held heads {self.heads}")
        a, z = sub.start - self.heads.start, sub.stop - self.heads.start
        h, d, D, b = self.num_heads, self.d, self.hidden, self._buffers
        return {"qkv": b["qkv"].view(3, h, d, D)[:, a:z], "conv": b["conv"].view(3, h, d, self.K)[:, a:z],
                "f_b": b["f_b"].view(h, d, d)[a:z], "dt_bias": b["dt_bias"].view(h, d)[a:z],
                "A_log": b["A_log"][a:z], "b": b["b_w"][a:z], "g_b": b["g_b"].view(h, d, d)[a:z],
                "o": b["o_w"].view(D, h, d)[:, a:z]}

    def set_heads(self, heads: range, tensors: dict[str, torch.Tensor]) -> None:
        """Hold `heads` from now on, with their blocks (layout as in `head_tensors`)."""
        h, d, D = len(heads), self.d, self.hidden
        t = tensors
        if t["qkv"].shape[1] != h or t["A_log"].shape[0] != h or t["o"].shape[1] != h:
            raise ValueError(f"set_heads({heads}): tensors hold a different number of heads")
        dev = self._buffers["o_w"].device

        def put(name: str, x: torch.Tensor, *shape: int, dt: torch.dtype | None = None) -> None:
            self._buffers[name] = x.reshape(*shape).to(dev, dt or self.dtype).contiguous()

        self.heads = heads
        put("qkv", t["qkv"], 3 * h * d, D)
        put("conv", t["conv"], 3 * h * d, self.K)
        put("f_b", t["f_b"], h * d, d)
        put("dt_bias", t["dt_bias"], h * d, dt=torch.float32)
        put("A_log", t["A_log"], h)
        put("b_w", t["b"], h, D)
        put("g_b", t["g_b"], h * d, d)
        put("o_w", t["o"], D, h * d)

    # ---- loading --------------------------------------------------------------------------------
    def full_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        """Checkpoint tensors of this layer (`prefix` = "model.layers.N.self_attn") and full shapes."""
        H, d, D, K = self.total_heads, self.d, self.hidden, self.K
        hd = H * d
        return {f"{prefix}.q_proj.weight": (hd, D), f"{prefix}.k_proj.weight": (hd, D),
                f"{prefix}.v_proj.weight": (hd, D), f"{prefix}.q_conv1d.weight": (hd, 1, K),
                f"{prefix}.k_conv1d.weight": (hd, 1, K), f"{prefix}.v_conv1d.weight": (hd, 1, K),
                f"{prefix}.f_a_proj.weight": (d, D), f"{prefix}.f_b_proj.weight": (hd, d),
                f"{prefix}.dt_bias": (hd,), f"{prefix}.A_log": (1, 1, H, 1),
                f"{prefix}.b_proj.weight": (H, D),
                f"{prefix}.g_a_proj.weight": (d, D), f"{prefix}.g_b_proj.weight": (hd, d),
                f"{prefix}.o_norm.weight": (d,), f"{prefix}.o_proj.weight": (D, hd)}

    def targets(self, sub: str) -> list[tuple[torch.Tensor, Span, Span, Callable | None]]:
        """Where checkpoint tensor `self_attn.<sub>` lives here: [(live view, rows, cols, post)] with the
        loader's spans over the full tensor (what `load` reads; weight updates reuse it)."""
        b, d, K = self._buffers, self.d, self.K
        a, z = self.heads.start, self.heads.stop
        h, hd = z - a, (z - a) * d
        rows = (a * d, z * d)
        qkv = {"q": 0, "k": 1, "v": 2}
        name = sub.removesuffix(".weight")
        if name in ("q_proj", "k_proj", "v_proj"):
            i = qkv[name[0]]
            return [(b["qkv"][i * hd:(i + 1) * hd], rows, None, None)]
        if name in ("q_conv1d", "k_conv1d", "v_conv1d"):
            i = qkv[name[0]]
            return [(b["conv"][i * hd:(i + 1) * hd], rows, None, lambda t: t.reshape(-1, K))]
        plain = {"f_a_proj": ("f_a", None), "g_a_proj": ("g_a", None), "o_norm": ("o_norm", None),
                 "f_b_proj": ("f_b", rows), "g_b_proj": ("g_b", rows), "dt_bias": ("dt_bias", rows),
                 "b_proj": ("b_w", (a, z))}
        if name in plain:
            buf, r = plain[name]
            return [(b[buf], r, None, None)]
        if name == "o_proj":
            return [(b["o_w"], None, rows, None)]
        if name == "A_log":
            return [(b["A_log"], None, None, lambda t: t.reshape(-1)[a:a + h])]
        raise KeyError(sub)

    def load(self, reader: CheckpointReader, prefix: str, dev: torch.device) -> None:
        """Read this rank's heads of every tensor, refusing shapes config.json does not give."""
        for name, want in self.full_shapes(prefix).items():
            got = tuple(reader.shape(name))
            if got != want:
                raise ConfigError(f"{name} has shape {list(got)}, but config.json's KDA dims (linear heads "
                                  f"{self.total_heads} x head_dim {self.d}, conv kernel {self.K}, hidden "
                                  f"{self.hidden}) give {list(want)}; config.json does not match the weights")
        a, z, d, K = self.heads.start, self.heads.stop, self.d, self.K
        rows = (a * d, z * d)

        def get(name: str, dt: torch.dtype = self.dtype, **span) -> torch.Tensor:
            return reader.get(f"{prefix}.{name}", dt, dev, **span)

        self.qkv = torch.cat([get(f"{c}_proj.weight", rows=rows) for c in "qkv"])
        self.conv = torch.cat([get(f"{c}_conv1d.weight", rows=rows).reshape(-1, K) for c in "qkv"])
        self.f_a, self.g_a = get("f_a_proj.weight"), get("g_a_proj.weight")
        self.f_b, self.g_b = get("f_b_proj.weight", rows=rows), get("g_b_proj.weight", rows=rows)
        self.dt_bias = get("dt_bias", torch.float32, rows=rows)  # kept float32, as transformers does
        self.A_log = get("A_log").reshape(-1)[a:z].contiguous()
        self.b_w = get("b_proj.weight", rows=(a, z))
        self.o_norm = get("o_norm.weight")
        self.o_w = get("o_proj.weight", cols=rows)

    # ---- compute --------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, ctx: ForwardContext, state: StateStep | None = None) -> torch.Tensor:
        """x [N, D] (normed residual rows) -> [N, D] over held heads (a partial sum of o_proj when heads
        are sharded). Reads and updates the requests' state slots: `state` (rows of x), default the
        step's (`ctx.state`, every row)."""
        st = ctx.state if state is None else state
        if st is None:
            raise RuntimeError("a KDA layer needs the step's state slots (ForwardContext.state)")
        b, N = self._buffers, x.shape[0]
        h, d, cd = self.num_heads, self.d, self.cdtype
        rec, conv_state = st.pool.layer(self.layer_idx)
        if rec.shape[1] != h:
            raise RuntimeError(f"KDA layer {self.layer_idx} holds {h} heads but its state pool "
                               f"{rec.shape[1]}; a switch left the layer half done")
        mixed = self._conv(gemm.linear(x, b["qkv"]), conv_state, st)
        q, k, v = (t.reshape(N, h, d) for t in mixed.split(h * d, dim=-1))
        g = self.forget_gate(x)
        beta = torch.sigmoid(gemm.linear(x, b["b_w"]))
        q, k, v, g, beta = (t.to(cd) for t in (q, k, v, g, beta))
        q = l2norm(q) * (d ** -0.5)
        k = l2norm(k)
        o = torch.empty(N, h, d, dtype=cd, device=x.device)
        if st.dec_rows is not None:
            r, s = st.dec_rows, st.dec_slots
            out, new = recurrent_delta_rule(q[r], k[r], v[r], g[r], beta[r], rec[s].to(cd))
            o[r] = out
            rec[s] = new.to(rec.dtype)
        for rows, slot in st.prefill:
            out, new = chunked_delta_rule(*(t[rows].transpose(0, 1) for t in (q, k, v, g, beta)),
                                          rec[slot].to(cd))
            o[rows] = out.transpose(0, 1)
            rec[slot] = new.to(rec.dtype)
        gate = gemm.linear(gemm.linear(x, b["g_a"]), b["g_b"]).view(N, h, d)
        o = self.gated_norm(o.to(self.dtype), gate)
        return gemm.linear(o.reshape(N, h * d), b["o_w"])

    def forget_gate(self, x: torch.Tensor) -> torch.Tensor:
        """g [N, h, d] float32, with transformers' `KimiLinearForgetGate` casts and ops."""
        b = self._buffers
        f = gemm.linear(gemm.linear(x, b["f_a"]), b["f_b"])
        g = (f.float() + b["dt_bias"].float().view(1, -1)).view(x.shape[0], self.num_heads, self.d)
        decay = vector_path(torch.exp, b["A_log"].float()).view(1, -1, 1)
        sp = torch.where(g > 20.0, g, vector_path(lambda t: torch.log(1.0 + torch.exp(t)), g))
        return -decay * sp

    def gated_norm(self, o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """RMSNormGated over each head's d values: float32 throughout, sigmoid gate, back to o's dtype."""
        w = self._buffers["o_norm"]
        if o.device.type == "cpu":  # the same float32 ops in one call (bit for bit, see layers.RMSNorm)
            hs = F.rms_norm(o.to(torch.float32), (self.d,), None, self.eps)
        else:
            hs = o.to(torch.float32)
            hs = hs * torch.rsqrt(hs.pow(2).mean(-1, keepdim=True) + self.eps)
        hs = w.to(torch.float32) * hs
        return (hs * vector_path(torch.sigmoid, gate.to(torch.float32))).to(o.dtype)

    def _conv(self, mixed: torch.Tensor, conv_state: torch.Tensor, st) -> torch.Tensor:
        """Causal depthwise conv + SiLU of the step's q/k/v rows [N, C], each sequence continuing from its
        slot's window (conv_state [slots, C, K-1]), which is then advanced."""
        w = self._buffers["conv"]  # [C, K]
        acc = conv_acc(mixed.dtype)
        out = torch.empty_like(mixed)
        if st.dec_rows is not None:
            r, s = st.dec_rows, st.dec_slots
            win = torch.cat([conv_state[s].to(acc), mixed[r][:, :, None].to(acc)], dim=-1)  # [B, C, K]
            out[r] = causal_taps(win.transpose(1, 2), w)[:, 0].to(mixed.dtype)
            conv_state[s] = win[:, :, 1:].to(conv_state.dtype)
        keep = self.K - 1
        for rows, slot in st.prefill:
            full = torch.cat([conv_state[slot].t().to(acc), mixed[rows].to(acc)])  # [K-1+n, C]
            out[rows] = causal_taps(full, w).to(mixed.dtype)
            conv_state[slot] = full[full.shape[0] - keep:].t().to(conv_state.dtype)
        return F.silu(out)
