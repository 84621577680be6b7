"""Structured outputs on rank 0: grammars compiled once with xgrammar (both peers' default backend) and a
matcher per sequence that masks the step's logits and advances by the tokens it accepts.

`GrammarBackend` is the engine's: it turns the tokenizer into xgrammar's `TokenizerInfo` (vocabulary in
the model's encoding, the engine's stop tokens, the model's logit width), compiles a request's
`StructuredOutputs` (JSON schema, any JSON object, regex, choice, EBNF, structural tag) into a cached
`CompiledGrammar` (thread-safe: the server compiles in a worker thread, so a bad schema is a 400 before
the request is queued, and the engine then finds it compiled), and gives each sequence a `Guide`.

A `Guide` is what the sampler and the engine talk to: `fill(bitmask, row)` writes the allowed-token mask of
its next token (the sampler applies every guided row's mask in one batched op), `accept(tokens) -> n`
advances by as many of `tokens` as the grammar allows and says how many (speculative decoding accepts
several tokens of one request at once), `rollback(n)` undoes the last n (a draft's rejected tail),
`terminated` is true once the grammar's stop token was accepted. A guide with `start_after` (a reasoning
model's end-of-thinking token ids) masks nothing until those tokens have been generated: the constraint
applies to the answer after the reasoning, as both peers do. The guide only ever sees accepted output
tokens, so it survives preemption (recompute rewrites KV, not tokens), a live layout switch (rank 0
alone holds it) and is simply dropped on abort.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch

from splash.engine.sampling import StructuredOutputs

MAX_ROLLBACK = 16  # tokens a guide can take back (a speculative step's rejected drafts)
CACHE_SIZE = 256  # compiled grammars kept (LRU)


class GrammarError(ValueError):
    """A schema, regex or grammar that cannot be compiled (the server answers 400 with it)."""


def _xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError as e:  # pragma: no cover - the dev extras install it
        raise GrammarError("structured outputs need the xgrammar package: pip install xgrammar") from e
    return xgrammar


def vocab_type(tokenizer: Any) -> str:
    """"byte_level" (GPT-2 style byte-level BPE: DeepSeek, GLM, Kimi), "byte_fallback" (SentencePiece
    with <0xNN> byte tokens) or "raw", read from the `tokenizers` pipeline's decoder."""
    inner = getattr(tokenizer, "_tok", None)
    if inner is None:
        return "raw"
    dec = json.loads(inner.to_str()).get("decoder") or {}
    kinds = {dec.get("type")} | {d.get("type") for d in dec.get("decoders", []) or []}
    if "ByteLevel" in kinds:
        return "byte_level"
    if "ByteFallback" in kinds:
        return "byte_fallback"
    return "raw"


# The characters of a length-bounded JSON string, as a pattern (a pattern's regex is matched against the
# string's JSON text: no control character, quote or backslash, which is what xgrammar allows for a
# length-bounded string, bar control characters: xgrammar 0.2.8 lets those through raw, which is no JSON).
_BOUNDED_CHARS = '[^\\x00-\\x1f"\\\\]'
_SUBSCHEMAS = ("items", "additionalProperties", "not", "if", "then", "else", "contains")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")


