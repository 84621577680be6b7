"""The step plan: what rank 0 tells every rank each step (see docs/runtime.md).

Pure data (no torch), so tests can build plans by hand. Rank 0's scheduler makes plans with every
rank's full page tables; steps travel as compact deltas (splash/step/wire.py) and each rank keeps its
own tables (splash/step/tables.py). Control plans (load, stats, ...) are pickled as they are.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from splash.core.layouts import LAYOUT_NAMES as LAYOUTS  # the names plans carry ("tp", ...)

# Plan kinds. "forward" and "switch" (a forward step in which the layout switches) run the SPMD step
# on every rank (STEP_KINDS, sent as step messages); the others are control messages of the rank group
# (splash/worker/loop.py): "load" carries the RuntimeSpec in `payload` and
# makes every rank (re)build its model shard and KV pool, "unload" drops them, "stats" gathers each
# rank's CommStats to rank 0, "tables" gathers each rank's page tables (tests, debugging), "shutdown"
# ends the worker processes; "draft" (speculative decoding with MTP layers, after a step) runs the
# draft model over the step's accepted rows and chains drafts (its payload a DraftWork; sent as a step
# message, since it grows tables); "state" puts back the state snapshots of KDA hybrid requests whose
# speculative rows were rejected (payload: the slots).
PLAN_KINDS = ("forward", "switch", "draft", "state", "load", "unload", "stats", "tables", "shutdown", "pd")
STEP_KINDS = ("forward", "switch")


@dataclass
class SeqSlice:
    """One request's share of a step: `num_new` new rows on top of `start` cached tokens."""

    req_id: int
    start: int  # tokens of this request already in the KV cache before this step
    num_new: int  # rows this step (prefill chunk length, or 1 in decode)
    owner: int  # owning rank for DP/DOP (chosen at admission); ignored by TP/CP
    # pages[r][j] = local page id on rank r of the request's global page j, -1 if rank r does not hold
    # it; len(pages[r]) == ceil((start + num_new) / page_size). Rank 0 only (the scheduler's plan: the
    # sequence's live table, valid while the step runs); decoded step messages leave it empty.
    pages: list[list[int]]
    sample: bool  # rank 0 needs logits of this slice's last row (decode, or last prefill chunk)
    # The request's state slot on the ranks (KDA models: the same index in every KDA layer; chosen at
    # admission, freed at finish/abort/preemption); -1 for models without per-request state.
    slot: int = -1

    @property
    def end(self) -> int:
        """Context length after this step."""
        return self.start + self.num_new


@dataclass
class RowLogprobs:
    """Rows of a step whose next-token logprobs rank 0 computes (prompt logprobs): for row `rows[i]`, the
    logprob of `targets[i]` and the `top` best (token, logprob); the runner fills `result` with
    (target logprobs [n], top values [n, top], top ids [n, top]) without keeping the rows' logits."""

    rows: list[int]
    targets: list[int]
    top: int = 0
    result: Any = None


@dataclass
class DraftWork:
    """The payload of a "draft" plan: its slices are the rows the last step made final (per request
    [start, start + num_new), their inputs the *next* token of each row), `src[i]` the first row of slice
    i in that step's hidden states, and `chain[i]` the drafts to chain from slice i's last row (0: none;
    chain step j writes the draft KV of position start + num_new + j - 1, which its table covers)."""

    src: list[int]
    chain: list[int]


@dataclass
class StepPlan:
    """Everything a rank needs to run one forward step; rows are the slices' new tokens in order."""

    step: int
    layout: str  # "tp" | "dp" | "cp" | "dop"
    input_ids: list[int]  # concatenated new tokens, in seqs order (an int32 array on the ranks)
    seqs: list[SeqSlice] = field(default_factory=list)
    kind: str = "forward"  # one of PLAN_KINDS
    payload: Any = None  # what a non-forward kind needs (EngineSpec for "load", a SwitchPlan later)
    # Rank 0: requests whose tables the ranks may forget (finished, aborted or preempted since the last
    # plan that ran), and, on a switching step, every live request's new table (shipped once).
    dropped: list[int] = field(default_factory=list)
    tables: dict[int, list[list[int]]] | None = None
    # Ranks: the table updates the step's message carried (a wire.TableDelta; the slices' `pages` are
    # then empty and the rank's own RankTables hold the tables).
    delta: Any = None
    # Rank 0 only, never sent: rows beyond the sampled ones whose next-token logprobs rank 0 wants
    # (prompt logprobs); None in every step where no request asked, which then costs nothing.
    row_logprobs: RowLogprobs | None = None
    # Rank 0 only, never sent: per slice, how many of its last rows rank 0 needs logits of (a speculating
    # request's verify rows: its last token and its drafts); None: the last row of each `sample` slice.
    num_sample: list[int] | None = None
    # Ranks: the state slots (KDA hybrids) whose rows this step are speculative (a verify slice): each
    # rank snapshots them before the forward, so rank 0 can have rejected rows taken back ("state").
    snapshot: list[int] | None = None

    @property
    def num_rows(self) -> int:
        return len(self.input_ids)

    def row_starts(self) -> list[int]:
        """First row of each slice (rows are the slices' new tokens concatenated in order)."""
        out, r = [], 0
        for s in self.seqs:
            out.append(r)
            r += s.num_new
        return out

    def positions(self) -> list[int]:
        """Absolute position of every row."""
        return [p for s in self.seqs for p in range(s.start, s.end)]

    def sample_rows(self) -> list[int]:
        """Rows whose logits rank 0 samples from: the last row of each `sample` slice, or its last
        `num_sample[i]` rows (speculative verification), in row order."""
        if self.num_sample is None:
            return [r + s.num_new - 1 for r, s in zip(self.row_starts(), self.seqs) if s.sample]
        return [r + s.num_new - n + j for r, s, n in zip(self.row_starts(), self.seqs, self.num_sample)
                if s.sample for j in range(n)]

    def validate(self, page_size: int, world: int) -> None:
        """Raise ValueError if the plan is internally inconsistent (cheap; used by tests and debug)."""
        if self.layout not in LAYOUTS:
            raise ValueError(f"unknown layout {self.layout!r}")
        if sum(s.num_new for s in self.seqs) != len(self.input_ids):
            raise ValueError("input_ids length does not match the slices' num_new")
        for s in self.seqs:
            if s.num_new < 1 or s.start < 0:
                raise ValueError(f"slice of request {s.req_id}: bad start/num_new {s.start}/{s.num_new}")
            if len(s.pages) != world:
                raise ValueError(f"slice of request {s.req_id}: page tables for {len(s.pages)} ranks, "
                                 f"expected {world}")
            need = -(-s.end // page_size)
            for r, tbl in enumerate(s.pages):
                if len(tbl) != need:
                    raise ValueError(f"slice of request {s.req_id}: rank {r} table has {len(tbl)} pages, "
                                     f"expected {need}")


def control_plan(kind: str, step: int = -1, layout: str = "tp", payload: Any = None) -> StepPlan:
    """A plan with no rows that carries a control message of the rank group."""
    if kind not in PLAN_KINDS:
        raise ValueError(f"unknown plan kind {kind!r}; expected one of {', '.join(PLAN_KINDS)}")
    return StepPlan(step=step, layout=layout, input_ids=[], seqs=[], kind=kind, payload=payload)


def shutdown_plan(step: int, layout: str = "tp") -> StepPlan:
    """The plan that tells worker ranks to leave their loop."""
    return control_plan("shutdown", step, layout)
