"""Eq 10 as a linear function of theta, for calibration: step_cost(...).total == step_features(...) @
theta_params(theta), with the max() branches, the busiest rank and the [.]+ of exposed communication
fixed by `theta`. Least squares on measured step times then fits these parameters (all >= 0) for the
branches the data sit in (splash/calibration/fit.py)."""

from __future__ import annotations

import numpy as np

from splash.core.costmodel import Batch, LayerLoads, active_requests, kinds_loads
from splash.core.layouts import Layout
from splash.core.model_config import ConfigError
from splash.core.sizes import AttentionSizes
from splash.core.theta import Theta

FIT_PARAMS = ("t0", "t_row", "t_experts", "inv_flops_proj", "inv_bw_weights", "inv_flops_att",
              "inv_bw_kv", "inv_link_bw", "latency", "t_seq", "t_req")


def theta_params(theta: Theta) -> np.ndarray:
    """Theta's linear parameters in FIT_PARAMS order (rates inverted: seconds per FLOP or byte)."""
    return np.array([theta.t0, theta.t_row, theta.t_experts, 1 / theta.flops_proj, 1 / theta.bw_weights,
                     1 / theta.flops_att, 1 / theta.bw_kv, 1 / theta.link_bw, theta.latency, theta.t_seq,
                     theta.t_req])


def with_params(theta: Theta, params: np.ndarray, max_rate: float = 1e30) -> Theta:
    """A copy of `theta` carrying `params` (FIT_PARAMS order); a zero inverse rate becomes `max_rate`."""
    p = np.maximum(np.asarray(params, dtype=float), 0.0)
    if p.shape != (len(FIT_PARAMS),):
        raise ConfigError(f"expected {len(FIT_PARAMS)} parameters, got shape {p.shape}")

    def rate(v: float) -> float:
        return min(max_rate, 1 / v) if v > 0 else max_rate

    d = theta.to_dict()
    d.update(t0=p[0], t_row=p[1], t_experts=p[2], flops_proj=rate(p[3]), bw_weights=rate(p[4]),
             flops_att=rate(p[5]), bw_kv=rate(p[6]), link_bw=rate(p[7]), latency=p[8], t_seq=p[9],
             t_req=p[10])
    return Theta.from_dict({k: (float(v) if isinstance(v, np.floating) else v) for k, v in d.items()})


def _roofline(att: np.ndarray, flops: float, nbytes: float, theta: Theta) -> None:
    """Add one roofline's active branch to a feature row (FLOPs at 1/Phi_att, or bytes at 1/beta_KV)."""
    if flops / theta.flops_att >= nbytes / theta.bw_kv:
        att[5] += flops
    else:
        att[6] += nbytes


def _layer_features(layout: Layout, ld: LayerLoads, theta: Theta, b: int, t_att: float) -> np.ndarray:
    """One layer's part of `step_features` on busiest rank `b` (whose t_att is `t_att`)."""
    x = np.zeros(len(FIT_PARAMS))
    if ld.f_proj[b] / theta.flops_proj >= ld.w_read[b] / theta.bw_weights:
        x[3] += ld.f_proj[b]
    else:
        x[4] += ld.w_read[b]
    att = np.zeros(len(FIT_PARAMS))  # t_att of the busiest rank
    _roofline(att, ld.f_att[b], ld.kv_read[b], theta)
    if ld.f_index is not None and ld.index_read is not None:
        _roofline(att, ld.f_index[b], ld.index_read[b], theta)
    att[9] = ld.slices[b]
    x += att
    x[8] += ld.collectives
    eta = theta.eta_of(layout)
    if ld.comm_bytes / theta.link_bw_of(layout) - eta * t_att > 0:
        x[7] += ld.comm_bytes * theta.link_bw / theta.link_bw_of(layout)  # in units of 1 / link_bw
        x -= eta * att
    return x


def step_features(layout: Layout, sizes: AttentionSizes, batch: Batch, theta: Theta,
                  page_size: int | None = None) -> np.ndarray:
    """x with step_cost(layout, ...).total == x @ theta_params(theta), branches chosen by `theta`."""
    kinds, b = kinds_loads(layout, sizes, batch, theta, page_size)
    x = np.zeros(len(FIT_PARAMS))
    rows = batch.n_rows
    x[0] = 1.0
    x[1] = rows
    x[2] = 1.0 - (1.0 - theta.expert_frac) ** rows if rows > 0 else 0.0
    x[10] = active_requests(batch)
    for n, ld, times in kinds:
        x += n * _layer_features(layout, ld, theta, b, float(times[1][b]))
    return x
