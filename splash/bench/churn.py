"""The soak's load (`splash bench soak`, splash/bench/soak.py): clients drawing RL and agent requests from
a seeded mix, and a controller that updates weights, flushes, pauses and releases memory mid-flight; a
tally of what came back. Greedy checks hold a shared lock for their lifetime and updates take it
exclusively, so each check runs under one weight version."""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

KINDS = ("grpo", "multiturn", "cut", "n2", "stop", "bad", "greedy")
WEIGHTS = (3, 2, 2, 2, 2, 1, 3)  # draws per kind (a grpo draw sends 4 requests, a multiturn 2-3)


# ---- the tally ---------------------------------------------------------------------------------------------
@dataclass
class Tally:
    sent: Counter[str] = field(default_factory=Counter)  # requests per kind
    ok: Counter[str] = field(default_factory=Counter)
    bad_4xx: int = 0  # malformed requests answered 4xx (as they must be)
    unexpected_4xx: list[str] = field(default_factory=list)
    http_5xx: list[str] = field(default_factory=list)
    client_errors: list[str] = field(default_factory=list)
    cut: int = 0
    events: Counter[str] = field(default_factory=Counter)  # updates, flushes (200 / 400), pauses, releases
    event_errors: list[str] = field(default_factory=list)
    # greedy checks: (weights version, prompt ids, max tokens, output ids)
    checks: list[tuple[int, list[int], int, list[int]]] = field(default_factory=list)
    usage: list[tuple[float, float]] = field(default_factory=list)  # (seconds, KV usage)
    marks: list[tuple[float, str]] = field(default_factory=list)  # (seconds, event)

    def status(self, kind: str, code: int, text: str) -> None:
        if code == 200:
            self.ok[kind] += 1
        elif code >= 500:
            self.http_5xx.append(f"{kind}: {code} {text[:200]}")
        else:
            self.unexpected_4xx.append(f"{kind}: {code} {text[:200]}")


class VersionLock:
    """Many greedy checks at once, or one weight update: a check never spans an update."""

    def __init__(self) -> None:
        self._readers = 0
        self._cond = asyncio.Condition()
        self._writing = False

    async def read(self) -> None:
        async with self._cond:
            await self._cond.wait_for(lambda: not self._writing)
            self._readers += 1

    async def unread(self) -> None:
        async with self._cond:
            self._readers -= 1
            self._cond.notify_all()

    async def write(self) -> None:
        async with self._cond:
            await self._cond.wait_for(lambda: not self._writing)
            self._writing = True
            await self._cond.wait_for(lambda: self._readers == 0)

    async def unwrite(self) -> None:
        async with self._cond:
            self._writing = False
            self._cond.notify_all()


