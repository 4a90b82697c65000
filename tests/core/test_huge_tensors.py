"""Huge tensors: element offsets beyond 2^31 and 2^32 (views with huge batch strides
over lazily committed memory: only the touched pages are ever committed).  Every kernel
(forward, backward, decode, paged decode) must index them with 64-bit offsets and give
bit for bit what it gives on compact copies of the same data; the emulator binds such
views in place (no staging copy) and still checks every access."""
import pytest
import torch

import torch_metal_flash as tmf

OFFSETS = {"beyond_2^31": 2**31 + 64, "beyond_2^32": 2**32 + 64}  # elements (fp16: bytes x 2)


def huge(values: torch.Tensor, batch_stride: int) -> torch.Tensor:
    """``values`` (dense, batch first) as a view whose batch b starts at element b * batch_stride."""
    inner = values[0].numel()
    base = torch.empty((values.shape[0] - 1) * batch_stride + inner, dtype=values.dtype)
    view = base.as_strided(values.shape, (batch_stride,) + values[0].stride())
    return view.copy_(values)


def rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).half()


def _grads(q, k, v, dout, **kw):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out, lse, _ = tmf.flash_attn_func(q, k, v, return_attn_probs=True, **kw)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    return out, lse, dq, dk, dv


@pytest.mark.parametrize("offset", list(OFFSETS.values()), ids=list(OFFSETS))
@pytest.mark.parametrize("lq,lk", [(5, 7), (1, 256)], ids=["prefill", "decode_route"])
def test_forward_backward_on_huge_strides_match_compact(offset, lq, lk):
    q, k, v = rand(2, lq, 4, 16, seed=1), rand(2, lk, 2, 16, seed=2), rand(2, lk, 2, 16, seed=3)
    dout = rand(2, lq, 4, 16, seed=4)
    with tmf.backend("emulator", strict=True):
        compact = _grads(q, k, v, dout, causal=True)
        big = _grads(huge(q, offset), huge(k, offset), huge(v, offset), huge(dout, offset), causal=True)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), compact, big):
        assert torch.equal(a, b), f"{name} differs on the huge-strided views"


def test_output_with_huge_strides_from_the_planner():
    """out written through a view whose batch 1 starts beyond 2^32 elements."""
    from torch_metal_flash.backends import select
    from torch_metal_flash.planner import plan_forward
    from torch_metal_flash.problem.spec import make_spec
    q, k, v = rand(2, 2, 3, 32, seed=5), rand(2, 2, 9, 32, seed=6), rand(2, 2, 9, 32, seed=7)
    spec = make_spec(q, k, v, scale=0.2)
    lse = torch.empty(2, 2, 3)
    out = huge(torch.zeros(2, 2, 3, 32, dtype=torch.float16), OFFSETS["beyond_2^32"])
    with tmf.backend("emulator"):
        backend, _ = select(q.device)
        backend.run(plan_forward(spec, out, lse))
        ref, ref_lse, _ = torch.ops.metal_flash.fwd(q, k, v, None, None, None, 0.2, 0, -1, -1, 0.0, False)
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)


@pytest.mark.parametrize("num_splits", [1, 2])
def test_kvcache_decode_with_cache_rows_beyond_2_32(num_splits):
    cache_k, cache_v = rand(3, 300, 2, 64, seed=8), rand(3, 300, 2, 64, seed=9)
    q, knew, vnew = rand(2, 1, 4, 64, seed=10), rand(2, 1, 2, 64, seed=11), rand(2, 1, 2, 64, seed=12)
    kw = dict(cache_seqlens=torch.tensor([280, 17], dtype=torch.int32),
              cache_batch_idx=torch.tensor([2, 0], dtype=torch.int32), causal=True, num_splits=num_splits,
              return_softmax_lse=True)
    big_k, big_v = huge(cache_k, OFFSETS["beyond_2^32"]), huge(cache_v, OFFSETS["beyond_2^32"])
    with tmf.backend("emulator", strict=True):
        ref = tmf.flash_attn_with_kvcache(q, cache_k, cache_v, knew, vnew, **kw)
        got = tmf.flash_attn_with_kvcache(q, big_k, big_v, knew, vnew, **kw)
    assert torch.equal(ref[0], got[0]) and torch.equal(ref[1], got[1])
    assert torch.equal(big_k, cache_k) and torch.equal(big_v, cache_v), "the in-place append differs"


def test_paged_decode_with_block_indices_beyond_2_32_elements():
    page, H, D = 16, 1, 64
    nblocks = 2**32 // (page * H * D) + 4  # the last blocks start beyond 2^32 elements
    pool_k = torch.empty(nblocks, page, H, D, dtype=torch.float16)
    pool_v = torch.empty(nblocks, page, H, D, dtype=torch.float16)
    high = torch.tensor([[nblocks - 1, nblocks - 3, 5], [nblocks - 2, 7, nblocks - 4]], dtype=torch.int32)
    compact_k, compact_v = rand(6, page, H, D, seed=13), rand(6, page, H, D, seed=14)
    for i, blk in enumerate(high.flatten().tolist()):
        pool_k[blk], pool_v[blk] = compact_k[i], compact_v[i]
    low = torch.arange(6, dtype=torch.int32).view(2, 3)
    q = rand(2, 2, 2, D, seed=15)
    kw = dict(cache_seqlens=torch.tensor([40, 33], dtype=torch.int32), causal=True, return_softmax_lse=True)
    with tmf.backend("emulator", strict=True):
        ref = tmf.flash_attn_with_kvcache(q, compact_k, compact_v, block_table=low, **kw)
        got = tmf.flash_attn_with_kvcache(q, pool_k, pool_v, block_table=high, **kw)
    assert torch.equal(ref[0], got[0]) and torch.equal(ref[1], got[1])


def test_emulator_checks_bounds_of_views_bound_in_place():
    """A view spanning more than the emulator stages (bound in place) still gets exact bounds checks."""
    from pathlib import Path

    from torch_metal_flash import emulator
    lib = emulator.compile_shader(Path(__file__).parents[1] / "emulator" / "kernels" / "checks.metal")
    base = torch.zeros(2**28 + 64)  # 1 GiB, lazily committed
    y = base[32:].as_strided((2, 16), (2**28, 1))
    with pytest.raises(emulator.OutOfBoundsError, match="buffer\\(0\\)"):
        lib.write_before_start(y, grid=1, threadgroup=1, checked=True)
    assert base[31] == 0, "the bad write reached the caller's memory"


@pytest.fixture(autouse=True)
def _memory_stays_small():
    """Only touched pages are committed: nothing stages (copies) a huge view."""
    import resource
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    yield
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before  # KiB on Linux
    assert grown < 1 << 20, f"peak memory grew by {grown / 2**20:.1f} GiB"
