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
"""

from __future__ import annotations

import json
import math
import os
import platform
import re
import sys
import sysconfig
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from splash.core.model_config import ConfigError, ModelConfig

TRAIN_VERSION = "2"  # 2: the deep and narrow default shape (16 x 128)
SPECIALS = {"bos_token": "<|bos|>", "eos_token": "<|eos|>", "pad_token": "<|pad|>"}  # ids 0, 1, 2
SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__",
                       "encodings", "pydoc_data"})  # not code people write / huge generated tables
HELDOUT_EVERY = 25  # files 12, 37, 62, ... (sorted) are held out
MTP_WEIGHT = 0.3  # DeepSeek-V3's lambda for the first 10T tokens
# gamma of DeepSeek-V3's aux-loss-free load balancing: 5x its 0.001, so a run of a few hundred steps
# balances its experts (0.001 left them 3-4x skewed after 70 steps)
BIAS_UPDATE = 5e-3
# The default shape: DeepSeek-V3's architecture, deep and narrow like the real one (61 layers + 1 MTP
# layer), so the MTP layer is a small share of a target step (on CPU at batch 1 every layer costs about the
# same: at 4 layers a chain of 3 drafts cost ~75% of a step). 16 x 128 has about 4 x 256's matmul FLOPs
# per token, but trains ~1.4x slower per token on 2 cores (each layer's attention scores cost the same at
# any width, and 4x the layers run 4x the small ops).
DEFAULT_LAYERS = 16
DEFAULT_HIDDEN = 128
HEAD_DIM = 32  # qk_nope_head_dim = v_head_dim; heads = hidden / HEAD_DIM, so heads * v_head_dim = hidden
ROPE_DIM = 16
MAX_LAYERS = 256


def shape_dims(layers: int = DEFAULT_LAYERS, hidden_size: int = DEFAULT_HIDDEN) -> dict[str, Any]:
    """The model dims that follow from a depth and a width: MLA with hidden/32 heads of 32 (+16 rope),
    q_lora_rank 3/4 hidden, kv_lora_rank max(64, hidden/2); one dense first layer (intermediate 3 x hidden),
    then MoE: 8 routed experts top-2 plus 1 shared, expert intermediate hidden/2. At 16 x 128: 4 heads,
    q_lora_rank 96, kv_lora_rank 64, dense 384, experts 64."""
    if isinstance(layers, bool) or not isinstance(layers, int) or not 1 <= layers <= MAX_LAYERS:
        raise ConfigError(f"layers must be an integer in [1, {MAX_LAYERS}], got {layers!r}")
    if (isinstance(hidden_size, bool) or not isinstance(hidden_size, int) or hidden_size % HEAD_DIM
            or not HEAD_DIM <= hidden_size <= 4096):
        raise ConfigError(f"hidden size must be a multiple of {HEAD_DIM} in [{HEAD_DIM}, 4096] (heads of "
                          f"{HEAD_DIM}), got {hidden_size!r}")
    h = hidden_size
    return {"hidden_size": h, "intermediate_size": 3 * h, "moe_intermediate_size": h // 2,
            "num_hidden_layers": layers, "num_attention_heads": h // HEAD_DIM, "q_lora_rank": 3 * h // 4,
            "kv_lora_rank": max(64, h // 2), "qk_nope_head_dim": HEAD_DIM, "qk_rope_head_dim": ROPE_DIM,
            "v_head_dim": HEAD_DIM, "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2,
            "n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.5, "first_k_dense_replace": 1,
            "max_position_embeddings": 2048}


DEFAULT_DIMS: dict[str, Any] = shape_dims()


def resolve_dims(layers: int | None = None, hidden_size: int | None = None,
                 dims: dict[str, Any] | None = None) -> dict[str, Any]:
    """Every model dim: shape_dims(layers, hidden_size) (each defaulting to `dims`' own value, then to
    the default shape), overridden by `dims` (tests pin toy dims that way)."""
    dims = dict(dims or {})
    unknown = set(dims) - set(DEFAULT_DIMS)
    if unknown:
        raise ConfigError(f"unknown model dims {sorted(unknown)}; choose from {sorted(DEFAULT_DIMS)}")
    for arg, key, val in (("layers", "num_hidden_layers", layers),
                          ("hidden_size", "hidden_size", hidden_size)):
        if val is not None and key in dims and dims[key] != val:
            raise ConfigError(f"{arg}={val} contradicts dims[{key!r}]={dims[key]}")
    L = layers if layers is not None else dims.get("num_hidden_layers", DEFAULT_LAYERS)
    h = hidden_size if hidden_size is not None else dims.get("hidden_size", DEFAULT_HIDDEN)
    return {**shape_dims(L, h), **dims}


def _heldout(i: int) -> bool:
    return i % HELDOUT_EVERY == HELDOUT_EVERY // 2


@dataclass(frozen=True)
class Corpus:
    """Token streams (documents as BOS text EOS, concatenated) and what they were made from."""

    train: torch.Tensor  # int64 [N]
    heldout: torch.Tensor  # int64 [M]
    description: dict[str, Any]


# ---- corpus and tokenizer -----------------------------------------------------------------------------
def stdlib_files(limit_bytes: int | None = None) -> tuple[str, list[str]]:
    """The stdlib's *.py files (sorted relative paths) and its root; `limit_bytes` keeps the first files
    up to that many bytes (tests use a small slice)."""
    root = sysconfig.get_paths()["stdlib"]
    out: list[str] = []
    for d, dirs, files in os.walk(root):
        rel = os.path.relpath(d, root)
        parts = [] if rel == "." else rel.split(os.sep)
        if SKIP_DIRS.intersection(parts):
            dirs[:] = []
            continue
        dirs[:] = [x for x in dirs if x not in SKIP_DIRS]
        out += [os.path.join(*parts, f) for f in files if f.endswith(".py")]
    out.sort()
    if limit_bytes is not None:
        kept, total = [], 0
        for f in out:
            if total >= limit_bytes:
                break
            kept.append(f)
            total += os.path.getsize(os.path.join(root, f))
        out = kept
    if len(out) < 2:
        raise ConfigError(f"found no Python sources under the standard library at {root}; train-mtp needs "
                          "a Python installation with its stdlib sources (*.py)")
    return root, out


def _read(root: str, rel: str) -> str:
    with open(os.path.join(root, rel), encoding="utf-8", errors="replace") as f:
        return f.read()


def train_tokenizer(texts: list[str], vocab_size: int) -> Any:
    """Byte-level BPE (GPT-2's byte alphabet, so any text encodes) with BOS/EOS/PAD at ids 0-2 and BOS
    prepended by the post-processor, as splash's built-in tokenizer does. BPE training has no randomness:
    the same texts give the same merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIALS.values()),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), min_frequency=2,
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer)
    bos = SPECIALS["bos_token"]
    tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                       special_tokens=[(bos, tok.token_to_id(bos))])
    return tok


