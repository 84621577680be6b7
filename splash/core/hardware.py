"""Hardware profiles (B200, H200, BW1000 DCU, this CPU) and theta derived from them.

A profile holds nominal datasheet rates and efficiency factors; `theta_for` turns it into the rates
Eq 10 uses. These are priors: `splash calibrate` measures a deployment and writes a theta JSON that
`Theta.load` reads instead. BW1000 figures are not fully published; its entries are stated
assumptions sized to the paper's DCU scenario and should be calibrated before real use.
"""

from __future__ import annotations

from dataclasses import dataclass

from splash.core.model_config import ConfigError
from splash.core.sizes import GIB, AttentionSizes
from splash.core.theta import Theta


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    description: str
    memory_gib: float  # device memory per rank
    tflops_bf16: float  # dense
    tflops_fp8: float
    hbm_tb_s: float
    link_gb_s: float  # per direction, per device, into a collective
    latency_us: float  # one small collective
    memory_fraction: float = 0.90  # share of device memory the server may use
    reserve_gib: float = 2.0  # transient reserve R_r
    matmul_eff: float = 0.6
    attention_eff: float = 0.35
    mem_eff: float = 0.8
    link_eff: float = 0.7
    step_overhead_ms: float = 1.0  # launches, sampling, scheduling per step
    law_scenario: str | None = None  # its appendix-B illustrative-law scenario, if any
    # The link between a prefill and a decode group (disaggregation's KV transfer), per rank and direction:
    # a node's scale-out NIC per device, not the collectives' NVLink (None: priced at link_gb_s).
    pd_link_gb_s: float | None = None
    pd_latency_us: float = 0.0  # one transfer's fixed cost: handshake, submission, completion notice


# Prefill-to-decode link: the paper's 1P1D groups sit on two nodes and does not name their fabric; an HGX
# B200/H200 node pairs each GPU with one 400 Gb/s NDR NIC (ConnectX-7, GPUDirect RDMA, what Mooncake
# writes through), so 50 GB/s per rank-link and direction; the per-transfer latency (100 us) is an assumed
# handshake + completion notice. The DCU's 200 Gb/s per device is assumed. Calibrate all three.
PROFILES: dict[str, HardwareProfile] = {
    "b200": HardwareProfile("b200", "NVIDIA B200 (HGX, NVLink 5)", 180e9 / GIB, 2250, 4500, 8.0, 900, 8,
                            memory_fraction=0.85, law_scenario="b200", pd_link_gb_s=50, pd_latency_us=100),
    "h200": HardwareProfile("h200", "NVIDIA H200 SXM (NVLink 4)", 141e9 / GIB, 989, 1979, 4.8, 450, 10,
                            law_scenario="h200", pd_link_gb_s=50, pd_latency_us=100),
    "dcu": HardwareProfile("dcu", "Hygon BW1000 DCU (assumed figures; calibrate)", 64.0, 200, 400, 1.8, 100,
                           20, memory_fraction=0.85, reserve_gib=1.0, law_scenario="dcu", pd_link_gb_s=25,
                           pd_latency_us=100),
    "cpu": HardwareProfile("cpu", "CPU ranks over gloo (one process per rank)", 8.0, 0.05, 0.05, 0.01, 1.0,
                           200, memory_fraction=1.0, reserve_gib=0.25, matmul_eff=1.0, attention_eff=1.0,
                           mem_eff=1.0, link_eff=1.0, step_overhead_ms=2.0),
}
PROFILES["bw1000"] = PROFILES["dcu"]


def profile(name: str) -> HardwareProfile:
    try:
        return PROFILES[name.lower()]
    except KeyError:
        raise ConfigError(f"unknown hardware {name!r}; choose one of b200, h200, dcu (bw1000), cpu") from None


def theta_for(hw: HardwareProfile | str, ranks: int, sizes: AttentionSizes | None = None,
              memory_fraction: float | None = None, memory_gib: float | None = None) -> Theta:
    """Theta from a profile. With `sizes`, the layout-independent dense/MoE part of a step is priced
    too (t0 reads the non-attention weights once, t_row its per-row FLOPs), so makespans are
    realistic; it never changes which layout wins."""
    hw = profile(hw) if isinstance(hw, str) else hw
    frac = hw.memory_fraction if memory_fraction is None else float(memory_fraction)
    if not 0 < frac <= 1:
        raise ConfigError(f"memory fraction must be in (0, 1], got {frac}")
    mem = (hw.memory_gib if memory_gib is None else float(memory_gib)) * GIB * frac
    if mem <= 0:
        raise ConfigError("memory per rank must be > 0")
    fp8 = sizes is not None and sizes.dtype == "fp8"
    peak = (hw.tflops_fp8 if fp8 else hw.tflops_bf16) * 1e12
    bw = hw.hbm_tb_s * 1e12 * hw.mem_eff
    t0 = hw.step_overhead_ms * 1e-3
    t_row = t_experts = expert_frac = 0.0
    if sizes is not None:
        experts = sizes.expert_bytes() / ranks
        t0 += (sizes.fixed_bytes_per_rank(ranks) - experts) / bw
        t_row = 2 * _active_params_per_row(sizes) / ranks / (peak * hw.matmul_eff)
        c = sizes.cfg
        if c.n_routed_experts:
            t_experts = experts / bw
            expert_frac = (c.num_experts_per_tok or 0) / c.n_routed_experts
    return Theta(
        ranks=ranks, memory_bytes=mem, flops_proj=peak * hw.matmul_eff,
        flops_att=hw.tflops_bf16 * 1e12 * hw.attention_eff, bw_weights=bw, bw_kv=bw,
        link_bw=hw.link_gb_s * 1e9 * hw.link_eff, latency=hw.latency_us * 1e-6, t0=t0, t_row=t_row,
        t_experts=t_experts, expert_frac=expert_frac,
        reserve_bytes=hw.reserve_gib * GIB, act_bytes=2.0, name=f"{hw.name}x{ranks}", source="profile",
        pd_link_bw=None if hw.pd_link_gb_s is None else hw.pd_link_gb_s * 1e9 * hw.link_eff,
        pd_link_lat=hw.pd_latency_us * 1e-6,
    )


def _active_params_per_row(sizes: AttentionSizes) -> float:
    """Non-attention parameters one token multiplies (dense MLP or its routed + shared experts)."""
    c = sizes.cfg
    total = 0.0
    for i in range(sizes.layers):
        if c.is_moe_layer(i):
            k = (c.num_experts_per_tok or 0) + (c.n_shared_experts or 0)
            total += k * 3 * c.hidden_size * c.moe_intermediate_size
        else:
            total += 3 * c.hidden_size * c.intermediate_size
    return total  # the LM head runs on sampled rows only; left out
