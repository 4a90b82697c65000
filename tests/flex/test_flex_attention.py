"""tmf.flex_attention in the emulator (strict: every call on the flex kernels) against the float64
oracle of FlexAttention (torch_metal_flash.testing.flex_oracle, the suite's acceptance rule), forward and
backward, gradients of captured tensors included; torch's own flex_attention as a second opinion."""
from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch.nn.attention import flex_attention as torch_flex
from torch.nn.attention.flex_attention import and_masks, create_block_mask, or_masks

import torch_metal_flash as tmf
from torch_metal_flash import emulator
from torch_metal_flash.flex.lowering import CapturedGradientError
from torch_metal_flash.flex.reference import dense_flex_attention
from torch_metal_flash.testing import randn
from torch_metal_flash.testing.flex_oracle import FlexMods, check_flex, flex_reference


def causal(b, h, q, kv):
    return q >= kv


def window(n):
    def mask(b, h, q, kv):
        return (q >= kv) & (q - kv < n)
    return mask


def doc_ids(n, cuts, dtype=torch.int64):
    ids = torch.zeros(n, dtype=dtype)
    for c in cuts:
        ids[c:] += 1
    return ids


def t5_buckets(L, S, buckets=8, max_distance=64):
    """T5's relative-position buckets of q - kv + S - 1 (an int table the score_mod indexes)."""
    rel = torch.arange(-(S - 1), L).abs()
    exact = buckets // 2
    big = exact + (torch.log(rel.clamp(min=1).float() / exact) / math.log(max_distance / exact)
                   * (buckets - exact)).long()
    return torch.where(rel < exact, rel, big.clamp(max=buckets - 1)).to(torch.int32)