def build_corpus(tok: Any, root: str, files: list[str]) -> Corpus:
    """Encode every file as BOS text EOS; held-out files (`_heldout`) go to their own stream."""
    eos = tok.token_to_id(SPECIALS["eos_token"])
    texts = [_read(root, f) for f in files]
    encs = tok.encode_batch(texts)  # BOS added by the post-processor
    train: list[int] = []
    held: list[int] = []
    for i, e in enumerate(encs):
        (held if _heldout(i) else train).extend([*e.ids, eos])
    desc = {"source": "Python standard library sources (*.py)", "root": root,
            "python": platform.python_version(), "files": len(files),
            "heldout_files": sum(map(_heldout, range(len(files)))),
            "bytes": sum(len(t.encode()) for t in texts), "skipped_dirs": sorted(SKIP_DIRS),
            "heldout_rule": f"file i (sorted) with i % {HELDOUT_EVERY} == {HELDOUT_EVERY // 2}",
            "train_tokens": len(train), "heldout_tokens": len(held)}
    return Corpus(torch.tensor(train, dtype=torch.long), torch.tensor(held, dtype=torch.long), desc)


# ---- model --------------------------------------------------------------------------------------------
def model_config(vocab_size: int, dims: dict[str, Any] | None = None) -> ModelConfig:
    """The splash ModelConfig of the trained model: `resolve_dims(dims=dims)` (the default shape, or the
    shape following from dims' layers and hidden size, overridden by `dims`)."""
    d = resolve_dims(dims=dims)
    return ModelConfig(name="mtp", model_type="deepseek_v3", vocab_size=vocab_size, topk_method="noaux_tc",
                       scoring_func="sigmoid", norm_topk_prob=True, rope_theta=10000.0, rope_scaling=None,
                       rope_interleave=True, bos_token_id=0, eos_token_id=1, pad_token_id=2, **d)


