"""Theta: the rates, latencies and budgets Eq 10 prices a step with (splash/core/costmodel.py), per
layout where they differ, saved and loaded as JSON (what `splash calibrate` fits and `--theta` reads)."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from splash.core.layouts import LAYOUTS, Layout
from splash.core.model_config import ConfigError

# Collectives per attention layer (each pays the latency delta once): TP all-reduce after O;
# DP all-gather of owners' rows; CP exact LSE merge; DOP forward + reverse all-to-all + all-reduce.
COLLECTIVES = {Layout.TP: 1, Layout.DP: 1, Layout.CP: 1, Layout.DOP: 3}
DEFAULT_ETA = {"TP": 0.0, "DP": 0.0, "CP": 0.5, "DOP": 0.5}


@dataclass
class Theta:
    """Deployment parameters of pi(x; theta): rates, latencies and the memory budget per rank."""

    ranks: int
    memory_bytes: float  # H_r: device memory usable per rank
    flops_proj: float  # Phi_proj, FLOP/s for the projections
    flops_att: float  # Phi_att, FLOP/s for attention
    bw_weights: float  # beta_W, bytes/s reading projection weights
    bw_kv: float  # beta_KV, bytes/s reading latent KV
    link_bw: float  # bytes/s one rank receives in a collective
    latency: float  # delta: seconds per collective
    t0: float = 0.0  # seconds per step outside the attention stages
    t_row: float = 0.0  # seconds per query row outside attention (dense / MoE), layout-independent
    t_experts: float = 0.0  # seconds to stream all of a rank's expert weights once
    expert_frac: float = 0.0  # share of experts one token routes to (top-k / E): N rows touch
    #                           1 - (1 - expert_frac)^N of them, so small batches read few experts
    eta: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_ETA))
    reserve_bytes: float = 0.0  # R_r: transient reserve kept free
    act_bytes: float = 2.0  # bytes per activation element exchanged
    name: str = ""
    source: str = "profile"
    t_seq: float = 0.0  # seconds per request a rank attends, per layer (per-slice launch/gather cost;
    #                     0 in the paper's profiles, measured by `splash calibrate` on this runtime)
    collectives: dict[str, float] | None = None  # collectives per attention layer, per layout
    #                     (None: COLLECTIVES; calibration fits them as effective counts in `latency` units,
    #                     since an all-to-all and an all-reduce do not cost one latency alike)
    t_req: float = 0.0  # seconds per request with rows this step, outside attention and layout-independent
    #                     (per-request step work: positions, page tables, sampling; 0 in the paper's
    #                     profiles, measured by `splash calibrate` on this runtime)
    link_bw_by_layout: dict[str, float] | None = None  # bytes/s of each layout's collectives (None:
    #                     link_bw for all; calibration fits one per layout: all-reduce, all-gather and
    #                     all-to-all move their bytes at different rates)
    pd_link_bw: float | None = None  # bytes/s one rank's link moves between a prefill and a decode group
    #                     (a disaggregated deployment's KV transfer; None: link_bw, the collectives' rate)
    pd_link_lat: float = 0.0  # seconds per prefill-to-decode transfer (handshake, submission, completion)

    def __post_init__(self) -> None:
        if int(self.ranks) < 1:
            raise ConfigError(f"theta: ranks must be >= 1, got {self.ranks}")
        self.ranks = int(self.ranks)
        for f in ("memory_bytes", "flops_proj", "flops_att", "bw_weights", "bw_kv", "link_bw"):
            if not float(getattr(self, f)) > 0:
                raise ConfigError(f"theta: {f} must be > 0, got {getattr(self, f)}")
        if not 0 <= float(self.expert_frac) <= 1:
            raise ConfigError(f"theta: expert_frac must be in [0, 1], got {self.expert_frac}")
        for f in ("latency", "t0", "t_row", "t_experts", "reserve_bytes", "t_req", "pd_link_lat"):
            if float(getattr(self, f)) < 0:
                raise ConfigError(f"theta: {f} must be >= 0, got {getattr(self, f)}")
        eta = {Layout.parse(k).label: float(v) for k, v in dict(self.eta).items()}
        for k, v in eta.items():
            if not 0 <= v <= 1:
                raise ConfigError(f"theta: eta[{k}] must be in [0, 1], got {v}")
        self.eta = {lay.label: eta.get(lay.label, DEFAULT_ETA[lay.label]) for lay in LAYOUTS}
        if float(self.t_seq) < 0:
            raise ConfigError(f"theta: t_seq must be >= 0, got {self.t_seq}")
        if self.collectives is not None:
            coll = {Layout.parse(k).label: float(v) for k, v in dict(self.collectives).items()}
            if any(v < 0 for v in coll.values()):
                raise ConfigError(f"theta: collectives must be >= 0, got {coll}")
            self.collectives = {lay.label: coll.get(lay.label, float(COLLECTIVES[lay])) for lay in LAYOUTS}
        if self.link_bw_by_layout is not None:
            bw = {Layout.parse(k).label: float(v) for k, v in dict(self.link_bw_by_layout).items()}
            if not all(v > 0 for v in bw.values()):
                raise ConfigError(f"theta: link_bw_by_layout must be > 0, got {bw}")
            self.link_bw_by_layout = {lay.label: bw.get(lay.label, float(self.link_bw)) for lay in LAYOUTS}
        if self.pd_link_bw is not None:
            if not float(self.pd_link_bw) > 0:
                raise ConfigError(f"theta: pd_link_bw must be > 0 (or null: link_bw), got {self.pd_link_bw}")
            self.pd_link_bw = float(self.pd_link_bw)

    def eta_of(self, layout: Layout) -> float:
        return self.eta[layout.label]

    def collectives_of(self, layout: Layout) -> float:
        """Collectives one attention layer of `layout` issues (each pays the latency delta once)."""
        return COLLECTIVES[layout] if self.collectives is None else self.collectives[layout.label]

    def link_bw_of(self, layout: Layout) -> float:
        """Bytes/s the collectives of `layout` move (link_bw unless calibrated per layout)."""
        return self.link_bw if self.link_bw_by_layout is None else self.link_bw_by_layout[layout.label]

    @property
    def pd_bw(self) -> float:
        """Bytes/s of one rank's link between the prefill and the decode group (link_bw unless given)."""
        return self.link_bw if self.pd_link_bw is None else self.pd_link_bw

    # -- JSON --------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Theta:
        if not isinstance(d, dict):
            raise ConfigError("theta JSON must be an object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"theta JSON has unknown field(s): {', '.join(unknown)}")
        try:
            return cls(**d)
        except TypeError as e:
            raise ConfigError(f"theta JSON is incomplete: {e}") from None

    def save(self, path: str | os.PathLike[str]) -> None:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f, indent=2, sort_keys=True)
            f.write("\n")

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Theta:
        try:
            with open(path, encoding="utf-8") as f:
                d = json.load(f)
        except FileNotFoundError:
            raise ConfigError(f"no theta file at {path!r}; write one with `splash calibrate --out FILE` "
                              "(plan and simulate can use a built-in profile instead: --gpu)") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{path} is not a theta JSON file: {e}") from None
        return cls.from_dict(d)
