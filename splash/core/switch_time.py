"""Eq 7: the exposed part of a layer-wise overlapped switch, from per-layer transfer times (bytes over the
link plus a latency per collective) and the destination's per-layer compute (splash/core/costmodel.py)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from splash.core.costmodel import StepCost
from splash.core.model_config import ConfigError
from splash.core.theta import Theta


def exposed_switch_time(xfer: Sequence[float], comp: Sequence[float]) -> float:
    """t_exposed = t_xfer_1 + sum_{i>=2} max(0, t_xfer_i - t_comp_{i-1}) (one layer in transit)."""
    x = [float(v) for v in xfer]
    c = [float(v) for v in comp]
    if not x:
        return 0.0
    if len(c) < len(x) - 1:
        raise ConfigError(f"need compute times for {len(x) - 1} layers, got {len(c)}")
    return x[0] + sum(max(0.0, x[i] - c[i - 1]) for i in range(1, len(x)))


def layer_transfer_times(weight_bytes: np.ndarray, kv_bytes: np.ndarray, layers: int,
                         theta: Theta) -> list[float]:
    """Per-layer transfer time of a switch: busiest rank's bytes / link + one latency per collective.

    `kv_bytes` is one layer's per-rank KV ([T], every layer alike) or each layer's ([layers, T]: a DSA
    model's indexer layers carry their indexer keys, GLM-5's shared layers none, a hybrid's KDA layers
    their per-request states instead). `weight_bytes` likewise: [T] every layer alike, or [layers, T]
    (a hybrid's KDA layers move KDA projections; `transfer.switch_layer_bytes` gives both)."""
    w_b = np.asarray(weight_bytes, dtype=float)
    w = w_b.max(axis=-1, initial=0) if w_b.ndim == 2 else np.full(layers, w_b.max(initial=0))
    kv_b = np.asarray(kv_bytes, dtype=float)
    per_layer = kv_b.max(axis=-1, initial=0) if kv_b.ndim == 2 else np.full(layers, kv_b.max(initial=0))
    if len(per_layer) != layers or len(w) != layers:
        raise ConfigError(f"need KV and weight bytes for {layers} layers, got {len(per_layer)} and {len(w)}")
    n_coll = (w > 0).astype(float) + (per_layer > 0)  # nothing to move, nothing to pay
    return ((w + per_layer) / theta.link_bw + n_coll * theta.latency).tolist()


def switch_time(weight_bytes: np.ndarray, kv_bytes: np.ndarray, dst_cost: StepCost,
                theta: Theta) -> tuple[float, float]:
    """(exposed, blocking) seconds of a switch whose destination step costs `dst_cost` (`kv_bytes`: see
    `layer_transfer_times`)."""
    xfer = layer_transfer_times(weight_bytes, kv_bytes, dst_cost.layers, theta)
    comp = [dst_cost.per_layer] * dst_cost.layers
    return exposed_switch_time(xfer, comp), float(sum(xfer))
