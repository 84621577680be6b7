"""Model-free stand-ins for engine tests: a runner whose next token is a function of the history it
saw through the plans (so wrong positions, lost history or bad recompute change the output), and a
byte-level toy tokenizer."""

from __future__ import annotations

import torch

from splash.core.presets import PRESETS
from splash.runtime_spec import RuntimeSpec
from splash.step.plan import StepPlan

VOCAB = 138
EOS = 1


def fake_spec(model=None, **options) -> RuntimeSpec:
    """The spec of a model-free engine: `model` (default the `tiny` shape) with the fakes' vocabulary;
    `options` as `RuntimeSpec.for_tests` takes them (EngineConfig keywords, `world`, `dtype`, ...)."""
    return RuntimeSpec.for_tests((model or PRESETS["tiny"]).replace(vocab_size=VOCAB), **options)


def next_token(history: list[int]) -> int:
    h = 7
    for t in history:
        h = (h * 31 + t) % 1000003
    return h % (VOCAB - 10) + 10


class FakeRunner:
    """Keeps each sequence's tokens as written by the plans; logits peak at `next_token(history)`."""

    def __init__(self, rule=next_token, fail_at_step: int | None = None) -> None:
        self.device = torch.device("cpu")
        self.rule = rule
        self.cache: dict[int, list[int]] = {}
        self.plans: list[StepPlan] = []
        self.fail_at_step = fail_at_step

    def execute(self, plan: StepPlan) -> torch.Tensor:
        if self.fail_at_step is not None and plan.step >= self.fail_at_step:
            raise RuntimeError("simulated device failure")
        self.plans.append(plan)
        rows, r = [], 0
        for sl in plan.seqs:
            hist = self.cache.setdefault(sl.req_id, [])
            del hist[sl.start:]  # recompute after preemption rewrites from `start`
            assert len(hist) == sl.start, "plan skipped positions"
            hist.extend(plan.input_ids[r:r + sl.num_new])
            r += sl.num_new
            if sl.sample:
                logits = torch.linspace(0, 1, VOCAB, dtype=torch.float64)
                logits[self.rule(hist)] = 8.0
                rows.append(logits)
        return torch.stack(rows) if rows else torch.empty(0, VOCAB, dtype=torch.float64)


class ByteTok:
    """id = byte + 10; ids < 10 are special (skipped in decode)."""

    vocab_size = VOCAB + 256

    def encode(self, text: str) -> list[int]:
        return [b + 10 for b in text.encode()]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return bytes(i - 10 for i in ids if i >= 10).decode("utf-8", errors="replace")


class PagedFakeRunner:
    """A model-free runner that keeps a real paged KV store: each position's (token, weight version) is
    written into the local pages the plan's tables name, on every rank that holds them, and each sampled
    row's logits peak at `rule(tokens read back through its table)`. So a page handed to two requests, a
    table that lost a page, a switch that moved the wrong page, or a cached page read after a weight
    update (its version is older than the reader's admission) changes an output or fails an assertion.

    A switch plan (`kind == "switch"`) first copies the pages its manifest moves (`kv_pairs`: sender page
    -> receiver page, valid tokens), as the executor does. `version` is bumped by a weight update."""

    def __init__(self, world: int, page_size: int, rule=next_token) -> None:
        self.device = torch.device("cpu")
        self.world, self.P, self.rule = world, page_size, rule
        self.kv: dict[tuple[int, int], list] = {}  # (rank, local page) -> P x (token, version) | None
        self.tables: dict[int, list[list[int]]] = {}  # req_id -> the table of the last plan it was in
        self.computed: dict[int, int] = {}  # req_id -> positions written
        self.admitted: dict[int, tuple[int, int]] = {}  # req_id -> (version at admission, cached positions)
        self.version = 0
        self.steps = 0
        self.stale_reads: list[str] = []

    def _read(self, table: list[list[int]], pos: int) -> tuple[int, int] | None:
        j, o = divmod(pos, self.P)
        got = [self.kv.get((r, table[r][j]), [None] * self.P)[o] for r in range(self.world)
               if j < len(table[r]) and table[r][j] >= 0]
        assert got, f"position {pos}: no rank holds page {j}"
        assert all(g == got[0] for g in got), f"position {pos}: ranks disagree {got}"
        return got[0]

    def _write(self, table: list[list[int]], pos: int, item: tuple[int, int]) -> None:
        j, o = divmod(pos, self.P)
        held = [r for r in range(self.world) if table[r][j] >= 0]
        assert held, f"position {pos}: no rank holds page {j} to write"
        for r in held:
            self.kv.setdefault((r, table[r][j]), [None] * self.P)[o] = item

    def execute(self, plan: StepPlan) -> torch.Tensor:
        self.steps += 1
        for rid in plan.dropped:
            self.tables.pop(rid, None)
            self.computed.pop(rid, None)
            self.admitted.pop(rid, None)
        if plan.kind == "switch":  # the manifest's page moves, read before any is written (executor)
            sent = [(d, dp, list(self.kv.get((s, sp), [None] * self.P)[:n]))
                    for (s, d), pairs in plan.payload.kv_pairs.items() for sp, dp, n in pairs.tolist()]
            for d, dp, items in sent:
                page = self.kv.setdefault((d, dp), [None] * self.P)
                page[:len(items)] = items
            for rid, table in plan.tables.items():
                if rid in self.tables:
                    self.tables[rid] = [list(row) for row in table]
        rows, r = [], 0
        for sl in plan.seqs:
            table = [list(row) for row in sl.pages]
            if sl.req_id not in self.admitted or sl.start < self.computed.get(sl.req_id, 0):
                # (re)admitted: positions before `start` come from the prefix cache
                self.admitted[sl.req_id] = (self.version, sl.start)
            ver, cached = self.admitted[sl.req_id]
            for p in range(cached):
                item = self._read(table, p)
                if item is None or item[1] != ver:
                    self.stale_reads.append(f"request {sl.req_id} position {p}: {item}, admitted at "
                                            f"version {ver}")
            for k, tok in enumerate(plan.input_ids[r:r + sl.num_new]):
                self._write(table, sl.start + k, (tok, self.version))
            r += sl.num_new
            self.tables[sl.req_id] = table
            self.computed[sl.req_id] = sl.start + sl.num_new
            if sl.sample:
                hist = []
                for p in range(sl.start + sl.num_new):
                    item = self._read(table, p)
                    assert item is not None, f"request {sl.req_id} position {p} was never written"
                    hist.append(item[0])
                logits = torch.linspace(0, 1, VOCAB, dtype=torch.float64)
                logits[self.rule(hist)] = 8.0
                rows.append(logits)
        return torch.stack(rows) if rows else torch.empty(0, VOCAB, dtype=torch.float64)
