"""Per-rank model runner, and the assembly of a single-rank engine from a model name.

The runner turns a `StepPlan` into the model's `ForwardContext`, runs the forward pass over all
rows and returns logits only for the rows rank 0 samples (the LM head over prefill rows is waste).
"""

from __future__ import annotations

import os
import re
from typing import Any

import torch

from splash.config import ConfigError, ModelConfig
from splash.engine.llm_engine import LLMEngine
from splash.engine.plan import LAYOUTS, StepPlan
from splash.engine.scheduler import SchedulerConfig
from splash.kv.allocator import KVAllocator

_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9, "t": 1e12,
          "tb": 1e12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(value: int | float | str) -> int:
    """'2GiB', '512MB', '1e9', 123 -> bytes; ConfigError on anything else."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if value <= 0:
            raise ConfigError(f"memory size must be positive, got {value}")
        return int(value)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)\s*", str(value).lower())
    if not m or m.group(2) not in _UNITS or float(m.group(1)) <= 0:
        raise ConfigError(f"cannot read memory size {value!r}; write e.g. 2GiB, 512MiB or 1500000000")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def _available_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 * 2**30


class ModelRunner:
    """One rank: weights, its KV pool, its attention layout; runs plans."""

    def __init__(self, model: Any, pool: Any, layout: Any, comm: Any = None, rank: int = 0,
                 world: int = 1) -> None:
        self.model = model
        self.pool = pool
        self.layout = layout
        self.comm = comm
        self.rank = rank
        self.world = world
        self.device = torch.device(getattr(model, "device", "cpu"))
        self.stats: dict[str, Any] = {}

    @torch.inference_mode()
    def forward(self, plan: StepPlan) -> torch.Tensor:
        """Run the plan on this rank; hidden states [N, d] of every row."""
        from splash.model.context import ForwardContext

        ctx = ForwardContext.build(plan.seqs, kv=self.pool, layout=self.layout, comm=self.comm,
                                   rank=self.rank, world=self.world, device=self.device, stats=self.stats)
        ids = torch.tensor(plan.input_ids, dtype=torch.long, device=self.device)
        return self.model(ids, ctx.positions, ctx)

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> torch.Tensor:
        """Logits [n_sample, V] for the plan's sample rows (rank 0's view)."""
        hidden = self.forward(plan)
        rows = plan.sample_rows()
        if not rows:
            return hidden.new_empty(0, self.model.cfg.vocab_size)
        idx = torch.tensor(rows, dtype=torch.long, device=self.device)
        return self.model.compute_logits(hidden.index_select(0, idx))


def _kv_pages(cfg: ModelConfig, model: torch.nn.Module, kv_dtype: torch.dtype, page_size: int,
              memory_per_rank: int | str | None, num_kv_pages: int | None, max_num_seqs: int,
              max_model_len: int, device: torch.device) -> int:
    """Pages of this rank's KV pool: an explicit count, or what the memory budget leaves after weights."""
    from splash.kv.pool import KVPool

    if num_kv_pages is not None:
        if num_kv_pages < 1:
            raise ConfigError(f"num_kv_pages must be >= 1, got {num_kv_pages}")
        return int(num_kv_pages)
    per_page = KVPool.bytes_per_page(cfg, page_size, kv_dtype)
    weights = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    if memory_per_rank is not None:
        budget = parse_bytes(memory_per_rank)
        kv = budget - weights
        if kv < per_page:
            raise ConfigError(f"--memory-per-rank {memory_per_rank} leaves no room for the KV cache: the "
                              f"weights take {weights / 2**20:.1f} MiB and one page needs {per_page} bytes; "
                              f"raise it")
        return int(kv // per_page)
    # Default: enough for a full batch at full context, capped by a share of what the device has.
    want = max_num_seqs * -(-max_model_len // page_size) * per_page
    cap = int(_available_bytes(device) * (0.85 if device.type == "cuda" else 0.2))
    if device.type != "cuda":
        cap = min(cap, 128 * 2**20)  # CPU demos and tests: plenty, and quick to allocate
    return max(1, min(want, cap) // per_page)


def build_engine(model: str = "tiny", dtype: str | torch.dtype | None = None, max_num_seqs: int = 64,
                 max_num_batched_tokens: int | None = None, max_model_len: int | None = None,
                 memory_per_rank: int | str | None = None, page_size: int = 16,
                 num_kv_pages: int | None = None, device: str | torch.device | None = None,
                 layout: str = "tp", ranks: int | None = None, tp: int | None = None,
                 seed: int | None = None) -> LLMEngine:
    """Load `model` ('tiny' or a checkpoint directory) and build a single-rank LLMEngine."""
    from splash.attention.batched import BatchedLocalLayout
    from splash.kv.pool import KVPool
    from splash.model import load_model, resolve_dtype, resolve_model_path

    world = int(ranks if ranks is not None else (tp if tp is not None else 1))
    if layout not in LAYOUTS:
        raise ConfigError(f"unknown layout {layout!r}; choose one of {', '.join(LAYOUTS)}")
    if world != 1:
        raise ConfigError(f"{world} ranks are not available yet in this engine; run with --tp 1")
    if page_size < 1:
        raise ConfigError(f"page_size must be >= 1, got {page_size}")
    if seed is not None:
        torch.manual_seed(seed)
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    path = resolve_model_path(model)
    cfg = ModelConfig.from_hf(path)
    tdtype = resolve_dtype(dtype, dev)
    net = load_model(path, tdtype, device=dev)
    max_model_len = int(max_model_len or cfg.max_position_embeddings)
    if max_model_len < 2:
        raise ConfigError(f"max_model_len must be >= 2, got {max_model_len}")
    if max_num_batched_tokens is None:
        max_num_batched_tokens = max(512, max_num_seqs)
    pages = _kv_pages(cfg, net, tdtype, page_size, memory_per_rank, num_kv_pages, max_num_seqs,
                      max_model_len, dev)
    pool = KVPool(cfg.num_hidden_layers, pages, page_size, cfg.latent_dim, tdtype, dev)
    runner = ModelRunner(net, pool, BatchedLocalLayout())
    alloc = KVAllocator(pages, page_size, world=1, layout=layout)
    sched = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                            max_model_len=max_model_len)
    tok = _load_tokenizer(path)
    eos = set(cfg.eos_token_ids)
    tok_eos = getattr(tok, "eos_token_id", None)
    if isinstance(tok_eos, int):
        eos.add(tok_eos)
    name = "tiny" if model == "tiny" else os.path.basename(os.path.normpath(os.fspath(model)))
    info = {"model": name, "dtype": str(tdtype).removeprefix("torch."), "device": str(dev),
            "kv_dtype": str(tdtype).removeprefix("torch.")}
    return LLMEngine(runner, alloc, sched, tokenizer=tok, eos_token_ids=sorted(eos),
                     vocab_size=cfg.vocab_size, model_name=name, info=info)


def _load_tokenizer(path: str) -> Any:
    """The checkpoint's tokenizer, or None when it ships none (then only token ids work)."""
    if not os.path.isfile(os.path.join(path, "tokenizer.json")):
        return None
    from splash.tokenizer import load_tokenizer

    return load_tokenizer(path)
