"""Long runs stay bounded (bench/long_run.py at a reduced count; the full run is
100,000 calls): every cache within its documented size, no memory growth."""
import sys
from pathlib import Path

import torch_metal_flash as tmf

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import long_run  # noqa: E402


def test_calls_with_varying_shapes_stay_bounded():
    snaps = long_run.run(calls=400, seed=1, samples=12, checked=True)
    assert not long_run.bounded(snaps, rss_growth_mib=64)
    assert snaps[-1]["caches"]["fallback_warnings"] >= 5  # the run did exercise the warning registry


def test_caches_are_lru_with_a_size_and_clearable():
    from torch_metal_flash.caches import LRU
    cache = LRU("test.lru", 2)
    cache.put("a", 1)
    cache.put("b", 2)
    assert cache.get("a") == 1  # a is now the most recent
    cache.put("c", 3)
    assert "b" not in cache and cache.get("a") == 1 and cache.get("c") == 3
    assert tmf.cache_info()["test.lru"]["evictions"] == 1
    tmf.clear_caches()
    assert len(cache) == 0 and all(v["size"] == 0 for v in tmf.cache_info().values())
