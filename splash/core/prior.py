"""The theta a deployment starts from before (or without) calibration, and how engines pick one.

`runtime_prior` is a hardware profile's theta adapted to what this runtime actually does per MLA
layer: the collectives each layout issues (TP one all-reduce; DP one all-gather; CP two all-to-alls
and an all-gather for the exact merge; DOP two all-to-alls and an all-reduce), no overlap of attention
with those collectives (they are issued and waited on in turn, so eta = 0), and activations exchanged
in the model's dtype. `load_or_default_theta` is what an engine calls for `--theta FILE|PROFILE`: a
calibrated file, or a profile name (`cpu`: the built-in CPU prior, rates measured on the development
VM; `h200`, `b200`, `dcu`/`bw1000`: `runtime_prior` of that hardware profile); without either it uses
`default_theta`: the CPU prior on CPU, on CUDA the H200 profile prior. Either way `--layout auto`
then corrects the prior online from the engine's own step times (splash/core/correction.py).
"""

from __future__ import annotations

import logging
import os

import numpy as np

from splash.core.layouts import LAYOUTS
from splash.core.model_config import ConfigError, ModelConfig, dtype_bytes
from splash.core.sizes import AttentionSizes
from splash.core.theta import Theta

log = logging.getLogger("splash.calibration")

RUNTIME_COLLECTIVES = {"TP": 1.0, "DP": 1.0, "CP": 3.0, "DOP": 3.0}
RUNTIME_ETA = {lay.label: 0.0 for lay in LAYOUTS}

# The built-in CPU default: per-parameter medians of three `splash calibrate --tp 2` runs (tiny model,
# float32, shared-memory data plane, batched slices, native C attention kernel and batched MoE experts,
# 32 timed steps per point, per-layout communication terms) on the 2-core development VM, 2026-12-01.
# On the fast engine a step is ~2x cheaper and the layouts lie closer together: 73% of the 33 held-out
# points (three runs) are ties within two standard errors and the two halves of the steps agree on the
# best layout at only 50-74% of the points, so this theta picks the measured best at 64% of them (8 of
# the 9 decisive ones), within 10% of the best at 94%, mean regret 3.1%, step-time rel. RMSE 25% (the
# previous default, fitted on the slower engine, made the same picks at 94% rel. RMSE: it priced every
# step about 2x too slow). Per-rank rates and latencies, so they carry over to other T roughly; t0 /
# t_row / t_experts / t_req are the tiny model's and never change which layout wins. A stated default,
# not a measurement of *this* machine: calibrate for that.
CPU_MEASURED = {"t0": 4.47e-3, "t_row": 3.64e-5, "t_experts": 9.48e-4, "inv_flops_proj": 0.0,
                "inv_bw_weights": 0.0, "inv_flops_att": 2.56e-11, "inv_bw_kv": 4.52e-10,
                "inv_link_bw": 4.15e-9, "latency": 1.88e-4, "t_seq": 0.0, "t_req": 9.6e-6}
# Each layout's collectives cost differently per call and per byte (TP's all-reduce, DP's all-gather,
# CP/DOP's all-to-alls): effective collectives per layer (TP's latency sits in t0) and link rates,
# fitted per layout in the same runs (DOP's bytes cost almost nothing beyond its latency).
CPU_MEASURED_COMM = {"collectives": {"TP": 0.0, "DP": 1.64, "CP": 3.0, "DOP": 2.68},
                     "link_bw_by_layout": {"TP": 2.58e8, "DP": 7.81e7, "CP": 2.24e8, "DOP": 1.2e9}}


def default_profile(device: str | None) -> str:
    """The hardware profile of a device type: 'cpu' for CPU ranks, 'h200' for CUDA (until calibrated)."""
    return "h200" if device is not None and str(device).startswith("cuda") else "cpu"


