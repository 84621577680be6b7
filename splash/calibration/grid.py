"""The (B, s, q) points a calibration times, and which of them are held out for the fidelity check.

B running requests, s context per request *after* this step (the cost model's convention: s counts
this step's rows), q query rows per request this step (1 = decode, > 1 = a prefill chunk). Grids are
designed, not full products: they span the regimes where different layouts win (few long requests,
many short ones, decode vs chunked prefill) while keeping every step short enough to time on CPU.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from splash.core.costmodel import Batch
from splash.core.model_config import ConfigError


@dataclass(frozen=True, order=True)
class GridPoint:
    B: int  # running requests
    s: int  # context per request after this step
    q: int  # query rows per request this step

    def __post_init__(self) -> None:
        if self.B < 1 or self.q < 1 or self.s < self.q:
            raise ConfigError(f"grid point B={self.B} s={self.s} q={self.q}: need B >= 1 and 1 <= q <= s")

    @property
    def rows(self) -> int:
        return self.B * self.q

    @property
    def tokens(self) -> int:
        return self.B * self.s

    def batch(self, ranks: int) -> Batch:
        """The policy's x for this point, owners round-robin as the engine's admission balances them."""
        return Batch.balanced(self.B, self.s, self.q, ranks)

    def label(self) -> str:
        return f"B={self.B} s={self.s} q={self.q}"

    def to_dict(self) -> dict[str, int]:
        return {"B": self.B, "s": self.s, "q": self.q}


def _product(bs: Iterable[int], ss: Iterable[int], qs: Iterable[int], max_rows: int,
             max_tokens: int) -> list[GridPoint]:
    return [GridPoint(b, s, q) for b in bs for s in ss for q in qs
            if q <= s and b * q <= max_rows and b * s <= max_tokens]


def default_grid() -> list[GridPoint]:
    """~40 points: decode over B x s, chunked prefill over a few (B, q), one long single prefill."""
    pts = _product((1, 2, 4, 8, 16, 32, 64), (64, 512, 2048), (1,), 64, 64 * 1024)
    pts += _product((1, 4, 16), (128, 1024), (32,), 512, 32 * 1024)
    pts += _product((1, 2), (256, 2048), (256,), 512, 2 * 1024)
    pts += [GridPoint(64, 256, 1), GridPoint(8, 1024, 1), GridPoint(2, 1024, 64), GridPoint(8, 256, 16),
            GridPoint(2, 1024, 128)]
    return sorted(set(pts))


def quick_grid() -> list[GridPoint]:
    """12 cheap points spanning the same regimes (a calibration in about a minute at T = 2)."""
    return sorted({GridPoint(1, 64, 1), GridPoint(4, 512, 1), GridPoint(16, 64, 1), GridPoint(32, 256, 1),
                   GridPoint(64, 64, 1), GridPoint(2, 2048, 1), GridPoint(8, 1024, 1),
                   GridPoint(1, 512, 128), GridPoint(4, 256, 32), GridPoint(1, 1024, 256),
                   GridPoint(16, 128, 8), GridPoint(2, 128, 64)})


def parse_points(text: str) -> list[GridPoint]:
    """'B:s:q,B:s:q,...' -> points (for small custom grids, e.g. tests)."""
    out = []
    for item in text.replace(" ", "").split(","):
        if not item:
            continue
        try:
            b, s, q = (int(v) for v in item.split(":"))
        except ValueError:
            raise ConfigError(f"grid point {item!r}: write B:s:q with integers, e.g. 8:512:1") from None
        out.append(GridPoint(b, s, q))
    if not out:
        raise ConfigError("the grid is empty; give points as B:s:q,B:s:q")
    return sorted(set(out))


def split_holdout(points: Sequence[GridPoint], every: int = 3) -> tuple[list[GridPoint], list[GridPoint]]:
    """(train, held out): every `every`-th point of the sorted grid is held out, starting at the second,
    so both halves span the grid. With fewer than 2 points nothing can be held out."""
    pts = sorted(points)
    if every < 2:
        raise ConfigError(f"hold out every k-th point needs k >= 2, got {every}")
    held = [p for i, p in enumerate(pts) if i % every == 1] if len(pts) >= 2 else []
    train = [p for p in pts if p not in held]
    return train, held
