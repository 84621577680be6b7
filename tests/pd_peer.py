"""A PD engine in its own process, driven by JSON lines on stdin (tests/test_pd_layouts.py).

A T > 1 engine starts its own rank group (torch.distributed, once per process), so the two sides of a
transfer at T > 1 each need a process; the test drives this one as the decode side (or the prefill side)
with the engine's own calls, no HTTP in between. One command per line, one JSON answer per line:
{"op": "switch", "layout": L} (switch, then run a one-token request so the switch happens now),
{"op": "reserve", ...}, {"op": "arrived", ...}, {"op": "prefill", ...}, {"op": "stats"}, {"op": "quit"}.
"""

from __future__ import annotations

import json
import sys
import traceback
from typing import Any

from splash.engine.build import build_engine
from splash.engine.sampling import SamplingParams


def settle(eng: Any, layout: str) -> str:
    """Switch `eng` to `layout` now: the switch runs with the next step, so run a short request."""
    if eng.switcher is not None and eng.allocator.layout != layout:
        eng.switcher.request(layout)
        eng.add_request(f"settle-{eng.steps}", params=SamplingParams(temperature=0.0, max_tokens=1),
                        prompt_token_ids=[1, 2, 3])
        while eng.has_unfinished():
            eng.step()
    return str(eng.allocator.layout)


def run_until_done(eng: Any, outs: list[Any], rid: str) -> dict[str, Any]:
    done = {o.request_id: o for o in outs if o.finished}
    while rid not in done and eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
    o = done[rid]
    return {"tokens": [c.token_ids for c in sorted(o.outputs, key=lambda c: c.index)]}


def main() -> None:
    opts = json.loads(sys.argv[1])
    eng = build_engine(opts.pop("model"), **opts)
    print(json.dumps({"ready": True, "layout": eng.allocator.layout}), flush=True)
    try:
        for line in sys.stdin:
            cmd = json.loads(line)
            try:
                op = cmd["op"]
                if op == "quit":
                    break
                if op == "switch":
                    ans: dict[str, Any] = {"layout": settle(eng, cmd["layout"])}
                elif op == "reserve":
                    ans = eng.pd.reserve(cmd["rid"], cmd["ids"], SamplingParams(**cmd["params"]))
                elif op == "arrived":
                    r = cmd["result"]
                    outs = eng.pd.arrived(cmd["rid"], r["first_tokens"], r["first_logprobs"], None,
                                          r["drafts"], r["bytes"], r.get("fill"))
                    ans = run_until_done(eng, outs, cmd["rid"])
                elif op == "prefill":
                    got: dict[str, Any] = {}
                    eng.pd.add_prefill(cmd["rid"], cmd["ids"], SamplingParams(**cmd["params"]), cmd["dest"],
                                       got.update)
                    while eng.has_unfinished():
                        eng.step()
                    ans = {k: v for k, v in got.items() if k != "prompt_logprobs"}
                elif op == "prefill_many":  # (one batch: chunks and sends interleave with its switches)
                    res: dict[str, Any] = {}
                    for rid, ids, dest in zip(cmd["rids"], cmd["ids"], cmd["dests"]):
                        eng.pd.add_prefill(rid, ids, SamplingParams(**cmd["params"]), dest,
                                           lambda r, res=res: res.__setitem__(r["request_id"], r))
                    layouts = set()
                    while eng.has_unfinished():
                        eng.step()
                        layouts.add(str(eng.allocator.layout))
                    ans = {"results": {k: {x: y for x, y in v.items() if x != "prompt_logprobs"}
                                       for k, v in res.items()}, "layouts": sorted(layouts)}
                elif op == "arrived_many":  # (all in, then decode them together while the layout switches)
                    done: dict[str, Any] = {}
                    layouts = set()
                    for rid, r in cmd["results"].items():
                        for o in eng.pd.arrived(rid, r["first_tokens"], r["first_logprobs"], None,
                                                r["drafts"], r["bytes"], r.get("fill")):
                            if o.finished:
                                done[o.request_id] = list(o.outputs[0].token_ids)
                        if cmd.get("step_between"):
                            for o in eng.step():
                                if o.finished:
                                    done[o.request_id] = list(o.outputs[0].token_ids)
                            layouts.add(str(eng.allocator.layout))
                    while eng.has_unfinished():
                        for o in eng.step():
                            if o.finished:
                                done[o.request_id] = list(o.outputs[0].token_ids)
                        layouts.add(str(eng.allocator.layout))
                    ans = {"tokens": done, "layouts": sorted(layouts)}
                elif op == "stats":
                    st = eng.stats()
                    ans = {"stats": {k: v for k, v in st.items() if isinstance(v, (int, float, str))},
                           "books": eng.scheduler.book_errors(), "requests": len(eng.requests),
                           "free": list(eng.allocator.num_free)}
                else:
                    ans = {"failed": f"unknown op {op!r}"}
            except Exception as e:  # noqa: BLE001 - reported to the test
                ans = {"failed": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}
            print(json.dumps(ans, default=str), flush=True)
    finally:
        eng.shutdown()


if __name__ == "__main__":
    main()