def bounded_strings(schema: Any) -> Any:
    """`schema` with each plain string's minLength/maxLength written as the equivalent pattern (see
    _BOUNDED_CHARS: works around xgrammar emitting raw control characters in such strings)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    if (out.get("type") == "string" and ("minLength" in out or "maxLength" in out)
            and not {"pattern", "format", "enum", "const"} & out.keys()):
        lo, hi = int(out.pop("minLength", 0)), out.pop("maxLength", None)
        out["pattern"] = f"{_BOUNDED_CHARS}{{{lo},{'' if hi is None else int(hi)}}}"
    for k in _SUBSCHEMAS:
        if isinstance(out.get(k), dict):
            out[k] = bounded_strings(out[k])
    for k in _SCHEMA_LISTS:
        if isinstance(out.get(k), list):
            out[k] = [bounded_strings(s) for s in out[k]]
    for k in _SCHEMA_MAPS:
        if isinstance(out.get(k), dict):
            out[k] = {name: bounded_strings(s) for name, s in out[k].items()}
    return out


class GrammarBackend:
    """The engine's grammar compiler and guide factory (see the module docstring)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        xgr = _xgrammar()
        self.vocab_size = int(vocab_size)
        inner = getattr(tokenizer, "_tok", None)
        if inner is None:
            raise GrammarError("structured outputs need the model's tokenizer (this engine has none)")
        vocab = inner.get_vocab(with_added_tokens=True)
        encoded = [""] * self.vocab_size
        for text, i in vocab.items():
            if 0 <= i < self.vocab_size:
                encoded[i] = text
        kind = {"byte_level": xgr.VocabType.BYTE_LEVEL, "byte_fallback": xgr.VocabType.BYTE_FALLBACK,
                "raw": xgr.VocabType.RAW}[vocab_type(tokenizer)]
        self.stop_token_ids = [int(t) for t in stop_token_ids]
        self.info = xgr.TokenizerInfo(encoded, kind, vocab_size=self.vocab_size,
                                      stop_token_ids=self.stop_token_ids or None)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=True)
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._lock = threading.Lock()
        self.compiled = 0  # grammars compiled (not served from the cache)
        # wall seconds spent masking logits (fill + apply) and advancing matchers (`bench offline
        # --json-schema` reports them per step)
        self.seconds = {"mask": 0.0, "accept": 0.0}

    def compile(self, spec: StructuredOutputs) -> Any:
        """The compiled grammar of `spec` (cached); GrammarError naming what is wrong."""
        key = spec.key()
        with self._lock:
            got = self._cache.get(key)
            if got is not None:
                self._cache.move_to_end(key)
                return got
        try:
            got = self._compile(spec)
        except GrammarError:
            raise
        except Exception as e:  # xgrammar's own errors (RuntimeError, ValueError): a bad schema or pattern
            raise GrammarError(f"invalid {spec.kind.replace('_', ' ')}: {str(e).strip().splitlines()[0]}"
                               ) from None
        with self._lock:
            self._cache[key] = got
            self.compiled += 1
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return got

    def _compile(self, spec: StructuredOutputs) -> Any:
        c = self.compiler
        kind = spec.kind
        if kind == "json":
            schema = spec.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as e:
                    raise GrammarError(f"invalid JSON schema: not JSON ({e.msg} at {e.pos})") from None
            if not isinstance(schema, dict):
                raise GrammarError("invalid JSON schema: it must be a JSON object")
            return c.compile_json_schema(json.dumps(bounded_strings(schema)), any_whitespace=False,
                                         strict_mode=True)
        if kind == "json_object":  # OpenAI's JSON mode: an object (any keys), not any JSON value
            return c.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
        if kind == "regex":
            return c.compile_regex(spec.regex)
        if kind == "choice":
            alts = " | ".join(json.dumps(ch, ensure_ascii=False) for ch in spec.choice or ())
            return c.compile_grammar(f"root ::= {alts}")
        if kind == "grammar":
            return c.compile_grammar(spec.grammar)
        tag = json.loads(spec.structural_tag or "{}")
        return c.compile_structural_tag(json.dumps(tag))

    def guide(self, spec: StructuredOutputs) -> Guide:
        """A fresh matcher for one sequence."""
        return Guide(self, self.compile(spec), spec.start_after)

    def allocate(self, rows: int) -> torch.Tensor:
        """A bitmask for `rows` rows (int32, ceil(V / 32) words each)."""
        return _xgrammar().allocate_token_bitmask(rows, self.vocab_size)

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
        """Mask `logits` [n, V] in place: rows `rows` keep only the tokens their bitmask rows allow
        (bitmask row j belongs to logits row rows[j]); one batched op."""
        if logits.dtype == torch.float64:  # (xgrammar's kernels take 16/32-bit floats only)
            words = bitmask.to(logits.device)
            bits = (words.unsqueeze(-1) >> torch.arange(32, dtype=words.dtype, device=words.device)) & 1
            allowed = bits.flatten(1)[:, : logits.shape[1]].bool()
            if allowed.shape[1] < logits.shape[1]:  # (columns past the grammar's vocabulary: never)
                allowed = torch.nn.functional.pad(allowed, (0, logits.shape[1] - allowed.shape[1]))
            idx = torch.tensor(rows, device=logits.device)
            logits[idx] = logits[idx].masked_fill(~allowed, float("-inf"))
            return
        xgr = _xgrammar()
        full = bitmask if len(rows) == logits.shape[0] and rows == list(range(len(rows))) else None
        if full is None:  # the bitmask is indexed by logits row: scatter ours into a full-size one
            full = torch.full((logits.shape[0], bitmask.shape[1]), -1, dtype=bitmask.dtype)
            full[rows] = bitmask
        xgr.apply_token_bitmask_inplace(logits, full.to(logits.device), vocab_size=self.vocab_size,
                                        indices=rows)


class Guide:
    """One sequence's grammar matcher (see the module docstring)."""

    def __init__(self, backend: GrammarBackend, compiled: Any, start_after: Sequence[int] = ()) -> None:
        xgr = _xgrammar()
        self.matcher = xgr.GrammarMatcher(compiled)
        self.start_after = tuple(start_after)
        self.active = not self.start_after
        self._tail: list[int] = []  # the last tokens while waiting for `start_after`
        self._history: list[tuple[int, bool]] = []  # (token, went to the matcher) of the last MAX_ROLLBACK

    @property
    def terminated(self) -> bool:
        """The grammar is complete and its stop token was accepted."""
        return self.active and self.matcher.is_terminated()

    def fill(self, bitmask: torch.Tensor, row: int) -> bool:
        """Write the next token's allowed set into `bitmask[row]`; False (nothing written: any token)
        while the guide waits for its start."""
        if not self.active:
            return False
        self.matcher.fill_next_token_bitmask(bitmask, row)
        return True

    def accept(self, tokens: Sequence[int]) -> int:
        """Advance by `tokens` in order; the number accepted (fewer than given: the grammar refused the
        next one, and nothing after it was taken)."""
        n = 0
        for t in tokens:
            if not self.active:
                self._tail = (self._tail + [int(t)])[-len(self.start_after):]
                self._remember(int(t), False)
                if tuple(self._tail) == self.start_after:
                    self.active = True
                n += 1
                continue
            if self.matcher.is_terminated() or not self.matcher.accept_token(int(t)):
                break
            self._remember(int(t), True)
            n += 1
        return n

    def rollback(self, n: int) -> None:
        """Undo the last `n` accepted tokens (at most MAX_ROLLBACK)."""
        if n > len(self._history):
            raise ValueError(f"cannot roll back {n} tokens; the guide keeps the last {len(self._history)}")
        back = self._history[len(self._history) - n:]
        del self._history[len(self._history) - n:]
        to_matcher = sum(1 for _, m in back if m)
        if to_matcher:
            self.matcher.rollback(to_matcher)
        if any(not m for _, m in back) or (back and not back[0][1] and self.active):
            # (tokens taken back from before the start: the wait for `start_after` resumes)
            self.active = not self.start_after or any(m for _, m in self._history)
            self._tail = [t for t, _ in self._history][-len(self.start_after):] if self.start_after else []

    def _remember(self, token: int, matched: bool) -> None:
        self._history.append((token, matched))
        if len(self._history) > MAX_ROLLBACK:
            del self._history[0]
