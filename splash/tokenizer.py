"""A checkpoint's tokenizer: `tokenizer.json` through the `tokenizers` library, special tokens from
`tokenizer_config.json`, and its chat format, so serving needs no transformers at run time.

The chat format (`Tokenizer.chat_format`): the checkpoint's Jinja template ("jinja": `chat_template.jinja`
and `additional_chat_templates/*.jinja`, else `tokenizer_config.json`'s `chat_template`, a string or named
templates; rendered by splash.chat.template as transformers renders it), else DeepSeek-V3.2's Python
encoder for `model_type` deepseek_v32 ("deepseek_v32"; its checkpoints ship no template), else a plain
"User: ... Assistant:" template for splash's own built-in models only ("plain"). A real checkpoint with
none of these has no chat format (None, `chat_format_warning` says why): chat requests need
`--chat-template` (`Tokenizer.set_chat_template`) or a per-request template.
"""

from __future__ import annotations

import json
import os
from typing import Any

from tokenizers import Tokenizer as _HFTokenizer

from splash.chat import dsv32
from splash.chat.reasoning import thinking_from_kwargs
from splash.chat.template import ChatTemplateError, normalize_messages, render
from splash.core.model_config import ConfigError

# Used for splash's own built-in models when their template is gone: one line per turn, then the cue.
PLAIN_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] | capitalize }}: {{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}"
)
# The special tokens splash's built-in models are written with (splash.model.tiny.SPECIALS): what marks a
# tokenizer as splash's own rather than a real checkpoint's.
BUILTIN_SPECIALS = {"bos_token": "<|bos|>", "eos_token": "<|eos|>", "pad_token": "<|pad|>"}
# transformers' named special tokens (SPECIAL_TOKENS_ATTRIBUTES): the ones a chat template sees.
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                       "mask_token")
# model_type -> the built-in chat format of a family whose checkpoints ship no Jinja template
BUILTIN_FORMATS = {"deepseek_v32": "deepseek_v32"}


def _token_str(v: Any) -> str | None:
    """tokenizer_config writes special tokens as a string or as an AddedToken dict."""
    if isinstance(v, dict):
        return v.get("content")
    return v if isinstance(v, str) else None


class Tokenizer:
    """encode / decode / chat template with the attributes the engine and server read.

    `chat_template`: the checkpoint's default template text (None: none); `chat_templates`: its named
    templates ({} or e.g. {"default": ..., "tool_use": ...}); `model_type`: config.json's."""

    def __init__(self, tok: _HFTokenizer, config: dict[str, Any] | None = None,
                 chat_template: str | dict[str, str] | None = None, extra_eos: tuple[int, ...] = (),
                 *, model_type: str | None = None) -> None:
        self._tok = tok
        cfg = config or {}
        self.config = cfg
        self.model_type = model_type
        self.bos_token = _token_str(cfg.get("bos_token"))
        self.eos_token = _token_str(cfg.get("eos_token"))
        self.pad_token = _token_str(cfg.get("pad_token"))
        self.bos_token_id = self._id(self.bos_token)
        self.eos_token_id = self._id(self.eos_token)
        self.pad_token_id = self._id(self.pad_token)
        self.add_bos_token = bool(cfg.get("add_bos_token", False))
        self.chat_templates: dict[str, str] = {}
        if isinstance(chat_template, dict):
            self.chat_templates = {str(k): v for k, v in chat_template.items() if isinstance(v, str)}
            chat_template = self.chat_templates.get("default")
        self.chat_template: str | None = chat_template or None
        eos = [self.eos_token_id] if self.eos_token_id is not None else []
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(eos + [int(e) for e in extra_eos]))
        self.all_special_ids: set[int] = {
            i for i, t in tok.get_added_tokens_decoder().items() if getattr(t, "special", False)}
        self.special_tokens_map: dict[str, str] = {
            k: t for k in SPECIAL_TOKEN_NAMES if (t := _token_str(cfg.get(k))) is not None}
        self.builtin = all(self.special_tokens_map.get(k) == v for k, v in BUILTIN_SPECIALS.items())

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
    @property
    def chat_format(self) -> str | None:
        """How chat requests are rendered: "jinja" (a template), "deepseek_v32" (DeepSeek-V3.2's encoder),
        "plain" (a built-in model without template), or None (no chat format: chat requests fail)."""
        if self.chat_template or self.chat_templates:
            return "jinja"
        if self.model_type in BUILTIN_FORMATS:
            return BUILTIN_FORMATS[self.model_type]
        return "plain" if self.builtin else None

    @property
    def chat_format_warning(self) -> str | None:
        """One line saying why chat requests cannot be rendered (None when they can)."""
        if self.chat_format is not None:
            return None
        kind = self.model_type or "(none: no config.json)"
        return (f"this checkpoint ships no chat template and its model_type {kind} has no built-in chat "
                "format; pass --chat-template FILE")

    def set_chat_template(self, text: str) -> None:
        """A server-wide template (`--chat-template`, resolved by splash.chat.template.resolve_chat_template)
        in place of the checkpoint's, named ones included."""
        if not isinstance(text, str) or not text.strip():
            raise ValueError("the chat template is empty")
        self.chat_template = text
        self.chat_templates = {}

    def get_chat_template(self, chat_template: str | None = None, tools: Any = None) -> str | None:
        """The Jinja template a request renders with, as transformers picks it: the request's own (a template
        text, or the name of one of the checkpoint's), else "tool_use" when tools are given and the
        checkpoint names one, else the default; None when there is no Jinja template."""
        if chat_template is not None:
            return self.chat_templates.get(chat_template, chat_template)
        if tools is not None and "tool_use" in self.chat_templates:
            return self.chat_templates["tool_use"]
        if self.chat_template:
            return self.chat_template
        if self.chat_templates:
            raise ChatTemplateError(
                "this checkpoint has several chat templates and no default; pass the name of one as "
                f"chat_template: {', '.join(sorted(self.chat_templates))}")
        return None

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tokenize: bool = True, *, tools: list[dict[str, Any]] | None = None,
                            chat_template: str | None = None, continue_final_message: bool | str = False,
                            documents: list[dict[str, Any]] | None = None,
                            **kwargs: Any) -> list[int] | str:
        """Render the conversation in the checkpoint's chat format; token ids by default.

        `chat_template` (a template text or a template's name) overrides the checkpoint's for this call;
        `kwargs` are template variables (chat_template_kwargs: `thinking`, `enable_thinking`, ...). As in
        transformers, the rendered text is tokenized without adding special tokens (the template writes
        its own BOS); the plain template has none, so there the tokenizer adds it. Raises ValueError (a
        ChatTemplateError) when the template rejects the conversation or there is no chat format."""
        template = self.get_chat_template(chat_template, tools)
        add_special = False
        if template is not None:
            text = render(template, messages, tools=tools, documents=documents,
                          add_generation_prompt=add_generation_prompt,
                          continue_final_message=continue_final_message,
                          **{**self.special_tokens_map, **kwargs})
        elif self.chat_format == "deepseek_v32":
            text = _render_dsv32(messages, tools, add_generation_prompt, continue_final_message, kwargs)
        elif self.chat_format == "plain":
            text = render(PLAIN_TEMPLATE, messages, add_generation_prompt=add_generation_prompt,
                          continue_final_message=continue_final_message, **kwargs)
            add_special = True
        else:
            raise ChatTemplateError(self.chat_format_warning or "no chat format")
        if not tokenize:
            return text
        return self.encode(text, add_special_tokens=add_special)


