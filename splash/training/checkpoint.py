"""The trained model on disk: every tensor under its Hugging Face / DeepSeek checkpoint name (the MTP
layer's as `model.layers.{L}.*`, experts unfused), the configs and the tokenizer beside it, and the
checkpoint loaded back as the module it was trained as (reference logits for tests)."""

from __future__ import annotations

import json
import os
import re
from typing import Any

import torch

from splash.core.model_config import ModelConfig
from splash.training.corpus import SPECIALS
from splash.training.model import MTPModel, hf_config

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
