"""Constrained generation across live layout switches: on T = 2 gloo ranks, seeded sampling under a forced
tool call, a JSON schema and a regex, while a schedule takes the layout through all 12 directions in the
middle of the answers. The grammar lives on rank 0 and sees only accepted tokens, so every token must
equal the unswitched single-rank engine's, and every answer must still parse and validate."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from helpers_agent import TOOLS, write_agent_checkpoint

from splash.chat.json_tools import DeepSeekV31ToolParser
from splash.chat.tool_grammar import tool_call_structural_tag
from splash.engine.build import build_engine
from splash.engine.sampling import SamplingParams, StructuredOutputs
from splash.tokenizer import load_tokenizer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300), pytest.mark.usefixtures("one_torch_thread")]

CIRCUIT = ["tp", "dp", "cp", "dop", "tp", "cp", "dp", "dop", "cp", "tp", "dop", "dp", "tp"]
ALL12 = ",".join(f"{2 * i + 3}:{lay}" for i, lay in enumerate(CIRCUIT[1:]))  # every other step from 3
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "n"], "additionalProperties": False}
REGEX = r"[a-z]{3,8}@[a-z]{2,5}\.(com|org)"
ENGINE = dict(dtype="float64", page_size=4, max_num_seqs=8, max_num_batched_tokens=16, device="cpu",
              num_kv_pages=480)


@pytest.fixture(scope="module")
def group():
    from splash.engine.group import RankGroup

    g = RankGroup.start(2, device="cpu", timeout_s=60.0, threads=1)
    yield g
    g.close()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_agent_checkpoint(tmp_path_factory.mktemp("agent-switch") / "v31", seed=4)


def requests(ckpt: str) -> list[tuple[list[int], SamplingParams]]:
    tok = load_tokenizer(ckpt)
    ask = [{"role": "user", "content": "Weather in Oslo?"}]
    tools = tok.apply_chat_template(ask, tools=TOOLS)
    plain = tok.apply_chat_template(ask)
    tag = tool_call_structural_tag("deepseekv31", TOOLS, "required", True)
    specs = [(tools, StructuredOutputs(structural_tag=tag)), (plain, StructuredOutputs(json=SCHEMA)),
             (plain, StructuredOutputs(regex=REGEX)), (tools, StructuredOutputs(structural_tag=tag))]
    return [(ids, SamplingParams(temperature=1.0, seed=10 + i, max_tokens=160, structured_outputs=s,
                                 skip_special_tokens=False)) for i, (ids, s) in enumerate(specs)]


def serve(eng, reqs) -> dict[int, tuple[list[int], str, str]]:
    for i, (ids, p) in enumerate(reqs):
        eng.add_request(str(i), prompt_token_ids=ids, params=p)
    done = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                done[int(o.request_id)] = (list(o.outputs[0].token_ids), o.outputs[0].text,
                                           o.outputs[0].finish_reason)
        assert not eng.scheduler.book_errors()
    return done


def test_constrained_answers_survive_all_12_switches(group, ckpt):
    reqs = requests(ckpt)
    ref_eng = build_engine(model=ckpt, **ENGINE)
    try:
        ref = serve(ref_eng, reqs)
    finally:
        ref_eng.shutdown()
    eng = build_engine(model=ckpt, layout="tp", rank_group=group, switch_schedule=ALL12, **ENGINE)
    try:
        got = serve(eng, reqs)
        stats = eng.stats()
    finally:
        eng.shutdown()
    assert got == ref, "a live switch changed a constrained answer"
    assert stats["num_switches"] == 12 and len(stats["switches_total"]) == 12, stats["switches_total"]
    for i, (_, text, reason) in got.items():
        assert reason == "stop", (i, reason, text)
        if i in (0, 3):
            _, calls = DeepSeekV31ToolParser.extract(text, TOOLS)
            schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
            assert calls
            for c in calls:
                jsonschema.validate(json.loads(c.arguments), schemas[c.name])
        elif i == 1:
            jsonschema.validate(json.loads(text), SCHEMA), text
        else:
            assert re.fullmatch(REGEX, text), text


def test_constrained_answers_survive_preemption(ckpt):
    """A pool too small for every answer at once: requests are preempted and recomputed mid-answer; the
    guide only ever saw accepted tokens, so each answer equals the one served with room to spare."""
    reqs = requests(ckpt)
    roomy = build_engine(model=ckpt, **{**ENGINE, "dtype": "float32"})
    try:
        ref = serve(roomy, reqs)
    finally:
        roomy.shutdown()
    tight = build_engine(model=ckpt, **{**ENGINE, "dtype": "float32", "num_kv_pages": 100})
    try:
        got = serve(tight, reqs)
        preempted = tight.scheduler.num_preemptions
    finally:
        tight.shutdown()
    assert preempted > 0, "the pool was meant to force preemption"
    assert got == ref
