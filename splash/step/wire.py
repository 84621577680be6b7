"""The step message on the wire: a compact binary of what changed, not every rank's full page tables.

Rank 0 used to pickle the whole `StepPlan` every step, every slice carrying every rank's table: at B=32,
~900-token contexts and T=4 a decode step's message was 23 KB (TP) to 35 KB (DP), growing with ranks x
context. Now every rank keeps its own tables (`RankTables`) and rank 0's `PlanEncoder` sends per step:

- per slice: req_id (int64), start (int32), owner (uint8), and num_new / sample only when some slice
  is not a one-row sampled decode (a flag says they are omitted); a KDA model's state slot (int32)
  when any slice has one (a flag says so);
- input_ids (int32);
- the requests ranks must forget (finished, aborted, preempted since the last message; int64);
- for the slices whose table grew: the slice index, how many pages, and the new local page ids of
  every rank ([T, n] int32, -1 where a rank does not hold the page);
- after a layout switch only: every live request's whole new table, once ([T, n] int32).

A decode step is ~13 bytes per request plus a 40-byte header, and a new page (every page_size steps
per request) 4T bytes more. Arrays are laid out by item size (int64, then int32, then uint8) so each
is aligned. A message is the `bytes` alone for a forward step, or `(bytes, kind, payload)` for another
step kind (a switch carries its SwitchPlan). Rank 0 decodes its own message too, so every rank -
rank 0 and T = 1 included - runs the same path. Control messages (load, stats, ...) stay pickled
StepPlans.
"""

from __future__ import annotations

import pickle
import struct
from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np

from splash.step.plan import LAYOUTS, STEP_KINDS, SeqSlice, StepPlan
from splash.step.tables import RankTables

VERSION = 1
_HEAD = struct.Struct("<BBBBHxxq")  # version, kind, layout, flags, world, (pad), step
_COUNTS = struct.Struct("<IIIIII")  # slices B, rows N, drops, grown slices, new pages, replaced tables
_HEADER = _HEAD.size + _COUNTS.size  # 40: the arrays that follow start 8-aligned
_ONE_ROW = 1  # flag: every slice has num_new == 1 (the num_new array is omitted)
_ALL_SAMPLE = 2  # flag: every slice samples (the sample array is omitted)
_SLOTS = 4  # flag: the slices carry state slots (KDA models; else the slot array is omitted, slots -1)
_SNAP = 8  # flag: some slices are speculative with state slots (a uint8 array says which: snapshot them)


@dataclass
class TableDelta:
    """The table updates one message carries; `apply` takes a rank's share into its RankTables."""

    drops: np.ndarray  # int64 [d]
    grow_ids: np.ndarray  # int64 [g]: requests whose tables grew ...
    grow_count: np.ndarray  # int32 [g]: ... by this many pages ...
    grow_pages: np.ndarray  # int32 [T, sum(grow_count)]: ... with these local ids per rank
    rep_ids: np.ndarray  # int64 [r]: requests whose tables are replaced (a switch) ...
    rep_len: np.ndarray  # int32 [r]
    rep_pages: np.ndarray  # int32 [T, sum(rep_len)]

    def apply(self, tables: RankTables, rank: int) -> None:
        """Drops first, then replaced tables, then growth (the order rank 0 encoded them in)."""
        if len(self.drops):
            tables.drop(self.drops.tolist())
        for ids, counts, pages, put in ((self.rep_ids, self.rep_len, self.rep_pages, tables.replace),
                                        (self.grow_ids, self.grow_count, self.grow_pages, tables.append)):
            if not len(ids):
                continue
            row, off = pages[rank], 0
            for rid, n in zip(ids.tolist(), counts.tolist()):
                put(rid, row[off:off + n])
                off += n


