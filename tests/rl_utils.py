"""Shared by the RL tests: transformers' greedy tokens, logprobs and routed experts of a checkpoint, the
two checkpoints they switch between, and a stand-in trainer that broadcasts a checkpoint's tensors over
a weight-update group."""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch
from helpers_ckpt import build_checkpoint, hf_logits, hf_reference
from safetensors.torch import load_file

from splash.distributed.weight_group import join_group


def two_checkpoints(tmp_path_factory, prompts: list[list[int]], new: int) -> dict:
    """The RL tests' checkpoints A (seed 0) and B (seed 1), each with its `reference` for `prompts`."""
    a = build_checkpoint(tmp_path_factory.mktemp("A"), "v3", seed=0)
    b = build_checkpoint(tmp_path_factory.mktemp("B"), "v3", seed=1)
    return {"A": (a, reference(a, prompts, new)), "B": (b, reference(b, prompts, new))}


def reference(path: str, prompts: list[list[int]], new: int
              ) -> tuple[list[list[int]], list[list[float]], list[torch.Tensor]]:
    """transformers' (float64) greedy tokens, their logprobs, and each MoE layer's chosen experts per
    position fed to the model ([len(prompt) + new - 1, moe_layers, k], ids sorted)."""
    hf = hf_reference(path)
    toks, lps, routes = [], [], []
    for p in prompts:
        ids = list(p)
        for _ in range(new):
            ids.append(int(hf_logits(hf, ids)[-1].argmax()))
        gen = ids[len(p):]
        seen: list[torch.Tensor] = []

        def keep(m, i, o, seen=seen):
            seen.append(o[2].sort(-1).values)

        hooks = [layer.mlp.gate.register_forward_hook(keep) for layer in hf.model.layers
                 if hasattr(layer.mlp, "gate")]
        lp = torch.log_softmax(hf_logits(hf, ids[:-1]), -1)[len(p) - 1:]
        for h in hooks:
            h.remove()
        toks.append(gen)
        lps.append([float(lp[j, t]) for j, t in enumerate(gen)])
        routes.append(torch.stack(seen, dim=1).to(torch.int32))
    return toks, lps, routes


class Trainer:
    """A thread that joins group `name` as rank 0 and broadcasts every tensor of checkpoint `path`
    (in sorted name order) once `start()`ed; `join()` re-raises its error."""

    def __init__(self, path: str, port: int, world: int, name: str,
                 change: Callable[[dict[str, torch.Tensor]], None] | None = None) -> None:
        self.tensors = load_file(f"{path}/model.safetensors")
        if change is not None:
            change(self.tensors)
        self.names = sorted(self.tensors)
        self.port, self.world, self.name = port, world, name
        self.error: BaseException | None = None
        self.joined = threading.Event()
        self.go = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    @property
    def meta(self) -> dict:
        return {"names": self.names, "dtypes": [str(self.tensors[n].dtype) for n in self.names],
                "shapes": [list(self.tensors[n].shape) for n in self.names], "group_name": self.name}

    def _run(self) -> None:
        try:
            g = join_group("127.0.0.1", self.port, 0, self.world, self.name, "gloo", timeout_s=60)
            self.joined.set()
            if self.go.wait(60):
                for n in self.names:
                    g.broadcast(self.tensors[n].clone(), 0)
            g.close()
        except BaseException as e:  # noqa: BLE001 - re-raised by join()
            self.error = e

    def start(self) -> Trainer:
        self.thread.start()
        return self

    def join(self) -> None:
        self.go.set()
        self.thread.join(60)
        assert not self.thread.is_alive(), "the trainer thread hung"
        if self.error is not None:
            raise self.error