# ---- the load ----------------------------------------------------------------------------------------------
class Soak:
    """`url` takes the traffic; `servers` (default [url]) take the controller's events, each of them (a
    router in front of a prefill and a decode: both get every weight update); the last one's KV usage is
    plotted. `n_copies`: an n = 2 draw goes as 2 requests of n = 1 (where a server refuses n > 1)."""

    def __init__(self, a: argparse.Namespace, url: str, paths: list[str], vocab: int,
                 servers: list[str] | None = None, n_copies: bool = False) -> None:
        self.a, self.url, self.paths, self.vocab = a, url, paths, vocab
        self.servers, self.n_copies = servers or [url], n_copies
        self.t = Tally()
        self.version = 0  # index into paths (A, B, A, ...) of the weights being served
        self.lock = VersionLock()
        self.left = a.requests
        self.t0 = time.monotonic()

    def _ids(self, rng: random.Random, n: int) -> list[int]:
        return [rng.randrange(3, self.vocab) for _ in range(n)]

    def _sp(self, rng: random.Random, greedy: bool = False, **kw: Any) -> dict[str, Any]:
        sp = {"max_new_tokens": rng.randint(2, self.a.max_tokens), "ignore_eos": True,
              "temperature": 0.0 if greedy else 1.0, **kw}
        if not greedy:
            sp["sampling_seed"] = rng.randrange(1 << 30)
        return sp

    async def _generate(self, c: Any, kind: str, body: dict[str, Any]) -> dict[str, Any] | None:
        self.t.sent[kind] += 1
        try:
            r = await c.post("/generate", json=body, timeout=self.a.timeout)
        except Exception as e:  # noqa: BLE001 - counted, never raised
            self.t.client_errors.append(f"{kind}: {type(e).__name__}: {e}")
            return None
        self.t.status(kind, r.status_code, r.text)
        return r.json() if r.status_code == 200 else None

    async def job(self, c: Any, rng: random.Random) -> None:
        """One draw of the mix; it takes the requests it sends from `left` before sending them."""
        kind = rng.choices(KINDS, WEIGHTS)[0]
        turns = rng.randint(2, 3)
        self.left -= {"grpo": 4, "multiturn": turns, "n2": 2 if self.n_copies else 1}.get(kind, 1)
        if kind == "grpo":  # one prompt, 4 samples as separate requests at once (slime's shape)
            ids, sp = self._ids(rng, rng.randint(8, 40)), self._sp(rng)
            bodies = [{"input_ids": ids, "sampling_params": {**sp, "sampling_seed": sp["sampling_seed"] + i}}
                      for i in range(4)]
            await asyncio.gather(*(self._generate(c, kind, b) for b in bodies))
        elif kind == "multiturn":
            history = self._ids(rng, rng.randint(6, 24))
            for _ in range(turns):
                out = await self._generate(c, kind, {"input_ids": history, "sampling_params": self._sp(rng)})
                if out is None:
                    break
                history = history + out["output_ids"] + self._ids(rng, rng.randint(2, 8))
        elif kind == "cut":
            await self._cut(c, rng)
        elif kind == "n2" and self.n_copies:  # the same prompt twice, other seeds (what n = 2 samples)
            ids, sp = self._ids(rng, rng.randint(4, 30)), self._sp(rng)
            await asyncio.gather(*(self._generate(c, kind, {"input_ids": ids, "sampling_params": {
                **sp, "sampling_seed": sp["sampling_seed"] + i}}) for i in range(2)))
        elif kind == "n2":
            await self._generate(c, kind, {"input_ids": self._ids(rng, rng.randint(4, 30)),
                                           "sampling_params": self._sp(rng, n=2)})
        elif kind == "stop":
            await self._generate(c, kind, {"text": "the quick brown fox " * rng.randint(1, 4),
                                           "sampling_params": self._sp(rng, stop=["e", " t"])})
        elif kind == "bad":
            await self._bad(c, rng)
        else:
            await self._greedy(c, rng)

    async def _greedy(self, c: Any, rng: random.Random) -> None:
        ids, sp = self._ids(rng, rng.randint(4, 40)), self._sp(rng, greedy=True)
        await self.lock.read()
        try:
            version = self.version
            out = await self._generate(c, "greedy", {"input_ids": ids, "sampling_params": sp})
        finally:
            await self.lock.unread()
        if out is not None:
            self.t.checks.append((version, ids, sp["max_new_tokens"], list(out["output_ids"])))

    async def _cut(self, c: Any, rng: random.Random) -> None:
        """A stream read for a few chunks, then the connection dropped (the server must abort it)."""
        self.t.sent["cut"] += 1
        body = {"input_ids": self._ids(rng, rng.randint(4, 30)), "stream": True,
                "sampling_params": self._sp(rng, max_new_tokens=self.a.max_tokens)}
        try:
            async with c.stream("POST", "/generate", json=body, timeout=self.a.timeout) as r:
                if r.status_code != 200:
                    self.t.status("cut", r.status_code, (await r.aread()).decode(errors="replace"))
                    return
                n = 0
                async for _ in r.aiter_lines():
                    n += 1
                    if n >= rng.randint(1, 4):
                        self.t.cut += 1
                        break
                self.t.ok["cut"] += 1
        except Exception as e:  # noqa: BLE001
            self.t.client_errors.append(f"cut: {type(e).__name__}: {e}")

    async def _bad(self, c: Any, rng: random.Random) -> None:
        """Malformed input: each must be a 4xx that names the problem, and change nothing."""
        self.t.sent["bad"] += 1
        choice = rng.randrange(6)
        try:
            r = await self._send_bad(c, choice)
        except Exception as e:  # noqa: BLE001 - counted, never raised
            self.t.client_errors.append(f"bad({choice}): {type(e).__name__}: {e}")
            return
        if 400 <= r.status_code < 500:
            self.t.bad_4xx += 1
        elif r.status_code >= 500:
            self.t.http_5xx.append(f"bad({choice}): {r.status_code} {r.text[:200]}")
        else:
            self.t.unexpected_4xx.append(f"bad({choice}) accepted: {r.status_code}")

    async def _send_bad(self, c: Any, choice: int) -> Any:
        if choice == 0:
            r = await c.post("/generate", content=b"{not json", headers={"content-type": "application/json"})
        elif choice == 1:
            r = await c.post("/generate", json={"input_ids": [1, 2],
                                                "sampling_params": {"max_new_tokens": -1}})
        elif choice == 2:
            r = await c.post("/generate", json={"input_ids": [self.vocab + 5]})
        elif choice == 3:
            r = await c.post("/generate", json={"input_ids": [3] * 100_000})
        elif choice == 4:
            r = await c.post("/v1/completions", json={"model": "no-such-model", "prompt": "hi"})
        else:
            r = await c.post("/v1/completions", json={"model": self.a.served, "prompt": [1.5, "x"]})
        return r

    async def client(self, i: int) -> None:
        import httpx

        rng = random.Random(self.a.seed * 1000 + i)
        async with httpx.AsyncClient(base_url=self.url, timeout=self.a.timeout) as c:
            while self.left > 0:
                await self.job(c, rng)

    def _mark(self, what: str) -> None:
        self.t.events[what] += 1
        self.t.marks.append((time.monotonic() - self.t0, what))

    async def _post(self, c: Any, path: str, body: dict[str, Any] | None = None) -> int:
        """POST to every server (in order); the first status that is not 200, else 200."""
        codes = []
        for server in self.servers:
            try:
                r = await c.post(server + path, json=body or {}, timeout=max(self.a.timeout, 300.0))
            except Exception as e:  # noqa: BLE001 - counted, never raised
                self.t.event_errors.append(f"{server}{path}: {type(e).__name__}: {e}")
                codes.append(0)
                continue
            if r.status_code >= 500:
                self.t.http_5xx.append(f"{server}{path}: {r.status_code} {r.text[:200]}")
            codes.append(r.status_code)
        return next((x for x in codes if x != 200), 200)

    async def controller(self) -> None:
        """Weight updates at even points of the run; flushes, pauses and memory release around them."""
        import httpx

        total = self.a.requests
        at = [total * (k + 1) // (self.a.updates + 1) for k in range(self.a.updates)]
        async with httpx.AsyncClient(timeout=self.a.timeout) as c:
            while self.left > 0 or at:
                await asyncio.sleep(0.05)
                done = total - self.left
                self.t.usage.append((time.monotonic() - self.t0, await self._usage(c)))
                if at and done >= at[0]:
                    at.pop(0)
                    await self.lock.write()
                    try:
                        nxt = (self.version + 1) % 2
                        code = await self._post(c, "/update_weights_from_disk",
                                                {"model_path": self.paths[nxt], "weight_version": str(nxt)})
                        if code == 200:
                            self.version = nxt
                            self._mark("update")
                        else:
                            self.t.event_errors.append(f"update refused: {code}")
                    finally:
                        await self.lock.unwrite()
                    code = await self._post(c, "/flush_cache")
                    self._mark(f"flush {code}")
                    # pause in place, then continue: running requests keep their KV
                    # (with several servers, one that took a pause or a release is given its undo
                    # even when another refused)
                    several = len(self.servers) > 1
                    if (code := await self._post(c, "/pause_generation", {"mode": "in_place"})) == 200:
                        self._mark("pause")
                        await asyncio.sleep(0.2)
                    if code == 200 or several:
                        await self._post(c, "/continue_generation")
                    # release and resume the KV memory: running requests are retracted and recompute
                    code = await self._post(c, "/release_memory_occupation", {"tags": ["kv_cache"]})
                    if code == 200:
                        self._mark("release")
                        await asyncio.sleep(0.1)
                    if code == 200 or several:
                        if await self._post(c, "/resume_memory_occupation", {"tags": ["kv_cache"]}) != 200:
                            self.t.event_errors.append("resume_memory_occupation failed")

    async def _usage(self, c: Any) -> float:
        try:
            r = await c.get(self.servers[-1] + "/get_server_info", timeout=10)
            return float(r.json().get("kv_usage", 0.0)) if r.status_code == 200 else float("nan")
        except Exception:  # noqa: BLE001
            return float("nan")

    async def run(self) -> None:
        await asyncio.gather(self.controller(), *(self.client(i) for i in range(self.a.clients)))
