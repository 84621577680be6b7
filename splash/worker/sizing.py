"""How many KV pages one rank gets: its memory budget minus what its weights occupy, minus a reserve.

The weights counted are the ones this rank really holds for the layout it runs (measured from its
tensors), so the layout-dependent part is exactly the analytical core's: W_A/T of head-sharded
projections under TP/DOP, all of W_A under DP/CP (`splash.core.sizes.AttentionSizes.attention_weight_bytes`),
plus the fixed non-attention share and the replicated parts, which every layout holds alike. Hence on
one `--memory-per-rank`, DOP's pool exceeds DP's by W_A*(1-1/T)/k tokens per rank, to page rounding.
The reserve (activation workspace of one step) depends only on the engine's limits, never on the
layout, so it cancels out of that difference.
"""

from __future__ import annotations

import torch

from splash.core.model_config import ConfigError, ModelConfig
from splash.core.sizes import parse_bytes
from splash.runtime_spec import RuntimeSpec


def available_bytes(device: torch.device) -> int:
    """Free memory on `device` (CUDA: the driver's view; CPU: MemAvailable)."""
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


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of every tensor this rank's model holds (its shard, for the layout it was built for)."""
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers())
               if t is not None and not t.is_meta)


def reserve_bytes(cfg: ModelConfig, dtype: torch.dtype, max_num_batched_tokens: int,
                  max_num_seqs: int) -> int:
    """Activation workspace of one step, kept out of the KV budget (layout-independent on purpose).

    Per row: a few residual-width buffers, the absorbed queries and latent of all heads, the widest
    MLP intermediate (routed experts of one token, or the dense MLP); plus float32 logits of one
    sampled row per running sequence.
    """
    b = torch.empty(0, dtype=dtype).element_size()
    heads = cfg.num_attention_heads
    mlp = max(cfg.intermediate_size, (cfg.num_experts_per_tok or 0) * cfg.moe_intermediate_size)
    per_row = 8 * cfg.hidden_size + 2 * heads * cfg.latent_dim + 2 * mlp
    return int(max_num_batched_tokens * per_row * b + max_num_seqs * cfg.vocab_size * 4)


def kv_pages(spec: RuntimeSpec, device: torch.device, weights: int, reserve: int, keep_free: int = 0,
             state_bytes: int = 0) -> int:
    """Pages of one rank's KV pool: an explicit count, what the budget leaves, or a default, for the
    spec's model, page size, element format and limits on `device`, after this rank's measured
    `weights` and `reserve`.

    `keep_free`: bytes the default (unbudgeted) pool leaves unused beyond its usual share, e.g. for the
    projection replicas a live switch into DP/CP gathers. `state_bytes`: a KDA hybrid's state slots
    (splash/kv/state.py), taken from the same budget before the pages."""
    from splash.kv.pool import KVPool

    c, page_size = spec.config, spec.page_size
    num_kv_pages, memory_per_rank = c.num_kv_pages, c.memory_per_rank
    max_num_seqs, max_model_len = int(c.max_num_seqs or 0), int(c.max_model_len or 0)
    if num_kv_pages is not None:
        if num_kv_pages < 1:
            raise ConfigError(f"num_kv_pages must be >= 1, got {num_kv_pages}")
        return int(num_kv_pages)
    per_page = KVPool.bytes_per_page(spec.model, page_size, spec.dtype, spec.kv_format)
    most = -(-c.max_total_tokens // page_size) if c.max_total_tokens else None  # --max-total-tokens's cap
    if memory_per_rank is not None:
        budget = parse_bytes(memory_per_rank)
        kv = budget - weights - reserve - state_bytes
        if kv < per_page:
            state = f", the state slots {state_bytes / 2**20:.2f} MiB" if state_bytes else ""
            raise ConfigError(f"--memory-per-rank {memory_per_rank} leaves no room for the KV cache: this "
                              f"rank's weights take {weights / 2**20:.2f} MiB, the step workspace "
                              f"{reserve / 2**20:.2f} MiB{state}, and one page needs {per_page} bytes; "
                              "raise it")
        pages = int(kv // per_page)
        return pages if most is None else min(pages, most)
    # Default: enough for a full batch at full context, capped by a share of what the device has.
    want = max_num_seqs * -(-max_model_len // page_size) * per_page
    cap = int(available_bytes(device) * (0.85 if device.type == "cuda" else 0.2)) - keep_free
    if device.type == "cuda" and c.mem_fraction_static:  # weights + KV within this share of the GPU
        free, total = torch.cuda.mem_get_info(device)  # (the weights are loaded: counted in total - free)
        cap = int(free - total * (1 - c.mem_fraction_static)) - keep_free
    if device.type != "cuda":
        cap = min(cap, 128 * 2**20)  # CPU demos and tests: plenty, and quick to allocate
    if device.type == "cuda":  # (a CPU's default pool stays as it is: the slots come on top of it)
        cap -= state_bytes
    if cap < per_page:
        also = ""
        if keep_free:
            also = f" next to the {keep_free / 2**20:.0f} MiB of projection replicas live switching needs"
        if device.type == "cuda" and c.mem_fraction_static:
            also += f" within --mem-fraction-static {c.mem_fraction_static} (raise it)"
        raise ConfigError(f"free memory leaves no room for a KV cache{also}; pass --memory-per-rank or "
                          "--num-kv-pages")
    pages = min(want, cap) // per_page
    return pages if most is None else min(pages, most)