def _render_dsv32(messages: Any, tools: list[dict[str, Any]] | None, add_generation_prompt: bool,
                  continue_final_message: bool | str, kwargs: dict[str, Any]) -> str:
    """DeepSeek-V3.2's prompt (splash.chat.dsv32), thinking when the request's `thinking` /
    `enable_thinking` says so. continue_final_message: the final assistant message is left open (no
    end-of-sentence; with only reasoning, no `</think>` either, so the model goes on thinking)."""
    msgs = normalize_messages(messages)
    thinking = bool(thinking_from_kwargs(kwargs))
    if not continue_final_message:
        try:
            return dsv32.render(msgs, tools=tools, thinking=thinking,
                                add_generation_prompt=add_generation_prompt)
        except ValueError as e:
            raise ChatTemplateError(str(e)) from None
    if add_generation_prompt:
        raise ChatTemplateError("continue_final_message and add_generation_prompt cannot both be set")
    last = msgs[-1]
    if last.get("role") != "assistant" or last.get("tool_calls"):
        raise ChatTemplateError("continue_final_message needs a final assistant message without tool_calls")
    try:
        text = dsv32.render(msgs, tools=tools, thinking=thinking, add_generation_prompt=False)
    except ValueError as e:
        raise ChatTemplateError(str(e)) from None
    text = text.removesuffix(dsv32.EOS)
    if thinking and not last.get("content") and last.get("reasoning_content"):
        text = text.removesuffix(dsv32.END_THINK)
    return text


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from None
    return d if isinstance(d, dict) else {}


def _read_text(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read the chat template {path}: {e}") from None


def read_chat_templates(path: str | os.PathLike[str], tokenizer_config: dict[str, Any] | None = None
                        ) -> str | dict[str, str] | None:
    """A checkpoint's chat template(s) as transformers loads them: `chat_template.jinja` (the default) and
    `additional_chat_templates/NAME.jinja` take priority over tokenizer_config.json's `chat_template` (a
    string, or a list of {"name", "template"}). One default template: its text; several: a dict by name."""
    p = os.fspath(path)
    files: dict[str, str] = {}
    if os.path.isfile(os.path.join(p, "chat_template.jinja")):
        files["default"] = _read_text(os.path.join(p, "chat_template.jinja"))
    extra = os.path.join(p, "additional_chat_templates")
    if os.path.isdir(extra):
        for name in sorted(os.listdir(extra)):
            if name.endswith(".jinja") and os.path.isfile(os.path.join(extra, name)):
                files[name.removesuffix(".jinja")] = _read_text(os.path.join(extra, name))
    if files:
        return files["default"] if list(files) == ["default"] else files
    cfg = tokenizer_config if tokenizer_config is not None else _read_json(
        os.path.join(p, "tokenizer_config.json"))
    template = cfg.get("chat_template")
    if isinstance(template, list):
        named = {t["name"]: t["template"] for t in template if isinstance(t, dict)
                 and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)}
        return named or None
    return template if isinstance(template, str) and template else None


def load_tokenizer(path: str | os.PathLike[str]) -> Tokenizer:
    """The tokenizer of a checkpoint directory (needs tokenizer.json)."""
    p = os.fspath(path)
    tj = os.path.join(p, "tokenizer.json")
    if not os.path.isfile(tj):
        raise ConfigError(f"{p!r} has no tokenizer.json; send prompts as token ids or add a tokenizer")
    tok = _HFTokenizer.from_file(tj)
    cfg = _read_json(os.path.join(p, "tokenizer_config.json"))
    model_type = _read_json(os.path.join(p, "config.json")).get("model_type")
    gen = _read_json(os.path.join(p, "generation_config.json"))
    eos = gen.get("eos_token_id")
    extra = tuple(eos) if isinstance(eos, list) else ((eos,) if isinstance(eos, int) else ())
    return Tokenizer(tok, cfg, read_chat_templates(p, cfg), extra,
                     model_type=model_type if isinstance(model_type, str) else None)
