"""What an RL trainer drives between rollouts: pause/continue, weight updates, memory release.

`RLControl` is a part of `LLMEngine` (rank 0, `engine.rl`; the engine answers the same names). Every
method runs between steps on the thread that steps the engine (the AsyncEngine posts them to its engine
thread). Names follow SGLang's native API (`update_weights_from_disk`, `release_memory_occupation`, ...)
and vLLM's (`sleep`, `wake_up`).

While the engine is *held* - paused, or memory released - `step()` runs nothing: queued and retracted
requests wait, new ones queue behind them, and everything resumes on `continue_generation()` /
`resume_memory_occupation()`. A weight update applies between two steps: the prefix cache forgets
every page at once (no later request hits KV of the old weights; pages still held by live requests
are freed once, by their last holder), and live requests keep their KV and continue (SGLang's
partial rollouts); `pause_generation("retract")` first makes them recompute on the new weights
instead. docs/runtime.md "Events and the books" gives the rule of every event in one table.
"""

from __future__ import annotations

import logging
from typing import Any

from splash.engine.outputs import RequestOutput
from splash.engine.weights import (
    MEMORY_TAGS,
    WeightOp,
    disk_op,
    dist_op,
    run_op,
    tensors_op,
)
from splash.model.update import WeightUpdateError

log = logging.getLogger("splash.engine")

PAUSE_MODES = ("abort", "retract", "in_place")


