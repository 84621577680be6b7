"""`splash model train-mtp`: train a small DeepSeek-V3-shaped model with one MTP layer on CPU, so
speculative-decoding benchmarks have a draft head whose guesses are really accepted (the built-in models
have random weights: their drafts almost never match). Shape: deep and narrow like DeepSeek-V3 itself
(default 16 layers at hidden 128, `layers` / `hidden_size` choose another; shape_dims), so the MTP layer
is a small share of a target step.

Corpus: the Python standard library's own sources (present on every machine; `site-packages`, tests,
codec tables and pydoc's topic dump left out), files in sorted order, one in HELDOUT_EVERY held out
for evaluation. Tokenizer: a byte-level BPE learnt from the training files with `tokenizers`. Main model:
transformers' DeepseekV3ForCausalLM (so the main model's semantics are exactly transformers'). MTP layer
(depth 1, DeepSeek-V3 paper, SGLang's / vLLM's DeepseekV3 MTP conventions): at position i,

    x = eh_proj(cat([enorm(embed(t[i+1])), hnorm(h[i])]))     h: the main model's final hidden, post-norm
    x = DecoderLayer_L(x)                                        positions i, causal, the main rotary
    logits = shared_head.head(shared_head.norm(x))               predicts t[i+2]

with L = num_hidden_layers; embed and head are the main model's while training (copies are written as
`model.layers.{L}.embed_tokens.weight` / `shared_head.head.weight`). Loss: main CE + MTP_WEIGHT * MTP CE.
The routers' e_score_correction_bias is trained as DeepSeek-V3 does (auxiliary-loss-free balancing: each
step it moves by BIAS_UPDATE towards the mean expert load).

Deterministic from the seed and the step count (fixed thread count, deterministic algorithms): a `minutes`
budget is turned into a step count once, from the speed of the first steps while the learning rate still
warms up (train_info.json records it, and `steps=` that number replays the run exactly on the same machine
and Python, unless the deadline cut it short: a machine that slowed down later).

This file is the training loop and its evaluation; the corpus and tokenizer are `corpus.py`, the model's
shape and module `model.py`, the checkpoint written and loaded `checkpoint.py` (all in splash/training/).
"""

from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from splash.core.model_config import ConfigError, ModelConfig
from splash.training.checkpoint import checkpoint_tensors, load_mtp_model, write_checkpoint
from splash.training.corpus import build_corpus, is_heldout, read_source, stdlib_files, train_tokenizer
from splash.training.model import DEFAULT_DIMS, MTPModel, model_config, resolve_dims, shape_dims

__all__ = [  # (with the corpus, model and checkpoint names callers import from here)
    "BIAS_UPDATE", "CALIBRATE_STEPS", "DEFAULT_DIMS", "MTP_WEIGHT", "TRAINED_NAME", "TRAIN_VERSION",
    "MTPModel", "Trained", "checkpoint_tensors", "ensure_trained_model", "evaluate", "generated_acceptance",
    "load_mtp_model", "model_config", "resolve_dims", "shape_dims", "train", "train_mtp_model",
    "write_checkpoint",
]

TRAIN_VERSION = "2"  # 2: the deep and narrow default shape (16 x 128)
MTP_WEIGHT = 0.3  # DeepSeek-V3's lambda for the first 10T tokens
# gamma of DeepSeek-V3's aux-loss-free load balancing: 5x its 0.001, so a run of a few hundred steps
# balances its experts (0.001 left them 3-4x skewed after 70 steps)
BIAS_UPDATE = 5e-3


