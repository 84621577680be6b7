"""The hook protocol of a step, so that a feature is a file and not lines in the engine's step.

`LLMEngine.step` runs schedule -> execute -> sample -> commit; at fixed points of it, the engine calls
the *stages* registered once in its constructor (`splash/engine/stages/__init__.py`). A stage owns the
per-request state of its feature in its own table, keyed by the sequence (or the request), so
`Sequence` keeps only what every request has. Every hook is optional: `Hooks` lists, per hook, only the
stages that override it, so a feature nobody uses costs a step nothing and one that some request uses
costs a dict lookup per sequence.
"""

from __future__ import annotations

from typing import Any

from splash.engine.outputs import RequestOutput
from splash.engine.request import Request
from splash.engine.request import Sequence as Seq
from splash.engine.sampler import Sampled

Stop = tuple[str, "int | str | None"]  # (finish reason, stop reason) a check_stop hook ends a sequence with


class Stage:
    """Base of every stage: each hook a no-op. In step order:

    - `on_add(seq)`: a request's sequence was created, before it is queued.
    - `before_execute(st)`: the step is scheduled (`st`: the ScheduledStep), the ranks have not run it.
    - `after_execute(st, logits)`: the ranks ran it; rank 0's logits of the sampled rows, before sampling.
    - `on_token(seq, s, now)`: a token `s` (a Sampled) was appended to `seq`'s output.
    - `check_stop(seq, tok, may_stop)`: after the stop tokens: whether this token ends `seq` (in stage
      order; the first that says so wins, and later ones are not asked).
    - `on_finish(seq)`: `seq` ended (stop, length), its pages are about to be freed.
    - `after_step(st)`: every token of the step is committed (MTP's draft phase, the depth decision).
    - `output(seq, fields)` / `request_output(req, fields)`: the fields a stage adds to a snapshot.
    - `on_drop(seq)`: the request left the engine (finished and reported, or aborted): forget `seq`.
    - `stats()`: what the stage adds to `LLMEngine.stats()`.
    """

    def on_add(self, seq: Seq) -> None: ...

    def before_execute(self, st: Any) -> None: ...

    def after_execute(self, st: Any, logits: Any) -> None: ...

    def on_token(self, seq: Seq, s: Sampled, now: float) -> None: ...

    def check_stop(self, seq: Seq, tok: int, may_stop: bool) -> Stop | None: ...

    def on_finish(self, seq: Seq) -> None: ...

    def after_step(self, st: Any) -> None: ...

    def output(self, seq: Seq, fields: dict[str, Any]) -> None: ...

    def request_output(self, req: Request, fields: dict[str, Any]) -> None: ...

    def on_drop(self, seq: Seq) -> None: ...

    def stats(self) -> dict[str, Any]:
        return {}


HOOKS = ("on_add", "before_execute", "after_execute", "on_token", "check_stop", "on_finish", "after_step",
         "output", "request_output", "on_drop", "stats")


class Hooks:
    """Per hook, the bound methods of the stages that override it, in registration order."""

    def __init__(self, stages: list[Stage]) -> None:
        self.stages = stages
        for name in HOOKS:
            base = getattr(Stage, name)
            setattr(self, name, [getattr(s, name) for s in stages if getattr(type(s), name) is not base])

    on_add: list[Any]
    before_execute: list[Any]
    after_execute: list[Any]
    on_token: list[Any]
    check_stop: list[Any]
    on_finish: list[Any]
    after_step: list[Any]
    output: list[Any]
    request_output: list[Any]
    on_drop: list[Any]
    stats: list[Any]

    def snapshot(self, req: Request, final: bool = False) -> RequestOutput:
        """`req`'s RequestOutput with what each stage adds (text, logprobs, ...); `final`: it has left the
        engine (finished and reported, or aborted), and the stages forget it."""
        outs = []
        for seq in req.seqs:
            fields: dict[str, Any] = {}
            for hook in self.output:
                hook(seq, fields)
            outs.append(seq.completion(**fields))
        fields = {}
        for hook in self.request_output:
            hook(req, fields)
        out = req.output(outs, **fields)
        if final:
            self.drop(req)
        return out

    def drop(self, req: Request) -> None:
        """Every stage forgets `req`'s sequences."""
        for seq in req.seqs:
            for hook in self.on_drop:
                hook(seq)


class Delegate:
    """An engine attribute that lives on one of its parts (`pause_generation = Delegate("rl")`): reads,
    calls and assignments go to `engine.<part>.<name>`, so callers keep the engine's public names."""

    def __init__(self, part: str, name: str | None = None) -> None:
        self.part, self.name = part, name

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = self.name or name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        return self if obj is None else getattr(getattr(obj, self.part), self.name)  # type: ignore[arg-type]

    def __set__(self, obj: Any, value: Any) -> None:
        setattr(getattr(obj, self.part), self.name, value)  # type: ignore[arg-type]

    @staticmethod
    def install(cls: type, part: str, names: dict[str, str]) -> None:
        """Answer each of `names` ({the engine's name: the part's}) on `cls` from `cls().<part>`."""
        for name, inner in names.items():
            setattr(cls, name, Delegate(part, inner))