class RLControl:
    """The engine's RL controls (`engine.rl`): uses its `scheduler`, `runner`, `allocator`, `abort_all`
    and `audit`. `NAMES`: what the engine answers for it (the names SGLang's and vLLM's callers use)."""

    NAMES = {n: n for n in (
        "is_paused", "hold_reason", "weight_version", "checkpoint_path", "memory_saver", "num_weight_updates",
        "pause_generation", "continue_generation", "retract_running", "flush_cache",
        "update_weights_from_disk", "update_weights_from_tensors", "init_weights_update_group",
        "update_weights_from_distributed", "destroy_weights_update_group", "release_memory_occupation",
        "resume_memory_occupation", "rl_stats")}

    def __init__(self, engine: Any, checkpoint_path: str | None = None) -> None:
        self.engine = engine
        self._held: set[str] = set()
        self._released: set[str] = set()
        self.weight_version = "default"
        self.checkpoint_path = checkpoint_path  # the checkpoint last loaded from disk (start or update)
        self.num_weight_updates = 0
        # Whether memory release is on (SGLang's --enable-memory-saver): `splash serve` and splash.Engine
        # start with it off as SGLang does, LLM (vLLM's sleep/wake_up) with it on.
        self.memory_saver = True

    def audit(self, where: str) -> None:
        self.engine.audit(where)  # prove the books (splash/kv/books.py)

    # ---- pause ----------------------------------------------------------------------------------
    @property
    def is_paused(self) -> bool:
        """No step runs (paused, or memory released); requests wait."""
        return bool(self._held)

    @property
    def kv_released(self) -> bool:
        """The KV cache's memory is released: no page exists to hold, read or write into."""
        return "kv_cache" in self._released

    def hold_reason(self) -> str | None:
        if "released" in self._held:
            return f"memory is released ({', '.join(sorted(self._released))}); resume it first"
        if "paused" in self._held:
            return "generation is paused; call continue_generation"
        return None

    def pause_generation(self, mode: str = "abort") -> list[RequestOutput]:
        """Stop stepping. "abort": end every request now (each with what it had, finish reason
        abort; returned); "retract": running requests drop their KV and go back to the queue (they
        recompute when generation continues); "in_place": running requests keep their KV."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode {mode!r} is unknown; choose one of {', '.join(PAUSE_MODES)}")
        self._held.add("paused")
        if mode == "abort":
            return self.engine.abort_all()
        if mode == "retract":
            self.retract_running()
        self.audit(f"pause ({mode})")
        return []

    def continue_generation(self) -> None:
        self._held.discard("paused")

    def retract_running(self) -> int:
        """Move every running sequence back to the queue's front (pages freed, order kept)."""
        sched = self.engine.scheduler
        running = list(sched.running)
        for seq in reversed(running):
            sched._preempt(seq)
        return len(running)

    def flush_cache(self) -> None:
        """Empty the prefix cache (every cached page freed); with live requests their KV is in use, and
        flushing is refused (as SGLang does)."""
        # Only KV in use blocks a flush: requests queued without pages (new ones waiting out a pause, as
        # SGLang holds them outside its scheduler) lose nothing, so slime's pause -> flush -> update works.
        live = len(self.engine.scheduler.running)
        if live:
            raise ValueError(f"cache not flushed: {live} running requests hold KV; wait for them, abort them "
                             f"or pause with mode abort or retract")
        self.engine.allocator.invalidate_cache()
        self.audit("flush_cache")

    # ---- weights --------------------------------------------------------------------------------
    def _check_weights_live(self) -> None:
        if "weights" in self._released:
            raise WeightUpdateError("the weights are released; resume_memory_occupation(['weights']) first")

    def _after_update(self, version: str | None) -> None:
        self.num_weight_updates += 1
        self.weight_version = str(version) if version is not None else str(self.num_weight_updates)
        # Cached prefixes hold the old weights' KV: never match them again (SGLang flushes too); KV of
        # live requests is theirs (see the module docstring), pages they share freed by the last one.
        self.engine.allocator.invalidate_cache()
        self.audit("a weight update")

    def update_weights_from_disk(self, model_path: str, weight_version: str | None = None) -> None:
        """Load every weight from a checkpoint directory into the live layout on every rank (all or
        nothing; WeightUpdateError names what is wrong, and the old weights keep serving)."""
        self._check_weights_live()
        op = disk_op(self.engine, model_path)
        self._run(op)
        self.checkpoint_path = op.args["path"]
        self._after_update(weight_version)

    def update_weights_from_tensors(self, named_tensors: Any, weight_version: str | None = None) -> None:
        """Replace the named weights ({name: full tensor} or [(name, tensor)], checkpoint names and
        shapes) on every rank; the others keep their values."""
        self._check_weights_live()
        self._run(tensors_op(self.engine, named_tensors))
        self._after_update(weight_version)

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                  world_size: int, group_name: str = "weight_update_group",
                                  backend: str | None = None, timeout_s: float = 600.0) -> None:
        """Join a trainer's group (trainer = rank 0; engine rank r = rank_offset + r). Blocks until the
        trainer and every engine rank have joined; `timeout_s` also bounds each later broadcast (a
        trainer may gather a bucket between posting an update and sending it)."""
        if backend is None:
            backend = "nccl" if self.engine.runner.device.type == "cuda" else "gloo"
        if backend not in ("gloo", "nccl"):
            raise WeightUpdateError(f"backend {backend!r} is not supported; use gloo (CPU) or nccl (GPU)")
        if backend == "nccl" and self.engine.runner.device.type != "cuda":
            raise WeightUpdateError("backend nccl needs an engine on CUDA; this one runs on CPU: use gloo")
        world = self.engine.allocator.world
        if not isinstance(rank_offset, int) or not isinstance(world_size, int) or rank_offset < 1 \
                or rank_offset + world > world_size:
            raise WeightUpdateError(f"the engine's {world} ranks need group ranks rank_offset.."
                                    f"rank_offset+{world - 1} within world_size={world_size}, after the "
                                    f"trainer's rank 0 (got rank_offset={rank_offset})")
        self._run(WeightOp("init_group", {"master_address": str(master_address),
                                          "master_port": int(master_port), "rank_offset": rank_offset,
                                          "world_size": world_size,
                                          "group_name": str(group_name), "backend": backend,
                                          "timeout_s": float(timeout_s)}))

    def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                        group_name: str = "weight_update_group",
                                        weight_version: str | None = None) -> None:
        """Receive the named full tensors the trainer broadcasts (from group rank 0, in this order)."""
        self._check_weights_live()
        self._run(dist_op(self.engine, list(names), list(dtypes), [list(s) for s in shapes], group_name))
        self._after_update(weight_version)

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> None:
        self._run(WeightOp("destroy_group", {"group_name": group_name}))

    def _run(self, op: WeightOp) -> None:
        reply = run_op(self.engine, op)
        if not reply.get("ok"):
            raise WeightUpdateError(reply.get("error") or "the ranks refused the operation")

    # ---- memory ---------------------------------------------------------------------------------
    def release_memory_occupation(self, tags: list[str] | None = None, backup: bool = True) -> None:
        """Free KV-cache and/or weight memory on every rank ("kv_cache", "weights"; default both).
        Running requests are retracted (they recompute later); nothing steps until all is resumed.
        `backup=False` discards the weights: resume then re-reads the last checkpoint from disk."""
        tags = self._tags(tags)
        if not self.memory_saver:
            raise ValueError("memory release is off on this engine: start it with --enable-memory-saver "
                             "(splash.Engine: enable_memory_saver=True), as SGLang needs")
        if "kv_cache" in tags:
            self.retract_running()
            self.engine.allocator.invalidate_cache()  # the pool's memory goes: nothing cached survives
            self.engine.pd.release()  # prefill/decode: no transfer may land in memory about to go
        self._held.add("released")
        self._released |= set(tags)
        self._run(WeightOp("release", {"tags": tags, "backup": backup}))
        self.audit("memory release")

    def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        """Give back what `release_memory_occupation` freed (weights as they were when released)."""
        tags = self._tags(tags)
        self._run(WeightOp("resume", {"tags": tags, "checkpoint": self.checkpoint_path}))
        self._released -= set(tags)
        if not self._released:
            self._held.discard("released")

    @staticmethod
    def _tags(tags: list[str] | None) -> list[str]:
        if tags is None:
            return list(MEMORY_TAGS)
        if isinstance(tags, str) or not all(isinstance(t, str) for t in tags):
            raise ValueError(f"tags must be a list of strings from {list(MEMORY_TAGS)}")
        bad = [t for t in tags if t not in MEMORY_TAGS]
        if bad:
            raise ValueError(f"memory tag {bad[0]!r} is unknown; use {' and/or '.join(MEMORY_TAGS)}")
        return list(dict.fromkeys(tags))

    def rl_stats(self) -> dict[str, Any]:
        return {"weight_version": self.weight_version, "paused": "paused" in self._held,
                "memory_released": sorted(self._released), "num_weight_updates": self.num_weight_updates}
