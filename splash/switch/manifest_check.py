"""The core's switch manifest made concrete and checked: its page moves in local page ids, every page a
rank newly holds arriving exactly once from a rank that holds it, its frees exactly the pages the
tables drop (`kv_pairs`), and its weight moves as one of gather / slice / keep (`weight_op`). A
disagreement is a bug between the core and the runtime, raised before anything is sent."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from splash.core.manifest import KVPages, Manifest
from splash.switch.columns import Columns
from splash.switch.plan import LiveRequest


def kv_pairs(kv: KVPages, live: Sequence[LiveRequest], cols: Columns, table: np.ndarray,
              fresh: np.ndarray, P: int) -> dict[tuple[int, int], np.ndarray]:
    """The core's page moves in local page ids; checks them (and its frees) against the tables:
    every page a rank newly holds must arrive exactly once, from a rank that holds it, and the core's
    frees must be exactly the pages the tables drop. `table` and `fresh` are [T, pages] laid out as
    `cols` (the destination table, and the pages a rank newly holds)."""
    ids, T = [req.req_id for req in live], table.shape[0]
    i, j, s, r = _checked_rows(kv.moves, (2, 3), ids, T, "moves")
    col = _check_moves(kv, ids, cols, table, i, j, s, r)
    _check_counts(r, col, fresh, cols, ids, "moves", "the pages the destination tables need")
    fi, fj, fr = _checked_rows(kv.frees, (2,), ids, T, "frees")
    out = (fj < 0) | (fj >= cols.cached[fi]) if len(fj) else fj
    if out.any():
        a, b = _run(kv.free_starts, len(fj), int(out.argmax()))
        raise RuntimeError(f"manifest frees pages {tuple(fj[a:b][:4].tolist())} of request {ids[fi[a]]}, "
                           f"outside its {cols.cached[fi[a]]} pages (core and placement rule disagree)")
    _check_counts(fr, cols.off[fi] + fj, cols.mine & (table < 0) & ~cols.alias, cols, ids, "frees",
                  "the tables'")
    if not len(col):
        return {}
    rows = np.stack([cols.old[s, col], table[r, col], np.minimum(P, cols.context[i] - j * P)], axis=1)
    key = s * T + r
    keys, first = np.unique(key, return_index=True)
    return {(int(k) // T, int(k) % T): rows[key == k] for k in keys[np.argsort(first)]}


def _checked_rows(rows: np.ndarray, ranks: tuple[int, ...], ids: list[int], T: int,
                  what: str) -> list[np.ndarray]:
    """The columns of the core's move / free rows, after checking they name requests and ranks that
    exist (a corrupt manifest must give the clear error, not an IndexError or numpy's wrap-around)."""
    if not len(rows):
        return list(rows.T)
    named = rows[:, [0, *ranks]]
    bad = ((named < 0) | (named >= np.array([len(ids)] + [T] * len(ranks)))).any(axis=1)
    if bad.any():
        raise RuntimeError(f"manifest {what} row {rows[int(bad.argmax())].tolist()} names a request or rank "
                           f"outside the {len(ids)} requests on {T} ranks (core and placement rule disagree)")
    return list(rows.T)


def _check_moves(kv: KVPages, ids: list[int], cols: Columns, table: np.ndarray, i: np.ndarray, j: np.ndarray,
                 s: np.ndarray, r: np.ndarray) -> np.ndarray:
    """Each move (a run of rows) must stay inside its request's table, come from a rank that holds the
    page, go to one that newly holds it, and carry cached history. Returns the moved columns."""
    if not len(j):
        return j
    width = cols.n[i]
    out = (j < 0) | (j >= width)
    col = np.where(out, 0, cols.off[i] + j)
    old = cols.old
    if old.shape[1]:
        deny = (old[s, col] < 0) | (table[r, col] < 0) | (old[r, col] >= 0)
    else:
        deny = np.zeros_like(out)
    uncached = ~out & (j >= cols.cached[i])
    bad = out | deny | uncached
    if not bad.any():
        return col
    a, b = _run(kv.move_starts, len(j), int(bad.argmax()))
    pages, rid = tuple(j[a:b][:4].tolist()), ids[i[a]]
    if out[a:b].any():
        raise RuntimeError(f"manifest moves pages {pages} of request {rid}, outside its {width[a]} pages "
                           "(core and placement rule disagree)")
    if deny[a:b].any():
        raise RuntimeError(f"manifest moves pages {pages} of request {rid} {s[a]}->{r[a]}, which the page "
                           "tables do not allow (core and placement rule disagree)")
    raise RuntimeError(f"manifest moves pages {pages} of request {rid}, beyond its {cols.cached[i[a]]} "
                       "cached pages (core and placement rule disagree)")


def _run(starts: np.ndarray, rows: int, row: int) -> tuple[int, int]:
    """[first, last + 1) rows of the move / free that `row` belongs to."""
    g = int(np.searchsorted(starts, row, side="right")) - 1
    return int(starts[g]), int(starts[g + 1]) if g + 1 < len(starts) else rows


def _check_counts(rank: np.ndarray, col: np.ndarray, want: np.ndarray, cols: Columns, ids: list[int],
                  what: str, than: str) -> None:
    """Per request, over its cached pages: how many of the core's rows name each (rank, column) equals
    the tables' `want` [T, pages]."""
    if len(rank):
        T, N = want.shape
        got = np.bincount(rank * N + col, minlength=T * N).reshape(T, N)
        diff = (got != want) & cols.is_cached
    else:
        diff = want & cols.is_cached
    if not diff.any():
        return
    i = int(cols.req[int(diff.any(axis=0).argmax())])
    a = int(cols.off[i])
    bad = np.argwhere(diff[:, a:a + int(cols.cached[i])])
    raise RuntimeError(f"manifest {what} (rank, page) {bad[:4].tolist()} of request {ids[i]} differ from "
                       f"{than} (core and placement rule disagree)")


def weight_op(man: Manifest, src: str, dst: str, T: int) -> str:
    """'gather' / 'slice' / 'keep', checked against the core's weight moves and frees."""
    moves, frees = man.weight_moves(), man.weight_frees()
    if not moves and not frees:
        return "keep"
    if moves and not frees and man.src.sharded and not man.dst.sharded:
        H = man.sizes.heads
        per = H // T
        got = {(m.proj, m.src, m.dst, h) for m in moves for h in range(m.start, m.stop)}
        want = {(p.name, h // per, r, h) for p in man.sizes.projections for r in range(T) for h in range(H)
                if h // per != r}
        if got == want:
            return "gather"
    if frees and not moves and not man.src.sharded and man.dst.sharded:
        return "slice"
    raise RuntimeError(f"switch {src}->{dst}: the manifest's weight moves are neither an all-gather of head "
                       "slices nor a discard; the executor cannot run them")