class PlanEncoder:
    """Rank 0's side: turns scheduled StepPlans (full tables) into messages, remembering how many pages
    of each request the ranks already hold (`known`), so each page id travels once."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.known: dict[int, int] = {}  # req_id -> pages of its table every rank holds
        self.decode_sizes: Counter[int] = Counter()  # message bytes of forward steps without prefill rows
        self.last_size = 0

    def encode(self, plan: StepPlan) -> bytes | tuple[bytes, str, Any]:
        # `known` changes only once the message is built: a plan that fails to encode leaves it as the
        # ranks have it (the engine re-sends its drops with the next plan).
        T, known = self.world, self.known
        seqs = plan.seqs
        drops = [r for r in dict.fromkeys(plan.dropped) if r in known]
        gone = set(drops)
        now: dict[int, int] = {}  # req_id -> pages the ranks will hold after this message
        rep_ids: list[int] = []
        rep: list[np.ndarray] = []
        if plan.tables is not None:  # a switch: every live request's new table, once
            keep = plan.tables
            stale = [r for r in known if r not in keep and r not in gone]
            gone.update(stale)
            drops += stale
            for rid, tbl in keep.items():
                a = np.asarray(tbl, dtype=np.int32).reshape(T, -1)
                rep_ids.append(rid)
                rep.append(a)
                now[rid] = a.shape[1]
        grow_idx: list[int] = []
        grow: list[np.ndarray] = []
        for k, s in enumerate(seqs):
            pages = s.pages
            if len(pages) != T:
                raise ValueError(f"slice of request {s.req_id}: page tables for {len(pages)} ranks, "
                                 f"expected {T}")
            have = now.get(s.req_id, 0 if s.req_id in gone else known.get(s.req_id, 0))
            n = len(pages[0])
            if n < have and s.req_id not in now:  # its tail was returned (speculative rows rejected):
                drops.append(s.req_id)  # the ranks drop the table and take it whole again below
                gone.add(s.req_id)
                have = 0
            if n > have:
                grow_idx.append(k)
                grow.append(np.asarray([row[have:] for row in pages], dtype=np.int32).reshape(T, n - have))
                now[s.req_id] = n
            elif n < have:
                raise RuntimeError(f"request {s.req_id}: its table shrank from {have} to {n} pages in a "
                                   "switch step (scheduler bookkeeping bug)")
        B, N = len(seqs), len(plan.input_ids)
        one_row = N == B and all(s.num_new == 1 for s in seqs)
        all_sample = all(s.sample for s in seqs)
        slots = any(s.slot >= 0 for s in seqs)
        ns = plan.num_sample
        snap = slots and ns is not None and any(n > 1 for n in ns)
        flags = ((_ONE_ROW if one_row else 0) | (_ALL_SAMPLE if all_sample else 0) | (_SLOTS if slots else 0)
                 | (_SNAP if snap else 0))
        kind = STEP_KINDS.index(plan.kind) if plan.kind in STEP_KINDS else 255
        grow_pages = np.concatenate(grow, axis=1) if grow else np.zeros((T, 0), np.int32)
        rep_pages = np.concatenate(rep, axis=1) if rep else np.zeros((T, 0), np.int32)
        parts = [
            _HEAD.pack(VERSION, kind, LAYOUTS.index(plan.layout), flags, T, plan.step),
            _COUNTS.pack(B, N, len(drops), len(grow_idx), grow_pages.shape[1], len(rep_ids)),
            # int64
            np.fromiter((s.req_id for s in seqs), np.int64, B).tobytes(),
            np.asarray(drops, dtype=np.int64).tobytes(),
            np.asarray(rep_ids, dtype=np.int64).tobytes(),
            # int32
            np.fromiter((s.start for s in seqs), np.int32, B).tobytes(),
            b"" if one_row else np.fromiter((s.num_new for s in seqs), np.int32, B).tobytes(),
            np.fromiter((s.slot for s in seqs), np.int32, B).tobytes() if slots else b"",
            np.asarray(plan.input_ids, dtype=np.int32).tobytes(),
            np.asarray(grow_idx, dtype=np.int32).tobytes(),
            np.fromiter((g.shape[1] for g in grow), np.int32, len(grow)).tobytes(),
            grow_pages.tobytes(),
            np.fromiter((a.shape[1] for a in rep), np.int32, len(rep)).tobytes(),
            rep_pages.tobytes(),
            # uint8
            np.fromiter((s.owner for s in seqs), np.uint8, B).tobytes(),
            b"" if all_sample else np.fromiter((s.sample for s in seqs), np.uint8, B).tobytes(),
            np.fromiter((n > 1 for n in ns), np.uint8, B).tobytes() if snap else b"",
        ]
        data = b"".join(parts)
        for r in gone:
            known.pop(r, None)
        known.update(now)
        msg: bytes | tuple[bytes, str, Any] = data
        if plan.kind != "forward" or plan.payload is not None:
            msg = (data, plan.kind, plan.payload)
        elif one_row and all_sample:  # a decode step: count what the control plane carries (pickled)
            self.last_size = len(pickle.dumps(data, protocol=pickle.HIGHEST_PROTOCOL))
            self.decode_sizes[self.last_size] += 1
        return msg

    def decode_bytes_p50(self) -> int | None:
        """Median message bytes over the forward steps with no prefill rows (None before any)."""
        return median(self.decode_sizes)


def median(counts: Counter[int]) -> int | None:
    """The lower median of values given as value -> count."""
    total = sum(counts.values())
    if not total:
        return None
    seen = 0
    for v in sorted(counts):
        seen += counts[v]
        if 2 * seen >= total:
            return v
    return None  # unreachable


def is_step_message(msg: Any) -> bool:
    """Whether a control-plane object is a step message (else it is a pickled control StepPlan)."""
    return isinstance(msg, (bytes, tuple))


def decode(msg: bytes | tuple[bytes, str, Any]) -> StepPlan:
    """The StepPlan a message stands for, its slices without tables (`pages=[]`) and the table
    updates in `plan.delta` (apply them with `plan.delta.apply(tables, rank)` before building the step)."""
    if isinstance(msg, tuple):
        data, kind, payload = msg
    else:
        data, kind, payload = msg, None, None
    ver, kcode, lcode, flags, T, step = _HEAD.unpack_from(data, 0)
    if ver != VERSION:
        raise RuntimeError(f"step message version {ver}, this rank reads {VERSION}: ranks run different "
                           "splash versions")
    B, N, nd, ng, nn, nr = _COUNTS.unpack_from(data, _HEAD.size)
    off = _HEADER

    def take(dtype: Any, n: int) -> np.ndarray:
        nonlocal off
        a = np.frombuffer(data, dtype, n, off)
        off += a.nbytes
        return a

    req = take(np.int64, B)
    drops = take(np.int64, nd)
    rep_ids = take(np.int64, nr)
    start = take(np.int32, B)
    num_new = None if flags & _ONE_ROW else take(np.int32, B)
    slot = take(np.int32, B) if flags & _SLOTS else None
    input_ids = take(np.int32, N)
    grow_idx = take(np.int32, ng)
    grow_count = take(np.int32, ng)
    grow_pages = take(np.int32, T * nn).reshape(T, nn)
    rep_len = take(np.int32, nr)
    rep_pages = take(np.int32, T * int(rep_len.sum())).reshape(T, -1)
    owner = take(np.uint8, B)
    sample = None if flags & _ALL_SAMPLE else take(np.uint8, B)
    snap = take(np.uint8, B) if flags & _SNAP else None
    ids, starts, owners = req.tolist(), start.tolist(), owner.tolist()
    nums = [1] * B if num_new is None else num_new.tolist()
    samples = [True] * B if sample is None else [bool(x) for x in sample.tolist()]
    slots = [-1] * B if slot is None else slot.tolist()
    seqs = [SeqSlice(r, s, n, o, [], sm, sl)
            for r, s, n, o, sm, sl in zip(ids, starts, nums, owners, samples, slots)]
    if kind is None:
        kind = STEP_KINDS[kcode] if kcode < len(STEP_KINDS) else "forward"
    delta = TableDelta(drops, req[grow_idx], grow_count, grow_pages, rep_ids, rep_len, rep_pages)
    snapshot = None if snap is None else [sl for sl, f in zip(slots, snap.tolist()) if f]
    return StepPlan(step=step, layout=LAYOUTS[lcode], input_ids=input_ids, seqs=seqs, kind=kind,
                    payload=payload, delta=delta, snapshot=snapshot)