# ---- training -----------------------------------------------------------------------------------------
class _Balancer:
    """DeepSeek-V3's auxiliary-loss-free balancing: count each router's expert picks during a step, then
    move its e_score_correction_bias by +-BIAS_UPDATE towards the mean load."""

    def __init__(self, model: nn.Module) -> None:
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

        self.routers = [m for m in model.modules() if isinstance(m, DeepseekV3TopkRouter)]
        self.counts = [torch.zeros(r.num_experts) for r in self.routers]
        self.active = False
        for i, r in enumerate(self.routers):
            r.register_forward_hook(self._hook(i))

    def _hook(self, i: int) -> Any:
        def count(_m: nn.Module, _inp: Any, out: Any) -> None:
            if self.active:
                idx = out[2].detach().reshape(-1)
                self.counts[i] += torch.bincount(idx, minlength=self.counts[i].numel()).to(torch.float32)
        return count

    @torch.no_grad()
    def step(self) -> float:
        """Apply the update; returns the worst max-load / mean-load ratio over routers (1 = balanced)."""
        worst = 1.0
        for r, c in zip(self.routers, self.counts):
            if c.sum() > 0:
                r.e_score_correction_bias += BIAS_UPDATE * torch.sign(c.mean() - c)
                worst = max(worst, float(c.max() / c.mean()))
            c.zero_()
        return worst


def _batch(stream: torch.Tensor, gen: torch.Generator, batch: int, seq: int) -> torch.Tensor:
    starts = torch.randint(0, stream.numel() - seq - 1, (batch,), generator=gen)
    return torch.stack([stream[s: s + seq + 1] for s in starts.tolist()])


def _losses(model: MTPModel, chunk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """chunk [B, S+1]: main CE on t[1..S], MTP CE on t[2..S]."""
    ids, labels = chunk[:, :-1], chunk[:, 1:]
    logits, mtp = model(ids)
    ce = nn.functional.cross_entropy
    main = ce(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
    extra = ce(mtp.reshape(-1, mtp.shape[-1]), labels[:, 1:].reshape(-1))
    return main, extra


@torch.no_grad()
def evaluate(model: MTPModel, stream: torch.Tensor, seq: int, windows: int) -> dict[str, float]:
    """Held-out losses and top-1 accuracies over `windows` evenly spaced windows of `stream`: main (t[i+1]),
    MTP (t[i+2]), and `mtp_agrees_main`: MTP's argmax at i equals the main model's argmax at i+1, i.e.
    greedy speculative decoding's acceptance of a 1-token draft on this text."""
    n = min(windows, (stream.numel() - 1) // (seq + 1))
    if n < 1:
        raise ConfigError("the held-out slice is shorter than one sequence; use a larger corpus")
    stride = (stream.numel() - (seq + 1)) // max(1, n - 1) if n > 1 else 0  # spread over every held-out file
    chunk = torch.stack([stream[i * stride: i * stride + seq + 1] for i in range(n)])
    model.eval()
    stats = torch.zeros(6, dtype=torch.float64)
    for b in range(0, n, 8):
        c = chunk[b: b + 8]
        ids, labels = c[:, :-1], c[:, 1:]
        logits, mtp = model(ids)
        ce = nn.functional.cross_entropy
        top, mtop = logits.argmax(-1), mtp.argmax(-1)
        stats += torch.tensor([
            ce(logits.flatten(0, 1), labels.flatten(), reduction="sum").item(),
            ce(mtp.flatten(0, 1), labels[:, 1:].flatten(), reduction="sum").item(),
            (top == labels).sum().item(), (mtop == labels[:, 1:]).sum().item(),
            (mtop == top[:, 1:]).sum().item(), labels.numel()], dtype=torch.float64)
    model.train()
    tok, mtok = stats[5].item(), stats[5].item() * (seq - 1) / seq
    return {"main_loss": stats[0].item() / tok, "mtp_loss": stats[1].item() / mtok,
            "main_top1": stats[2].item() / tok, "mtp_top1": stats[3].item() / mtok,
            "mtp_agrees_main": stats[4].item() / mtok, "tokens": int(tok)}


@torch.no_grad()
def generated_acceptance(model: MTPModel, stream: torch.Tensor, prompts: int = 8, prompt_len: int = 64,
                         new_tokens: int = 64) -> float:
    """Greedy speculative decoding's 1-token draft acceptance on the model's own greedy continuations of
    held-out prompts (what a benchmark serving this model greedily measures)."""
    model.eval()
    stride = max(prompt_len, (stream.numel() - prompt_len) // prompts)
    ids = torch.stack([stream[i * stride: i * stride + prompt_len] for i in range(prompts)])
    out = model.main.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                              min_new_tokens=new_tokens, do_sample=False, pad_token_id=2)
    logits, mtp = model(out)
    model.train()
    top, mtop = logits.argmax(-1), mtp.argmax(-1)
    # drafts proposed at positions whose next token is generated: i >= prompt_len - 1
    sl = slice(prompt_len - 1, out.shape[1] - 2)
    return float((mtop[:, sl] == top[:, 1:][:, sl]).float().mean())


CALIBRATE_STEPS = 12  # a `minutes` run times steps 6-11 (the first ones are slow), then fixes its step count


def _schedule(step: int, total: int, peak: float, warmup: int) -> float:
    """Linear warmup over `warmup` steps (not tied to `total`, so a `minutes` run can fix `total` during
    warmup and still replay exactly with steps=total), then cosine down to 10% of the peak at `total`."""
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, frac))))



