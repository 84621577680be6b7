"""A checkpoint's tokenizer: `tokenizer.json` through the `tokenizers` library, special tokens and the
chat template from `tokenizer_config.json` (rendered with jinja2 like transformers does), so serving
needs no transformers at run time.
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from typing import Any

from tokenizers import Tokenizer as _HFTokenizer

from splash.core.config import ConfigError

# Used when a checkpoint ships no chat template: one line per turn, then the assistant's cue.
PLAIN_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] | capitalize }}: {{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}"
)


def _token_str(v: Any) -> str | None:
    """tokenizer_config writes special tokens as a string or as an AddedToken dict."""
    if isinstance(v, dict):
        return v.get("content")
    return v if isinstance(v, str) else None


class Tokenizer:
    """encode / decode / chat template with the attributes the engine and server read."""

    def __init__(self, tok: _HFTokenizer, config: dict[str, Any] | None = None,
                 chat_template: str | None = None, extra_eos: tuple[int, ...] = ()) -> None:
        self._tok = tok
        cfg = config or {}
        self.config = cfg
        self.bos_token = _token_str(cfg.get("bos_token"))
        self.eos_token = _token_str(cfg.get("eos_token"))
        self.pad_token = _token_str(cfg.get("pad_token"))
        self.bos_token_id = self._id(self.bos_token)
        self.eos_token_id = self._id(self.eos_token)
        self.pad_token_id = self._id(self.pad_token)
        self.add_bos_token = bool(cfg.get("add_bos_token", False))
        self.chat_template = chat_template
        eos = [self.eos_token_id] if self.eos_token_id is not None else []
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(eos + [int(e) for e in extra_eos]))
        self.all_special_ids: set[int] = {
            i for i, t in tok.get_added_tokens_decoder().items() if getattr(t, "special", False)}
        self._template = None

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def __len__(self) -> int:
        return self.vocab_size

    # ---- text <-> ids ---------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        if (add_special_tokens and self.add_bos_token and self.bos_token_id is not None
                and (not ids or ids[0] != self.bos_token_id)):
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, tid: int) -> str | None:
        return self._tok.id_to_token(tid)

    # ---- chat -----------------------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tokenize: bool = True, **kwargs: Any) -> list[int] | str:
        """Render the conversation (the checkpoint's template, else a plain one); token ids by default.

        As in transformers, a template's own text (e.g. its BOS) is not doubled by the tokenizer."""
        if self._template is None:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(msg: str) -> None:
                raise ValueError(msg)

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.filters["tojson"] = lambda x, indent=None, **kw: json.dumps(x, ensure_ascii=False,
                                                                          indent=indent)
            env.globals["raise_exception"] = raise_exception
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            self._template = env.from_string(self.chat_template or PLAIN_TEMPLATE)
        text = self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     bos_token=self.bos_token or "", eos_token=self.eos_token or "",
                                     pad_token=self.pad_token or "", **kwargs)
        if not tokenize:
            return text
        # the plain fallback carries no BOS itself, so let the tokenizer add it
        return self.encode(text, add_special_tokens=self.chat_template is None)


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from None
    return d if isinstance(d, dict) else {}


def load_tokenizer(path: str | os.PathLike[str]) -> Tokenizer:
    """The tokenizer of a checkpoint directory (needs tokenizer.json)."""
    p = os.fspath(path)
    tj = os.path.join(p, "tokenizer.json")
    if not os.path.isfile(tj):
        raise ConfigError(f"{p!r} has no tokenizer.json; send prompts as token ids or add a tokenizer")
    tok = _HFTokenizer.from_file(tj)
    cfg = _read_json(os.path.join(p, "tokenizer_config.json"))
    template = cfg.get("chat_template")
    if isinstance(template, list):  # [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    jinja_file = os.path.join(p, "chat_template.jinja")
    if not template and os.path.isfile(jinja_file):
        with open(jinja_file, encoding="utf-8") as f:
            template = f.read()
    gen = _read_json(os.path.join(p, "generation_config.json"))
    eos = gen.get("eos_token_id")
    extra = tuple(eos) if isinstance(eos, list) else ((eos,) if isinstance(eos, int) else ())
    return Tokenizer(tok, cfg, template if isinstance(template, str) else None, extra)
