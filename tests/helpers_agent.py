"""A tiny DeepSeek-V3-shaped checkpoint that speaks DeepSeek-V3.1's agent format: a byte-level BPE
tokenizer with V3.1's special tokens (the tool section, `<think>`/`</think>` as plain added tokens) and
a chat template in V3.1's layout (tools listed in the system turn, calls `<｜tool▁call▁begin｜>NAME
<｜tool▁sep｜>{args}<｜tool▁call▁end｜>`, tool results, thinking switched by `thinking`). Its vocabulary
is padded past the tokenizer's, as real checkpoints pad theirs. The weights are tiny's (random): what
the model says is noise, which is the point of the grammar tests (every answer must still parse)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from splash.core.presets import PRESETS
from splash.model.tiny import CORPUS, write_tiny_model

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
SPECIAL = [BOS, EOS, "<｜User｜>", "<｜Assistant｜>", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>",
           "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>", "<｜tool▁output▁begin｜>",
           "<｜tool▁output▁end｜>"]
PLAIN_ADDED = ["<think>", "</think>"]

TEMPLATE = r"""{%- if not thinking is defined %}{% set thinking = false %}{% endif %}
{%- set ns = namespace(system_prompt='') %}
{%- for message in messages %}{% if message['role'] == 'system' %}
{%- set ns.system_prompt = ns.system_prompt + message['content'] %}{% endif %}{% endfor %}
{{- bos_token }}{{ ns.system_prompt }}
{%- if tools %}{{ '\n\n## Tools\n' }}
  {%- for tool in tools %}{{ '\n' }}{{ tool | tojson }}{% endfor %}{% endif %}
{%- for message in messages %}
  {%- if message['role'] == 'user' %}{{ '<｜User｜>' + message['content'] }}
  {%- elif message['role'] == 'assistant' %}{{ '<｜Assistant｜></think>' }}
    {%- if message.content %}{{ message.content }}{% endif %}
    {%- if message.tool_calls %}{{ '<｜tool▁calls▁begin｜>' }}
      {%- for tc in message.tool_calls %}{{ '<｜tool▁call▁begin｜>' + tc.function.name + '<｜tool▁sep｜>' }}
        {%- if tc.function.arguments is string %}{{ tc.function.arguments }}
        {%- else %}{{ tc.function.arguments | tojson }}{% endif %}
        {{- '<｜tool▁call▁end｜>' }}{% endfor %}{{ '<｜tool▁calls▁end｜>' }}{% endif %}
    {{- '<｜end▁of▁sentence｜>' }}
  {%- elif message['role'] == 'tool' %}
    {{- '<｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>' }}
  {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{ '<｜Assistant｜>' }}
  {%- if thinking %}<think>{% else %}</think>{% endif %}{% endif %}"""

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "unit"], "additionalProperties": False}}}
SEARCH = {"type": "function", "function": {
    "name": "search", "description": "Search the web.",
    "parameters": {"type": "object", "properties": {"query": {"type": "string", "maxLength": 16},
                                                    "top": {"type": "boolean"}},
                   "required": ["query"], "additionalProperties": False}}}
TOOLS = [WEATHER, SEARCH]


def bpe_tokenizer(corpus: list[str], special: list[str], plain_added: list[str], bos: str):
    """A byte-level BPE (600 tokens) trained on `corpus`, with `special` tokens, `plain_added` ones added
    but not special (as DeepSeek's `<think>`), and a BOS of its own before every encoding (so a
    template's must not be doubled)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False, special_tokens=special)
    tok.train_from_iterator(corpus, trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in plain_added])
    tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A",
                                                       special_tokens=[(bos, tok.token_to_id(bos))])
    return tok


def build_tokenizer():
    return bpe_tokenizer(CORPUS.splitlines() + [TEMPLATE, json.dumps(TOOLS)] * 3, SPECIAL, PLAIN_ADDED, BOS)


def write_agent_checkpoint(d: Path | str, seed: int = 0) -> str:
    """The checkpoint at `d` (see the module docstring)."""
    tok = build_tokenizer()
    n = tok.get_vocab_size(with_added_tokens=True)
    vocab = (n + 63) // 64 * 64  # padded, as real vocabularies are
    cfg = dataclasses.replace(PRESETS["tiny"], vocab_size=vocab, bos_token_id=256, eos_token_id=257,
                              pad_token_id=258)
    d = Path(write_tiny_model(d, seed=seed, cfg=cfg))
    tok.save(str(d / "tokenizer.json"))
    bos, eos = tok.token_to_id(BOS), tok.token_to_id(EOS)
    (d / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS, "pad_token": EOS,
        "clean_up_tokenization_spaces": False, "model_max_length": 4096, "chat_template": TEMPLATE},
        ensure_ascii=False), encoding="utf-8")
    (d / "special_tokens_map.json").unlink(missing_ok=True)
    for name in ("config.json", "generation_config.json"):
        c = json.loads((d / name).read_text())
        c.update(bos_token_id=bos, eos_token_id=eos, pad_token_id=eos)
        (d / name).write_text(json.dumps(c, indent=2))
    return str(d)