def _check_args(steps: int | None, minutes: float, vocab_size: int, seq_len: int, batch_size: int,
                warmup: int, threads: int, dims: dict[str, Any]) -> None:
    if steps is not None and steps < 1:
        raise ConfigError(f"--steps must be at least 1, got {steps}")
    if steps is None and not (minutes > 0 and math.isfinite(minutes)):
        raise ConfigError(f"--minutes must be a positive number, got {minutes}; or give --steps")
    if vocab_size < 512:
        raise ConfigError(f"vocab_size must be at least 512 (256 bytes, 3 specials, merges): {vocab_size}")
    if seq_len < 2 or batch_size < 1 or warmup < 1 or threads < 1:
        raise ConfigError("seq_len must be >= 2 (the MTP layer predicts 2 ahead); batch_size, warmup and "
                          f"threads >= 1; got {seq_len}, {batch_size}, {warmup}, {threads}")
    max_pos = dims["max_position_embeddings"]
    if seq_len > max_pos:
        raise ConfigError(f"seq_len {seq_len} exceeds max_position_embeddings {max_pos}")


@dataclass
class Trained:
    """What a training run produced, before it is written."""

    model: MTPModel
    cfg: ModelConfig
    tokenizer: Any
    info: dict[str, Any]


def train_mtp_model(out_dir: str, *, seed: int = 0, minutes: float = 12.0, steps: int | None = None,
                    layers: int | None = None, hidden_size: int | None = None, **kwargs: Any) -> str:
    """Train (`train`'s arguments: `layers` x `hidden_size`, default 16 x 128) and write the checkpoint to
    `out_dir` (created); returns it."""
    t = train(seed=seed, minutes=minutes, steps=steps, layers=layers, hidden_size=hidden_size, **kwargs)
    return write_checkpoint(out_dir, t.model, t.cfg, t.tokenizer, t.info)


