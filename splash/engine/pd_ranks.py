"""One PD side's T ranks seen from rank 0: their transfer engines, the layout they publish, and a
request's transfer as per-rank writes planned by the core (`splash.core.pd.plan_pd`).

The transfer is a switch between two groups: the prefill side holds a request in its layout a on T_p
ranks, the decode side needs it in its layout b on T_d ranks; the core's manifest says which prefill rank
sends which page (every per-token store of it) and which heads of the per-request state to which decode
rank, each block once over the link; a destination that replicates (TP pages, CP's KDA state) completes
its copies inside its own group (`fill`). This module only turns the manifest's global page ids and head
ids into each rank's local ones (the page tables `pages[r][j]`, `stores.state_share`) and runs them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

from splash.core import stores as core_stores
from splash.core.layouts import Layout
from splash.core.pd import Group, PageMove, PDManifest, StateMove, plan_pd
from splash.step.plan import control_plan
from splash.worker.pd import PDOp, rank_pd, rank_transfer


class PDRanks:
    """Rank 0's handle on its side's ranks for the PD transfer (one per engine)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        spec = engine.spec
        model = json.dumps(dataclasses.asdict(spec.model), sort_keys=True, default=str)
        self.identity = {"checkpoint": hashlib.sha256(model.encode()).hexdigest()[:16],
                         "model": spec.model_name, "dtype": str(spec.dtype).removeprefix("torch."),
                         "kv_format": spec.kv_format, "page_size": spec.page_size}
        self._state_stores = {s.name: s for s in core_stores.request_stores(spec.model)}
        self.used = False  # any rank's transfer engine started (closing then has something to stop)

    # ---- the ranks --------------------------------------------------------------------------------
    def run(self, op: PDOp) -> list[dict[str, Any]]:
        """`op` on every rank of this side (rank 0's share here); each rank's reply, in rank order."""
        runner = self.engine.runner
        self.used = self.used or op.kind != "close"
        group = getattr(runner, "group", None)
        if group is None:
            return [rank_pd(runner, 0, op)]

        def go() -> list[dict[str, Any]]:
            group.send(control_plan("pd", layout=self.engine.allocator.layout, payload=op))
            return group.gather(rank_pd(runner.local, 0, op))

        return group.guarded(go)  # type: ignore[no-any-return]

    def local(self) -> Any:
        """Rank 0's own transfer engine (the handshake's checks)."""
        runner = self.engine.runner
        return rank_transfer(getattr(runner, "local", runner), self.identity)

    def start(self) -> None:
        """Every rank's transfer engine started (a bad install fails at startup, not at the first request)."""
        self.layout_info()

    def layout_info(self) -> dict[str, Any]:
        """What the handshake publishes: rank 0's memory and identity at the top level, this side's live
        layout and size, and every rank's own info (`ranks`)."""
        infos = self.run(PDOp("info", self.identity))
        bad = next((i for i in infos if "error" in i), None)
        if bad is not None:
            raise RuntimeError("prefill/decode disaggregation cannot start its transfer engine: "
                               f"{bad['error']}")
        return {**infos[0], "layout": self.engine.allocator.layout, "world": len(infos), "ranks": infos}

    def close(self) -> None:
        """Stop every rank's transfer engine (its memory is about to be released)."""
        if self.used:
            self.run(PDOp("close"))
            self.used = False

    # ---- a request's transfer ---------------------------------------------------------------------
    def manifest(self, src: Group, dst: Group, context: int) -> PDManifest:
        spec = self.engine.spec
        return plan_pd(spec.model, src, dst, context, spec.page_size, kv_format=spec.kv_format,
                       dtype=str(spec.dtype).removeprefix("torch."))

    def group(self, owner: int) -> Group:
        """This side's layout and size now, for a request owned by `owner`."""
        return Group(Layout.named(self.engine.allocator.layout), self.engine.world, int(owner))

    def writes(self, pages: tuple[PageMove, ...], states: tuple[StateMove, ...], src: Group,
               src_table: list[list[int]], src_slot: int, dst: Group, dst_table: list[list[int]],
               dst_slot: int, peers: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
        """Per source rank, its writes (one per destination rank it sends to): the moves' global pages
        and heads in each side's local page ids and local heads."""
        per: dict[tuple[int, int], dict[str, Any]] = {}

        def entry(s: int, d: int) -> dict[str, Any]:
            if (s, d) not in per:
                per[(s, d)] = {"peer": peers[d], "src": [], "dst": [], "src_slot": -1, "dst_slot": -1,
                               "heads": []}
            return per[(s, d)]

        for m in pages:
            a, b = src_table[m.src][m.page], dst_table[m.dst][m.page]
            if a < 0 or b < 0:
                raise ValueError(f"page {m.page}: rank {m.src} holds {a}, rank {m.dst} reserved {b}: the "
                                 "manifest and the page tables disagree")
            e = entry(m.src, m.dst)
            e["src"].append(a)
            e["dst"].append(b)
        for m in states:
            store = self._state_stores[m.store]
            mine = core_stores.state_share(store, src.layout, m.src, src.ranks, src.owner)
            theirs = core_stores.state_share(store, dst.layout, m.dst, dst.ranks, dst.owner)
            if mine is None or theirs is None:
                raise ValueError(f"{m.store} heads {m.h0}..{m.h1}: rank {m.src} -> {m.dst} hold none")
            e = entry(m.src, m.dst)
            e["src_slot"], e["dst_slot"] = src_slot, dst_slot
            e["heads"].append((m.store, m.h0 - mine.start, m.h0 - theirs.start, m.h1 - m.h0))
        out: list[list[dict[str, Any]]] = [[] for _ in range(src.ranks)]
        for (s, _), e in sorted(per.items()):
            out[s].append(e)
        return out

    def send(self, writes: list[list[dict[str, Any]]]) -> tuple[int, float, int, str | None]:
        """Run the writes on every rank; -> (bytes moved, the slowest rank's seconds, pieces written over
        every rank, first error)."""
        if not any(writes):
            return 0, 0.0, 0, None
        replies = self.run(PDOp("write", self.identity, writes))
        nbytes = sum(sum(r.get("bytes", ())) for r in replies)
        secs = max((float(r.get("seconds", 0.0)) for r in replies), default=0.0)
        errs = [e for r in replies for e in ([r["error"]] if isinstance(r.get("error"), str)
                                             else r.get("error") or ()) if e]
        pieces = sum(int(r.get("pieces", 0)) for r in replies)
        return nbytes, secs, pieces, errs[0] if errs else None
