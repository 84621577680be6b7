"""Chat templates: splash's rendering (splash/chat/template.py through splash/tokenizer.py) gives the token
ids transformers' `AutoTokenizer.apply_chat_template` gives, on a byte-level BPE checkpoint built here with
a DeepSeek/Hermes-style tool template; DeepSeek-V3.2's encoder when a deepseek_v32 checkpoint ships no
template; a clear error for any other real checkpoint without one; `--chat-template` files and strings."""

from __future__ import annotations

import ast
import copy
import json
from pathlib import Path

import pytest
from helpers_agent import bpe_tokenizer

from splash.chat import dsv32
from splash.chat.template import ChatTemplateError, render, resolve_chat_template
from splash.tokenizer import BUILTIN_SPECIALS, PLAIN_TEMPLATE, load_tokenizer

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
SPECIAL = [BOS, EOS, "<｜User｜>", "<｜Assistant｜>", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>",
           "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>"]
PLAIN_ADDED = ["<think>", "</think>"]  # added but not special, as in DeepSeek's tokenizers

# DeepSeek-V3.1's layout with Hermes-style JSON tools: namespace, a reversed loop left with break, system
# turns skipped with continue, tools and arguments through tojson, raise_exception on a bad conversation.
TEMPLATE = r"""{%- if not thinking is defined %}{% set thinking = false %}{% endif %}
{%- set ns = namespace(system_prompt='', last_user=-1) %}
{%- for message in messages %}
  {%- if message['role'] == 'system' %}
    {%- set ns.system_prompt = ns.system_prompt + ('\n\n' if ns.system_prompt else '') + message['content'] %}
  {%- endif %}
{%- endfor %}
{%- for message in messages | reverse %}
  {%- if message['role'] == 'user' %}
    {%- set ns.last_user = (messages | length) - loop.index0 - 1 %}
    {%- break %}
  {%- endif %}
{%- endfor %}
{{- bos_token }}{{ ns.system_prompt }}
{%- if custom_instructions is defined %}{{ '\n\n' + custom_instructions }}{% endif %}
{%- if tools %}
{{- '\n\n## Tools\nYou may call these functions:\n<tools>' }}
{%- for tool in tools %}
{{- '\n' }}{{ tool | tojson }}
{%- endfor %}
{{- '\n</tools>' }}
{%- endif %}
{%- for message in messages %}
  {%- if message['role'] == 'system' %}{% continue %}{% endif %}
  {%- if message['role'] == 'user' %}
    {{- '<｜User｜>' }}{% if message.name is defined %}[{{ message.name }}] {% endif %}
    {{- message['content'] }}
  {%- elif message['role'] == 'assistant' %}
    {%- if ns.last_user < 0 %}{{ raise_exception('the conversation has no user message') }}{% endif %}
    {{- '<｜Assistant｜>' }}
    {%- if message.reasoning_content is defined and loop.index0 > ns.last_user %}
      {{- '<think>' + message.reasoning_content + '</think>' }}
    {%- else %}
      {{- '</think>' }}
    {%- endif %}
    {%- if message.content is defined and message.content %}{{ message.content }}{% endif %}
    {%- if message.tool_calls is defined %}
      {{- '<｜tool▁calls▁begin｜>' }}
      {%- for tool_call in message.tool_calls %}
        {%- if tool_call.function is defined %}{% set tool_call = tool_call.function %}{% endif %}
        {{- '<｜tool▁call▁begin｜>{"name": "' + tool_call.name + '", "arguments": ' }}
        {{- tool_call.arguments | tojson }}{{ '}<｜tool▁call▁end｜>' }}
      {%- endfor %}
      {{- '<｜tool▁calls▁end｜>' }}
    {%- endif %}
    {{- '<｜end▁of▁sentence｜>' }}
  {%- elif message['role'] == 'tool' %}
    {{- '<｜tool▁output▁begin｜>' }}
    {%- if message.tool_call_id is defined %}[{{ message.tool_call_id }}] {% endif %}
    {{- message['content'] + '<｜tool▁output▁end｜>' }}
  {%- else %}
    {{- raise_exception('unknown role ' + message['role']) }}
  {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
  {{- '<｜Assistant｜>' }}{% if thinking %}<think>{% else %}</think>{% endif %}
{%- endif %}
"""

# GLM-style: arguments iterated as a mapping, which only works once JSON-string arguments are parsed.
OTHER_TEMPLATE = r"""{{ bos_token }}{% for m in messages %}<|{{ m.role }}|>
{% if m.tool_calls is defined %}{% for tc in m.tool_calls %}<call>{{ tc.function.name }}
{% for k, v in tc.function.arguments.items() %}<arg>{{ k }}={{ v if v is string else v | tojson }}</arg>
{% endfor %}</call>{% endfor %}{% else %}{{ m.content }}{% endif %}
{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"""

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city (°C, «now»).",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                        "days": {"type": "integer"}},
                       "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "The local time <HH:MM> & zone.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}},
]

CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the weather and the time in Paris?", "name": "ana"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "days": 2})}},
        {"id": "call_2", "type": "function",
         "function": {"name": "get_time", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 24 °C"},
    {"role": "tool", "tool_call_id": "call_2", "content": "14:05 CEST"},
    {"role": "user", "content": "Thanks! And tomorrow?"},
]


def as_transformers_serve_sends(messages):
    """What transformers' server (and vLLM, SGLang) hands apply_chat_template: arguments parsed."""
    out = copy.deepcopy(messages)
    for m in out:
        for tc in m.get("tool_calls") or []:
            if isinstance(tc["function"]["arguments"], str):
                tc["function"]["arguments"] = json.loads(tc["function"]["arguments"])
    return out


def build_tokenizer():
    corpus = [TEMPLATE, OTHER_TEMPLATE, json.dumps(TOOLS), dsv32.TOOLS_TEMPLATE] + [
        str(m.get("content")) for m in CONVERSATION]
    return bpe_tokenizer(corpus, SPECIAL, PLAIN_ADDED, BOS)


def write_checkpoint(d: Path, model_type: str = "deepseek_v3", template=TEMPLATE, jinja_file=None) -> str:
    d.mkdir(parents=True)
    TOK.save(str(d / "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS,
           "pad_token": EOS, "clean_up_tokenization_spaces": False, "model_max_length": 4096}
    if template is not None:
        cfg["chat_template"] = template
    (d / "tokenizer_config.json").write_text(json.dumps(cfg, ensure_ascii=False), encoding="utf-8")
    (d / "config.json").write_text(json.dumps({"model_type": model_type}))
    if jinja_file is not None:  # transformers 5's save_pretrained writes the template here
        (d / "chat_template.jinja").write_text(jinja_file, encoding="utf-8")
    return str(d)


TOK = build_tokenizer()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("ckpt") / "jinja")


@pytest.fixture(scope="module")
def hf(ckpt):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ckpt)


def hf_ids(hf_tok, messages, **kw):
    out = hf_tok.apply_chat_template(as_transformers_serve_sends(messages), tokenize=True, **kw)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def test_tool_conversation_matches_transformers(ckpt, hf):
    tok = load_tokenizer(ckpt)
    assert tok.chat_format == "jinja" and tok.chat_format_warning is None
    ids = tok.apply_chat_template(CONVERSATION, tools=TOOLS)
    assert ids == hf_ids(hf, CONVERSATION, tools=TOOLS, add_generation_prompt=True)
    text = tok.apply_chat_template(CONVERSATION, tools=TOOLS, tokenize=False)
    assert text == hf.apply_chat_template(as_transformers_serve_sends(CONVERSATION), tools=TOOLS,
                                          add_generation_prompt=True, tokenize=False)
    # the pieces the template was asked for, with arguments as objects and no HTML escaping
    assert text.startswith(BOS + "You are a helpful assistant.\n\n## Tools") and text.count(BOS) == 1
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
    assert '"arguments": {"city": "Paris", "days": 2}' in text and "«now»" in text and "<HH:MM> &" in text
    assert "[call_2] 14:05 CEST" in text and "[ana] What" in text and text.endswith("<｜Assistant｜></think>")
    assert tok.apply_chat_template(CONVERSATION, add_generation_prompt=False) == hf_ids(
        hf, CONVERSATION, add_generation_prompt=False)
    assert CONVERSATION[2]["tool_calls"][0]["function"]["arguments"].startswith("{")  # caller's left alone


def test_continue_final_message_matches_transformers(ckpt, hf):
    tok = load_tokenizer(ckpt)
    conv = CONVERSATION + [{"role": "assistant", "content": "Tomorrow it will be ",
                            "reasoning_content": "The user asks about tomorrow"}]
    kw = {"tools": TOOLS, "add_generation_prompt": False, "continue_final_message": True}
    text = tok.apply_chat_template(conv, tokenize=False, **kw)
    assert text.endswith("</think>Tomorrow it will be ") and EOS not in text[-40:]  # left open
    assert tok.apply_chat_template(conv, **kw) == hf_ids(hf, conv, **kw)
    # continuing the reasoning instead (the field's name), every alias of it tagged
    kw["continue_final_message"] = "reasoning_content"
    text = tok.apply_chat_template(conv, tokenize=False, **kw)
    assert text.endswith("<think>The user asks about tomorrow")
    assert tok.apply_chat_template(conv, **kw) == hf_ids(hf, conv, **kw)
    with pytest.raises(ValueError, match="add_generation_prompt"):
        tok.apply_chat_template(conv, continue_final_message=True)  # with the default add_generation_prompt
    with pytest.raises(ValueError, match="no 'content'"):
        tok.apply_chat_template(conv[:3], add_generation_prompt=False, continue_final_message=True)


