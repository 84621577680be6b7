"""Calibration: Eq 10 as a linear model, the NNLS fit, fidelity bookkeeping, the default theta, the CLI."""

import json
import subprocess
import sys

import numpy as np
import pytest

from splash.calibration.fidelity import evaluate, format_summary, format_table, repeatability, summarize
from splash.calibration.fit import Observation, fit_theta, nnls
from splash.calibration.grid import GridPoint, default_grid, parse_points, quick_grid, split_holdout
from splash.calibration.measure import Timing, pages_needed
from splash.core.costmodel import Batch, step_cost
from splash.core.features import FIT_PARAMS, step_features, theta_params, with_params
from splash.core.layouts import LAYOUTS, Layout
from splash.core.model_config import ConfigError
from splash.core.presets import PRESETS
from splash.core.prior import (
    CPU_MEASURED,
    CPU_MEASURED_COMM,
    RUNTIME_COLLECTIVES,
    load_or_default_theta,
    runtime_prior,
)
from splash.core.sizes import AttentionSizes
from splash.core.theta import Theta

SIZES = AttentionSizes(PRESETS["tiny"], "fp32", "fp32")
PAGE = 16


def _true_theta(ranks=2):
    """A CPU-like theta whose regimes differ across the grid (latency-, slice- and compute-bound)."""
    p = [8e-3, 1e-4, 5e-3, 1 / 2e9, 1 / 5e8, 1 / 1e9, 1 / 3e9, 1 / 2e8, 1.5e-3, 2e-4, 3e-4]
    return with_params(runtime_prior(ranks, SIZES), np.array(p))


def _batches(rng, ranks):
    yield Batch.balanced(1, 64, 1, ranks)
    yield Batch.balanced(16, 2048, 1, ranks)
    yield Batch.balanced(2, 1024, 256, ranks)
    for _ in range(6):  # unbalanced contexts, mixed decode and prefill rows, skewed owners
        n = int(rng.integers(1, 12))
        s = rng.integers(1, 3000, size=n)
        q = np.minimum(s, rng.choice([0, 1, 1, 7, 300], size=n))
        yield Batch.make(s, q, rng.integers(0, ranks, size=n), ranks)


@pytest.mark.parametrize("ranks", [2, 4])
def test_step_features_reproduce_step_cost(ranks):
    """features @ params == Eq 10 exactly, whichever max() branches, busiest rank and [.]+ apply."""
    rng = np.random.default_rng(1)
    base = runtime_prior(ranks, SIZES)
    for k in range(12):
        p = theta_params(_true_theta(ranks)) * np.exp(rng.normal(0, 2.5, len(FIT_PARAMS)))
        th = with_params(base, p)
        if k % 2:  # the paper's overlap and collective counts, too
            d = th.to_dict()
            d.update(eta={"CP": 0.5, "DOP": 0.7}, collectives=None)
            th = Theta.from_dict(d)
        for batch in _batches(rng, ranks):
            for lay in LAYOUTS:
                want = step_cost(lay, SIZES, batch, th, PAGE).total
                got = step_features(lay, SIZES, batch, th, PAGE) @ theta_params(th)
                assert got == pytest.approx(want, rel=1e-9, abs=1e-15), (k, lay)


