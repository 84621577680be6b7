"""The theta a deployment starts from before (or without) calibration, and how engines pick one.

`runtime_prior` is a hardware profile's theta adapted to what this runtime actually does per MLA
layer: the collectives each layout issues (TP one all-reduce; DP one all-gather; CP two all-to-alls
and an all-gather for the exact merge; DOP two all-to-alls and an all-reduce), no overlap of attention
with those collectives (they are issued and waited on in turn, so eta = 0), and activations exchanged
in the model's dtype. `load_or_default_theta` is what an engine calls for `--theta FILE`.
"""

from __future__ import annotations

import logging

from splash.config import ConfigError, ModelConfig, dtype_bytes
from splash.costmodel import Theta
from splash.layouts import LAYOUTS
from splash.sizes import AttentionSizes

log = logging.getLogger("splash.calibration")

RUNTIME_COLLECTIVES = {"TP": 1.0, "DP": 1.0, "CP": 3.0, "DOP": 3.0}
RUNTIME_ETA = {lay.label: 0.0 for lay in LAYOUTS}


def default_profile(device: str | None) -> str:
    """The hardware profile of a device type: 'cpu' for CPU ranks, 'h200' for CUDA (until calibrated)."""
    return "h200" if device is not None and str(device).startswith("cuda") else "cpu"


def runtime_prior(ranks: int, sizes: AttentionSizes, profile: str = "cpu") -> Theta:
    """`hardware.theta_for(profile)` with this runtime's collective counts, eta and activation bytes."""
    from splash.hardware import theta_for

    d = theta_for(profile, ranks, sizes).to_dict()
    d.update(collectives=dict(RUNTIME_COLLECTIVES), eta=dict(RUNTIME_ETA), act_bytes=dtype_bytes(sizes.dtype),
             source=f"profile:{profile}")
    return Theta.from_dict(d)


def load_or_default_theta(path: str | None, ranks: int, cfg: ModelConfig, dtype: str = "bf16",
                          device: str | None = None) -> tuple[Theta, str]:
    """(theta, where it came from): the calibrated file if given, else the device's profile prior.

    A file calibrated for another number of ranks is refused (its latencies and busiest-rank loads
    were fitted at that T). Either way one log line says which theta the policy runs on.
    """
    if path:
        theta = Theta.load(path)
        if theta.ranks != ranks:
            raise ConfigError(f"{path} was calibrated for {theta.ranks} ranks but the engine runs on "
                              f"{ranks}; run `splash calibrate --tp {ranks} --out {path}`")
        src = f"calibrated theta from {path}"
        log.info("layout policy: %s (%s)", src, theta.source or "unknown source")
        return theta, src
    prof = default_profile(device)
    theta = runtime_prior(ranks, AttentionSizes(cfg, dtype, dtype), prof)
    src = (f"built-in '{prof}' profile prior (uncalibrated); run `splash calibrate --tp {ranks} "
           f"--out theta.json` and pass --theta theta.json for this machine's rates")
    log.warning("layout policy: %s", src)
    return theta, src
