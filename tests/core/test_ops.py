"""The torch.ops.metal_flash ops: opcheck, float64 gradcheck of every feature,
torch.compile(fullgraph=True) forward and backward."""
import pytest
import torch

import torch_metal_flash  # noqa: F401  (registers the ops)
from torch_metal_flash import reference
from torch_metal_flash.problem.spec import make_spec

fwd = torch.ops.metal_flash.fwd
bwd = torch.ops.metal_flash.bwd


def _inputs(B=2, H=4, Hkv=2, Lq=5, Lk=7, D=8, dtype=torch.float64, requires_grad=False, layout="bhld", seed=0):
    g = torch.Generator().manual_seed(seed)

    def make(h, L):
        if layout == "blhd":
            t = torch.randn(B, L, h, D, generator=g).to(dtype).transpose(1, 2)
        else:
            t = torch.randn(B, h, L, D, generator=g).to(dtype)
        return t.detach().requires_grad_(requires_grad)
    return make(H, Lq), make(Hkv, Lk), make(Hkv, Lk)


FEATURES = {
    "plain": dict(),
    "causal_top_left": dict(window_right=0),
    "causal_bottom_right": dict(window_right=0, diag_offset=2),
    "window": dict(window_left=2, window_right=1, diag_offset=2),
    "softcap": dict(softcap=2.0),
    "alibi": dict(alibi=True),
    "sinks": dict(sinks=True),
    "float_mask": dict(mask="float"),
    "bool_mask": dict(mask="bool"),
    "everything": dict(window_right=0, diag_offset=2, softcap=1.5, alibi=True, sinks=True, mask="float"),
}


def _args(q, k, v, feature, requires_grad=False):
    f = dict(FEATURES[feature])
    g = torch.Generator().manual_seed(1)
    B, H, Lq, _ = q.shape
    Lk = k.shape[2]
    mask = alibi = sinks = None
    if f.get("mask") == "float":
        mask = torch.randn(1, H, Lq, Lk, generator=g).to(q.dtype).requires_grad_(requires_grad)
    elif f.get("mask") == "bool":
        mask = torch.rand(B, 1, Lq, Lk, generator=g) > 0.3
    if f.get("alibi"):
        alibi = torch.rand(H, generator=g)
    if f.get("sinks"):
        sinks = torch.randn(H, generator=g).to(q.dtype).requires_grad_(requires_grad)
    return (q, k, v, mask, alibi, sinks, 0.35, f.get("diag_offset", 0), f.get("window_left", -1),
            f.get("window_right", -1), f.get("softcap", 0.0), requires_grad)


@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("requires_grad", [False, True])
@pytest.mark.parametrize("dtype,layout", [(torch.float32, "bhld"), (torch.float16, "blhd"),
                                          (torch.bfloat16, "bhld")])
def test_opcheck_fwd(feature, requires_grad, dtype, layout):
    q, k, v = _inputs(dtype=dtype, requires_grad=requires_grad, layout=layout)
    torch.library.opcheck(fwd, _args(q, k, v, feature, requires_grad))


@pytest.mark.parametrize("feature", ["plain", "everything"])
@pytest.mark.parametrize("shape", [dict(Lq=1, Lk=1), dict(Lq=9, Lk=4, H=2, Hkv=1)])
def test_opcheck_bwd(feature, shape):
    q, k, v = _inputs(dtype=torch.float32, **shape)
    args = _args(q, k, v, feature, requires_grad=True)
    out, lse, aux = fwd(*args)
    dout = torch.randn_like(out)
    compute_dbias = args[3] is not None and args[3].is_floating_point()
    args = [a.detach() if isinstance(a, torch.Tensor) else a for a in args]
    torch.library.opcheck(bwd, (dout, q, k, v, out.detach(), aux, None, *args[3:11], compute_dbias))


@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("layout", ["bhld", "blhd"])
def test_gradcheck(feature, layout):
    q, k, v = _inputs(requires_grad=True, layout=layout, Lq=4, Lk=6, D=4)
    args = _args(q, k, v, feature, requires_grad=True)
    tensors = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.requires_grad]

    def f(*ts):
        full = list(args)
        for i, t in zip(tensors, ts):
            full[i] = t
        out, lse, _ = fwd(*full)
        return out, lse.masked_fill(torch.isinf(lse), 0.0)
    assert torch.autograd.gradcheck(f, [args[i] for i in tensors])


