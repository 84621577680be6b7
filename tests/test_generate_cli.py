"""`splash generate`: JSON shape, greedy tokens equal to the Python API, clear one-line errors."""

import json

import pytest
import torch
from helpers_ckpt import build_checkpoint

from splash.cli import main
from splash.engine.sampling import SamplingParams
from splash.llm import LLM


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    torch.set_num_threads(1)
    return build_checkpoint(tmp_path_factory.mktemp("gen"), "v3", seed=1)


def run_cli(capsys, *argv):
    rc = main(["generate", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_json_output_matches_python_api(ckpt, capsys):
    rc, out, err = run_cli(capsys, "--model", ckpt, "--dtype", "float64", "--prompt-ids", "3,4,5",
                           "--prompt-ids", "7, 8,9,10,11", "--max-tokens", "6", "--ignore-eos",
                           "--memory-per-rank", "64MiB", "--page-size", "4", "--json")
    assert rc == 0, err
    doc = json.loads(out)
    llm = LLM(model=ckpt, dtype="float64", page_size=4, num_kv_pages=64)
    want = llm.generate(prompt_token_ids=[[3, 4, 5], [7, 8, 9, 10, 11]],
                        sampling_params=SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    assert [o["token_ids"] for o in doc["outputs"]] == [w.outputs[0].token_ids for w in want]
    assert all(o["finish_reason"] == "length" and len(o["token_ids"]) == 6 for o in doc["outputs"])
    eng = doc["engine"]
    assert eng["ranks"] == 1 and eng["layout"] == "tp" and eng["dtype"] == "float64"
    # 64 MiB minus the weights, in pages of 4 tokens x 3 layers x 32 floats64.
    assert 0 < eng["kv_pool_tokens"] <= 64 * 2**20 // (3 * 32 * 8) and eng["kv_pool_tokens"] % 4 == 0


@pytest.mark.parametrize("argv,msg", [
    ([], "--prompt"),
    (["--prompt-ids", "1,2", "--tp", "3"], "cannot be split evenly over 3 ranks"),
    (["--prompt-ids", "1,2", "--temperature", "-1"], "temperature"),
    (["--prompt-ids", "1,2", "--memory-per-rank", "lots"], "memory size"),
    (["--prompt-ids", "1,2", "--memory-per-rank", "1KiB"], "weights"),
    (["--prompt-ids", "1,2", "--max-model-len", "3", "--max-tokens", "1"], None),
    (["--prompt-ids", "1,2,3,4", "--max-model-len", "3"], "context"),
    (["--prompt-ids", "1,500"], "vocabulary"),
    (["--prompt", "hi"], "tokenizer"),
    (["--model", "/nonexistent/ckpt", "--prompt-ids", "1"], "checkpoint"),
    (["--prompt-ids", "1,2", "--device", "tpu"], "unknown device 'tpu'"),
    (["--prompt-ids", "1,2", "--device", "cpu:x"], "unknown device"),
] + ([] if torch.cuda.is_available() else
       [(["--prompt-ids", "1,2", "--device", "cuda"], "use --device cpu")]))
def test_bad_input_is_one_clear_line(ckpt, capsys, argv, msg):
    rc, out, err = run_cli(capsys, "--model", ckpt, "--dtype", "float64", *argv)
    if msg is None:
        assert rc == 0, err
        return
    assert rc == 2 and msg in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_bad_flags_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        main(["generate", "--prompt-ids", "1,x"])
    assert e.value.code == 2
    with pytest.raises(SystemExit):
        main(["generate", "--layout", "zz", "--prompt-ids", "1"])
    assert "invalid choice" in capsys.readouterr().err
    for bad in ("-1", "0", "nan", "soon"):
        with pytest.raises(SystemExit):
            main(["generate", "--collective-timeout", bad, "--prompt-ids", "1"])
        assert "positive number of seconds" in capsys.readouterr().err


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from splash.model.tiny import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny"))


def test_text_prompts_detokenize_and_stop_strings_on_the_tiny_model(tiny_dir, capsys):
    from splash.tokenizer import load_tokenizer

    tok = load_tokenizer(tiny_dir)
    base = ["--model", tiny_dir, "--prompt", "Hello world", "--max-tokens", "24", "--ignore-eos", "--json"]
    rc, out, err = run_cli(capsys, *base)
    assert rc == 0, err
    first = json.loads(out)["outputs"][0]
    assert first["prompt_token_ids"] == tok.encode("Hello world")
    assert first["text"] == tok.decode(first["token_ids"]) and first["finish_reason"] == "length"
    text = first["text"]
    # Stop on a piece of the greedy text: same tokens up to it, text cut before it.
    cut = next((i for i in range(4, len(text) - 2)
                if text[i:i + 2].strip() and text.find(text[i:i + 2]) == i), None)
    assert cut is not None, text
    rc, out, err = run_cli(capsys, *base, "--stop", text[cut:cut + 2])
    assert rc == 0, err
    stopped = json.loads(out)["outputs"][0]
    assert stopped["finish_reason"] == "stop" and stopped["text"] == text[:cut]
    assert first["token_ids"][:len(stopped["token_ids"])] == stopped["token_ids"]
    # Human-readable output names the prompt and the engine.
    rc, out, err = run_cli(capsys, "--model", tiny_dir, "--prompt", "Hi", "--max-tokens", "3")
    assert rc == 0 and "'Hi'" in out and "KV pool" in out


def test_cli_entry_point_in_a_subprocess(tiny_dir):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "splash", "generate", "--model", tiny_dir,
                        "--prompt-ids", "65,66", "--max-tokens", "4", "--json"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert len(doc["outputs"][0]["token_ids"]) <= 4 and doc["engine"]["kv_pool_tokens"] > 0


def test_bench_offline_runs_and_compares_with_transformers(ckpt, capsys):
    """Smoke test of `splash bench offline --compare-hf` (float64: both sides generate the same tokens)."""
    rc = main(["bench", "offline", "--model", ckpt, "--dtype", "float64", "--batch", "3", "--input-len", "5",
               "--output-len", "4", "--repeat", "1", "--compare-hf", "--json"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    doc = json.loads(out.strip().splitlines()[-1])
    assert doc["batch"] == 3 and doc["splash"]["output_tokens_per_s"] > 0 and doc["hf"]["seconds"] > 0
    assert doc["speedup"] > 0 and doc["greedy_agreement"] == 1.0


def test_bench_offline_times_prefill_not_the_prefix_cache(ckpt):
    """The timed runs repeat the warm-up's prompts: with the prefix cache on (the default) they would be
    cached prefills. The bench flushes before each timed run, so no prompt token is ever a hit."""
    from splash.bench.offline import run_splash
    from splash.cli import build_parser

    args = build_parser().parse_args(["bench", "offline", "--model", ckpt, "--dtype", "float32",
                                      "--batch", "2", "--input-len", "40", "--output-len", "2",
                                      "--repeat", "2", "--page-size", "4"])
    _, _, _, eng = run_splash(args)
    try:
        st = eng.stats()
        assert st["prefix_cache_queries"] > 0, "the cache was not on: the check proves nothing"
        assert st["prefix_cache_hits"] == 0, st["prefix_cache_hits"]
    finally:
        eng.shutdown()
