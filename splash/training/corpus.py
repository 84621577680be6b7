"""The trainer's corpus and tokenizer: the Python standard library's own sources (present on every
machine; `site-packages`, tests, codec tables and pydoc's topic dump left out), files in sorted order, one
in HELDOUT_EVERY held out for evaluation, and a byte-level BPE learnt from the training files with
`tokenizers`. Deterministic: the same Python gives the same files, merges and token streams."""

from __future__ import annotations

import os
import platform
import sysconfig
from dataclasses import dataclass
from typing import Any

import torch

from splash.core.model_config import ConfigError

SPECIALS = {"bos_token": "<|bos|>", "eos_token": "<|eos|>", "pad_token": "<|pad|>"}  # ids 0, 1, 2
SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__",
                       "encodings", "pydoc_data"})  # not code people write / huge generated tables
HELDOUT_EVERY = 25  # files 12, 37, 62, ... (sorted) are held out


def is_heldout(i: int) -> bool:
    return i % HELDOUT_EVERY == HELDOUT_EVERY // 2


@dataclass(frozen=True)
class Corpus:
    """Token streams (documents as BOS text EOS, concatenated) and what they were made from."""

    train: torch.Tensor  # int64 [N]
    heldout: torch.Tensor  # int64 [M]
    description: dict[str, Any]


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


def read_source(root: str, rel: str) -> str:
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
    """Encode every file as BOS text EOS; held-out files (`is_heldout`) go to their own stream."""
    eos = tok.token_to_id(SPECIALS["eos_token"])
    texts = [read_source(root, f) for f in files]
    encs = tok.encode_batch(texts)  # BOS added by the post-processor
    train: list[int] = []
    held: list[int] = []
    for i, e in enumerate(encs):
        (held if is_heldout(i) else train).extend([*e.ids, eos])
    desc = {"source": "Python standard library sources (*.py)", "root": root,
            "python": platform.python_version(), "files": len(files),
            "heldout_files": sum(map(is_heldout, range(len(files)))),
            "bytes": sum(len(t.encode()) for t in texts), "skipped_dirs": sorted(SKIP_DIRS),
            "heldout_rule": f"file i (sorted) with i % {HELDOUT_EVERY} == {HELDOUT_EVERY // 2}",
            "train_tokens": len(train), "heldout_tokens": len(held)}
    return Corpus(torch.tensor(train, dtype=torch.long), torch.tensor(held, dtype=torch.long), desc)
