"""`splash calibrate`: time each layout on this deployment, fit theta (Eq 10), check it on held-out points."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from splash.argtypes import output_file, positive_int
from splash.core.layouts import DEFAULT_PAGE_SIZE


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "calibrate", help="measure this deployment and fit theta for the layout policy",
        description="Time real forward steps of every layout (tp, dp, cp, dop) over a grid of (B running "
                    "requests, s context, q query rows), fit theta of Eq 10 by least squares on two thirds "
                    "of the points, and print how well it picks layouts on the held-out third. Engines "
                    "load the result with --theta FILE.")
    p.add_argument("--tp", type=positive_int, default=2, help="ranks T (default 2)")
    p.add_argument("--model", default="tiny", help="checkpoint directory, or 'tiny' (default)")
    p.add_argument("--dtype", default="float32", help="model dtype (default float32)")
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda if present)")
    p.add_argument("--out", default="theta.json", metavar="FILE", type=output_file,
                   help="where to save theta (default theta.json)")
    p.add_argument("--quick", action="store_true",
                   help="small grid, one round (about a minute at T=2; too few points and steps for "
                        "a decisive fidelity check)")
    p.add_argument("--points", default=None, metavar="B:s:q,...",
                   help="custom grid instead of the built-in one, e.g. 1:64:1,32:512:1,1:1024:256")
    p.add_argument("--layouts", default="tp,dp,cp,dop", help="layouts to compare (default all four)")
    p.add_argument("--reps", type=positive_int, default=None,
                   help="timed steps per layout, point and round; the layouts take turns step by step "
                        "(default 16, quick 8; one step varies by 15-40%% on a shared CPU: with 2 rounds "
                        "the median of 32 steps picks the same best layout in both halves of the steps at "
                        "~85%% of the points, the median of 16 at ~74%%)")
    p.add_argument("--rounds", type=positive_int, default=None,
                   help="passes over the grid (default 2, quick 1)")
    p.add_argument("--holdout-every", type=int, default=3, metavar="K",
                   help="hold out every K-th grid point for the fidelity check (default 3)")
    p.add_argument("--page-size", type=positive_int, default=DEFAULT_PAGE_SIZE,
                   help=f"KV page size (default {DEFAULT_PAGE_SIZE})")
    p.add_argument("--profile", default=None, help="hardware profile of the prior (default: cpu, or h200 on "
                                                   "CUDA)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true",
                   help="print one JSON object on stdout instead of the table (progress stays on stderr)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from splash.calibration.fidelity import format_summary, format_table
    from splash.calibration.grid import default_grid, parse_points, quick_grid
    from splash.calibration.run import LAYOUT_NAMES, calibrate
    from splash.core.model_config import ConfigError
    from splash.distributed.launch import WorkerError

    layouts = [x.strip().lower() for x in args.layouts.split(",") if x.strip()]
    bad = [x for x in layouts if x not in LAYOUT_NAMES]
    if bad or len(set(layouts)) < 2:
        raise ConfigError(f"--layouts wants two or more of {', '.join(LAYOUT_NAMES)}, got {args.layouts!r}")
    points = parse_points(args.points) if args.points else (quick_grid() if args.quick else default_grid())
    if args.holdout_every < 2:
        raise ConfigError(f"--holdout-every must be >= 2, got {args.holdout_every}")
    reps = args.reps or (8 if args.quick else 16)
    rounds = args.rounds or (1 if args.quick else 2)
    try:
        cal = calibrate(args.tp, points, layouts=layouts, model=args.model, dtype=args.dtype,
                        page_size=args.page_size, reps=reps, rounds=rounds, device=args.device,
                        profile=args.profile, holdout_every=args.holdout_every, seed=args.seed,
                        progress=True)
    except (WorkerError, RuntimeError, TimeoutError) as e:  # a rank or an engine failed mid-run
        print(f"splash calibrate: error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 1
    cal.theta.save(args.out)
    if args.json:
        obj: dict[str, Any] = {"out": args.out, **cal.to_dict()}
        print(json.dumps(obj))
        return 0
    print(f"measured {len(points)} points x {len(layouts)} layouts on T={args.tp} in {cal.seconds:.0f} s; "
          f"fitted on {len(cal.train)}, held out {len(cal.held)} "
          f"(train step-time error {cal.fit.rel_rmse:.1%}, start: {cal.fit.start})")
    if cal.rows:
        print(format_table(cal.rows, layouts))
        print(format_summary(cal.summary, "calibrated"))
        print(format_summary(cal.prior_summary, f"uncalibrated {cal.prior.source} prior, same points"))
    if cal.repeatability == cal.repeatability:  # not NaN
        spread = sorted(t.spread for t in cal.timings.values())
        print(f"repeatability: the two halves of the measurements pick the same best layout at "
              f"{cal.repeatability:.0%} of all {len(points)} points (each half has half the steps; the full "
              f"median is steadier); one step's noise (IQR / median) is {spread[len(spread) // 2]:.0%} at "
              f"the median (layout, point), {reps * rounds} timed steps each")
    else:
        print("no held-out points (grid too small): fidelity not checked")
    print(f"theta saved to {args.out} (engines: --theta {args.out})")
    return 0
