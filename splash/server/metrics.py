"""Prometheus metrics with vLLM-like names under a `splash:` prefix, one registry per app.

Per-app registries (not prometheus_client's global one) let tests build several apps in one process.
Gauges that mirror engine state are refreshed from `engine.stats()` at scrape time, so the engine
never has to know about Prometheus; latency histograms are observed by the request handlers.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from splash.step.plan import LAYOUTS

# Buckets as vLLM uses them (seconds); tiny-model CPU latencies land in the low buckets.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


# `*_created` timestamp series double the exposition for no use here (vLLM disables them too).
disable_created_metrics()


def _first(stats: Mapping[str, Any], *keys: str) -> Any:
    for k in keys:
        if stats.get(k) is not None:
            return stats[k]
    return None


class ServerMetrics:
    """All `splash:` series of one server; `render()` returns the exposition text."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r, m = self.registry, model_name
        lbl = ["model_name"]
        self._label = {"model_name": m}

        self.running = Gauge("splash:num_requests_running", "Requests in the running batch.", lbl,
                             registry=r).labels(m)
        self.waiting = Gauge("splash:num_requests_waiting", "Requests queued for admission.", lbl,
                             registry=r).labels(m)
        self.kv_usage = Gauge("splash:kv_cache_usage_perc",
                              "Fraction of KV pages in use (1 = full).", lbl, registry=r).labels(m)
        self.prompt_tokens = Counter("splash:prompt_tokens", "Prompt tokens of admitted requests.", lbl,
                                     registry=r).labels(m)
        self.generation_tokens = Counter("splash:generation_tokens", "Generated tokens.", lbl,
                                         registry=r).labels(m)
        self._success = Counter("splash:request_success", "Finished requests by finish reason.",
                                lbl + ["finished_reason"], registry=r)
        self.ttft = Histogram("splash:time_to_first_token_seconds",
                              "Time from request arrival to its first generated token.", lbl,
                              buckets=TTFT_BUCKETS, registry=r).labels(m)
        self.itl = Histogram("splash:inter_token_latency_seconds",
                             "Time between successive token deliveries of a request.", lbl,
                             buckets=ITL_BUCKETS, registry=r).labels(m)
        self.e2e = Histogram("splash:e2e_request_latency_seconds",
                             "Time from request arrival to its last token.", lbl,
                             buckets=E2E_BUCKETS, registry=r).labels(m)
        # Filled by the multi-rank runtime (layouts, switches); single-rank engines report T = 1, tp.
        self._layout = Gauge("splash:layout", "1 for the attention layout in use, 0 for the others.",
                             lbl + ["layout"], registry=r)
        self.ranks = Gauge("splash:ranks", "Ranks serving the model (T).", lbl, registry=r).labels(m)
        self._pool = Gauge("splash:kv_pool_tokens_per_rank", "KV pool capacity of each rank, in tokens.",
                           lbl + ["rank"], registry=r)
        self.slots_used = Gauge("splash:state_slots_used",
                                "KDA hybrids: request state slots held (one per admitted request).", lbl,
                                registry=r).labels(m)
        self.slots_total = Gauge("splash:state_slots_total",
                                 "KDA hybrids: request state slots per rank (0: no per-request state).", lbl,
                                 registry=r).labels(m)
        self.snaps_used = Gauge("splash:prefix_snapshots_used",
                                "KDA hybrids: prefix-cache state snapshots held (rows of the snapshot pool).",
                                lbl, registry=r).labels(m)
        self.snaps_total = Gauge("splash:prefix_snapshots_total",
                                 "KDA hybrids: state snapshot rows per rank (--num-state-snapshots).", lbl,
                                 registry=r).labels(m)
        self.spec_depth = Gauge("splash:spec_depth",
                                "Drafts per decoding request the next step verifies (0: speculation off; "
                                "the depth policy's choice under --speculative-policy auto).", lbl,
                                registry=r).labels(m)
        self.pd_waiting = Gauge("splash:pd_requests_waiting_for_kv",
                                "PD decode: requests with pages reserved, waiting for their KV.", lbl,
                                registry=r).labels(m)
        self.pd_inflight = Gauge("splash:pd_prefills_inflight",
                                 "PD prefill: requests prefilling or transferring their KV.", lbl,
                                 registry=r).labels(m)
        self.pd_bootstrapping = Gauge("splash:pd_rooms_bootstrapping",
                                      "PD prefill: requests held until their decode's destination arrives.",
                                      lbl, registry=r).labels(m)
        self.distinct = Gauge("splash:kv_distinct_tokens",
                              "Distinct KV tokens the group can hold under the current layout.", lbl,
                              registry=r).labels(m)
        self._store_bytes = Gauge("splash:kv_bytes_per_token",
                                  "KV bytes one token takes over all layers, per store (latent; the DSA "
                                  "indexer's keys).", lbl + ["store"], registry=r)

        self._engine = _EngineCounters(model_name)
        r.register(self._engine)
        from splash.server.switch_metrics import SwitchCollector

        self._switches = SwitchCollector(model_name)  # splash:switches_total{from,to}, exposed seconds
        r.register(self._switches)

    def finished(self, reason: str | None) -> None:
        self._success.labels(self._label["model_name"], reason or "unknown").inc()

    def refresh(self, stats: Mapping[str, Any]) -> None:
        """Copy engine state into the gauges; missing keys leave a gauge at its last value."""
        lab = self._label["model_name"]
        self._engine.stats = dict(stats)
        self._switches.stats = self._engine.stats
        for gauge, keys in ((self.running, ("num_running", "running", "num_requests_running")),
                            (self.waiting, ("num_waiting", "waiting", "num_requests_waiting")),
                            (self.kv_usage, ("kv_usage", "kv_cache_usage", "kv_cache_usage_perc")),
                            (self.ranks, ("ranks", "world", "tp")),
                            (self.slots_used, ("state_slots_used",)),
                            (self.slots_total, ("state_slots_total",)),
                            (self.snaps_used, ("prefix_snapshots_used",)),
                            (self.snaps_total, ("prefix_snapshots_total",)),
                            (self.spec_depth, ("speculative_depth",)),
                            (self.pd_waiting, ("pd_waiting_for_kv",)),
                            (self.pd_inflight, ("pd_prefill_inflight",)),
                            (self.pd_bootstrapping, ("pd_rooms_bootstrapping",)),
                            # The allocator's pool_tokens() already counts distinct tokens of the
                            # group under the current layout (TP: one rank's pool; DP/CP: the sum).
                            (self.distinct, ("kv_distinct_tokens", "kv_pool_tokens"))):
            v = _first(stats, *keys)
            if isinstance(v, (int, float)):
                gauge.set(float(v))
        layout = _first(stats, "layout")
        if isinstance(layout, str):
            for name in sorted(set(LAYOUTS) | {layout}):
                self._layout.labels(lab, name).set(1.0 if name == layout else 0.0)
        per_rank = _first(stats, "kv_pool_tokens_per_rank")
        if per_rank is None and isinstance(_first(stats, "kv_pool_tokens"), int):
            ranks = int(_first(stats, "ranks", "world") or 1)
            per_rank = [int(stats["kv_pool_tokens"]) // max(1, ranks)] * max(1, ranks)
        if isinstance(per_rank, (list, tuple)):
            for rank, tokens in enumerate(per_rank):
                self._pool.labels(lab, str(rank)).set(float(tokens))
        stores = _first(stats, "kv_bytes_per_token")
        if isinstance(stores, dict):
            for store, b in stores.items():
                self._store_bytes.labels(lab, str(store)).set(float(b))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCounters(Collector):
    """Counters the engine keeps itself, exported as of the last refresh.

    `splash:engine_generated_tokens_total` counts every sampled token, including those of requests
    whose client left: the difference to `splash:generation_tokens_total` is wasted work.
    """

    SERIES = (("splash:engine_generated_tokens", "generation_tokens_total",
               "Tokens sampled by the engine (delivered or not)."),
              ("splash:engine_steps", "steps", "Engine steps run."),
              ("splash:prefix_cache_queries", "prefix_cache_queries",
               "Prompt tokens looked up in the prefix cache (vLLM's name)."),
              ("splash:prefix_cache_hits", "prefix_cache_hits", "Of those, tokens found cached."),
              ("splash:num_preemptions", "num_preemptions", "Sequences preempted (KV dropped, recomputed)."),
              # KDA hybrids' prefix cache (splash/kv/snapshots.py)
              ("splash:prefix_snapshots_saved", "prefix_snapshots_saved",
               "KDA hybrids: state snapshots taken at a prompt's cacheable end."),
              ("splash:prefix_snapshot_hits", "prefix_snapshot_hits",
               "KDA hybrids: requests that started from a cached prefix's state snapshot."),
              ("splash:prefix_snapshots_evicted", "prefix_snapshots_evicted",
               "KDA hybrids: snapshots dropped for room (LRU) or with their prefix block."),
              ("splash:prefix_snapshots_dropped", "prefix_snapshots_dropped",
               "KDA hybrids: snapshots dropped by a weight update (or a flush of the index)."),
              ("splash:prefix_snapshots_moved", "prefix_snapshots_moved",
               "KDA hybrids: snapshots carried through a live layout switch (one per snapshot and switch)."),
              ("splash:spec_verify", "spec_verify_ct",
               "Speculative verify slices run (one per request and step)."),
              ("splash:spec_draft_tokens", "spec_draft_tokens", "Draft tokens verified."),
              ("splash:spec_accepted_tokens", "spec_accepted_tokens", "Draft tokens accepted."),
              ("splash:spec_depth_changes", "spec_depth_changes",
               "Times the depth policy changed the speculation depth."),
              # prefill/decode disaggregation (splash/engine/stages/pd.py): a prefill counts what it sent,
              # a decode what it received
              ("splash:kv_transfer_bytes", "kv_transfer_bytes_total",
               "PD: KV bytes moved by the transfer engine (sent on a prefill, received on a decode)."),
              ("splash:kv_transfer_seconds", "kv_transfer_seconds_total",
               "PD: seconds spent in KV transfers."),
              ("splash:kv_fill_bytes", "kv_fill_bytes_total",
               "PD decode: KV bytes copied inside this group to complete the replicas its layout keeps "
               "(each block crosses the link once; splash plan pd's fill)."),
              ("splash:kv_transfers", "kv_transfers_total", "PD: KV transfers (one per request)."),
              ("splash:kv_transfer_pieces", "kv_transfer_pieces_total",
               "PD prefill: pieces its KV writes moved (one per run of pages per store and layer, per "
               "state head range): pages in runs make few pieces."),
              ("splash:kv_transfer_failures", "kv_transfer_failures_total",
               "PD: requests whose KV transfer or handshake failed."))

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.stats: dict[str, Any] = {}

    def describe(self) -> list[CounterMetricFamily]:
        return [CounterMetricFamily(name, doc, labels=["model_name"]) for name, _, doc in self.SERIES]

    def collect(self) -> list[CounterMetricFamily]:
        out = []
        for name, key, doc in self.SERIES:
            fam = CounterMetricFamily(name, doc, labels=["model_name"])
            v = self.stats.get(key)
            if isinstance(v, (int, float)):
                fam.add_metric([self.model_name], float(v))
            out.append(fam)
        return out


class RequestTimer:
    """Observes TTFT, inter-token latency and E2E latency of one request as its tokens arrive."""

    def __init__(self, metrics: ServerMetrics, arrival: float | None = None) -> None:
        self.m = metrics
        self.arrival = arrival if arrival is not None else time.perf_counter()
        self.last: float | None = None
        self.tokens = 0

    def tokens_seen(self, total_generated: int) -> None:
        """Called with the cumulative generated-token count of the request after each snapshot."""
        new = total_generated - self.tokens
        if new <= 0:
            return
        now = time.perf_counter()
        if self.last is None:
            self.m.ttft.observe(now - self.arrival)
        else:
            self.m.itl.observe(now - self.last)
        self.m.generation_tokens.inc(new)
        self.tokens, self.last = total_generated, now

    def done(self, reasons: list[str | None]) -> None:
        self.m.e2e.observe(time.perf_counter() - self.arrival)
        for r in reasons:
            self.m.finished(r)
