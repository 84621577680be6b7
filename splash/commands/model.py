"""`splash model init-tiny|init-small|init-tiny-dsa|init-tiny-glm5|init-small-dsa DIR [--seed N]` and
`splash model info MODEL`."""

from __future__ import annotations

import argparse
import json
import os

from splash.core.config import ConfigError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("model", help="model checkpoints: write a built-in model (tiny, small, tiny-dsa, "
                                     "tiny-glm5, small-dsa), describe one")
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
    i = kinds.add_parser("info", help="dimensions, parameters and KV bytes per token of a checkpoint")
    i.add_argument("model", help="checkpoint directory, a built-in model (tiny, small, tiny-dsa, ...) or a "
                                 "preset (deepseek-v3, deepseek-v3.2, glm-5, ...)")
    i.add_argument("--json", action="store_true", help="print one JSON object")
    i.set_defaults(func=_info)
    p.set_defaults(func=lambda a: (p.print_help(), 2)[1])


def _init_builtin(args: argparse.Namespace) -> int:
    from splash.model.tiny import write_builtin_model

    name = getattr(args, "builtin", "tiny")
    if os.path.isfile(os.path.join(args.dir, "config.json")) and not args.force:
        raise ConfigError(f"{args.dir} already holds a checkpoint; pass --force to overwrite it")
    if not args.dir:
        raise ConfigError(f"give the directory to write the {name} model to")
    if os.path.exists(args.dir) and not os.path.isdir(args.dir):
        raise ConfigError(f"{args.dir} exists and is not a directory")
    if not 0 <= args.seed < 2**63:
        raise ConfigError(f"--seed must be in [0, 2**63), got {args.seed}")
    try:
        path = write_builtin_model(args.dir, name, seed=args.seed)
    except OSError as e:
        raise ConfigError(f"cannot write {args.dir}: {e.strerror or e}") from None
    print(f"wrote the {name} model (seed {args.seed}) to {path}")
    return 0


def _info(args: argparse.Namespace) -> int:
    from splash.core.config import ModelConfig
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
            "kv_bytes_per_token_fp8": kv_bytes_per_token(cfg, "fp8"),
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