def hf_config(cfg: ModelConfig) -> dict[str, Any]:
    """config.json: splash's built-in form (splash.model.tiny.hf_config_dict) plus one MTP layer."""
    from splash.model.tiny import hf_config_dict

    return {**hf_config_dict(cfg), "num_nextn_predict_layers": 1}


class MTPLayer(nn.Module):
    """DeepSeek-V3's MTP module at depth 1: a DeepseekV3DecoderLayer (layer index L, so its MLP is MoE)
    plus enorm / hnorm / eh_proj / shared_head.norm; the embedding and head are passed in (the main
    model's). Its names, `layer.` dropped, are the checkpoint's under `model.layers.{L}.`."""

    def __init__(self, config: Any, layer_idx: int) -> None:
        super().__init__()
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
            DeepseekV3DecoderLayer,
            DeepseekV3RMSNorm,
        )

        d = config.hidden_size
        self.enorm = DeepseekV3RMSNorm(d, eps=config.rms_norm_eps)
        self.hnorm = DeepseekV3RMSNorm(d, eps=config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * d, d, bias=False)
        self.layer = DeepseekV3DecoderLayer(config, layer_idx=layer_idx)
        self.shared_head = nn.Module()
        self.shared_head.norm = DeepseekV3RMSNorm(d, eps=config.rms_norm_eps)

    def forward(self, next_embeds: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor,
                position_embeddings: tuple[torch.Tensor, torch.Tensor], mask: Any,
                head: nn.Module) -> torch.Tensor:
        """Logits for t[i+2] from embed(t[i+1]) and the main model's post-norm hidden h[i]."""
        x = self.eh_proj(torch.cat([self.enorm(next_embeds), self.hnorm(hidden)], dim=-1))
        x = self.layer(x, attention_mask=mask, position_ids=position_ids,
                       position_embeddings=position_embeddings)
        return head(self.shared_head.norm(x))


class MTPModel(nn.Module):
    """transformers' DeepseekV3ForCausalLM (`main`) plus one MTP layer sharing its embedding and head."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

        hf = DeepseekV3Config(**{k: v for k, v in hf_config(cfg).items() if k != "architectures"})
        hf._attn_implementation = "sdpa"
        self.main = DeepseekV3ForCausalLM(hf)
        self.mtp = MTPLayer(hf, layer_idx=cfg.num_hidden_layers)
        for m in self.mtp.modules():  # transformers' own init (N(0, initializer_range), unit norms)
            self.main._init_weights(m)

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """ids [B, S] -> (main logits [B, S, V] for t[1..S], MTP logits [B, S-1, V] for t[2..S])."""
        from transformers.masking_utils import create_causal_mask

        base = self.main.model
        h = base(input_ids=ids).last_hidden_state  # after model.norm
        logits = self.main.lm_head(h)
        n = ids.shape[1] - 1
        pos = torch.arange(n, device=ids.device).unsqueeze(0)
        e = base.embed_tokens(ids[:, 1:])
        rope = base.rotary_emb(e, pos)
        mask = create_causal_mask(config=self.main.config, inputs_embeds=e, attention_mask=None, cache=None,
                                  position_ids=pos)
        mtp_logits = self.mtp(e, h[:, :-1], pos, rope, mask, self.main.lm_head)
        return logits, mtp_logits


_FUSED = re.compile(r"^(.*mlp\.experts)\.(gate_up_proj|down_proj)$")


def _unfuse(name: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
    """transformers 5 keeps experts fused ([E, 2I, H] gate|up, [E, H, I] down); checkpoints name each."""
    m = _FUSED.match(name)
    if not m:
        return {name: t}
    out = {}
    for e in range(t.shape[0]):
        p = f"{m.group(1)}.{e}"
        if m.group(2) == "down_proj":
            out[f"{p}.down_proj.weight"] = t[e]
        else:
            inter = t.shape[1] // 2
            out[f"{p}.gate_proj.weight"] = t[e, :inter]
            out[f"{p}.up_proj.weight"] = t[e, inter:]
    return out


def checkpoint_tensors(model: MTPModel, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Every tensor under its Hugging Face / DeepSeek checkpoint name, MTP layer included (float32)."""
    from splash.model.tiny import weight_shapes

    L = cfg.num_hidden_layers
    out: dict[str, torch.Tensor] = {}
    for k, v in model.main.state_dict().items():
        out.update(_unfuse(k, v))
    for k, v in model.mtp.state_dict().items():
        k = k.removeprefix("layer.")
        out.update(_unfuse(f"model.layers.{L}.{k}", v))
    out[f"model.layers.{L}.embed_tokens.weight"] = model.main.model.embed_tokens.weight
    out[f"model.layers.{L}.shared_head.head.weight"] = model.main.lm_head.weight
    want = mtp_weight_shapes(cfg) | weight_shapes(cfg)
    got = {k: tuple(v.shape) for k, v in out.items()}
    if got != want:  # a transformers whose names drifted: fail here, not in the server
        diff = sorted(set(got) ^ set(want)) or sorted(k for k in got if got[k] != want[k])
        raise RuntimeError(f"checkpoint names/shapes differ from DeepSeek-V3's: {diff[:6]}")
    return {k: v.detach().to(torch.float32).contiguous().clone() for k, v in out.items()}


