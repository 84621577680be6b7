"""`RuntimeSpec`: every fact an engine runs on, derived once on rank 0 and frozen.

`EngineConfig` holds what the user asked for; the spec holds what that means for this checkpoint on
these ranks: the checkpoint's directory and `ModelConfig` (parsed once), the torch dtype, the KV element
format ("auto" resolved), the start layout and schedule as `Layout`s, the theta prior (loaded once, when
the layout policy or the speculation-depth policy prices with it), the kernels, the speculation and
generation settings. `splash/engine/resolve.py` makes it; rank 0 sends it to every rank in the "load"
plan (it pickles), each rank builds its share from it (splash/worker/load.py) and rank 0's engine,
scheduler, switch controller and depth policy read it: nothing downstream parses or resolves again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from splash.config import EngineConfig, KernelConfig
from splash.core.layouts import Layout
from splash.core.model_config import ModelConfig
from splash.core.theta import Theta


@dataclass(frozen=True)
class RuntimeSpec:
    """The resolved engine (see the module docstring). `config` is the resolved `EngineConfig` (world and
    batch bounds filled); the other fields are the facts derived from it and the checkpoint."""

    config: EngineConfig
    model_path: str  # the checkpoint directory (absolute); what a memory resume re-reads
    model_name: str  # what the API reports ("tiny", or the checkpoint folder's name)
    model: ModelConfig  # with the draft (MTP) layers when MTP speculation is on
    dtype: torch.dtype
    device: str  # rank 0's device type ("cpu" | "cuda"): every rank must run on one of this type
    kv_format: str  # the pool's element format, the core's name (never "auto")
    page_size: int
    world: int
    start_layout: Layout  # what every rank loads (auto: DOP; one rank: TP's rules)
    schedule: tuple[tuple[int, Layout], ...] = ()  # forced switches (--switch-schedule), by step
    auto: bool = False  # --layout auto on T > 1: the policy switches live
    switching: bool = False  # live switches can happen (auto or a schedule): pools leave replica room
    theta: Theta | None = None  # the policies' prior (auto, or the depth policy); None when neither runs
    theta_source: str = ""
    kernels: KernelConfig = field(default_factory=KernelConfig)
    num_drafts: int = 0  # drafts per speculating request and step (0: speculation off)
    speculative_algorithm: str | None = None  # "NGRAM" | "MTP" | None
    speculative_policy: str = "auto"
    prefix_cache: bool = True
    generation_defaults: dict[str, Any] = field(default_factory=dict)  # the checkpoint's sampling defaults
    eos_token_ids: tuple[int, ...] = ()  # the model's and its tokenizer's

    # ---- convenience --------------------------------------------------------------------------------
    @property
    def layout_name(self) -> str:
        """The start layout's runtime name ("tp", ...), as plans and allocators carry it."""
        return self.start_layout.value

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size

    @classmethod
    def of(cls, config: EngineConfig, *, model: ModelConfig, dtype: torch.dtype, device: str,
           kv_format: str, model_path: str = "", model_name: str = "model", **facts: Any) -> RuntimeSpec:
        """The spec of a resolved `config` (`EngineConfig.resolved`) and the facts only rank 0 can find
        (the checkpoint's config, dtype, format, theta, ...): what follows from the config alone (layout,
        schedule, switching, kernels, speculation) is read here, once."""
        return cls(config=config, model_path=model_path, model_name=model_name, model=model, dtype=dtype,
                   device=device, kv_format=kv_format, page_size=config.page_size, world=config.world,
                   start_layout=Layout.named(config.start_layout),
                   schedule=tuple((n, Layout.named(lay)) for n, lay in config.schedule), auto=config.auto,
                   switching=config.switching, kernels=config.kernels, num_drafts=config.num_drafts,
                   speculative_algorithm=config.speculative_algorithm,
                   speculative_policy=config.speculative_policy, **facts)

    @classmethod
    def for_tests(cls, model: ModelConfig | None = None, *, dtype: torch.dtype = torch.float32,
                  world: int = 1, device: str = "cpu", kv_format: str | None = None, **options: Any
                  ) -> RuntimeSpec:
        """A spec without a checkpoint (the tests' model-free engines): `model` a ModelConfig (default
        the `tiny` preset), `options` EngineConfig keywords, or spec facts (`theta`, `eos_token_ids`,
        `prefix_cache`, ...)."""
        from dataclasses import fields

        from splash.core.model_config import dtype_name
        from splash.core.presets import PRESETS

        own = {f.name for f in fields(cls)} - {f.name for f in fields(EngineConfig)}
        facts = {k: options.pop(k) for k in list(options) if k in own}
        cfg = model if model is not None else PRESETS["tiny"]
        config = EngineConfig.from_kwargs(**options).resolved(world, cfg.max_position_embeddings)
        return cls.of(config, model=cfg, dtype=dtype, device=device, kv_format=kv_format or dtype_name(dtype),
                      **facts)
