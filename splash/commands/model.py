"""`splash model init-tiny|init-small|init-tiny-dsa|init-tiny-glm5|init-small-dsa DIR [--seed N]`,
`splash model train-mtp DIR [--seed N] [--minutes M | --steps N] [--layers N] [--hidden-size N]` and
`splash model info MODEL`."""

from __future__ import annotations

import argparse
import json
import os

from splash.core.model_config import ConfigError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("model", help="model checkpoints: write a built-in model (tiny, small, tiny-dsa, "
                                     "tiny-glm5, small-dsa), train one with an MTP layer, describe one")
    kinds = p.add_subparsers(dest="model_cmd", metavar="ACTION")
    helps = {"tiny": "write the built-in tiny DeepSeek-V3-architecture checkpoint (tests, demos)",
             "small": "write the built-in benchmark checkpoint: DeepSeek-V3's real MLA dims (latent 512 + "
                      "rope 64), hidden 512, 4 layers, 8 experts",
             "tiny-dsa": "write tiny with DeepSeek-V3.2's sparse attention (an indexer per layer, top-k 16)",
             "tiny-glm5": "write tiny in GLM-5's shape (DSA; every other layer shares the previous top-k)",
             "small-dsa": "write small with DSA (8 x 128 indexer, top-k 2048): sparse-vs-dense benchmarks"}
    for name, text in helps.items():
        t = kinds.add_parser(f"init-{name}", help=text)
        t.add_argument("dir", help="output directory (created; must not already hold a checkpoint)")
        t.add_argument("--seed", type=int, default=0,
                       help=f"weight seed (default 0, the one '--model {name}' uses)")
        t.add_argument("--force", action="store_true", help="overwrite a checkpoint already in DIR")
        t.set_defaults(func=_init_builtin, builtin=name)
    t = kinds.add_parser("train-mtp", help=(
        "train a small DeepSeek-V3 model with one MTP layer on the Python standard library's sources (CPU, "
        "~12 minutes): a checkpoint whose MTP drafts are really accepted, for speculative decoding"))
    t.add_argument("dir", help="output directory (created; must not already hold a checkpoint)")
    t.add_argument("--seed", type=int, default=0, help="seed of the weights and the batches (default 0)")
    t.add_argument("--minutes", type=float, default=12.0,
                   help="wall-clock budget of the whole command (default 12); the step count is fixed from "
                        "the speed of the first steps and written to train_info.json")
    t.add_argument("--steps", type=int, default=None,
                   help="train exactly N steps instead (ignores --minutes; replays a --minutes run exactly)")
    t.add_argument("--layers", type=int, default=None, metavar="N",
                   help="decoder layers of the main model (default 16: deep and narrow like DeepSeek-V3, so "
                        "the one MTP layer is a small share of a step)")
    t.add_argument("--hidden-size", type=int, default=None, metavar="N",
                   help="hidden size, a multiple of 32 (default 128); heads (N/32), MLA ranks and expert "
                        "sizes follow from it")
    t.add_argument("--force", action="store_true", help="overwrite a checkpoint already in DIR")
    t.set_defaults(func=_train_mtp)
    i = kinds.add_parser("info", help="dimensions, parameters and KV bytes per token of a checkpoint")
    i.add_argument("model", help="checkpoint directory, a built-in model (tiny, small, tiny-dsa, ...) or a "
                                 "preset (deepseek-v3, deepseek-v3.2, glm-5, ...)")
    i.add_argument("--json", action="store_true", help="print one JSON object")
    i.set_defaults(func=_info)
    p.set_defaults(func=lambda a: (p.print_help(), 2)[1])


def _init_builtin(args: argparse.Namespace) -> int:
    from splash.model.tiny import write_builtin_model

    name = getattr(args, "builtin", "tiny")
    _check_out_dir(args.dir, args.force, f"{name} model")
    if not 0 <= args.seed < 2**63:
        raise ConfigError(f"--seed must be in [0, 2**63), got {args.seed}")
    try:
        path = write_builtin_model(args.dir, name, seed=args.seed)
    except OSError as e:
        raise ConfigError(f"cannot write {args.dir}: {e.strerror or e}") from None
    print(f"wrote the {name} model (seed {args.seed}) to {path}")
    return 0


def _check_out_dir(path: str, force: bool, what: str) -> None:
    if not path:
        raise ConfigError(f"give the directory to write the {what} to")
    if os.path.isfile(os.path.join(path, "config.json")) and not force:
        raise ConfigError(f"{path} already holds a checkpoint; pass --force to overwrite it")
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"{path} exists and is not a directory")