def train(*, seed: int = 0, minutes: float = 12.0, steps: int | None = None, vocab_size: int = 2048,
          seq_len: int = 256, batch_size: int = 8, lr: float = 3e-3, warmup: int = 50,
          layers: int | None = None, hidden_size: int | None = None, dims: dict[str, Any] | None = None,
          corpus_bytes: int | None = None, eval_windows: int = 64,
          threads: int = 2, progress: bool = True, log: Any = None) -> Trained:
    """Build the corpus and tokenizer, train the main model and its MTP layer, evaluate on held-out files.

    `steps`: train exactly that many steps (`minutes` is then ignored: the run is a pure function of the
    arguments). Otherwise the whole command (writing included) aims at `minutes` of wall clock: the step
    count is fixed during warmup from the speed of the first steps, and a hard deadline stops a machine
    that slows down later. `layers` / `hidden_size`: the model's depth and width (default 16 x 128), the
    other dims following from them (shape_dims); `dims` overrides any dim (tests), `corpus_bytes` keeps
    only the first stdlib files (tests)."""
    from splash.progress import progress_bar

    dims = resolve_dims(layers, hidden_size, dims)
    _check_args(steps, minutes, vocab_size, seq_len, batch_size, warmup, threads, dims)
    say = log or (lambda s: print(s, file=sys.stderr, flush=True))
    t0 = time.monotonic()
    deadline = t0 + minutes * 60.0 if steps is None else math.inf
    prev = (torch.get_num_threads(), torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled())
    torch.manual_seed(seed)
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        root, files = stdlib_files(corpus_bytes)
        texts = [read_source(root, f) for i, f in enumerate(files) if not is_heldout(i)]
        tok = train_tokenizer(texts, vocab_size)
        corpus = build_corpus(tok, root, files)
        say(f"corpus: {len(files)} stdlib files, {corpus.description['bytes'] / 1e6:.1f} MB -> "
            f"{corpus.train.numel():,} train / {corpus.heldout.numel():,} held-out tokens "
            f"(BPE vocab {tok.get_vocab_size()}, {time.monotonic() - t0:.0f} s)")
        cfg = model_config(tok.get_vocab_size(), dims)
        model = MTPModel(cfg)
        model.train()
        params = sum(p.numel() for p in model.parameters())
        mtp_params = sum(p.numel() for p in model.mtp.parameters())  # embedding and head are main's
        say(f"model: DeepSeek-V3 {cfg.num_hidden_layers} layers + 1 MTP layer, hidden {cfg.hidden_size}, "
            f"{cfg.num_attention_heads} heads, {cfg.n_routed_experts} experts (top {cfg.num_experts_per_tok}"
            f", intermediate {cfg.moe_intermediate_size}), {params / 1e6:.2f} M parameters "
            f"({mtp_params / 1e6:.2f} M in the MTP layer)")
        decay = [p for p in model.parameters() if p.dim() >= 2]
        flat = [p for p in model.parameters() if p.dim() < 2]
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                 {"params": flat, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95), eps=1e-8)
        balancer = _Balancer(model)
        gen = torch.Generator().manual_seed(seed)
        # a `minutes` run fixes its step count while still in warmup, where the schedule ignores it
        calibrate = min(CALIBRATE_STEPS, warmup)
        total = steps if steps is not None else calibrate
        bar = progress_bar(total, "train-mtp", "step", disable=not progress)
        ema: list[float] = []
        done, tokens, t_train, times, cut, skew = 0, 0, time.monotonic(), [], False, 1.0
        step = 0
        while step < total:
            if time.monotonic() > deadline and step > 0:
                say(f"stopped at step {step} of {total}: the {minutes:g}-minute budget is spent (the machine "
                    "slowed down after the first steps; --steps cannot replay a cut run)")
                cut = True
                break
            t_step = time.monotonic()
            for g in opt.param_groups:
                g["lr"] = _schedule(step, total, lr, warmup)
            chunk = _batch(corpus.train, gen, batch_size, seq_len)
            balancer.active = True
            main_loss, mtp_loss = _losses(model, chunk)
            balancer.active = False
            (main_loss + MTP_WEIGHT * mtp_loss).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            skew = balancer.step()
            step, tokens = step + 1, tokens + chunk[:, :-1].numel()
            done = step
            times.append(time.monotonic() - t_step)
            cur = [main_loss.item(), mtp_loss.item()]
            ema = cur if not ema else [0.95 * e + 0.05 * c for e, c in zip(ema, cur)]
            if steps is None and step == calibrate:
                per_step = sum(times[calibrate // 2:]) / len(times[calibrate // 2:])
                reserve = 8.0 + per_step * 0.4 * eval_windows / batch_size  # evaluation and writing
                total = step + max(0, int((deadline - time.monotonic() - reserve) / per_step))
                bar.total = total
                say(f"{per_step:.2f} s/step -> {total} steps in the {minutes:g}-minute budget "
                    f"(--steps {total} replays this run)")
            bar.set_postfix(loss=f"{ema[0]:.3f}", mtp=f"{ema[1]:.3f}",
                            tok_s=f"{tokens / (time.monotonic() - t_train):.0f}", skew=f"{skew:.2f}",
                            refresh=False)
            bar.update(1)
        bar.close()
        train_s = time.monotonic() - t_train
        say(f"trained {done} steps, {tokens:,} tokens in {train_s:.0f} s ({tokens / train_s:.0f} tok/s); "
            f"train loss {ema[0]:.3f}, MTP loss {ema[1]:.3f}; evaluating on held-out files")
        ev = evaluate(model, corpus.heldout, seq_len, eval_windows)
        ev["mtp_acceptance_greedy_generated"] = generated_acceptance(model, corpus.heldout,
                                                                     prompts=min(8, eval_windows))
        info = {"version": TRAIN_VERSION, "seed": seed, "steps": done, "planned_steps": total,
                "stopped_by_deadline": cut, "batch_size": batch_size, "seq_len": seq_len, "lr": lr,
                "warmup": warmup, "schedule": "linear warmup, cosine to 10%", "mtp_weight": MTP_WEIGHT,
                "bias_update": BIAS_UPDATE, "threads": threads, "tokens_seen": tokens,
                "train_seconds": round(train_s, 1), "minutes": round((time.monotonic() - t0) / 60.0, 2),
                "minutes_budget": None if steps is not None else minutes, "parameters": params,
                "main_parameters": sum(p.numel() for p in model.main.parameters()),
                "mtp_layer_parameters": mtp_params,
                "shape": {"vocab_size": cfg.vocab_size, **{k: getattr(cfg, k) for k in DEFAULT_DIMS}},
                "final_train_loss": {"main": round(ema[0], 4), "mtp": round(ema[1], 4)},
                "final_expert_skew": round(skew, 3),  # worst router's max / mean expert load, last step
                "heldout": {k: (round(v, 4) if isinstance(v, float) else v) for k, v in ev.items()},
                "corpus": corpus.description, "torch": torch.__version__}
        return Trained(model, cfg, tok, info)
    finally:
        torch.set_num_threads(prev[0])
        torch.use_deterministic_algorithms(prev[1], warn_only=prev[2])


TRAINED_NAME = "trained-mtp"  # `--model trained-mtp`: the benchmark model, trained once on first use


def ensure_trained_model(seed: int = 0) -> str:
    """Path of the benchmark MTP model (seed 0, 12 minutes), trained on first use into splash's cache
    (race-safe: built beside the target and renamed into place). Benchmarks ask for it by name;
    `make test` never does."""
    import shutil
    import sys
    import tempfile

    from splash.model.tiny import cache_dir

    final = os.path.join(cache_dir(), f"{TRAINED_NAME}-v{TRAIN_VERSION}-seed{seed}")
    if os.path.isfile(os.path.join(final, "model.safetensors")):
        return final
    os.makedirs(os.path.dirname(final), exist_ok=True)
    print(f"training the benchmark model '{TRAINED_NAME}' once (about 12 minutes on 2 cores; "
          f"`splash model train-mtp DIR` does the same) into {final}", file=sys.stderr)
    tmp = tempfile.mkdtemp(prefix=f".{TRAINED_NAME}-", dir=os.path.dirname(final))
    try:
        train_mtp_model(os.path.join(tmp, "m"), seed=seed, minutes=12.0)
        try:
            os.rename(os.path.join(tmp, "m"), final)
        except OSError:
            if not os.path.isfile(os.path.join(final, "model.safetensors")):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