def test_theta_new_fields_round_trip(tmp_path):
    th = _true_theta()
    assert th.t_seq == pytest.approx(2e-4) and th.collectives == RUNTIME_COLLECTIVES
    assert th.collectives_of(Layout.CP) == 3 and th.eta_of(Layout.CP) == 0
    th.save(tmp_path / "t.json")
    assert Theta.load(tmp_path / "t.json") == th
    d = th.to_dict()
    for k in ("t_seq", "t_req", "collectives", "link_bw_by_layout"):  # files written before these load
        d.pop(k)
    old = Theta.from_dict(d)
    assert old.t_seq == 0 and old.t_req == 0
    assert old.collectives is None and old.collectives_of(Layout.CP) == 1
    assert old.link_bw_by_layout is None and old.link_bw_of(Layout.DOP) == old.link_bw
    per = Theta.from_dict({**d, "link_bw_by_layout": {"dop": 1e6}})  # unnamed layouts: link_bw
    assert per.link_bw_of(Layout.DOP) == 1e6 and per.link_bw_of(Layout.TP) == old.link_bw
    per.save(tmp_path / "p.json")
    assert Theta.load(tmp_path / "p.json") == per
    b = Batch.balanced(8, 64, 1, 2)
    assert step_cost(Layout.DOP, SIZES, b, per, PAGE).comm == pytest.approx(
        step_cost(Layout.DOP, SIZES, b, old, PAGE).comm * old.link_bw / 1e6)
    with pytest.raises(ConfigError, match="link_bw_by_layout"):
        Theta.from_dict({**d, "link_bw_by_layout": {"tp": 0}})
    with pytest.raises(ConfigError, match="t_seq"):
        Theta.from_dict({**d, "t_seq": -1})
    with pytest.raises(ConfigError, match="t_req"):
        Theta.from_dict({**d, "t_req": -1})
    with pytest.raises(ConfigError, match="collectives"):
        Theta.from_dict({**d, "collectives": {"tp": -1}})
    # t_seq prices the requests a rank attends: DP's owners split them, TP's ranks each see all
    b = Batch.balanced(64, 64, 1, 2)
    dt = {lay: step_cost(lay, SIZES, b, th, PAGE).total - step_cost(lay, SIZES, b, old_like(th), PAGE).total
          for lay in (Layout.TP, Layout.DP)}
    L = SIZES.layers
    assert dt[Layout.TP] == pytest.approx(L * 64 * th.t_seq, rel=0.2)
    assert dt[Layout.DP] == pytest.approx(L * 32 * th.t_seq, rel=0.2)
    # t_req prices every request with rows this step once, whatever the layout (requests without rows
    # cost nothing)
    d = th.to_dict()
    d["t_req"] = 0.0
    no_req = Theta.from_dict(d)
    b = Batch.make([64, 64, 64], [1, 0, 1], ranks=2)
    for lay in LAYOUTS:
        got = step_cost(lay, SIZES, b, th, PAGE).total - step_cost(lay, SIZES, b, no_req, PAGE).total
        assert got == pytest.approx(2 * th.t_req)


def old_like(th):
    d = th.to_dict()
    d["t_seq"] = 0.0
    return Theta.from_dict(d)


def test_nnls_meets_kkt_conditions():
    rng = np.random.default_rng(0)
    for _ in range(20):
        A = rng.normal(size=(30, 6)) * rng.uniform(0.1, 10, 6)
        b = rng.normal(size=30)
        x = nnls(A, b)
        g = A.T @ (b - A @ x)  # minus the gradient of 0.5 ||Ax - b||^2
        assert (x >= 0).all()
        assert np.all(g[x <= 0] <= 1e-8)  # no descent direction into the constraint
        assert np.allclose(g[x > 0], 0, atol=1e-8)  # stationary on the free set
    x_true = np.array([1.0, 0.0, 2.5])
    A = rng.uniform(0, 1, size=(10, 3))
    assert nnls(A, A @ x_true) == pytest.approx(x_true, abs=1e-9)


def _synthetic(true, points, rng, noise=0.03):
    return [Observation(lay, p.batch(2), step_cost(lay, SIZES, p.batch(2), true, PAGE).total
                        * (1 + noise * rng.standard_normal())) for p in points for lay in LAYOUTS]


def _check_picks(fit_theta_, true, held, min_hits=0.7):
    """Predicted step times within 8% of the truth; misses only between near-equal layouts (the truth's
    best leads by < 5%: DOP and TP are near ties at T = 2 in decode); at least `min_hits` of the points
    hit."""
    hits = 0
    for p in held:
        b = p.batch(2)
        t_true = {lay: step_cost(lay, SIZES, b, true, PAGE).total for lay in LAYOUTS}
        t_fit = {lay: step_cost(lay, SIZES, b, fit_theta_, PAGE).total for lay in LAYOUTS}
        for lay in LAYOUTS:
            assert t_fit[lay] == pytest.approx(t_true[lay], rel=0.08)
        best = min(t_true, key=t_true.get)
        pick = min(t_fit, key=t_fit.get)
        hits += pick == best
        assert t_true[pick] / t_true[best] - 1 < 0.05  # a miss only between near-equal layouts
        if sorted(t_true.values())[1] / t_true[best] - 1 > 0.05:
            assert pick == best, p
    assert hits >= min_hits * len(held)


