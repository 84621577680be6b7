"""The engine for the server: `LLMEngine` stepping on its own thread, streams as async iterators.

The asyncio side never takes a lock the engine thread holds during a step: requests and aborts are
posted as commands, results come back through `loop.call_soon_threadsafe`. So a slow step never
stalls the HTTP event loop, and a slow client never stalls the engine nor grows its memory: snapshots
are cumulative, so each request keeps only its newest unread one (a lagging consumer gets the tokens
of several steps at once, as vLLM merges outputs when the consumer falls behind).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from splash.config import EngineConfig
from splash.engine.llm_engine import LLMEngine, StepFailed
from splash.engine.outputs import RequestOutput
from splash.engine.pd_async import PDAsync
from splash.engine.sampling import SamplingParams
from splash.engine.streams import EngineDeadError, EngineError, Mailbox, Stream, put_all

log = logging.getLogger("splash.engine")
__all__ = ["AsyncEngine", "EngineDeadError", "EngineError"]


class AsyncEngine(PDAsync):  # (PDAsync: prefill/decode disaggregation's calls, splash/engine/pd_async.py)
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._cmds: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._streams: dict[str, Stream] = {}
        self._thread: threading.Thread | None = None
        self._stopped = False
        self._dead: EngineDeadError | None = None  # set when the engine thread gave up (rank group failed)
        self._stats: dict[str, Any] = engine.stats()
        self._stats_lock = threading.Lock()
        # Seconds an idle engine waits for the next request of a burst (see _gather_burst; 0: never).
        self.arrival_gap_s = engine.config.arrival_gap_ms / 1e3

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncEngine:
        """Build the engine from its config on the thread that will step it."""
        from splash.engine.build import build_engine

        return cls.built_on_thread(lambda: build_engine(config))

    @classmethod
    def from_args(cls, **kw: Any) -> AsyncEngine:
        """`from_config(EngineConfig.from_kwargs(**kw))`: the options as keywords."""
        return cls.from_config(EngineConfig.from_kwargs(**kw))

    @classmethod
    def built_on_thread(cls, build: Callable[[], LLMEngine]) -> AsyncEngine:
        """Run `build()` on a new engine thread, then step the engine on that same thread.

        Every torch op of the server process must run on one thread. OpenMP keeps a thread pool per
        thread that ever ran a parallel region; with two pools (a model loaded on the main thread,
        stepped on another) libgomp counts more threads than cores and stops spinning at barriers, so
        each parallel region sleeps and wakes its workers: a 16-row decode step of `small` went from 14
        to 21-25 ms on 2 cores. Errors of the build are raised here, with their own type.
        """
        handoff: queue.SimpleQueue[AsyncEngine | BaseException] = queue.SimpleQueue()

        def boot() -> None:
            try:
                me = cls(build())
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                handoff.put(e)
                return
            me._thread = threading.current_thread()
            handoff.put(me)
            me._loop()

        thread = threading.Thread(target=boot, name="splash-engine", daemon=True)
        thread.start()
        got = handoff.get()
        if isinstance(got, BaseException):
            thread.join()
            raise got
        return got

    # ---- facts the server needs (static after construction) -------------------------------------
    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def kv_pool_tokens(self) -> int:
        return self.engine.kv_pool_tokens

    @property
    def max_request_tokens(self) -> int:
        """Longest context one request can ever hold (the server refuses longer prompts with a 400)."""
        return self.engine.max_request_tokens

    @property
    def vocab_size(self) -> int | None:
        return self.engine.vocab_size

    def stats(self) -> dict[str, Any]:
        """The engine's counters as of the last step (cheap; safe from any thread)."""
        with self._stats_lock:
            return dict(self._stats)

    def add_step_hook(self, fn: Callable[[dict[str, Any]], None]) -> None:
        """Call `fn(info)` after every step, on the engine thread (keep it cheap and thread-safe)."""
        self.engine.on_step.append(fn)

    # ---- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(str(self._dead))  # a new one each time: a re-raise grows its traceback
        if self._stopped:
            raise EngineDeadError("the engine was shut down")
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="splash-engine", daemon=True)
            self._thread.start()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the loop; requests still running end with EngineDeadError and free their pages; then
        the engine's ranks are stopped (T > 1)."""
        if self._stopped:
            return
        self._stopped = True
        if self._thread is not None:
            self._cmds.put(("shutdown", None))
            self._thread.join(timeout)
            alive = self._thread.is_alive()
            self._thread = None
            if alive:  # a step is stuck (a hung rank): the collective timeout will end it; don't wait
                log.error("engine thread did not stop within %.0f s", timeout)
                return
        else:
            self._fail_all(EngineDeadError("the engine was shut down"))
        stop = getattr(self.engine, "shutdown", None)
        if stop is not None:
            try:
                stop()
            except Exception:  # noqa: BLE001 - shutting down; report, do not raise
                log.exception("engine shutdown failed")

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def num_open_streams(self) -> int:
        """Requests a caller is still iterating (the server's open responses)."""
        return len(self._streams)

    def end_open_streams(self, why: str) -> None:
        """End every open request now with EngineDeadError(why), pages freed (the engine thread does it
        between steps). For a graceful shutdown: the responses close with an error, not cut mid-way."""
        if self._thread is not None and self._thread.is_alive():
            self._cmds.put(("end_all", why))

    @property
    def dead(self) -> EngineDeadError | None:
        """Why the engine stopped for good after a failure (its rank group died), else None."""
        return self._dead

    @property
    def is_healthy(self) -> bool:
        """Running and able to step: False once the rank group has failed (every step would fail), which
        a worker that exited while the engine was idle makes so too."""
        return self.is_running and self._dead is None and self.engine.failure() is None

    # ---- the async API --------------------------------------------------------------------------
    async def generate(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str
                       ) -> AsyncIterator[RequestOutput]:
        """Yield cumulative snapshots of `request_id` until it finishes.

        Raises ValueError if the engine refuses the request, EngineError if a step fails. Leaving the
        iteration early (break, cancellation, client gone) aborts the request and frees its pages.
        """
        self.start()
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already running; use a unique id")
        loop = asyncio.get_running_loop()
        q = Mailbox()
        self._streams[request_id] = (loop, q)
        self._cmds.put(("add", (request_id, list(prompt_token_ids), params)))
        if self._dead is not None:  # the thread ended before this stream was registered: nobody will answer
            self._streams.pop(request_id, None)
            raise EngineDeadError(str(self._dead))
        finished = False
        try:
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    finished = True  # the engine already dropped it
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished and not self._stopped:
                self._cmds.put(("abort", (request_id, None)))

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run `fn(engine)` on the engine thread between two steps and return its result (or raise
        its error). For control operations (pause, weight updates, memory release): they must not
        interleave with a step."""
        self.start()
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._cmds.put(("call", (fn, fut)))
        if self._dead is not None:
            raise EngineDeadError(str(self._dead))
        return await asyncio.wrap_future(fut)

    def _finish_outputs(self, outs: list[RequestOutput]) -> None:
        """Deliver final snapshots the engine produced outside a step (aborts, pause with abort)."""
        self._deliver_all([(out.request_id, out) for out in outs])

    async def abort_all(self) -> int:
        """Abort every request; each one's stream ends with what it had (finish reason abort)."""
        def go(eng: LLMEngine) -> int:
            outs = eng.abort_all()
            self._finish_outputs(outs)
            return len(outs)

        return await self.call(go)

    async def pause_generation(self, mode: str = "abort") -> int:
        """Pause stepping (see LLMEngine.pause_generation); returns the number of requests affected."""
        def go(eng: LLMEngine) -> int:
            n = len(eng.scheduler.running)
            outs = eng.pause_generation(mode)
            self._finish_outputs(outs)
            return len(outs) if mode == "abort" else n

        return await self.call(go)

    async def continue_generation(self) -> None:
        await self.call(lambda eng: eng.continue_generation())

    @property
    def is_paused(self) -> bool:
        return self.engine.is_paused

    @property
    def weight_version(self) -> str:
        return self.engine.weight_version

    async def abort(self, request_id: str) -> None:
        """Abort a request and wait until the engine has freed its pages (no-op if unknown)."""
        if self._thread is None or self._stopped or self._dead is not None:
            return  # (a dead engine's thread has aborted everything already)
        fut: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._cmds.put(("abort", (request_id, fut)))
        if self._dead is not None or self._stopped:  # the thread may have ended before taking the command
            return
        await asyncio.wrap_future(fut)

    # ---- engine thread --------------------------------------------------------------------------
    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        self._deliver_all([(request_id, item)])

    def _deliver_all(self, items: list[tuple[str, RequestOutput | BaseException]]) -> None:
        """Hand each item to its stream's mailbox: one wake-up per event loop, not one per request
        (each `call_soon_threadsafe` writes to the loop's self-pipe, a system call on the step's path)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[str, Mailbox, Any]]] = {}
        for rid, item in items:
            stream = self._streams.get(rid)
            if stream is not None:
                by_loop.setdefault(stream[0], []).append((rid, stream[1], item))
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(put_all, batch)
            except RuntimeError:  # the consumer's loop is closed: nobody is listening
                for rid, _, _ in batch:
                    self._streams.pop(rid, None)

    def _handle(self, cmd: str, arg: Any) -> bool:
        """Apply one command; False means stop the loop."""
        eng = self.engine
        if cmd == "shutdown":
            return False
        if cmd == "end_all":
            self._fail_all(EngineDeadError(arg))
            return True
        if cmd == "add":
            rid, ids, params = arg
            try:
                eng.add_request(rid, params=params, prompt_token_ids=ids)
            except ValueError as e:
                self._deliver(rid, ValueError(str(e)))
        elif cmd == "call":
            fn, fut = arg
            if not fut.set_running_or_notify_cancel():
                return True
            try:
                fut.set_result(fn(eng))
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                fut.set_exception(e)
                if eng.failure() is not None:  # a rank died during the operation: nothing can step
                    raise
            finally:
                self._refresh_stats()
        elif cmd == "abort":
            rid, fut = arg
            try:
                out = eng.abort(rid)
                if out is not None:
                    self._deliver(rid, out)
            finally:
                # The awaiting side may have been cancelled (client gone); a cancelled future must not
                # turn into an exception here, which would fail every other running request.
                # set_running_or_notify_cancel() is atomic: once it returns True, cancel() cannot win.
                if fut is not None and fut.set_running_or_notify_cancel():
                    fut.set_result(None)
        return True

    def _refresh_stats(self) -> None:
        s = self.engine.stats()
        with self._stats_lock:
            self._stats = s

    def _fail_all(self, err: BaseException) -> bool:
        """End every request with `err`; False if the cleanup itself failed (the engine is unsound)."""
        ok = True
        try:
            self.engine.abort_all()
        except Exception:  # bookkeeping after a failure must not mask the failure
            log.exception("engine cleanup after an error failed")
            ok = False
        self._deliver_all([(rid, err) for rid in list(self._streams)])
        return ok

    def _declare_dead(self, why: str) -> None:
        """Nothing can step any more: stop the loop, so health says so (later calls: EngineDeadError)."""
        log.error("the engine cannot recover (%s); it stops", why)
        self._dead = EngineDeadError(f"the engine stopped after a failure it cannot recover from ({why}); "
                                     f"restart the server")

    def _gather_burst(self) -> bool:
        """An idle engine woken by a request takes in the rest of its burst before stepping: requests
        that keep arriving less than `arrival_gap_s` apart, for at most 10 gaps. Stepping on the first
        one alone would prefill it in a step of its own, a step ahead of its burst for the rest of their
        lives: every later step that admits a replacement then stalls the whole batch for a prompt chunk
        (the P99 inter-token latency). A lone request waits one gap. False means stop the loop."""
        deadline = time.monotonic() + 10 * self.arrival_gap_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return True
            try:
                cmd = self._cmds.get(timeout=min(self.arrival_gap_s, left))
            except queue.Empty:
                return True
            if not self._handle(*cmd):
                return False

    def _loop(self) -> None:
        eng = self.engine
        running = True
        while running:
            try:
                if not eng.has_unfinished() or eng.is_paused:  # idle or held: wait for a command
                    self._refresh_stats()
                    cmd = self._cmds.get()
                    running = self._handle(*cmd)
                    if running and cmd[0] == "add" and self.arrival_gap_s > 0:
                        running = self._gather_burst()
                while running:  # drain what arrived during the last step
                    try:
                        running = self._handle(*self._cmds.get_nowait())
                    except queue.Empty:
                        break
                if not running or not eng.has_unfinished() or eng.is_paused:
                    continue
                outs = eng.step()
                if outs:
                    self._deliver_all([(out.request_id, out) for out in outs])
                self._refresh_stats()
            except StepFailed as e:  # the step's requests were aborted and the books checked
                err = EngineError(str(e))
                self._deliver_all([(o.request_id, err) for o in e.failed])
                if e.fatal:
                    self._fail_all(err)
                    self._declare_dead(str(e))
                    running = False
                self._refresh_stats()
            except Exception as e:
                log.exception("engine failed outside a step")
                ok = self._fail_all(EngineError(f"engine failed: {type(e).__name__}: {e}"))
                self._refresh_stats()
                dead = self.engine.failure()
                if dead is not None or not ok:  # nothing can step any more: stop, so health says so
                    why = (str(dead).splitlines() or [type(dead).__name__])[0] if dead is not None else \
                        "the cleanup after the failure failed"
                    self._declare_dead(why)
                    running = False
        self._fail_all(self._dead or EngineDeadError("the engine was shut down"))
        while True:  # answer aborts still queued: their callers wait on the futures
            try:
                cmd, arg = self._cmds.get_nowait()
            except queue.Empty:
                break
            if cmd in ("abort", "call") and arg[1] is not None and arg[1].set_running_or_notify_cancel():
                if cmd == "call":
                    arg[1].set_exception(self._dead or EngineDeadError("the engine was shut down"))
                else:
                    arg[1].set_result(None)
        self._refresh_stats()
