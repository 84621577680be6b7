"""Layouts on both sides of the split (issue 47): a prefill group and a decode group, each at its own size
and in its own layout, switching live, the transfer planned by the core's manifest.

Each side is an engine in its own process (tests/pd_peer.py: a T > 1 engine owns its process's rank
group), driven with the engine's own PD calls over Mooncake's TCP transport on loopback. Checked, on the
KDA hybrid (pages of the latent and per-request recurrent/conv state with heads, so both kinds of
block move) in float64: for every (prefill layout, decode layout) pair, the greedy tokens equal one
colocated T = 1 engine's; the bytes the prefill side moved equal the manifest's link bytes and the decode
side's fill bytes its fill bytes (`splash.core.pd.plan_pd`); both sides' books balance.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("mooncake.engine", reason="Mooncake's transfer engine is not installed (make setup)")

from splash.core.model_config import ModelConfig  # noqa: E402
from splash.core.pd import Group, plan_pd  # noqa: E402
from splash.core.presets import resolve_model_config  # noqa: E402
from splash.engine.build import build_engine  # noqa: E402
from splash.engine.sampling import SamplingParams  # noqa: E402

pytestmark = [pytest.mark.timeout(600), pytest.mark.usefixtures("one_torch_thread")]

LAYOUTS = ("tp", "dp", "cp", "dop")
ENGINE = dict(dtype="float64", page_size=4, max_num_seqs=8, max_num_batched_tokens=64, device="cpu",
              check_books=True, num_kv_pages=64)
PROMPTS = [list(range(10, 31)), [90, 1, 33, 4, 8, 61, 9, 9, 13, 60, 12, 50, 7]]
PARAMS = dict(temperature=0.0, max_tokens=4, ignore_eos=True)
VERBOSE = bool(os.environ.get("PD_PEER_LOG"))  # (the peers' stderr, when debugging)


class Peer:
    """One side's engine in its own process; `ask` sends a command and waits for its answer."""

    def __init__(self, model: str, tp: int, mode: str, layout: str = "tp", **extra: Any) -> None:
        opts = {**ENGINE, "model": model, "disaggregation_mode": mode, **extra}
        if tp > 1:
            opts.update(tp=tp, layout=layout)
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("pd_peer.py")),
                                      json.dumps(opts)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=None if VERBOSE else subprocess.DEVNULL, text=True)
        self.tp = tp
        assert self._read(240).get("ready")

    def _read(self, timeout: float) -> dict[str, Any]:
        out = self.proc.stdout
        assert out is not None
        ready, _, _ = select.select([out], [], [], timeout)
        if not ready:
            raise TimeoutError(f"the peer did not answer in {timeout:g} s")
        line = out.readline()
        if not line:
            raise RuntimeError(f"the peer exited with {self.proc.wait(10)}")
        return json.loads(line)  # type: ignore[no-any-return]

    def ask(self, op: str, timeout: float = 120.0, **kw: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()
        ans = self._read(timeout)
        assert "failed" not in ans, ans.get("trace") or ans["failed"]
        return ans

    def close(self) -> None:
        try:
            if self.proc.poll() is None and self.proc.stdin is not None:
                self.proc.stdin.write('{"op": "quit"}\n')
                self.proc.stdin.flush()
            self.proc.wait(60)
        except Exception:  # noqa: BLE001 - a peer that will not leave is killed
            self.proc.kill()
            self.proc.wait(10)


def reference(model: str, prompts: list[list[int]] = PROMPTS) -> list[list[int]]:
    eng = build_engine(model, **ENGINE)
    try:
        for i, ids in enumerate(prompts):
            eng.add_request(f"r{i}", params=SamplingParams(**PARAMS), prompt_token_ids=ids)
        got: dict[str, list[int]] = {}
        while eng.has_unfinished():
            for o in eng.step():
                if o.finished:
                    got[o.request_id] = list(o.outputs[0].token_ids)
        return [got[f"r{i}"] for i in range(len(prompts))]
    finally:
        eng.shutdown()


def transfer(pre: Peer, dec: Peer, rid: str, ids: list[int], cfg: ModelConfig, a: str, b: str
             ) -> list[int]:
    """One request reserved on `dec`, prefilled on `pre` in layout a, decoded on `dec` in layout b:
    its tokens; the bytes each side counted checked against the core's manifest."""
    before = dec.ask("stats")["stats"]
    dest = dec.ask("reserve", rid=rid, ids=ids, params=PARAMS)
    assert dest["layout"]["layout"] == b and dest["layout"]["world"] == dec.tp
    res = pre.ask("prefill", rid=rid, ids=ids, params=PARAMS, dest=dest)
    assert res["error"] is None, res["error"]
    man = plan_pd(cfg, Group(a, pre.tp, 0), Group(b, dec.tp, int(dest["owner"])), len(ids),
                  ENGINE["page_size"], kv_format="float64", dtype="float64")
    assert res["bytes"] == man.link_bytes, (a, b, res["bytes"], man.to_json())
    tokens = dec.ask("arrived", rid=rid, result=res)["tokens"][0]
    after = dec.ask("stats")
    assert not after["books"], after["books"]
    assert after["stats"]["kv_fill_bytes_total"] - before["kv_fill_bytes_total"] == man.fill_bytes, (a, b)
    assert after["stats"]["kv_transfer_bytes_total"] - before["kv_transfer_bytes_total"] == man.link_bytes
    return tokens  # type: ignore[no-any-return]


@pytest.mark.parametrize("model", ["tiny", "tiny-dsa", "tiny-hybrid"])
def test_every_layout_pair_at_T2_to_T2_equals_colocated(model):
    """All 16 (prefill layout, decode layout) pairs at T = 2 -> T = 2, each side switching live between
    requests: tokens equal one colocated T = 1 engine's, bytes equal the manifest's (DeepSeek-V3's
    latent; V3.2's indexer keys beside it; the hybrid's per-request state with heads)."""
    ref = reference(model)
    cfg = resolve_model_config(model)
    pre, dec = Peer(model, 2, "prefill"), Peer(model, 2, "decode")
    try:
        k = 0
        for a in LAYOUTS:
            assert pre.ask("switch", layout=a)["layout"] == a
            for b in LAYOUTS:
                assert dec.ask("switch", layout=b)["layout"] == b
                i = k % len(PROMPTS)
                assert transfer(pre, dec, f"q{k}", PROMPTS[i], cfg, a, b) == ref[i], (a, b)
                k += 1
        for side in (pre, dec):
            st = side.ask("stats")
            assert not st["books"] and st["requests"] == 0
    finally:
        pre.close()
        dec.close()


@pytest.mark.parametrize("tp_pre,tp_dec,pairs", [
    (2, 1, [("tp", "tp"), ("cp", "tp"), ("dop", "tp")]),
    (1, 2, [("tp", "tp"), ("tp", "cp"), ("tp", "dop")]),
    (2, 4, [("cp", "tp"), ("tp", "dop")]),
], ids=["T2-T1", "T1-T2", "T2-T4"])
def test_different_sizes_on_the_two_sides(tp_pre, tp_dec, pairs):
    model = "tiny-hybrid"
    ref = reference(model)
    cfg = resolve_model_config(model)
    pre, dec = Peer(model, tp_pre, "prefill"), Peer(model, tp_dec, "decode")
    try:
        for k, (a, b) in enumerate(pairs):
            if tp_pre > 1:
                pre.ask("switch", layout=a)
            if tp_dec > 1:
                dec.ask("switch", layout=b)
            i = k % len(PROMPTS)
            assert transfer(pre, dec, f"s{k}", PROMPTS[i], cfg, a, b) == ref[i], (a, b)
    finally:
        pre.close()
        dec.close()


def test_random_switch_schedules_on_both_sides_while_transfers_are_in_flight():
    """Six requests parked on the decode side at once (its scheduled switches wait for their KV), prefilled
    in one batch on the prefill side (chunks over several steps, its layout switching between them, each
    request sent in the layout it finished in), arriving one by one while the decode side steps (and
    switches once nothing waits): greedy tokens equal one colocated engine's."""
    import random

    model = "tiny-hybrid"
    rng = random.Random(47)
    prompts = [[rng.randrange(3, 250) for _ in range(rng.randrange(5, 40))] for _ in range(6)]
    ref = reference(model, prompts)

    def schedule(steps: int, k: int) -> str:
        out, cur = [], "tp"
        for step in sorted(rng.sample(range(1, steps), k)):
            cur = rng.choice([x for x in LAYOUTS if x != cur])
            out.append(f"{step}:{cur}")
        return ",".join(out)

    pre = Peer(model, 2, "prefill", switch_schedule=schedule(4, 3))
    dec = Peer(model, 2, "decode", switch_schedule=schedule(16, 6))
    try:
        rids = [f"x{i}" for i in range(len(prompts))]
        dests = [dec.ask("reserve", rid=rid, ids=ids, params=PARAMS) for rid, ids in zip(rids, prompts)]
        sent = pre.ask("prefill_many", rids=rids, ids=prompts, dests=dests, params=PARAMS)
        assert len(sent["layouts"]) > 1, sent["layouts"]  # (the prefill did switch between its sends)
        errors = {rid: r["error"] for rid, r in sent["results"].items() if r["error"] is not None}
        assert not errors, errors
        got = dec.ask("arrived_many", results=sent["results"], step_between=True)
        assert len(got["layouts"]) > 1, got["layouts"]
        assert [got["tokens"][rid] for rid in rids] == ref
        for side in (pre, dec):
            st = side.ask("stats")
            assert not st["books"] and st["requests"] == 0
    finally:
        pre.close()
        dec.close()