def test_fit_recovers_known_theta_from_noisy_synthetic_timings():
    """Timings made by Eq 10 itself (+3% noise): the one-latency fit recovers the parameters that
    matter and picks the true best layout on held-out points."""
    true = _true_theta()
    rng = np.random.default_rng(7)
    train, held = split_holdout(default_grid())
    fit = fit_theta(_synthetic(true, train, rng), SIZES, runtime_prior(2, SIZES), PAGE, per_layout_comm=False)
    assert fit.rel_rmse < 0.05
    got, want = theta_params(fit.theta), theta_params(true)
    for name in ("t0", "latency", "t_seq", "t_req", "inv_flops_att", "inv_flops_proj"):
        i = FIT_PARAMS.index(name)
        assert got[i] == pytest.approx(want[i], rel=0.25), name
    _check_picks(fit.theta, true, held)


def test_per_layout_comm_fit_prices_each_layouts_collectives():
    """A deployment whose all-to-alls cost more per call and per byte than its all-reduce (as gloo's
    do): the per-layout fit reproduces it; one shared latency and link rate cannot. (Per layout, t0
    and the latencies are only identified together, so the check is on step times and picks.)"""
    d = _true_theta().to_dict()
    d.update(collectives={"TP": 1.0, "DP": 0.2, "CP": 8.0, "DOP": 12.0},
             link_bw_by_layout={"TP": 1e9, "DP": 5e7, "CP": 4e8, "DOP": 2e7})
    true = Theta.from_dict(d)
    rng = np.random.default_rng(3)
    train, held = split_holdout(default_grid())
    obs = _synthetic(true, train, rng, noise=0.02)
    fit = fit_theta(obs, SIZES, runtime_prior(2, SIZES), PAGE)
    shared = fit_theta(obs, SIZES, runtime_prior(2, SIZES), PAGE, per_layout_comm=False)
    assert fit.rel_rmse < 0.03 and shared.rel_rmse > 1.5 * fit.rel_rmse, (fit.rel_rmse, shared.rel_rmse)
    _check_picks(fit.theta, true, held, min_hits=0.7)  # this truth has more near-ties
    th = fit.theta
    assert th.link_bw_by_layout is not None and set(th.collectives) == {"TP", "DP", "CP", "DOP"}
    for lay in LAYOUTS:  # features @ params still equal Eq 10 with per-layout rates
        b = Batch.balanced(8, 512, 1, 2)
        assert step_features(lay, SIZES, b, th, PAGE) @ theta_params(th) == pytest.approx(
            step_cost(lay, SIZES, b, th, PAGE).total, rel=1e-9)


def test_fit_rejects_bad_input():
    with pytest.raises(ValueError, match="no observations"):
        fit_theta([], SIZES, runtime_prior(2, SIZES))
    o = [Observation(Layout.TP, Batch.balanced(1, 8, 1, 2), 0.01)]
    with pytest.raises(ValueError, match="unknown parameter"):
        fit_theta(o, SIZES, runtime_prior(2, SIZES), fixed=["bogus"])


def test_fidelity_hits_regret_and_table():
    th = _true_theta()
    pts = [GridPoint(1, 64, 1), GridPoint(64, 512, 1)]
    tim = {}
    for p in pts:
        pred = {lay.label.lower(): step_cost(lay, SIZES, p.batch(2), th, PAGE).total for lay in LAYOUTS}
        best = min(pred, key=pred.get)
        for lay, t in pred.items():
            # point 0 measured as predicted; point 1: the predicted best measured 20% slower than another
            scale = 1.0
            if p is pts[1]:
                scale = 1.5 if lay == best else 1.0
            tim[(lay, p)] = Timing(lay, p, [t * scale] * 3)
    rows = evaluate(th, SIZES, tim, pts, ["tp", "dp", "cp", "dop"], PAGE)
    assert rows[0].hit and rows[0].regret == 0
    r1 = rows[1]
    assert not r1.hit
    second = sorted(r1.predicted.values())[1]
    assert r1.regret == pytest.approx(1.5 * min(r1.predicted.values()) / second - 1)
    s = summarize(rows)
    assert s.points == 2 and s.hit_rate == 0.5 and s.max_regret == pytest.approx(r1.regret)
    assert s.within_10 == (0.5 if r1.regret > 0.1 else 1.0)
    assert rows[0].noise == 0 and not rows[0].tied  # identical repetitions: no noise
    assert s.tied == 0 and json.loads(json.dumps(s.to_dict()))["tied"] == 0
    assert s.hit_rate_decisive == s.hit_rate  # no ties: the decisive points are all points
    text = format_table(rows, ["tp", "dp", "cp", "dop"])
    assert "miss" in text and "B=" not in text and text.count("\n") == 4