def test_request_template_variables_and_named_templates(ckpt, hf, tmp_path):
    tok = load_tokenizer(ckpt)
    # a per-request template (GLM-style: arguments iterated as a mapping)
    got = tok.apply_chat_template(CONVERSATION, chat_template=OTHER_TEMPLATE, tokenize=False)
    assert got == hf.apply_chat_template(as_transformers_serve_sends(CONVERSATION), tokenize=False,
                                         chat_template=OTHER_TEMPLATE, add_generation_prompt=True)
    assert "<arg>city=Paris</arg>\n<arg>days=2</arg>" in got and got.startswith(BOS + "<|system|>")
    # chat_template_kwargs reach the template: thinking, and a variable of the template's own
    kw = {"thinking": True, "custom_instructions": "Answer in French."}
    text = tok.apply_chat_template(CONVERSATION, tools=TOOLS, tokenize=False, **kw)
    assert text.endswith("<｜Assistant｜><think>") and "\n\nAnswer in French.\n\n## Tools" in text
    assert tok.apply_chat_template(CONVERSATION, tools=TOOLS, **kw) == hf_ids(
        hf, CONVERSATION, tools=TOOLS, add_generation_prompt=True, **kw)
    # named templates in tokenizer_config: "tool_use" when tools are given, else "default"; a
    # chat_template.jinja (transformers 5's file) wins over tokenizer_config
    from transformers import AutoTokenizer

    named = [{"name": "default", "template": OTHER_TEMPLATE}, {"name": "tool_use", "template": TEMPLATE}]
    for d in (write_checkpoint(tmp_path / "named", template=named),
              write_checkpoint(tmp_path / "file", template=OTHER_TEMPLATE + "ignored", jinja_file=TEMPLATE)):
        mine, theirs = load_tokenizer(d), AutoTokenizer.from_pretrained(d)
        for tools in (TOOLS, None):
            assert mine.apply_chat_template(CONVERSATION, tools=tools) == hf_ids(
                theirs, CONVERSATION, tools=tools, add_generation_prompt=True)
    assert "<|user|>" in load_tokenizer(tmp_path / "named").apply_chat_template(CONVERSATION, tokenize=False)


def test_environment_loop_controls_tojson_and_errors(ckpt):
    msgs = [{"role": "user", "content": c} for c in ("a", "b", "c", "d")]
    loops = ("{% for m in messages %}{% if m.content == 'b' %}{% continue %}{% endif %}"
             "{% if m.content == 'd' %}{% break %}{% endif %}{{ m.content }}{% endfor %}")
    assert render(loops, msgs) == "ac"
    value = {"z": "é<&>", "a": [1, 2]}
    assert render("{{ v | tojson }}", msgs, v=value) == json.dumps(value, ensure_ascii=False)
    assert render("{{ v | tojson(indent=2, sort_keys=True) }}", msgs, v=value) == json.dumps(
        value, ensure_ascii=False, indent=2, sort_keys=True)
    assert render("{{ v | tojson(separators=(',', ':')) }}", msgs, v=value) == '{"z":"é<&>","a":[1,2]}'
    assert render("{% generation %}{{ messages[0].content }}{% endgeneration %}", msgs) == "a"
    assert len(render("{{ strftime_now('%Y-%m-%d') }}", msgs)) == 10
    assert render("{{ bos_token }}{{ eos_token is defined }}", msgs, bos_token="<s>") == "<s>False"
    with pytest.raises(ChatTemplateError, match="^boom c$"):
        render("{% for m in messages %}{% if m.content == 'c' %}{{ raise_exception('boom ' + m.content) }}"
               "{% endif %}{% endfor %}", msgs)
    with pytest.raises(ChatTemplateError, match="underscore"):
        render("{% set ns = namespace() %}{% set ns.__class__ = 1 %}", msgs)
    with pytest.raises(ChatTemplateError, match="does not compile"):
        render("{% for m in messages %}", msgs)
    with pytest.raises(ChatTemplateError, match="empty conversation"):
        render(TEMPLATE, [])
    # the sandbox holds, and what the template refuses surfaces as a ValueError (a 400 at the server)
    with pytest.raises(ChatTemplateError):
        render("{{ messages.__class__.__mro__ }}{{ ''.__class__.__subclasses__() }}", msgs)
    tok = load_tokenizer(ckpt)
    with pytest.raises(ValueError, match="no user message"):
        tok.apply_chat_template([{"role": "assistant", "content": "hi"}])
    with pytest.raises(ValueError, match="unknown role robot"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}, {"role": "robot", "content": "x"}])