def test_fully_masked_rows_zero_grad():
    q, k, v = _inputs(requires_grad=True)
    mask = torch.ones(5, 7, dtype=torch.bool)
    mask[1] = False
    out, lse, _ = fwd(q, k, v, mask, None, None, 0.3, 0, -1, -1, 0.0, True)
    assert torch.isposinf(lse[:, :, 1]).all() and torch.equal(out[:, :, 1], torch.zeros_like(out[:, :, 1]))
    out.sum().backward()
    assert torch.equal(q.grad[:, :, 1], torch.zeros_like(q.grad[:, :, 1]))
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


def test_sink_only_row():
    """A row with nothing visible but a sink: output 0, lse = the sink logit."""
    q, k, v = _inputs(Lq=3, Lk=4)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=q.dtype)
    mask = torch.zeros(3, 4, dtype=torch.bool)
    out, lse, _ = fwd(q, k, v, mask, None, sinks, 0.3, 0, -1, -1, 0.0, False)
    assert torch.equal(out, torch.zeros_like(out))
    torch.testing.assert_close(lse, sinks.view(1, 4, 1).expand_as(lse))


@pytest.mark.parametrize("feature", ["plain", "everything"])
def test_compile_fullgraph_matches_eager(feature):
    q, k, v = _inputs(dtype=torch.float32, requires_grad=True, layout="blhd")
    args = _args(q, k, v, feature, requires_grad=True)
    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]

    def step(*a):
        out, lse, _ = fwd(*a)
        return (out * out).sum() + lse.masked_fill(torch.isinf(lse), 0).sum()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    eager_grads = torch.autograd.grad(step(*args), leaves)
    compiled_grads = torch.autograd.grad(compiled(*args), leaves)
    for a, b in zip(eager_grads, compiled_grads):
        torch.testing.assert_close(a, b)


def test_compile_inductor_sdpa_face():
    q, k, v = _inputs(dtype=torch.float32, requires_grad=True)
    k, v = k.detach().repeat_interleave(2, 1).requires_grad_(), v.detach().repeat_interleave(2, 1).requires_grad_()

    def step(q, k, v):
        return torch_metal_flash.scaled_dot_product_attention(q, k, v, is_causal=True).square().sum()
    compiled = torch.compile(step, fullgraph=True)
    for a, b in zip(torch.autograd.grad(step(q, k, v), (q, k, v)), torch.autograd.grad(compiled(q, k, v), (q, k, v))):
        torch.testing.assert_close(a, b)


def test_reference_chunking_is_exact(monkeypatch):
    """Chunked and unchunked reference give the same result; chunks bound the scores in memory."""
    q, k, v = _inputs(Lq=37, Lk=11)
    spec = make_spec(q, k, v, None, None, None, scale=0.3, window_right=0, diag_offset=-3)
    whole_aux, chunked_aux = (torch.empty(2, 4, 37, 2, dtype=q.dtype) for _ in range(2))
    whole = reference.forward(spec, whole_aux)
    from torch_metal_flash.reference import attention
    monkeypatch.setattr(attention, "_CHUNK_ELEMENTS", 2 * 4 * 11 * 5)  # 5 rows per chunk
    assert [c for c in attention._row_chunks(spec)][:2] == [(0, 5), (5, 10)]
    chunked = reference.forward(spec, chunked_aux)
    for a, b in zip((*whole, whole_aux), (*chunked, chunked_aux)):
        torch.testing.assert_close(a, b)


def test_reference_row_of_finfo_min_scores_averages_the_values():
    """A float mask of finfo.min everywhere on a row (Hugging Face padding) is a
    finite score: the row averages all values (as torch does) and, constant in
    q and k at that magnitude, passes no gradient (spec.py; the kernels' rule)."""
    q, k, v = _inputs(dtype=torch.float32, requires_grad=True, Lq=3, Lk=11)
    mask = torch.zeros(3, 11)
    mask[1] = torch.finfo(torch.float32).min
    out, lse, _ = fwd(q, k, v, mask, None, None, 0.3, 0, -1, -1, 0.0, True)
    torch.testing.assert_close(out[:, :, 1], v.mean(dim=2).repeat_interleave(2, dim=1))
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
    assert torch.equal(q.grad[:, :, 1], torch.zeros_like(q.grad[:, :, 1]))
    # dO = 1: each live row spreads 1 over the keys, per query head of the group (2 rows x 2 heads).
    torch.testing.assert_close(v.grad.sum(dim=2), torch.full_like(v.grad.sum(dim=2), 2.0 * 2))
