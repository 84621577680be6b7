"""splash/worker/host_malloc.py: CPU ranks keep freed activation blocks for reuse (no page faults on the
next step), can be told not to, and give the memory back on request. In a fresh process each: malloc's
state depends on what the process did before."""

import json
import os
import subprocess
import sys

import pytest

from splash.worker import host_malloc

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux") or host_malloc._libc() is None,
                                reason="glibc only")

_PROBE = """
import json, resource, torch
from splash.worker import host_malloc

def rss_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20

def faults_of_fresh_block(nbytes):
    t = torch.empty(nbytes, dtype=torch.uint8); t.fill_(1); del t  # resident, then freed
    r0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t = torch.empty(nbytes - (1 << 20), dtype=torch.uint8); t.fill_(2)  # fits the freed block
    r1 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    del t
    return r1 - r0

from splash.config import EngineConfig
on = EngineConfig.from_kwargs().malloc_tune  # (SPLASH_MALLOC_TUNE, as an engine's config reads it)
tuned = host_malloc.tune(on) and host_malloc.tune(on)
faults = faults_of_fresh_block(16 << 20)
before = rss_mib()
host_malloc.give_back()
print(json.dumps({"tuned": tuned, "faults": faults, "returned_mib": before - rss_mib()}))
"""


def _probe(**env: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _PROBE], env={**os.environ, **env}, capture_output=True,
                         text=True, timeout=120, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_tuned_malloc_reuses_freed_blocks_and_gives_them_back():
    got = _probe()
    assert got["tuned"]
    assert got["faults"] < 256, got  # a 16 MiB block freed, 15 MiB asked for: not 3840 page faults
    assert got["returned_mib"] > 8, got  # ... it stayed resident until give_back


def test_opt_out():
    got = _probe(SPLASH_MALLOC_TUNE="0")
    assert not got["tuned"] and got["returned_mib"] < 8, got  # untouched: give_back is a no-op


def test_freeze_heap_moves_live_objects_out_of_the_collector_and_thaw_undoes_it():
    import gc

    from splash.worker.host_malloc import freeze_heap, thaw_heap

    try:
        freeze_heap()
        assert gc.get_freeze_count() > 0
    finally:
        thaw_heap()
    assert gc.get_freeze_count() == 0
