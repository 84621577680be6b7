"""Live switches seen from the client: which streamed deliveries waited across a layout switch.

`splash serve` reports its recent switches in `GET /get_server_info` (`switch_events`: when each was
planned into a step and when that step had run on every rank, wall clock). A delivery whose wait (the
inter-token gap before it) overlaps that interval is a token a switch held back; comparing the longest
of those with the longest gap of the whole run answers "is a live switch the worst stall?". A server
without that route (a peer) reports no switches.
"""

from __future__ import annotations

from typing import Any

import httpx


async def fetch_events(client: httpx.AsyncClient) -> list[dict[str, Any]]:
    """The server's recent switch events, [] if it does not report them."""
    try:
        r = await client.get("/get_server_info")
    except httpx.HTTPError:
        return []
    if r.status_code != 200:
        return []
    try:
        events = r.json().get("switch_events") or []
    except ValueError:
        return []
    return [e for e in events if isinstance(e, dict) and not e.get("refused") and e.get("ended")]


def switch_stalls(gaps: list[tuple[float, float]], events: list[dict[str, Any]], wall0: float
                  ) -> dict[str, Any]:
    """Each switch inside the run with the inter-token gaps that overlap its step.

    `gaps`: (end, length) in seconds of every delivery after a request's first, measured from the
    first send; `wall0`: the wall clock of the first send (events carry wall-clock times).
    """
    worst = max((g for _, g in gaps), default=0.0)
    rows: list[dict[str, Any]] = []
    for ev in events:
        a, b = float(ev["time"]) - wall0, float(ev["ended"]) - wall0
        if b < 0:
            continue  # before this load (warm-up)
        across = [g for end, g in gaps if end - g < b and end > a]
        rows.append({"t_s": round(a, 4), "src": ev.get("src"), "dst": ev.get("dst"), "cause": ev.get("cause"),
                     "step_ms": (b - a) * 1e3, "exposed_ms": float(ev.get("exposed_s", 0.0)) * 1e3,
                     "deliveries_across": len(across),
                     "max_itl_across_ms": max(across) * 1e3 if across else 0.0})
    worst_switch = max((r["max_itl_across_ms"] for r in rows), default=0.0)
    return {"switches": rows, "num_switches": len(rows), "max_itl_across_switch_ms": worst_switch,
            "switch_is_worst_stall": bool(rows) and worst_switch >= worst * 1e3}