def test_deepseek_v32_without_template_uses_its_encoder(tmp_path):
    tok = load_tokenizer(write_checkpoint(tmp_path / "v32", model_type="deepseek_v32", template=None))
    assert tok.chat_format == "deepseek_v32" and tok.chat_format_warning is None
    conv = copy.deepcopy(CONVERSATION)
    for kw, thinking in (({}, False), ({"thinking": False}, False), ({"thinking": True}, True),
                         ({"enable_thinking": True}, True)):
        want = dsv32.render(conv, tools=TOOLS, thinking=thinking)
        assert tok.apply_chat_template(conv, tools=TOOLS, tokenize=False, **kw) == want
        ids = tok.apply_chat_template(conv, tools=TOOLS, **kw)
        assert ids == TOK.encode(want, add_special_tokens=False).ids and ids.count(tok.bos_token_id) == 1
    assert tok.apply_chat_template(conv, add_generation_prompt=False, tokenize=False) == dsv32.render(
        conv, add_generation_prompt=False)
    assert "<｜DSML｜invoke" in dsv32.render(conv) and '"days": 2' not in dsv32.render(conv)
    prefill = conv + [{"role": "assistant", "content": "Tomorrow"}]
    text = tok.apply_chat_template(prefill, add_generation_prompt=False, continue_final_message=True,
                                   tokenize=False)
    assert text == dsv32.render(prefill, add_generation_prompt=False).removesuffix(dsv32.EOS)
    # a template (per request, or --chat-template) still wins over the encoder
    assert tok.apply_chat_template(conv, chat_template=OTHER_TEMPLATE, tokenize=False).startswith(BOS + "<|")


def test_real_checkpoint_without_template_needs_one(ckpt, tmp_path):
    with_template = load_tokenizer(ckpt).apply_chat_template(CONVERSATION, tools=TOOLS)
    for model_type in ("deepseek_v3", "some_new_model"):
        tok = load_tokenizer(write_checkpoint(tmp_path / model_type, model_type=model_type, template=None))
        assert tok.chat_format is None
        msg = (f"this checkpoint ships no chat template and its model_type {model_type} has no built-in "
               "chat format; pass --chat-template FILE")
        assert tok.chat_format_warning == msg
        with pytest.raises(ValueError, match="pass --chat-template FILE"):
            tok.apply_chat_template(CONVERSATION)
        # a per-request template works regardless; --chat-template sets one for every request
        assert tok.apply_chat_template(CONVERSATION, chat_template=OTHER_TEMPLATE)
        tok.set_chat_template(resolve_chat_template(TEMPLATE))
        assert tok.chat_format == "jinja" and tok.chat_format_warning is None
        assert tok.apply_chat_template(CONVERSATION, tools=TOOLS) == with_template


def test_builtin_models_keep_the_plain_template(tmp_path):
    # splash's own special tokens mark its built-in models (kept in step with splash.model.tiny.SPECIALS)
    src = (Path(__file__).resolve().parents[1] / "splash" / "model" / "tiny.py").read_text(encoding="utf-8")
    specials = next(ast.literal_eval(n.value) for n in ast.parse(src).body if isinstance(n, ast.Assign)
                    and any(getattr(t, "id", None) == "SPECIALS" for t in n.targets))
    assert BUILTIN_SPECIALS == {f"{k}_token": v for k, v in specials.items()}
    d = tmp_path / "builtin"
    d.mkdir()
    TOK.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps(BUILTIN_SPECIALS))
    tok = load_tokenizer(d)
    assert tok.chat_format == "plain" and tok.chat_format_warning is None
    assert tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False) == render(
        PLAIN_TEMPLATE, [{"role": "user", "content": "Hi"}]) == "User: Hi\nAssistant:"


def test_chat_template_option_from_file_or_string(ckpt, hf, tmp_path):
    path = tmp_path / "tool_chat.jinja"
    path.write_text(OTHER_TEMPLATE, encoding="utf-8")
    assert resolve_chat_template(str(path)) == OTHER_TEMPLATE
    assert resolve_chat_template(OTHER_TEMPLATE) == OTHER_TEMPLATE
    (tmp_path / "empty.jinja").write_text("")
    for bad, msg in ((str(tmp_path / "missing.jinja"), "no file and no Jinja template"),
                     (str(tmp_path / "empty.jinja"), "is empty"), (str(tmp_path), "is a directory"),
                     ("", "empty"), ("{% if %}", "does not compile")):
        with pytest.raises(ChatTemplateError, match=msg):
            resolve_chat_template(bad)
    tok = load_tokenizer(ckpt)
    tok.set_chat_template(resolve_chat_template(str(path)))  # server-wide, over the checkpoint's
    assert tok.apply_chat_template(CONVERSATION, tools=TOOLS) == hf_ids(
        hf, CONVERSATION, tools=TOOLS, chat_template=OTHER_TEMPLATE, add_generation_prompt=True)
