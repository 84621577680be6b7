"""Rollout simulator: conservation of work, switches accounted, fixed vs policy runs, plot written."""

import numpy as np
import pytest

from splash.core.hardware import theta_for
from splash.core.layouts import Layout
from splash.core.model_config import ConfigError
from splash.core.policy import PolicyConfig
from splash.core.presets import PRESETS
from splash.core.simulate import SimConfig, Workload, plot_rollouts, rollout, rollout_all
from splash.core.sizes import AttentionSizes

SIZES = AttentionSizes(PRESETS["tiny"])
THETA = theta_for("cpu", 4, SIZES)
WL = Workload.drain(24, 64, 512, output_median=48, output_sigma=1.2, output_max=1500, seed=3)
CFG = SimConfig(token_budget=512, max_running=16, stride=8, page_size=16)


def test_workload_is_heavy_tailed_and_seeded():
    a = Workload.drain(256, seed=1)
    assert (a.prompts == Workload.drain(256, seed=1).prompts).all()
    assert a.outputs.max() > 4 * np.median(a.outputs)
    with pytest.raises(ConfigError):
        Workload.drain(0)


@pytest.mark.parametrize("mode", [Layout.TP, Layout.DOP, "policy"])
def test_every_token_is_processed_once(mode):
    r = rollout(SIZES, THETA, WL, mode, CFG)
    assert r.output_tokens == int(WL.outputs.sum())
    assert r.prompt_tokens == int(WL.prompts.sum())
    assert len(r.completion_s) == WL.size
    assert r.makespan_s == pytest.approx(sum(r.time_by_layout.values()) + r.switch_s)
    assert r.makespan_s >= max(r.completion_s) - 1e-12
    if mode != "policy":
        assert r.switches == 0 and r.time_by_layout[mode.label] == pytest.approx(r.makespan_s)


def test_policy_run_records_its_switches():
    res = rollout_all(SIZES, THETA, WL, CFG, PolicyConfig(margin=0.0, min_dwell=0))
    pol = res["policy"]
    segs = pol.segments()
    assert len(segs) == pol.switches + 1  # every change of layout in the timeline was a paid switch
    assert all(s["start_s"] <= s["end_s"] for s in segs)
    assert set(res) == {"TP", "DP", "CP", "DOP", "policy"}
    # the policy picks per step among the fixed layouts, so it is never slower than the worst of them
    assert pol.makespan_s <= max(r.makespan_s for n, r in res.items() if n != "policy")


def test_a_request_that_never_fits_is_reported():
    tiny_mem = theta_for("cpu", 4, SIZES, memory_gib=0.001)
    with pytest.raises(ConfigError, match="never fits"):
        rollout(SIZES, tiny_mem, WL, Layout.TP, CFG)


def test_plot(tmp_path):
    res = rollout_all(SIZES, THETA, WL, CFG)
    out = tmp_path / "rollout.png"
    plot_rollouts(res, str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_speculation_in_the_simulator():
    """Verify steps emit the expected tokens (work conserved); the depth policy speculates when drafts are
    accepted and not when they never are, where always-on speculation only costs."""
    import dataclasses

    from splash.core.hardware import theta_for as tf

    sizes = AttentionSizes(PRESETS["deepseek-v3"], "fp8", "bf16")
    th = tf("h200", 8, sizes)
    wl = Workload.drain(16, 256, 1024, output_median=256, output_sigma=1.0, output_max=2048, seed=2)
    cfg = SimConfig(token_budget=4096, max_running=16, stride=8, page_size=64, spec_depth=3, spec_accept=0.8,
                    spec_draft_layers=1)
    runs = rollout_all(sizes, th, wl, cfg, PolicyConfig(), (Layout.TP, Layout.DP))
    assert {"policy", "policy+spec", "policy+spec-always"} <= set(runs)
    for name in ("policy", "policy+spec", "policy+spec-always"):
        assert runs[name].output_tokens == pytest.approx(int(wl.outputs.sum()))
    assert not runs["policy"].steps_by_depth and runs["policy+spec-always"].steps_by_depth.keys() == {3}
    assert runs["policy+spec"].makespan_s < runs["policy"].makespan_s
    assert sum(runs["policy+spec"].steps_by_depth.values()) < runs["policy"].steps
    never = dataclasses.replace(cfg, spec_accept=0.0)
    off = rollout(sizes, th, wl, "policy", never)
    on = rollout(sizes, th, wl, "policy", dataclasses.replace(never, spec_policy="always"))
    assert set(off.steps_by_depth) == {0} and on.makespan_s > off.makespan_s
