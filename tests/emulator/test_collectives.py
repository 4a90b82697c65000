"""simd and quad collectives against numpy, including partial-lane (divergent) use."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from emu_helpers import ORDERS, lib

N = 64  # two simdgroups


def _lanes(a):
    return a.reshape(-1, 32)


@pytest.mark.parametrize("order", ORDERS)
def test_simd_ops_match_numpy(order):
    rng = np.random.default_rng(1)
    x = rng.standard_normal(N).astype(np.float32)
    x[::7] *= 0.5
    xi = rng.integers(-50, 50, N).astype(np.int32)
    out = np.zeros((N, 24), np.float32)
    outi = np.zeros((N, 24), np.int32)
    st = lib("collectives.metal").simd_ops(x, xi, out, outi, grid=N, threadgroup=N, order=order)
    X, XI = _lanes(x).astype(np.float64), _lanes(xi)
    lane = np.arange(32)
    o = out.reshape(2, 32, 24)
    oi = outi.reshape(2, 32, 24)
    for g in range(2):
        v, vi = X[g], XI[g]
        np.testing.assert_allclose(o[g, :, 0], v.sum(), rtol=1e-5)
        np.testing.assert_array_equal(o[g, :, 1], np.float32(v.max()))
        np.testing.assert_array_equal(o[g, :, 2], np.float32(v.min()))
        np.testing.assert_allclose(o[g, :, 3], np.prod(v), rtol=1e-4)
        np.testing.assert_allclose(o[g, :, 4], np.cumsum(v), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(o[g, :, 5], np.cumsum(v) - v, rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(o[g, :, 6], v[(lane * 7) % 32].astype(np.float32))
        np.testing.assert_array_equal(o[g, :, 7], v[lane ^ 5].astype(np.float32))
        up = np.where(lane >= 3, v[np.maximum(lane - 3, 0)], v)
        np.testing.assert_array_equal(o[g, :, 8], up.astype(np.float32))
        down = np.where(lane + 3 < 32, v[np.minimum(lane + 3, 31)], v)
        np.testing.assert_array_equal(o[g, :, 9], down.astype(np.float32))
        np.testing.assert_array_equal(o[g, :, 10], v[(lane - 3) % 32].astype(np.float32))
        np.testing.assert_array_equal(o[g, :, 11], v[(lane + 3) % 32].astype(np.float32))
        np.testing.assert_array_equal(o[g, :, 12], np.float32(v[9]))
        np.testing.assert_array_equal(o[g, :, 13], np.float32(v[0]))
        quads = v.reshape(8, 4)
        np.testing.assert_allclose(o[g, :, 14], np.repeat(quads.sum(1), 4), rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(o[g, :, 15], v[lane ^ 1].astype(np.float32))
        np.testing.assert_array_equal(o[g, :, 16], np.repeat(quads[:, 2], 4).astype(np.float32))
        np.testing.assert_array_equal(o[g, :, 17], np.repeat(quads.max(1), 4).astype(np.float32))
        np.testing.assert_allclose(o[g, :, 18], 2 * v.sum(), rtol=1e-5)
        fill_down = np.where(lane + 5 < 32, v[(lane + 5) % 32], -v[(lane + 5) % 32])
        np.testing.assert_array_equal(o[g, :, 20], fill_down.astype(np.float32))
        q, base = lane % 8, lane // 8 * 8
        fill_up = np.where(q >= 3, v[base + (q - 3) % 8], -v[base + (q - 3) % 8])
        np.testing.assert_array_equal(o[g, :, 21], fill_up.astype(np.float32))
        np.testing.assert_allclose(o[g, :, 19], v.astype(np.float16).astype(np.float64).sum(), rtol=2e-2, atol=2e-2)
        assert (oi[g, :, 0] == vi.sum()).all()
        assert (oi[g, :, 1] == vi.max()).all()
        assert (oi[g, :, 2] == np.bitwise_and.reduce(vi)).all()
        assert (oi[g, :, 3] == np.bitwise_or.reduce(vi)).all()
        assert (oi[g, :, 4] == np.bitwise_xor.reduce(vi)).all()
        np.testing.assert_array_equal(oi[g, :, 5], np.cumsum(vi))
        ballot = int(sum(1 << i for i in range(32) if vi[i] > 0))
        assert (oi[g, :, 6].astype(np.uint32) == ballot).all()
        assert (oi[g, :, 7] == 1).all() and (oi[g, :, 8] == 0).all()
        np.testing.assert_array_equal(oi[g, :, 9], (lane == 0).astype(np.int32))
        assert (oi[g, :, 10].astype(np.uint32) == 0xFFFFFFFF).all()
        assert (oi[g, :, 11] == (ballot != 0)).all()
    assert st.simd_collectives > 0


@pytest.mark.parametrize("order", ORDERS)
def test_partial_lane_collectives(order):
    x = np.arange(32, dtype=np.float32) + 1
    out = np.zeros((32, 4), np.float32)
    lib("collectives.metal").partial_lanes(x, out, grid=32, threadgroup=32, order=order)
    lo = x[:8]
    np.testing.assert_array_equal(out[:8, 0], lo.sum())
    np.testing.assert_array_equal(out[:8, 1], np.cumsum(lo) - lo)
    evens = np.arange(8, 32, 2)
    np.testing.assert_array_equal(out[evens, 0], x[evens].max())
    mask = sum(1 << int(i) for i in evens) & 0xFFFF
    np.testing.assert_array_equal(out[evens, 2], float(mask))
    np.testing.assert_array_equal(out[evens, 3], x[8])
    odds = np.arange(9, 32, 2)
    assert (out[odds] == -1).all()


@pytest.mark.parametrize("n,tg", [(1000, 256), (77, 64), (1024, 1024), (40, 40)])
def test_block_reduce_non_uniform_threadgroups(n, tg):
    x = torch.randn(n)
    ntg = (n + tg - 1) // tg
    out = torch.zeros(ntg)
    st = lib("collectives.metal").block_reduce(x, out, n, grid=n, threadgroup=tg, order="random", seed=3)
    ref = torch.nn.functional.pad(x.double(), (0, ntg * tg - n)).view(ntg, tg).sum(1)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    assert st.threadgroups == ntg and st.threads == n
    assert st.barriers == ntg
    assert st.device_bytes_read == n * 4 + (n * 4)  # x once per valid thread + n per thread
    assert st.bytes_written[1] == ntg * 4


@pytest.mark.parametrize("order", ORDERS)
def test_lanes_reconverge_after_a_divergent_loop(order):
    n = 70  # iterations: 32 lanes, 32 lanes, 6 lanes
    x = np.arange(n, dtype=np.float32)
    out = np.zeros(64, np.float32)
    lib("collectives.metal").reconverge(x, out, n, grid=32, threadgroup=32, order=order)
    per_lane = np.zeros(32)
    chunks = [x[i:i + 32] for i in range(0, n, 32)]
    for c in chunks:
        per_lane[:len(c)] += c.sum()
    np.testing.assert_allclose(out[:32], per_lane.sum())
    assert (out[32:] == 1).all()