def test_pages_needed_follows_each_layouts_placement():
    pts = [GridPoint(3, 100, 1), GridPoint(1, 1000, 8)]  # 7 and 63 pages of 16 tokens per request
    assert pages_needed(pts, 16, "tp", 2) == 63 + 1  # every rank holds every page
    assert pages_needed(pts, 16, "dp", 2) == 63 + 1  # the owner of the long request holds it all
    assert pages_needed(pts, 16, "cp", 2) == 32 + 1  # page j on rank j % 2
    assert pages_needed([GridPoint(4, 100, 1)], 16, "dop", 2) == 2 * 7 + 1  # two requests per owner


def test_timing_statistics():
    t = Timing("tp", GridPoint(1, 8, 1), [0.010, 0.011, 0.030, 0.012])
    assert t.median == pytest.approx(0.0115)
    q1, q3 = np.percentile(t.times, [25, 75])
    assert t.spread == pytest.approx((q3 - q1) / 0.0115)
    assert t.se == pytest.approx(1.2533 * t.spread / 1.349 / 2)  # sigma from the IQR, over sqrt(n)
    d = t.to_dict()
    assert d["B"] == 1 and d["median_s"] == t.median and d["times_s"] == t.times and d["se"] == t.se


def test_points_within_two_standard_errors_are_tied_but_still_count():
    """A 3% lead measured with 10% standard errors is a tie; the headline hit rate still counts it."""
    th = _true_theta()
    p = GridPoint(64, 512, 1)
    pred = {lay.label.lower(): step_cost(lay, SIZES, p.batch(2), th, PAGE).total for lay in LAYOUTS}
    best = min(pred, key=pred.get)
    other = sorted(pred, key=pred.get)[1]
    noisy = [0.8, 0.9, 1.0, 1.1, 1.2] * 2  # IQR / median 0.2 over 10 steps
    tim = {(lay, p): Timing(lay, p, [t * v for v in noisy]) for lay, t in pred.items()}
    tim[(other, p)] = Timing(other, p, [pred[best] * 0.97 * v for v in noisy])  # measured 3% faster
    (row,) = evaluate(th, SIZES, tim, [p], list(pred), PAGE)
    assert not row.hit and row.meas_best == other and row.tied
    assert row.noise == pytest.approx(2 ** 0.5 * tim[(best, p)].se)
    s = summarize([row])
    assert s.hit_rate == 0 and s.tied == 1 and np.isnan(s.hit_rate_decisive)
    assert json.loads(json.dumps(s.to_dict()))["hit_rate_decisive"] is None
    assert "tie" in format_table([row], list(pred))
    text = format_summary(s)
    assert "no decisive point" in text and "nan" not in text


def test_repeatability_compares_the_two_halves_of_the_repetitions():
    a, b = GridPoint(1, 8, 1), GridPoint(2, 8, 1)
    tim = {("tp", a): Timing("tp", a, [1, 1, 1, 1]), ("dp", a): Timing("dp", a, [2, 2, 2, 2]),  # agree
           ("tp", b): Timing("tp", b, [1, 1, 3, 3]), ("dp", b): Timing("dp", b, [2, 2, 2, 2])}  # flip
    assert repeatability(tim, [a, b], ["tp", "dp"]) == 0.5
    assert repeatability(tim, [a], ["tp", "dp"]) == 1.0
    one = {k: Timing(v.layout, v.point, v.times[:1]) for k, v in tim.items()}
    assert np.isnan(repeatability(one, [a, b], ["tp", "dp"]))


