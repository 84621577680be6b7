"""Every rank's side of prefill/decode disaggregation: its own transfer engine over its own pools.

With T ranks a side's KV lives on T ranks (where the layout puts it), so each rank registers its pools
with its own Mooncake transfer engine and writes its part itself: rank 0 (splash/engine/stages/pd.py)
turns the core's transfer manifest into per-rank writes and sends them as one "pd" control plan; every
rank runs its share (`rank_pd`) and the replies are gathered. T = 1 calls `rank_pd` directly.

Ops (`PDOp.kind`): "info" -> this rank's `layout_info` (what the handshake publishes); "write" -> its
writes run, {"bytes", "seconds", "pieces", "error"}; "close" -> its transfer engine stopped (memory release).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from splash.disagg.transfer import KVTransfer, TransferError


@dataclass
class PDOp:
    """One control message of the PD transfer for every rank: `writes[r]` are rank r's writes (each a
    dict: peer (the destination rank's layout info), src, dst (page ids), src_slot, dst_slot, heads)."""

    kind: str
    identity: dict[str, Any] = field(default_factory=dict)
    writes: list[list[dict[str, Any]]] = field(default_factory=list)


def rank_transfer(runner: Any, identity: dict[str, Any]) -> KVTransfer:
    """This rank's transfer engine (started on first use, its pools registered; one per rank)."""
    xfer = getattr(runner, "pd_transfer", None)
    if xfer is None:
        xfer = KVTransfer(runner.pool, getattr(runner, "state", None), identity)
        runner.pd_transfer = xfer
    return xfer


def rank_pd(runner: Any, rank: int, op: PDOp) -> dict[str, Any]:
    """Run this rank's share of `op`; the reply rank 0 gathers (errors as text, never raised: one rank's
    failed write fails the requests it carried, not the rank)."""
    if op.kind == "close":
        xfer = getattr(runner, "pd_transfer", None)
        if xfer is not None:
            xfer.close()
            xfer.engine = None
            runner.pd_transfer = None
        return {"ok": True}
    try:
        xfer = rank_transfer(runner, op.identity)
    except Exception as e:  # noqa: BLE001 - reported to rank 0 with this rank's number
        return {"error": f"rank {rank}: {e}"}
    if op.kind == "info":
        return xfer.layout_info()
    if op.kind != "write":
        return {"error": f"rank {rank}: unknown PD op {op.kind!r}"}
    mine = op.writes[rank] if rank < len(op.writes) else []
    out: dict[str, Any] = {"bytes": [], "seconds": 0.0, "pieces": 0, "error": [None] * len(mine)}
    for i, w in enumerate(mine):
        try:
            n, secs, pieces = xfer.write(w["peer"], w["src"], w["dst"], int(w.get("src_slot", -1)),
                                         int(w.get("dst_slot", -1)), w.get("heads"))
        except TransferError as e:
            out["error"][i] = f"rank {rank}: {e}"
            n, secs, pieces = 0, 0.0, 0
        except Exception as e:  # noqa: BLE001 - a malformed write fails its request only
            out["error"][i] = f"rank {rank}: the KV write failed: {type(e).__name__}: {e}"
            n, secs, pieces = 0, 0.0, 0
        out["bytes"].append(n)
        out["seconds"] += secs
        out["pieces"] += pieces
    return out


def on_pd_plan(state: Any, plan: Any) -> None:
    """Worker handler of kind "pd"."""
    reply = rank_pd(state.runner, state.grid.rank, plan.payload)
    state.grid.comm.all_gather_object(reply)
