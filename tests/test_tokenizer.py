"""The tokenizer wrapper and the built-in tiny model (`splash model init-tiny`, `--model tiny`)."""

from __future__ import annotations

import json
import os
import threading

import pytest
import torch
from helpers_ckpt import Seq, SimpleRunner

from splash.cli import main
from splash.core.model_config import ModelConfig
from splash.core.presets import PRESETS
from splash.tokenizer import load_tokenizer

torch.set_num_threads(1)
TINY = PRESETS["tiny"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("tiny") / "ckpt")
    assert main(["model", "init-tiny", d]) == 0
    return d


def test_init_tiny_writes_a_checkpoint_matching_the_preset(tiny_dir, capsys):
    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert os.path.isfile(os.path.join(tiny_dir, f))
    cfg = ModelConfig.from_hf(tiny_dir)
    assert cfg.replace(name="tiny") == TINY
    assert main(["model", "init-tiny", tiny_dir]) == 2  # refuses to overwrite without --force
    assert "--force" in capsys.readouterr().err
    modes = {f: os.stat(os.path.join(tiny_dir, f)).st_mode & 0o777 for f in os.listdir(tiny_dir)}
    assert len(set(modes.values())) == 1, modes  # the weights are as readable as the rest
    for bad, msg in ((["/proc/splash-tiny"], "cannot write"), ([""], "give the directory"),
                     ([str(tiny_dir) + "-x", "--seed", str(2**70)], "--seed must be")):
        assert main(["model", "init-tiny", *bad]) == 2
        err = capsys.readouterr().err
        assert msg in err and "Traceback" not in err, err


def test_init_tiny_is_deterministic_per_seed(tiny_dir, tmp_path):
    def weights(d):
        with open(os.path.join(d, "model.safetensors"), "rb") as f:
            return f.read()

    assert main(["model", "init-tiny", str(tmp_path / "same")]) == 0
    assert main(["model", "init-tiny", str(tmp_path / "other"), "--seed", "1"]) == 0
    assert weights(tiny_dir) == weights(tmp_path / "same")
    assert weights(tiny_dir) != weights(tmp_path / "other")


def test_tokenizer_roundtrip_and_specials(tiny_dir):
    tok = load_tokenizer(tiny_dir)
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (TINY.bos_token_id, TINY.eos_token_id,
                                                                      TINY.pad_token_id)
    assert tok.vocab_size == TINY.vocab_size and tok.eos_token_ids == (TINY.eos_token_id,)
    for text in ("Hello, world! The quick brown fox.", "  spaces\tand\nlines  ", "héllo 世界 🙂", ""):
        ids = tok.encode(text)
        assert ids[0] == tok.bos_token_id and all(0 <= i < TINY.vocab_size for i in ids)
        assert tok.decode(ids) == text
        assert tok.encode(text, add_special_tokens=False) == ids[1:]
    ids = tok.encode("the weather in the city")
    assert len(ids) < 1 + len("the weather in the city")  # merges learnt from the built-in text apply
    assert tok.decode([*ids, tok.eos_token_id], skip_special_tokens=False).endswith("<|eos|>")


def test_chat_template_and_plain_fallback(tiny_dir, tmp_path):
    tok = load_tokenizer(tiny_dir)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}]
    text = tok.apply_chat_template(msgs, tokenize=False)
    assert text == "<|bos|>Be brief.\n\nUser: Hi\n\nAssistant: Hello.<|eos|>\n\nUser: Bye\n\nAssistant:"
    ids = tok.apply_chat_template(msgs)
    assert ids.count(tok.bos_token_id) == 1 and ids[0] == tok.bos_token_id and tok.eos_token_id in ids
    # no template in tokenizer_config -> a plain one, BOS from the tokenizer
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "tokenizer.json").write_text(open(os.path.join(tiny_dir, "tokenizer.json")).read())
    cfg = json.load(open(os.path.join(tiny_dir, "tokenizer_config.json")))
    cfg.pop("chat_template")
    (plain / "tokenizer_config.json").write_text(json.dumps(cfg))
    (plain / "generation_config.json").write_text(json.dumps({"eos_token_id": [257, 5]}))
    t2 = load_tokenizer(plain)
    assert t2.apply_chat_template(msgs[1:2], tokenize=False) == "User: Hi\nAssistant:"
    assert t2.apply_chat_template(msgs[1:2])[0] == t2.bos_token_id
    assert t2.eos_token_ids == (257, 5)


def test_transformers_reads_the_tiny_model_alike(tiny_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from splash.model import load_model

    text = "What is the weather like?"
    ids = load_tokenizer(tiny_dir).encode(text)
    assert AutoTokenizer.from_pretrained(tiny_dir)(text)["input_ids"] == ids
    hf = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32, experts_implementation="eager")
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0]
    got = SimpleRunner(load_model(tiny_dir, "float32"), page_size=16).all_logits(Seq(ids), len(ids))
    assert (got - want).abs().max().item() < 1e-4


def test_tiny_greedy_text_is_not_degenerate(tiny_dir):
    from splash.model import load_model

    tok, model = load_tokenizer(tiny_dir), load_model(tiny_dir, "float32")
    for prompt in ("Hello, world!", "The quick brown fox"):
        ids = tok.encode(prompt)
        runner, seq = SimpleRunner(model, page_size=16), Seq(list(ids))
        work = len(ids)
        for _ in range(32):
            seq.ids.append(int(runner.step([(seq, work)])[0].argmax()))
            work = 1
        out = seq.ids[len(ids):]
        assert len(set(out)) >= 8 and len(set(out[-12:])) >= 3
        assert sum(c.isprintable() or c == "\n" for c in tok.decode(out)) >= 0.8 * len(tok.decode(out))


def test_ensure_tiny_model_is_cached_and_race_safe(tmp_path, monkeypatch):
    from splash.model import resolve_model_path
    from splash.model.tiny import ensure_tiny_model

    monkeypatch.setenv("SPLASH_CACHE", str(tmp_path))
    paths: list[str] = []
    threads = [threading.Thread(target=lambda: paths.append(ensure_tiny_model())) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert len(paths) == 2 and paths[0] == paths[1]
    assert sorted(os.listdir(tmp_path)) == [os.path.basename(paths[0])]  # no temp folders left
    mtime = os.path.getmtime(os.path.join(paths[0], "model.safetensors"))
    assert resolve_model_path("tiny") == paths[0]
    assert os.path.getmtime(os.path.join(paths[0], "model.safetensors")) == mtime  # reused, not rewritten