def _train_mtp(args: argparse.Namespace) -> int:
    from splash.training.mtp import resolve_dims, train_mtp_model

    _check_out_dir(args.dir, args.force, "trained model")
    if args.layers is not None and args.layers < 1:
        raise ConfigError(f"--layers must be at least 1, got {args.layers}")
    if args.hidden_size is not None and (args.hidden_size < 32 or args.hidden_size % 32):
        raise ConfigError(f"--hidden-size must be a positive multiple of 32, got {args.hidden_size}")
    resolve_dims(args.layers, args.hidden_size)  # the rest of the shape's checks, before training
    if not 0 <= args.seed < 2**63:
        raise ConfigError(f"--seed must be in [0, 2**63), got {args.seed}")
    if args.steps is not None and args.steps < 1:
        raise ConfigError(f"--steps must be at least 1, got {args.steps}")
    if args.steps is None and not 0 < args.minutes < 10_000:
        raise ConfigError(f"--minutes must be a positive number of minutes, got {args.minutes}")
    try:  # fail before training, not after it
        os.makedirs(args.dir, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"cannot write {args.dir}: {e.strerror or e}") from None
    if not os.access(args.dir, os.W_OK):
        raise ConfigError(f"cannot write {args.dir}: permission denied; choose another directory")
    try:
        path = train_mtp_model(args.dir, seed=args.seed, minutes=args.minutes, steps=args.steps,
                               layers=args.layers, hidden_size=args.hidden_size)
    except OSError as e:
        raise ConfigError(f"cannot write {args.dir}: {e.strerror or e}") from None
    with open(os.path.join(path, "train_info.json"), encoding="utf-8") as f:
        info = json.load(f)
    held, shape = info["heldout"], info["shape"]
    print(f"wrote the MTP model ({shape['num_hidden_layers']} layers + 1 MTP layer, hidden "
          f"{shape['hidden_size']}; seed {args.seed}, {info['steps']} steps, {info['tokens_seen']:,} tokens, "
          f"{info['minutes']:.1f} min, {info['parameters'] / 1e6:.2f} M parameters) to {path}")
    print(f"held-out: main loss {held['main_loss']:.3f} top-1 {held['main_top1']:.1%}; MTP loss "
          f"{held['mtp_loss']:.3f} top-1 {held['mtp_top1']:.1%}; greedy draft acceptance "
          f"{held['mtp_agrees_main']:.1%} (held-out text), {held['mtp_acceptance_greedy_generated']:.1%} "
          "(the model's own greedy text)")
    return 0


def _info(args: argparse.Namespace) -> int:
    from splash.core.model_config import ModelConfig
    from splash.core.presets import PRESETS
    from splash.core.sizes import kv_bytes_per_token
    from splash.core.stores import values_per_token
    from splash.model import resolve_model_path
    from splash.model.tiny import BUILTIN_MODELS, weight_shapes

    if args.model in PRESETS and args.model not in BUILTIN_MODELS:  # dimensions only: no checkpoint to read
        path, cfg = None, PRESETS[args.model]
    else:
        path = resolve_model_path(args.model)
        cfg = ModelConfig.from_hf(path)
    params = sum(_numel(s) for s in weight_shapes(cfg).values())
    info = {"path": path, "model_type": cfg.model_type, "layers": cfg.num_hidden_layers,
            "hidden_size": cfg.hidden_size, "heads": cfg.num_attention_heads, "q_lora_rank": cfg.q_lora_rank,
            "kv_lora_rank": cfg.kv_lora_rank, "rope_head_dim": cfg.qk_rope_head_dim,
            "experts": cfg.n_routed_experts, "experts_per_token": cfg.num_experts_per_tok,
            "vocab_size": cfg.vocab_size, "parameters": params,
            "kv_values_per_token": values_per_token(cfg),
            "kv_bytes_per_token_bf16": kv_bytes_per_token(cfg, "bf16"),
            "kv_bytes_per_token_fp8": kv_bytes_per_token(cfg, "fp8"),  # = fp8_ds_mla (--kv-cache-dtype)
            "kv_bytes_per_token_fp8_e4m3": kv_bytes_per_token(cfg, "fp8_e4m3"),
            "rope_scaling": (cfg.rope_scaling or {}).get("rope_type"),
            "quantization": (cfg.quantization_config or {}).get("quant_method")}
    if cfg.is_sparse:  # DSA: the lightning indexer's dims and which layers run one
        full = cfg.indexer_layers
        info.update(index_n_heads=cfg.index_n_heads, index_head_dim=cfg.index_head_dim,
                    index_topk=cfg.index_topk, indexer_layers=len(full),
                    shared_layers=cfg.num_hidden_layers - len(full),
                    index_rope=("interleaved" if cfg.index_rope_interleave else "half-split"))
    if args.json:
        print(json.dumps(info))
    else:
        width = max(map(len, info))
        for k, v in info.items():
            print(f"{k:>{width}}: {'(a preset: dimensions only)' if k == 'path' and v is None else v}")
    return 0


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
