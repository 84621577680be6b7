"""How the fixed (layout-independent) parallelism outside attention splits a dimension over T ranks.

Dense MLP and shared experts split their intermediate size, routed experts split either the expert
count (expert-parallel) or every expert's intermediate size (tensor-parallel), and the vocabulary is
split by rows. All splits are contiguous, so each rank's share is one `get_slice` read per tensor.
"""

from __future__ import annotations

from splash.core.model_config import ConfigError

MOE_MODES = ("auto", "ep", "tp")


def even_range(n: int, rank: int, world: int) -> range:
    """Rank `rank`'s contiguous share of `n` items: sizes differ by at most one, larger ones first."""
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside a world of {world}")
    base, extra = divmod(n, world)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (rank < extra))


def span(r: range, n: int) -> tuple[int, int] | None:
    """A loader span for range `r` of `n` items; None when `r` is all of them (a plain full read)."""
    return None if (r.start, r.stop) == (0, n) else (r.start, r.stop)


def moe_mode(mode: str, n_experts: int, world: int) -> str:
    """Resolve the routed experts' parallelism: "ep" (each rank holds E/T whole experts) when T
    divides E, else "tp" (every rank holds a 1/T slice of every expert's intermediate size).

    Expert parallelism keeps each expert's GEMMs whole (better for real batches); the tensor-parallel
    fallback works for any rank count, at the cost of thinner GEMMs."""
    if mode not in MOE_MODES:
        raise ConfigError(f"expert parallelism {mode!r} is unknown; choose one of {', '.join(MOE_MODES)}")
    if mode == "auto":
        return "ep" if n_experts % world == 0 else "tp"
    if mode == "ep" and n_experts % world:
        raise ConfigError(f"{n_experts} routed experts cannot be split evenly over {world} ranks for expert "
                          f"parallelism; use expert_parallel='tp' (or 'auto') or a rank count dividing "
                          f"{n_experts}")
    return mode