def test_grid_parsing_and_holdout():
    assert parse_points("1:64:1, 8:512:32") == [GridPoint(1, 64, 1), GridPoint(8, 512, 32)]
    for bad in ("1:64", "a:b:c", "", "2:4:8"):
        with pytest.raises(ConfigError):
            parse_points(bad)
    for grid in (default_grid(), quick_grid()):
        train, held = split_holdout(grid)
        assert set(train).isdisjoint(held) and sorted(train + held) == sorted(grid)
        assert len(held) >= len(grid) // 3 and all(p.q <= p.s for p in grid)
    assert split_holdout([GridPoint(1, 8, 1)]) == ([GridPoint(1, 8, 1)], [])


def test_load_or_default_theta(tmp_path, caplog):
    cfg = PRESETS["tiny"]
    with caplog.at_level("WARNING", logger="splash.calibration"):
        th, src = load_or_default_theta(None, 2, cfg, "fp32", "cpu")
    assert th.ranks == 2 and "built-in default" in src and "splash calibrate" in caplog.text
    assert th.source == "cpu-measured-default" and th.t_seq == CPU_MEASURED["t_seq"]
    # the CPU default carries the per-layout communication terms measured with it
    assert th.collectives == CPU_MEASURED_COMM["collectives"] and th.act_bytes == 4
    assert th.link_bw_by_layout == CPU_MEASURED_COMM["link_bw_by_layout"]
    gpu, _ = load_or_default_theta(None, 4, cfg, "bf16", "cuda")
    assert gpu.source == "profile:h200" and gpu.ranks == 4 and gpu.act_bytes == 2
    cal = _true_theta()
    cal.save(tmp_path / "theta.json")
    th, src = load_or_default_theta(str(tmp_path / "theta.json"), 2, cfg)
    assert th == cal and "calibrated" in src
    with pytest.raises(ConfigError, match="--tp 4"):
        load_or_default_theta(str(tmp_path / "theta.json"), 4, cfg)


def _cli(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "splash", "calibrate", *args], capture_output=True,
                          text=True, timeout=timeout)


def test_cli_refuses_bad_input_in_one_line(tmp_path, capsys):
    from splash.cli import main

    for args, msg in ((["--layouts", "tp,xx"], "--layouts"), (["--points", "1:64"], "B:s:q"),
                      (["--tp", "1", "--points", "1:8:1,2:8:1"], "--tp 2"),
                      (["--points", "1:8:1", "--holdout-every", "1"], "--holdout-every")):
        assert main(["calibrate", *args, "--out", str(tmp_path / "t.json")]) == 2
        err = capsys.readouterr().err
        assert err.startswith("splash: error:") and msg in err and err.count("\n") == 1
    assert not (tmp_path / "t.json").exists()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_cli_tiny_real_calibration_end_to_end(tmp_path):
    """2 layouts x 3 points on 2 real ranks: timings, fit, held-out table, a loadable theta file."""
    out = tmp_path / "theta.json"
    r = _cli("--tp", "2", "--points", "1:32:1,4:64:1,2:64:16", "--layouts", "tp,dp", "--reps", "2",
             "--rounds", "1", "--out", str(out), "--json", timeout=200)
    assert r.returncode == 0, r.stderr[-2000:]
    obj = json.loads(r.stdout)
    th = Theta.load(out)
    assert th.ranks == 2 and th.to_dict() == obj["theta"] and "splash calibrate" in th.source
    assert obj["layouts"] == ["tp", "dp"] and len(obj["train"]) == 2
    (row,) = obj["heldout"]
    assert (row["B"], row["s"], row["q"]) == (2, 64, 16)
    assert set(row["measured_s"]) == set(row["predicted_s"]) == {"tp", "dp"}
    assert row["pred_best"] in ("tp", "dp") and row["regret"] >= 0
    assert len(obj["timings"]) == 6 and all(len(t["times_s"]) == 2 and t["median_s"] > 0
                                            for t in obj["timings"])
    assert obj["summary"]["points"] == 1 and 0 <= obj["repeatability"] <= 1