def make_mods(name: str, B: int, H: int, L: int, S: int) -> FlexMods:
    """A named FlexAttention problem's mods, with captured tensors built for its sizes."""
    g = torch.Generator().manual_seed(1)
    if name == "plain":
        return FlexMods()
    if name == "causal":
        return FlexMods(mask=lambda: causal)
    if name == "window":
        return FlexMods(mask=lambda: window(40))
    if name == "document":
        ids, kv_ids = doc_ids(L, (L // 3, L // 2 + 5)), doc_ids(S, (S // 3, S // 2 + 5))
        return FlexMods(mask=lambda a, c: (lambda b, h, q, kv: a[q] == c[kv]), captured=(ids, kv_ids))
    if name == "document_causal_int32":
        ids = doc_ids(max(L, S), (L // 4,), torch.int32)
        return FlexMods(mask=lambda a: and_masks(causal, lambda b, h, q, kv: a[q] == a[kv]), captured=(ids,))
    if name == "prefix_lm":
        return FlexMods(mask=lambda: or_masks(causal, lambda b, h, q, kv: kv < 23))
    if name == "softcap":
        return FlexMods(score=lambda: (lambda s, b, h, q, kv: 20.0 * torch.tanh(s / 20.0)))
    if name == "alibi":
        slopes = torch.exp2(-torch.arange(1, H + 1, dtype=torch.float32))
        return FlexMods(score=lambda sl: (lambda s, b, h, q, kv: s + sl[h] * (kv - q)), mask=lambda sl: causal,
                        captured=(slopes,))
    if name == "relative_bias":  # learned: its gradient sums along diagonals
        bias = randn(H, L + S - 1, generator=g).requires_grad_()
        return FlexMods(score=lambda t: (lambda s, b, h, q, kv: s + t[h, q - kv + S - 1]), captured=(bias,))
    if name == "learned_alibi_causal":  # learned per-head slopes: summed along rows
        slopes = (0.1 * randn(H, generator=g)).requires_grad_()
        return FlexMods(score=lambda sl: (lambda s, b, h, q, kv: s + sl[h] * (kv - q).float()),
                        mask=lambda sl: causal, captured=(slopes,))
    if name == "key_bias_temperature":  # learned key bias (columns) and a 0-d temperature (rows)
        kb = randn(S, generator=g).requires_grad_()
        temp = torch.tensor(0.75).requires_grad_()
        return FlexMods(score=lambda c, t: (lambda s, b, h, q, kv: s * t + c[kv]), captured=(kb, temp))
    if name == "t5_buckets":  # learned bias per bucket of q - kv (an int table): diagonals, many per element
        buckets = t5_buckets(L, S)
        bias = randn(8, H, generator=g).requires_grad_()
        return FlexMods(score=lambda bk, t: (lambda s, b, h, q, kv: s + t[bk[q - kv + S - 1], h]),
                        mask=lambda bk, t: causal, captured=(buckets, bias))
    if name == "half_bias_where":
        bias = randn(H, S, generator=g).half()
        return FlexMods(score=lambda t: (lambda s, b, h, q, kv: torch.where(kv % 7 == 3, -float("inf"),
                                                                          s + t[h][kv])), captured=(bias,))
    if name == "elementwise":
        return FlexMods(score=lambda: (lambda s, b, h, q, kv: torch.maximum(
            torch.minimum(s, torch.abs(s) * 0.5 + 1.0), -torch.sigmoid(s) - torch.log(torch.exp(s * 0.1) + 1.0))))
    if name == "many_ops":  # one of each lowered op kind (the discontinuous ones on index values)
        def many_ops(s, b, h, q, kv):
            d = q - kv
            i = d // 3 + d % 5 - torch.where(d < 0, -d, d) // 7 + ((q & 7) | (kv ^ 3)) + (~h & 1)
            x = d.float() / 3.0
            g = torch.sign(x) + torch.floor(x) - torch.ceil(x) + torch.trunc(x) + torch.round(x * 2) / 2
            a = torch.abs(s)
            f = torch.exp2(s * 0.1) + torch.log2(a + 1) + torch.log1p(a) + torch.expm1(s * 0.01) + torch.sin(s)
            f = f + torch.sqrt(a + 1) * torch.rsqrt(a + 2) * torch.cos(s) + torch.pow(a + 1, 0.5)
            f = f + torch.clamp(s, -1.0, 1.0) + torch.clamp(s, min=0.0) + (a + 1).reciprocal()
            flag = torch.logical_and(q > kv, torch.logical_not(h == 1)) | (b == 0)
            return torch.where(flag, 0.2 * f + 0.1 * g + 0.01 * i, s - 1.0)
        return FlexMods(score=lambda: many_ops)
    if name == "batch_head":
        return FlexMods(score=lambda: (lambda s, b, h, q, kv: s * (1.0 + 0.25 * b) - 0.125 * h),
                        mask=lambda: (lambda b, h, q, kv: (q + kv + h) % 5 != 0))
    raise KeyError(name)


def inputs(B, Hq, Hkv, L, S, D, dtype, grad=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    make = lambda H, n: randn(B, H, n, D, generator=g).to(dtype).requires_grad_(grad)  # noqa: E731
    return make(Hq, L), make(Hkv, S), make(Hkv, S)


def block_mask_of(mods: FlexMods, B, H, L, S, **kw):
    _, mask_mod = mods.build()
    return None if mask_mod is None else create_block_mask(mask_mod, B, H, L, S, device="cpu", **kw)


def run_flex(q, k, v, mods: FlexMods, block_mask, gqa=False, seed=5):
    """(results {out, lse, dq, dk, dv, dcaptured}, dout, dlse) of one call and its backward."""
    score_mod, _ = mods.build()
    out, lse = tmf.flex_attention(q, k, v, score_mod, block_mask, enable_gqa=gqa, return_lse=True)
    g = torch.Generator().manual_seed(seed)
    dout = randn(out.shape, generator=g).to(out.dtype)
    dlse = randn(lse.shape, generator=g)
    loss = (out.float() * dout.float()).sum() + (torch.where(torch.isfinite(lse), lse, 0.0) * dlse).sum()
    trainable = [t for t in mods.captured if t.requires_grad]
    grads = torch.autograd.grad(loss, [q, k, v, *trainable])
    it = iter(grads[3:])
    dcaptured = [next(it) if t.requires_grad else None for t in mods.captured]
    return dict(out=out, lse=lse, dq=grads[0], dk=grads[1], dv=grads[2], dcaptured=dcaptured), dout, dlse


# Every named problem forward and backward; dtypes, GQA and lengths rotate through them.
CASES = [
    ("plain", torch.float32, (2, 2, 2, 131, 97)),
    ("causal", torch.float16, (1, 4, 2, 97, 97)),
    ("window", torch.bfloat16, (1, 2, 2, 130, 130)),
    ("document", torch.float32, (2, 2, 1, 113, 129)),
    ("document_causal_int32", torch.float32, (1, 2, 2, 97, 97)),
    ("prefix_lm", torch.float16, (1, 2, 2, 100, 100)),
    ("softcap", torch.float32, (1, 4, 2, 97, 97)),
    ("alibi", torch.float16, (1, 2, 2, 97, 97)),
    ("relative_bias", torch.float32, (1, 2, 2, 77, 90)),
    ("learned_alibi_causal", torch.float32, (2, 2, 1, 90, 90)),
    ("key_bias_temperature", torch.bfloat16, (1, 2, 2, 70, 100)),
    ("t5_buckets", torch.float32, (1, 2, 2, 97, 97)),
    ("half_bias_where", torch.float32, (1, 2, 2, 65, 129)),
    ("elementwise", torch.bfloat16, (1, 2, 2, 97, 97)),
    ("batch_head", torch.float32, (2, 2, 2, 67, 67)),
    ("many_ops", torch.float32, (2, 2, 2, 61, 75)),
]


@pytest.mark.parametrize("name,dtype,shape", CASES, ids=[c[0] for c in CASES])
def test_forward_and_backward_match_the_oracle(name, dtype, shape):
    B, Hq, Hkv, L, S = shape
    D = 32
    mods = make_mods(name, B, Hq, L, S)
    block_mask = block_mask_of(mods, B, 1, L, S)
    q, k, v = inputs(B, Hq, Hkv, L, S, D, dtype, grad=True)
    with tmf.backend("emulator", strict=True):
        got, dout, dlse = run_flex(q, k, v, mods, block_mask, gqa=Hkv != Hq)
    assert got["out"].dtype == dtype and got["lse"].dtype == torch.float32
    assert all(g.dtype == t.dtype for g, t in zip(got["dcaptured"], mods.captured) if g is not None)
    check_flex(q, mods, got, flex_reference(q, k, v, mods, None, dout, dlse))
    if dtype == torch.float32 and Hkv == Hq:  # torch's own flex_attention, to the same rule
        score_mod, _ = mods.build()
        t_out, t_lse = torch_flex.flex_attention(q.detach(), k.detach(), v.detach(), score_mod, block_mask,
                                                 return_lse=True)
        check_flex(q, mods, {"out": t_out, "lse": t_lse}, flex_reference(q, k, v, mods))


@pytest.mark.parametrize("index,walk", [
    (lambda q, kv, h: q - kv + 5, "diag"), (lambda q, kv, h: 5 + q - kv, "diag"),
    (lambda q, kv, h: 3 * (kv - q), "diag"), (lambda q, kv, h: (q - kv).abs() // 2, "diag"),
    (lambda q, kv, h: q * 2 + h, "row"), (lambda q, kv, h: h, "row"), (lambda q, kv, h: kv % 7, "col"),
    (lambda q, kv, h: q + kv, None), (lambda q, kv, h: 2 * q - kv, None), (lambda q, kv, h: q * kv, None),
])
def test_a_read_is_summed_along_the_line_its_index_depends_on(index, walk):
    from torch_metal_flash.flex import lowering
    table = lowering.Buffer(torch.float32, (64,), True, "table")
    mod = lambda s, b, h, q, kv, t: s * t[index(q, kv, h) % 64]  # noqa: E731
    if walk is None:
        with pytest.raises(CapturedGradientError, match="'table'|table"):
            lowering.lower(mod, None, (table,))
    else:
        assert [r.walk for r in lowering.lower(mod, None, (table,)).reads] == [walk]


def test_captured_gradients_are_deterministic_and_masked_lines_get_none():
    B, H, L, S, D = 1, 2, 70, 70, 32
    mods = make_mods("relative_bias", B, H, L, S)
    block_mask = create_block_mask(causal, 1, 1, L, S, device="cpu")
    q, k, v = inputs(B, H, H, L, S, D, torch.float32, grad=True)
    runs = []
    for order in ("forward", "reverse"):
        with tmf.backend("emulator", strict=True), emulator.settings(order=order):
            runs.append(run_flex(q, k, v, mods, block_mask)[0])
    for name in ("out", "lse", "dq", "dk", "dv"):
        assert torch.equal(runs[0][name], runs[1][name]), name
    assert torch.equal(runs[0]["dcaptured"][0], runs[1]["dcaptured"][0])
    assert runs[0]["dcaptured"][0][:, :S - 1].abs().max() == 0  # q < kv: causally masked, no gradient


def test_a_gradient_the_kernels_cannot_reduce_raises_naming_the_tensor():
    L, D = 48, 32
    q, k, v = inputs(1, 2, 2, L, L, D, torch.float32, grad=True)
    pair_bias = torch.zeros(L, L, requires_grad=True)
    for strict in (True, False):
        with tmf.backend("emulator", strict=strict):
            with pytest.raises(CapturedGradientError, match="pair_bias.*q_idx - kv_idx"):
                tmf.flex_attention(q, k, v, score_mod=lambda s, b, h, qi, kv: s + pair_bias[qi, kv])
    # detached (or not requiring grad) it is just a table
    with tmf.backend("emulator", strict=True):
        out = tmf.flex_attention(q, k, v, score_mod=lambda s, b, h, qi, kv: s + pair_bias[qi, kv].detach())
    ref, _ = dense_flex_attention(q, k, v, lambda s, b, h, qi, kv: s + pair_bias.detach()[qi, kv])
    torch.testing.assert_close(out, ref)


def test_empty_rows_out_zero_lse_minus_inf_and_no_gradient():
    B, H, L, D = 1, 1, 50, 32
    mask = lambda b, h, q, kv: (q % 3 != 0) & (kv <= q)  # noqa: E731
    block_mask = create_block_mask(mask, 1, 1, L, L, device="cpu")
    q, k, v = inputs(B, H, H, L, L, D, torch.float32, grad=True)
    with tmf.backend("emulator", strict=True):
        out, lse = tmf.flex_attention(q, k, v, block_mask=block_mask, return_lse=True)
        (out.sum() + torch.where(torch.isfinite(lse), lse, 0.0).sum()).backward()
    empty = torch.arange(L) % 3 == 0
    assert torch.equal(out[0, 0, empty], torch.zeros(int(empty.sum()), D))
    assert torch.all(lse[0, 0, empty] == -math.inf) and torch.isfinite(lse[0, 0, ~empty]).all()
    assert torch.equal(q.grad[0, 0, empty], torch.zeros(int(empty.sum()), D))
    assert torch.isfinite(k.grad).all() and torch.isfinite(v.grad).all()


def test_blocks_outside_the_mask_are_never_loaded():
    L, D = 512, 32
    q, k, v = inputs(1, 1, 1, L, L, D, torch.float16, grad=True)
    block_mask = create_block_mask(window(64), 1, 1, L, L, device="cpu", BLOCK_SIZE=64)
    density = 1.0 - block_mask.sparsity() / 100.0

    def streamed(stats, kernel, buffers):
        """Bytes a kernel streams through its inner loop (K/V for forward and dQ, Q/dO for dK/dV)."""
        return sum(s.bytes_read.get(i, 0) for s in stats if kernel in s.kernel for i in buffers)

    def run(bm):
        with emulator.recording() as fwd:
            out = tmf.flex_attention(q, k, v, block_mask=bm)
        with emulator.recording() as bwd:
            out.float().sum().backward()
        return (streamed(fwd, "flash_fwd", (1, 2)), streamed(bwd, "_dq_", (1, 2)),
                streamed(bwd, "_dkv_", (0, 3)))

    with tmf.backend("emulator", strict=True), emulator.settings(checked=True):
        sparse = run(block_mask)
        dense = run(None)
    for s, d in zip(sparse, dense):
        assert s <= 1.2 * density * d, (s, d, density)


def test_block_size_32_skips_its_own_blocks_forward_and_backward():
    """A BlockMask of 32 x 32 blocks is walked at 32, not coarsened to 64: the forward (32-row query
    tiles) streams exactly the block density of the dense K/V bytes, less than the same mask at 64;
    the backward's 64-row tiles stream the union of their two rows of blocks (here the 64 mask's);
    the gradients pass the float64 oracle."""
    L, D = 256, 32
    mods = FlexMods(mask=lambda: window(48))
    q, k, v = inputs(1, 1, 1, L, L, D, torch.float16, grad=True)
    fine = block_mask_of(mods, 1, 1, L, L, BLOCK_SIZE=32)
    density = 1.0 - fine.sparsity() / 100.0

    def streamed(stats):
        """Bytes streamed through the inner loops: forward K/V, dQ K/V, dK/dV Q/dO."""
        return [sum(s.bytes_read.get(i, 0) for s in stats if kernel in s.kernel for i in buffers)
                for kernel, buffers in (("flash_fwd", (1, 2)), ("_dq_", (1, 2)), ("_dkv_", (0, 3)))]

    def run(bm):
        with emulator.recording() as stats:
            got = run_flex(q, k, v, mods, bm)[0]
        return got, streamed(stats)

    with tmf.backend("emulator", strict=True), emulator.settings(checked=True):
        got, sparse = run(fine)
        _, coarse = run(block_mask_of(mods, 1, 1, L, L, BLOCK_SIZE=64))
        _, dense = run(None)
    g = torch.Generator().manual_seed(5)
    dout = randn(got["out"].shape, generator=g).to(got["out"].dtype)
    dlse = randn(got["lse"].shape, generator=g)
    check_flex(q, mods, got, flex_reference(q, k, v, mods, None, dout, dlse))
    assert sparse[0] == density * dense[0], (sparse, dense, density)
    assert sparse[0] < coarse[0] and all(s <= c for s, c in zip(sparse, coarse)), (sparse, coarse)


@pytest.mark.parametrize("block_size", [16, 32, (32, 16)])
def test_sub_blocks_forward_and_backward_with_a_learned_bias(block_size):
    """Blocks of 16 / 32 kept as sub-blocks of the kernels' 64, at a length no block size divides:
    mask_mod in partial sub-blocks, hidden ones skipped, full ones without mask_mod, the diagonal
    gradient of a learned bias -- against the float64 oracle."""
    B, H, L, D = 1, 2, 150, 32
    g = torch.Generator().manual_seed(1)
    bias = randn(H, 2 * L - 1, generator=g).requires_grad_()
    mods = FlexMods(score=lambda t: (lambda s, b, h, q, kv: s + t[h, q - kv + L - 1]),
                    mask=lambda t: and_masks(causal, lambda b, h, q, kv: (q - kv < 40) | (kv < 20)), captured=(bias,))
    block_mask = block_mask_of(mods, 1, H, L, L, BLOCK_SIZE=block_size)
    q, k, v = inputs(B, H, H, L, L, D, torch.float32, grad=True)
    with tmf.backend("emulator", strict=True):
        got, dout, dlse = run_flex(q, k, v, mods, block_mask)
    check_flex(q, mods, got, flex_reference(q, k, v, mods, None, dout, dlse))


def test_head_dim_split_kernels_with_learned_biases(launched):
    """Head dim 384 runs the kernels that split the head dim over 4 simdgroups: learned biases read
    along rows, columns and diagonals (each line's gradient written once, by the row's first slice),
    BlockMask blocks of 32 skipped -- against the float64 oracle."""
    B, H, L, D = 1, 2, 75, 384
    g = torch.Generator().manual_seed(3)
    diag, row, col = randn(H, 2 * L - 1, generator=g), randn(H, L, generator=g), randn(L, generator=g)
    captured = tuple(t.mul_(0.5).requires_grad_() for t in (diag, row, col))
    mods = FlexMods(score=lambda d, r, c: (lambda s, b, h, q, kv: s + d[h, q - kv + L - 1] + r[h, q] + c[kv]),
                    mask=lambda *_: and_masks(causal, lambda b, h, q, kv: q - kv < 40), captured=captured)
    block_mask = block_mask_of(mods, 1, H, L, L, BLOCK_SIZE=32)
    q, k, v = inputs(B, H, H, L, L, D, torch.float16, grad=True)
    with tmf.backend("emulator", strict=True):
        got, dout, dlse = run_flex(q, k, v, mods, block_mask)
    split = {n.split("_f16_")[0] for n in launched if n.endswith("_ds4")}
    assert split == {"flash_fwd", "flash_bwd_dq", "flash_bwd_dkv"}, launched
    check_flex(q, mods, got, flex_reference(q, k, v, mods, None, dout, dlse))


@pytest.mark.parametrize("block_size", [16, (32, 48), 256])
def test_block_sizes_the_kernels_cannot_use_are_remapped(block_size):
    B, H, L, D = 1, 2, 140, 32
    mods = FlexMods(mask=lambda a: and_masks(causal, lambda b, h, q, kv: a[q] == a[kv]),
                    captured=(doc_ids(L, (30, 90)),))
    block_mask = block_mask_of(mods, 1, H, L, L, BLOCK_SIZE=block_size)
    q, k, v = inputs(B, H, H, L, L, D, torch.float32)
    with tmf.backend("emulator", strict=True):
        out, lse = tmf.flex_attention(q, k, v, block_mask=block_mask, return_lse=True)
    check_flex(q, mods, {"out": out, "lse": lse}, flex_reference(q, k, v, mods))


def test_compiled_fullgraph_forward_and_backward_run_the_kernels_bit_for_bit():
    B, H, L, S, D = 1, 2, 70, 90, 32
    mods = make_mods("relative_bias", B, H, L, S)
    score_mod, _ = mods.build()
    block_mask = create_block_mask(window(50), 1, 1, L, S, device="cpu")
    q, k, v = inputs(B, H, H, L, S, D, torch.float32, grad=True)
    bias = mods.captured[0]

    def step(q, k, v):
        out, lse = tmf.flex_attention(q, k, v, score_mod, block_mask, return_lse=True)
        return out.square().sum() + torch.where(torch.isfinite(lse), lse, 0.0).sum()

    def grads(loss):
        return torch.autograd.grad(loss, (q, k, v, bias))

    with tmf.backend("emulator", strict=True):
        eager = grads(step(q, k, v))
        explained = torch._dynamo.explain(step)(q, k, v)
        assert explained.graph_break_count == 0, explained.break_reasons
        for backend in ("aot_eager", "inductor"):
            torch._dynamo.reset()
            with emulator.recording() as launches:
                compiled = grads(torch.compile(step, backend=backend, fullgraph=True)(q, k, v))
            kernels = {s.kernel.split("_f32")[0] for s in launches}  # strict: no fallback to the dense path
            assert {"flash_fwd", "flash_bwd_dq", "flash_bwd_dkv", "flash_bwd_diag", "flash_bwd_segment_sum"} <= kernels
            for name, a, b in zip(("dq", "dk", "dv", "dbias"), compiled, eager):
                assert torch.equal(a, b), (backend, name)


def test_compiled_module_trains_with_a_learned_bias():
    """A model calling tmf.flex_attention under torch.compile(fullgraph=True): its bias parameter learns."""
    L, D, H = 48, 16, 2

    block_mask = create_block_mask(causal, 1, 1, L, L, device="cpu")

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = torch.nn.Linear(D * H, 3 * D * H)
            self.bias = torch.nn.Parameter(0.1 * randn(H, 2 * L - 1))

        def forward(self, x):
            q, k, v = self.qkv(x).unflatten(-1, (3, H, D)).permute(2, 0, 3, 1, 4)
            out = tmf.flex_attention(q, k, v, score_mod=lambda s, b, h, qi, kv: s + self.bias[h, qi - kv + L - 1],
                                     block_mask=block_mask)
            return out.transpose(1, 2).flatten(-2)

    torch.manual_seed(0)
    model = Block()
    x = randn(2, L, D * H)
    with tmf.backend("emulator", strict=True):
        step = torch.compile(lambda x: model(x).square().mean(), fullgraph=True)
        step(x).backward()
    grad = model.bias.grad
    assert grad is not None and torch.isfinite(grad).all() and grad[:, :L - 1].abs().max() == 0
    ref = Block()
    ref.load_state_dict(model.state_dict())
    q, k, v = ref.qkv(x).unflatten(-1, (3, H, D)).permute(2, 0, 3, 1, 4)  # the dense definition
    o = dense_flex_attention(q, k, v, lambda s, b, h, qi, kv: s + ref.bias[h, qi - kv + L - 1], causal)[0]
    o.transpose(1, 2).flatten(-2).square().mean().backward()
    torch.testing.assert_close(grad, ref.bias.grad, atol=1e-6, rtol=1e-4)


def test_flex_override_routes_torch_flex_attention_eager_and_compiled():
    L, D = 64, 32
    q, k, v = inputs(1, 2, 2, L, L, D, torch.float32)
    block_mask = create_block_mask(causal, 1, 1, L, L, device="cpu")
    expected = torch_flex.flex_attention(q, k, v, block_mask=block_mask)
    with tmf.backend("emulator", strict=True), tmf.flex_override():
        assert tmf.is_flex_enabled()
        for fn in (torch_flex.flex_attention,
                   torch.compile(lambda *a, **kw: torch_flex.flex_attention(*a, **kw), backend="aot_eager",
                                 fullgraph=True)):
            with emulator.recording() as launches:
                out = fn(q, k, v, block_mask=block_mask)
            assert any(s.kernel.startswith("flash_fwd") for s in launches)
            torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-4)
    assert not tmf.is_flex_enabled()


def test_diffusers_flex_backend_calls_with_expanded_masks_read_in_place():
    """diffusers' "flex" attention backend, as it calls torch's flex_attention: (B, L, H, D) inputs
    permuted, keyword arguments, kernel_options, an attention mask expanded to (B, H, L, S) and
    captured by a score_mod (float) or a mask_mod (bool)."""
    B, H, L, S, D = 2, 2, 40, 72, 32
    g = torch.Generator().manual_seed(4)
    q, k, v = (randn(B, n, H, D, generator=g) for n in (L, S, S))
    float_mask = randn(B, 1, 1, S, generator=g).expand(B, H, L, S)
    bool_mask = (torch.rand(B, 1, 1, S, generator=g) > 0.3).expand(B, H, L, S)

    def score_mod(score, batch_idx, head_idx, q_idx, kv_idx):
        return score + float_mask[batch_idx, head_idx, q_idx, kv_idx]

    def mask_mod(batch_idx, head_idx, q_idx, kv_idx):
        return bool_mask[batch_idx, head_idx, q_idx, kv_idx]

    block_mask = create_block_mask(mask_mod, B, None, L, S, device="cpu")
    query, key, value = (x.permute(0, 2, 1, 3) for x in (q, k, v))
    with tmf.backend("emulator", strict=True), tmf.flex_override():
        out = torch_flex.flex_attention(query=query, key=key, value=value, score_mod=score_mod,
                                        block_mask=block_mask, scale=None, enable_gqa=False, return_lse=False,
                                        kernel_options={"BLOCK_M": 64})
    mods = FlexMods(score=lambda f, b: score_mod, mask=lambda f, b: mask_mod, captured=(float_mask, bool_mask))
    check_flex(query, mods, {"out": out}, flex_reference(query, key, value, mods))
    from torch_metal_flash.ops.flex import _bound  # the kernels read the masks through their 0 strides
    assert _bound(float_mask).stride() == float_mask.stride() and _bound(bool_mask).stride() == bool_mask.stride()


def test_unsupported_mod_strict_raises_else_falls_back_once():
    L, D = 40, 32
    q, k, v = inputs(1, 1, 1, L, L, D, torch.float32)

    def data_dependent(s, b, h, q_idx, kv_idx):
        if q_idx > kv_idx:  # Python control flow on a tensor value
            return s
        return s * 2

    with tmf.backend("emulator", strict=True):
        with pytest.raises(Exception, match="data-dependent|Data-dependent"):
            tmf.flex_attention(q, k, v, score_mod=data_dependent)
    erf_mod = lambda s, b, h, q_idx, kv_idx: s + torch.erf(s)  # noqa: E731
    with tmf.backend("emulator", strict=True):
        with pytest.raises(tmf.UnsupportedError, match="score_mod uses aten.erf"):
            tmf.flex_attention(q, k, v, score_mod=erf_mod)
    with tmf.backend("emulator", strict=False):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = tmf.flex_attention(q, k, v, score_mod=erf_mod)
            again = tmf.flex_attention(q, k, v, score_mod=erf_mod)
    warned = [w for w in caught if issubclass(w.category, tmf.FallbackWarning) and "erf" in str(w.message)]
    assert len(warned) == 1
    torch.testing.assert_close(out, torch_flex.flex_attention(q, k, v, score_mod=erf_mod), atol=2e-5, rtol=1e-4)
    assert torch.equal(out, again)


def test_float64_falls_back_to_the_dense_definition():
    q, k, v = inputs(1, 1, 1, 33, 33, 16, torch.float64, grad=True)
    with tmf.backend("emulator", strict=False):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", tmf.FallbackWarning)
            out, lse = tmf.flex_attention(q, k, v, block_mask=create_block_mask(causal, 1, 1, 33, 33, device="cpu"),
                                          return_lse=True)
    ref, ref_lse = dense_flex_attention(q, k, v, None, causal)
    torch.testing.assert_close(out, ref, atol=0, rtol=0)
    assert out.dtype == torch.float64
    out.sum().backward()
    assert torch.isfinite(q.grad).all()


@pytest.mark.parametrize("call,match", [
    (lambda q, k, v: tmf.flex_attention(q[0], k, v), "query must be 4-D"),
    (lambda q, k, v: tmf.flex_attention(q, k.half(), v), "one dtype"),
    (lambda q, k, v: tmf.flex_attention(q, k[:, :1], v[:, :1]), "enable_gqa"),
    (lambda q, k, v: tmf.flex_attention(q, k[:, :1], v[:, :1].repeat(1, 3, 1, 1), enable_gqa=True), "agree"),
    (lambda q, k, v: tmf.flex_attention(q, k[..., :16], v), "head dim"),
    (lambda q, k, v: tmf.flex_attention(q, k, v, score_mod=3), "score_mod must be callable"),
    (lambda q, k, v: tmf.flex_attention(q, k, v, block_mask=torch.ones(2, 2)), "block_mask must be"),
    (lambda q, k, v: tmf.flex_attention(q, k, v, block_mask=create_block_mask(causal, 1, 1, 64, 64, device="cpu")),
     "block_mask was created for"),
    (lambda q, k, v: tmf.flex_attention(q, k, v, block_mask=create_block_mask(causal, 3, 1, 48, 48, device="cpu")),
     "block_mask has"),
])
def test_bad_input_names_the_argument(call, match):
    q, k, v = inputs(1, 2, 2, 48, 48, 32, torch.float32)
    with tmf.backend("emulator", strict=True):
        with pytest.raises((ValueError, TypeError), match=match):
            call(q, k, v)
