"""Prometheus series of live layout switching, exported from the engine's stats at scrape time.

`splash:switches_total{from,to}` counts switches per direction and `splash:switch_exposed_seconds`
is the histogram of each switch's exposed time on rank 0 (the `splash:layout` gauge lives in
metrics.py). With `--layout auto`, `splash:switch_backs_total{from,to}` counts the regret guard's
switches back (a switch that ran slower than the layout it left) and `splash:step_time_correction
{layout}` is each layout's online correction: its median measured / predicted step time. The engine
keeps the counts and the per-switch times itself (`stats()`), so the
collector only re-shapes them; a single-rank engine reports no switches.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from splash.switch.controller import EXPOSED_BUCKETS

EXPOSED_DOC = "Exposed time of each live layout switch on rank 0."
BACKS_DOC = "Switches back by the regret guard (the switch ran slower than the layout it left), by direction."
LAYOUT_LABELS = ["model_name", "layout"]
CORRECTION_DOC = "Online correction of the layout policy's prior: median measured / predicted step time."


class SwitchCollector(Collector):
    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.stats: Mapping[str, Any] = {}

    def describe(self) -> list[Any]:
        return [CounterMetricFamily("splash:switches", "Live layout switches, by direction.",
                                    labels=["model_name", "from", "to"]),
                HistogramMetricFamily("splash:switch_exposed_seconds",
                                      EXPOSED_DOC, labels=["model_name"]),
                CounterMetricFamily("splash:switch_backs", BACKS_DOC, labels=["model_name", "from", "to"]),
                GaugeMetricFamily("splash:step_time_correction", CORRECTION_DOC, labels=LAYOUT_LABELS)]

    def collect(self) -> list[Any]:
        sw = CounterMetricFamily("splash:switches", "Live layout switches, by direction.",
                                 labels=["model_name", "from", "to"])
        for key, n in sorted(dict(self.stats.get("switches_total") or {}).items()):
            src, _, dst = str(key).partition("->")
            sw.add_metric([self.model_name, src, dst], float(n))
        h = self.stats.get("switch_exposed_seconds") or {}
        counts = list(h.get("counts") or [0] * (len(EXPOSED_BUCKETS) + 1))
        cumulative = list(itertools.accumulate(counts))
        hist = HistogramMetricFamily("splash:switch_exposed_seconds",
                                     EXPOSED_DOC, labels=["model_name"])
        buckets = [(str(b), float(c)) for b, c in zip(EXPOSED_BUCKETS, cumulative)]
        buckets.append(("+Inf", float(cumulative[-1])))
        hist.add_metric([self.model_name], buckets, float(h.get("sum", 0.0)))
        backs = CounterMetricFamily("splash:switch_backs", BACKS_DOC, labels=["model_name", "from", "to"])
        for key, n in sorted(dict(self.stats.get("switch_backs_total") or {}).items()):
            src, _, dst = str(key).partition("->")
            backs.add_metric([self.model_name, src, dst], float(n))
        corr = GaugeMetricFamily("splash:step_time_correction", CORRECTION_DOC, labels=LAYOUT_LABELS)
        for lay, d in sorted(dict(self.stats.get("theta_correction") or {}).items()):
            corr.add_metric([self.model_name, lay], float(d["ratio"]))
        return [sw, hist, backs, corr]
