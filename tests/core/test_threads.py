"""Calls from 4 Python threads at once (different faces, shapes, backends, ``backend()``
contexts and emulator settings, with the emulator's library caches being filled
concurrently) give bit for bit the results of serial calls, and context-manager
state never leaks from one thread to another."""
from __future__ import annotations

import random
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

import torch_metal_flash as tmf
from torch_metal_flash import backends, emulator


def _t(seed, *shape, dtype=torch.float16):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _grad_job(backend, order, dtype, shape, causal):
    def run():
        B, L, H, D = shape
        q, k, v = (_t(s, B, L, H, D, dtype=dtype).requires_grad_() for s in (1, 2, 3))
        with tmf.backend(backend, strict=backend == "emulator"), emulator.settings(order=order):
            out = tmf.flash_attn_func(q, k, v, causal=causal)
            grads = torch.autograd.grad(out, (q, k, v), _t(4, *out.shape, dtype=dtype))
        return (out.detach(), *grads)
    return run


def _sdpa_job(backend, mask_len):
    def run():
        q, k = _t(5, 1, 2, 9, 24, dtype=torch.float32), _t(6, 1, 2, mask_len, 24, dtype=torch.float32)
        mask = torch.arange(mask_len) < mask_len - 2
        with tmf.backend(backend):
            return (tmf.scaled_dot_product_attention(q, k, k, attn_mask=mask),)
    return run


def _decode_job(num_splits):
    def run():
        cache = _t(7, 2, 300, 2, 32, dtype=torch.bfloat16)
        q = _t(8, 2, 1, 4, 32, dtype=torch.bfloat16)
        with tmf.backend("emulator", strict=True):
            return tmf.flash_attn_with_kvcache(q, cache, cache, cache_seqlens=torch.tensor([299, 40]),
                                               num_splits=num_splits, return_softmax_lse=True)
    return run


JOBS = [
    _grad_job("emulator", "forward", torch.float16, (1, 17, 2, 40), True),
    _grad_job("emulator", "reverse", torch.bfloat16, (2, 5, 4, 64), False),
    _grad_job("emulator", "random", torch.float32, (1, 9, 2, 13), True),
    _grad_job("reference", "forward", torch.float16, (1, 17, 2, 40), True),
    _sdpa_job("emulator", 33),
    _sdpa_job("reference", 33),
    _decode_job(1),
    _decode_job(3),
]


def test_four_threads_give_the_serial_results():
    serial = [job() for job in JOBS]
    # Fill the caches concurrently: fresh emulator backend and library caches (builds
    # reload from the disk cache), then every job three times, shuffled, on 4 threads.
    emulator.library._build_cache.clear()
    emulator.library._pre_cache.clear()
    backends._instances.pop("emulator", None)
    work = [i for i in range(len(JOBS)) for _ in range(3)]
    random.Random(0).shuffle(work)
    tmf.run_counts(reset=True)
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda i: (i, JOBS[i]()), work))
    for i, res in results:
        for a, b in zip(serial[i], res):
            assert torch.equal(a, b), f"job {i} differs when run on 4 threads"
    counts = tmf.run_counts(reset=True)
    assert counts.get("emulator", 0) == 3 * (2 * 3 + 1 + 2) and counts.get("reference", 0) == 3 * (2 + 1), counts


def test_backend_context_does_not_leak_across_threads(monkeypatch):
    monkeypatch.delenv("TORCH_METAL_FLASH_BACKEND", raising=False)
    monkeypatch.delenv("TORCH_METAL_FLASH_STRICT", raising=False)
    inside, seen = threading.Barrier(2), {}

    def holder():
        with tmf.backend("emulator", strict=True), emulator.settings(order="reverse", checked=False):
            inside.wait()  # the other thread looks while this one is inside the contexts
            inside.wait()
            seen["holder"] = (backends.requested(), backends.is_strict(), emulator.config.default_order())

    def other():
        inside.wait()
        try:
            seen["other"] = (backends.requested(), backends.is_strict(), emulator.config.default_order())
        finally:
            inside.wait()

    threads = [threading.Thread(target=f) for f in (holder, other)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert seen["holder"] == ("emulator", True, "reverse")
    assert seen["other"] == ("auto", False, "forward")


def test_two_loads_of_one_library_share_its_function_constant_lock():
    """Two _Build objects of one shared object (two threads building at once, or a reload after a
    cache eviction) must share the lock around the library's function-constant globals: with
    separate locks, concurrent launches could run with each other's constants."""
    emulator.library._build_cache.clear()
    lib = emulator.compile_shader(emulator.library.Path(__file__).parents[1] / "emulator" / "kernels" / "checks.metal")
    first = lib._build(checked=True)
    emulator.library._build_cache.clear()
    second = lib._build(checked=True)
    a, b = next(iter(first.values())), next(iter(second.values()))
    assert a is not b and a.path == b.path and a.lock is b.lock
