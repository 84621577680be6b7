"""`LLM`: the offline Python API, shaped like vLLM's (`LLM(model=...).generate(prompts, params)`)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from splash.config import EngineConfig
from splash.engine.llm_engine import LLMEngine
from splash.engine.outputs import RequestOutput
from splash.engine.sampling import SamplingParams

PromptLike = str | dict[str, Any] | Sequence[int]


class LLM:
    """Load a model once, then `generate` batches of prompts with continuous batching.

    `model` is "tiny" (the built-in model) or a Hugging Face DeepSeek-V2/V3 checkpoint directory. Other
    keywords are the engine's options (`splash.config.EngineConfig`: dtype, max_num_seqs, memory_per_rank,
    num_kv_pages, tp, layout, enforce_eager, ...; vLLM's `tensor_parallel_size` and SGLang's names are
    taken too, and an unknown one is refused naming the nearest valid one), or `config=` a whole one.

    With T > 1 ranks, rank 0 runs here and the others are started as processes (or joined from other
    nodes / torchrun); `shutdown()` (or leaving a `with LLM(...)` block, or interpreter exit) stops
    them. On a node or torchrun process that holds no rank 0, the constructor serves this node's
    ranks until rank 0 shuts down and then exits the program (SystemExit(0)), as vLLM's workers do.
    """

    def __init__(self, model: str = "tiny", dtype: str | None = None, *, config: EngineConfig | None = None,
                 **engine_kw: Any) -> None:
        from splash.core.model_config import ConfigError
        from splash.engine.group import follow_if_worker

        if config is None:
            config = EngineConfig.from_kwargs(model=model, dtype=dtype, **engine_kw)
        elif engine_kw or model != "tiny" or dtype is not None:
            raise ConfigError("give LLM a config= or keywords, not both")
        try:
            if follow_if_worker(config):
                raise SystemExit(0)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        from splash.engine.build import build_engine

        self.llm_engine: LLMEngine = build_engine(config)
        self._ids = itertools.count()

    def shutdown(self) -> None:
        """Stop the engine and its ranks (idempotent)."""
        self.llm_engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def get_tokenizer(self) -> Any:
        return self.llm_engine.tokenizer

    def stats(self) -> dict[str, Any]:
        return self.llm_engine.stats()

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache (vLLM's name; SGLang's /flush_cache): a benchmark repeating the same
        prompts would otherwise time cached prefills. False (nothing flushed) while requests hold KV."""
        try:
            self.llm_engine.flush_cache()
        except ValueError:
            return False
        return True

    # ---- RL: weight updates, sleep / wake-up (vLLM's names), pause (splash/engine/rl.py) -------------
    def update_weights_from_disk(self, model_path: str, weight_version: str | None = None) -> None:
        """Load every weight from checkpoint `model_path` into the live layout on every rank (all or
        nothing: WeightUpdateError names the tensor at fault and the old weights stay)."""
        self.llm_engine.update_weights_from_disk(model_path, weight_version)

    def update_weights_from_tensors(self, named_tensors: Any, weight_version: str | None = None) -> None:
        """Replace the named weights ({name: full tensor} or [(name, tensor)], checkpoint names)."""
        self.llm_engine.update_weights_from_tensors(named_tensors, weight_version)

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                  world_size: int, group_name: str = "weight_update_group",
                                  backend: str | None = None) -> None:
        """Join a trainer's broadcast group (trainer = rank 0; engine rank r = rank_offset + r)."""
        self.llm_engine.init_weights_update_group(master_address, master_port, rank_offset, world_size,
                                                  group_name, backend)

    def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                        group_name: str = "weight_update_group",
                                        weight_version: str | None = None) -> None:
        """Receive the named full tensors the trainer broadcasts from group rank 0, in this order."""
        self.llm_engine.update_weights_from_distributed(names, dtypes, shapes, group_name, weight_version)

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> None:
        self.llm_engine.destroy_weights_update_group(group_name)

    @property
    def weight_version(self) -> str:
        return self.llm_engine.weight_version

    def sleep(self, level: int = 1) -> None:
        """Free the KV cache and the weights on every rank (vLLM's name). Level 1 keeps a copy of the
        weights on disk (wake_up restores them exactly); level 2 discards them (wake_up re-reads the
        checkpoint last loaded from disk; push newer weights with an update after waking)."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
        self.llm_engine.release_memory_occupation(None, backup=level == 1)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Give back what `sleep` freed: `tags` "weights" and/or "kv_cache" (default both)."""
        self.llm_engine.resume_memory_occupation(tags)

    def is_sleeping(self) -> bool:
        return bool(self.llm_engine.rl_stats()["memory_released"])

    def generate(self, prompts: PromptLike | Sequence[PromptLike] | None = None,
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 prompt_token_ids: Sequence[int] | Sequence[Sequence[int]] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order."""
        items = _normalize(prompts, prompt_token_ids)
        if sampling_params is None:
            params = [SamplingParams()] * len(items)
        elif isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(items)
        else:
            params = list(sampling_params)
            if len(params) != len(items):
                raise ValueError(f"{len(params)} sampling params for {len(items)} prompts")
        eng = self.llm_engine
        why = eng.hold_reason()
        if why is not None:  # nothing would step: refuse rather than wait forever
            raise RuntimeError(f"cannot generate: {why}")
        ids = [f"llm-{next(self._ids)}" for _ in items]
        results: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from splash.progress import progress_bar

            bar = progress_bar(len(items), "generating", "req")
        try:
            for rid, (text, toks), p in zip(ids, items, params):
                eng.add_request(rid, prompt=text, params=p, prompt_token_ids=toks)
            while eng.has_unfinished():
                for out in eng.step(final_only=True):
                    if out.finished and out.request_id in ids:
                        results[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        finally:
            for rid in ids:  # an error (or Ctrl-C) must not leave pages behind
                if rid not in results:
                    eng.abort(rid)
            if bar is not None:
                bar.close()
        return [results[rid] for rid in ids]


def _normalize(prompts: Any, prompt_token_ids: Any) -> list[tuple[str | None, list[int] | None]]:
    """Every accepted prompt shape -> [(text or None, token ids or None)]."""
    if prompts is not None and prompt_token_ids is not None:
        raise ValueError("give prompts or prompt_token_ids, not both")
    if prompt_token_ids is not None:
        seqs = list(prompt_token_ids)
        if seqs and isinstance(seqs[0], int):
            seqs = [seqs]
        return [(None, [int(t) for t in s]) for s in seqs]
    if prompts is None:
        raise ValueError("give prompts (text) or prompt_token_ids")
    if isinstance(prompts, (str, dict)):
        prompts = [prompts]
    out: list[tuple[str | None, list[int] | None]] = []
    for p in prompts:
        if isinstance(p, str):
            out.append((p, None))
        elif isinstance(p, dict) and "prompt_token_ids" in p:
            out.append((p.get("prompt"), [int(t) for t in p["prompt_token_ids"]]))
        elif isinstance(p, dict) and "prompt" in p:
            out.append((str(p["prompt"]), None))
        else:
            raise ValueError(f"cannot read prompt {p!r}: use a string, or a dict with 'prompt' or "
                             f"'prompt_token_ids'")
    return out