def load_mtp_model(path: str) -> MTPModel:
    """A checkpoint written by train_mtp_model as the MTPModel it was trained as (experts fused back), so
    tests and the serving side get reference main and MTP logits: `load_mtp_model(dir)(ids)`."""
    from safetensors.torch import load_file

    cfg = ModelConfig.from_hf(path)
    model = MTPModel(cfg)
    flat = load_file(os.path.join(path, "model.safetensors"))
    L = cfg.num_hidden_layers

    def fused(sd: dict[str, torch.Tensor], name: Any) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for k, v in sd.items():
            m = _FUSED.match(name(k))
            if not m:
                out[k] = flat[name(k)]
            elif m.group(2) == "down_proj":
                out[k] = torch.stack([flat[f"{m.group(1)}.{e}.down_proj.weight"] for e in range(v.shape[0])])
            else:
                out[k] = torch.stack([torch.cat([flat[f"{m.group(1)}.{e}.gate_proj.weight"],
                                                 flat[f"{m.group(1)}.{e}.up_proj.weight"]])
                                      for e in range(v.shape[0])])
        return out

    model.main.load_state_dict(fused(model.main.state_dict(), lambda k: k))
    model.mtp.load_state_dict(fused(model.mtp.state_dict(),
                                    lambda k: f"model.layers.{L}.{k.removeprefix('layer.')}"))
    model.eval()
    return model


def mtp_weight_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The MTP layer's tensors (`model.layers.{L}.*`, L = num_hidden_layers) and their shapes."""
    import dataclasses

    from splash.model.tiny import weight_shapes

    L, d = cfg.num_hidden_layers, cfg.hidden_size
    p = f"model.layers.{L}."
    deeper = weight_shapes(dataclasses.replace(cfg, num_hidden_layers=L + 1))
    s = {k: v for k, v in deeper.items() if k.startswith(p)}
    s.update({p + "enorm.weight": (d,), p + "hnorm.weight": (d,), p + "eh_proj.weight": (d, 2 * d),
              p + "shared_head.norm.weight": (d,), p + "shared_head.head.weight": (cfg.vocab_size, d),
              p + "embed_tokens.weight": (cfg.vocab_size, d)})
    return s


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


def _write_json(path: str, obj: dict[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")


def write_checkpoint(out_dir: str, model: MTPModel, cfg: ModelConfig, tok: Any,
                     info: dict[str, Any]) -> str:
    """config.json, generation_config.json, model.safetensors (float32, MTP layer included), the tokenizer
    (tokenizer.json, tokenizer_config.json, special_tokens_map.json) and train_info.json."""
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    _write_json(os.path.join(out_dir, "tokenizer_config.json"),
                {**SPECIALS, "add_bos_token": False, "model_max_length": cfg.max_position_embeddings,
                 "tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False})
    _write_json(os.path.join(out_dir, "special_tokens_map.json"), SPECIALS)
    _write_json(os.path.join(out_dir, "config.json"), hf_config(cfg))
    _write_json(os.path.join(out_dir, "generation_config.json"),
                {"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2, "do_sample": False})
    weights = os.path.join(out_dir, "model.safetensors")
    save_file(checkpoint_tensors(model, cfg), weights, metadata={"format": "pt"})
    os.chmod(weights, os.stat(os.path.join(out_dir, "config.json")).st_mode & 0o777)  # (it writes 0600)
    _write_json(os.path.join(out_dir, "train_info.json"), info)
    return out_dir


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
        tok = train_tokenizer([_read(root, f) for i, f in enumerate(files) if not _heldout(i)], vocab_size)
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