def runtime_prior(ranks: int, sizes: AttentionSizes, profile: str = "cpu") -> Theta:
    """`hardware.theta_for(profile)` with this runtime's collective counts, eta and activation bytes."""
    from splash.core.hardware import theta_for

    d = theta_for(profile, ranks, sizes).to_dict()
    d.update(collectives=dict(RUNTIME_COLLECTIVES), eta=dict(RUNTIME_ETA), act_bytes=dtype_bytes(sizes.dtype),
             source=f"profile:{profile}")
    return Theta.from_dict(d)


def profile_theta(name: str, ranks: int, sizes: AttentionSizes) -> Theta:
    """The prior `--theta NAME` stands for: `cpu` is the built-in CPU default (rates measured on the
    development VM), any other profile of splash/core/hardware.py its `runtime_prior`."""
    from splash.core.hardware import PROFILES

    name = name.lower()
    if name not in PROFILES:
        raise ConfigError(f"unknown hardware profile {name!r}; choose one of {', '.join(sorted(PROFILES))}")
    return default_theta(ranks, sizes, "cpu") if name == "cpu" else runtime_prior(ranks, sizes, name)


def is_profile_name(spec: str) -> bool:
    """Whether `--theta SPEC` names a hardware profile (an existing file of that name wins)."""
    from splash.core.hardware import PROFILES

    return spec.lower() in PROFILES and not os.path.exists(spec)


def load_or_default_theta(path: str | None, ranks: int, cfg: ModelConfig, dtype: str = "bf16",
                          device: str | None = None) -> tuple[Theta, str]:
    """(theta, where it came from): the calibrated file or the hardware profile `path` names if given,
    else `default_theta` for the device.

    A file calibrated for another number of ranks is refused (its latencies and busiest-rank loads
    were fitted at that T). Either way one log line says which theta the policy runs on.
    """
    if path and is_profile_name(path):
        theta = profile_theta(path, ranks, AttentionSizes(cfg, dtype, dtype))
        src = (f"profile prior '{theta.source}' (--theta {path}: not measured on this machine; corrected "
               "online from the engine's step times)")
        log.info("layout policy: %s", src)
        return theta, src
    if path:
        if not os.path.exists(path):
            from splash.core.hardware import PROFILES

            raise ConfigError(f"--theta {path!r} is neither a theta file nor a hardware profile; pass a file "
                              f"written by `splash calibrate --tp {ranks} --out FILE` or one of "
                              f"{', '.join(sorted(PROFILES))}")
        theta = Theta.load(path)
        if theta.ranks != ranks:
            raise ConfigError(f"{path} was calibrated for {theta.ranks} ranks but the engine runs on "
                              f"{ranks}; run `splash calibrate --tp {ranks} --out {path}`")
        src = f"calibrated theta from {path}"
        log.info("layout policy: %s (%s)", src, theta.source or "unknown source")
        return theta, src
    theta = default_theta(ranks, AttentionSizes(cfg, dtype, dtype), device)
    src = (f"built-in default theta '{theta.source}' (not measured on this machine); run `splash calibrate "
           f"--tp {ranks} --out theta.json` and pass --theta theta.json for this deployment's rates")
    log.warning("layout policy: %s", src)
    return theta, src


def default_theta(ranks: int, sizes: AttentionSizes, device: str | None = None) -> Theta:
    """CPU: the profile prior carrying CPU_MEASURED; CUDA: the H200 profile prior (no GPU calibration
    has been run yet)."""
    from splash.core.features import FIT_PARAMS, with_params

    prof = default_profile(device)
    prior = runtime_prior(ranks, sizes, prof)
    if prof != "cpu":
        return prior
    theta = with_params(prior, np.array([CPU_MEASURED[k] for k in FIT_PARAMS]))
    d = theta.to_dict()
    d.update(CPU_MEASURED_COMM, source="cpu-measured-default", name=f"cpu-default-x{ranks}")
    return Theta.from_dict(d)
