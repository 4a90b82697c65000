"""torch_metal_flash.nn.MultiheadAttention against torch.nn.MultiheadAttention with the same weights."""
import pytest
import torch

import torch_metal_flash.nn as tnn

TOL = dict(atol=2e-5, rtol=2e-5)
# torch's own MultiheadAttention (the reference) warns about bool/float mask mixes; so do we, through it
pytestmark = pytest.mark.filterwarnings("ignore:Support for mismatched key_padding_mask and attn_mask")


@pytest.fixture
def spy(monkeypatch):
    """Counts the calls that reach torch_metal_flash's attention."""
    calls = []
    real = tnn.scaled_dot_product_attention

    def counting(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(tnn, "scaled_dot_product_attention", counting)
    return calls


def _pair(embed=32, heads=4, seed=0, **kw):
    torch.manual_seed(seed)
    ref = torch.nn.MultiheadAttention(embed, heads, **kw)
    if ref.in_proj_bias is not None:
        torch.nn.init.normal_(ref.in_proj_bias)  # torch initialises biases to zero: make them count
    if ref.bias_k is not None:
        torch.nn.init.normal_(ref.bias_k)
        torch.nn.init.normal_(ref.bias_v)
    ours = tnn.MultiheadAttention(embed, heads, **kw)
    ours.load_state_dict(ref.state_dict())
    return ref, ours


def _masks(kind, bsz, heads, tgt, src):
    kpm = am = None
    causal = False
    if "kpm" in kind:
        kpm = torch.zeros(bsz, src, dtype=torch.bool)
        kpm[-1, src - 2:] = True
        if "kpmf" in kind:
            kpm = torch.zeros(bsz, src).masked_fill(kpm, float("-inf"))
    if "am2" in kind:
        am = torch.rand(tgt, src) > 0.7
        am[:, 0] = False
        if "am2f" in kind:
            am = torch.randn(tgt, src)
    if "am3" in kind:
        am = torch.randn(bsz * heads, tgt, src)
    if "causal" in kind:
        am = torch.nn.Transformer.generate_square_subsequent_mask(tgt)
        causal = True
    return kpm, am, causal


MASKS = ["none", "kpm", "kpmf", "am2", "am2f", "am3", "kpm+am2", "kpm+am2f", "causal", "causal+kpm"]


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("masks", MASKS)
def test_matches_torch_self_attention(spy, batch_first, masks):
    ref, ours = _pair(batch_first=batch_first)
    bsz, L = 3, 7
    x = torch.randn(bsz, L, 32) if batch_first else torch.randn(L, bsz, 32)
    kpm, am, causal = _masks(masks, bsz, 4, L, L)
    kw = dict(key_padding_mask=kpm, attn_mask=am, is_causal=causal, need_weights=False)
    want, w_none = ref(x, x, x, **kw)
    got, g_none = ours(x, x, x, **kw)
    assert w_none is None and g_none is None and len(spy) == 1
    torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("options", [
    dict(kdim=24, vdim=20), dict(add_bias_kv=True), dict(add_zero_attn=True),
    dict(add_bias_kv=True, add_zero_attn=True, kdim=24, vdim=24), dict(bias=False), dict(batch_first=True),
])
@pytest.mark.parametrize("masks", ["none", "kpm+am2", "kpm+am2f"])
def test_matches_torch_cross_attention(spy, options, masks):
    ref, ours = _pair(**options)
    bsz, L, S = 2, 5, 9
    bf = options.get("batch_first", False)
    shape = (lambda n, e: (bsz, n, e)) if bf else (lambda n, e: (n, bsz, e))
    q = torch.randn(shape(L, 32))
    k = torch.randn(shape(S, options.get("kdim", 32)))
    v = torch.randn(shape(S, options.get("vdim", 32)))
    kpm, am, _ = _masks(masks, bsz, 4, L, S)
    want, _ = ref(q, k, v, key_padding_mask=kpm, attn_mask=am, need_weights=False)
    got, _ = ours(q, k, v, key_padding_mask=kpm, attn_mask=am, need_weights=False)
    assert len(spy) == 1
    torch.testing.assert_close(got, want, **TOL)


def test_unbatched(spy):
    ref, ours = _pair()
    x = torch.randn(7, 32)
    kpm = torch.zeros(7, dtype=torch.bool)
    kpm[5:] = True
    am = torch.randn(4, 7, 7)
    want, _ = ref(x, x, x, key_padding_mask=kpm, attn_mask=am, need_weights=False)
    got, _ = ours(x, x, x, key_padding_mask=kpm, attn_mask=am, need_weights=False)
    assert got.shape == (7, 32) and len(spy) == 1
    torch.testing.assert_close(got, want, **TOL)


def test_backward_matches_torch():
    ref, ours = _pair(batch_first=True)
    x = torch.randn(2, 6, 32)
    kpm = torch.zeros(2, 6, dtype=torch.bool)
    kpm[1, 4:] = True
    grads = []
    for m in (ref, ours):
        xi = x.clone().requires_grad_()
        out, _ = m(xi, xi, xi, key_padding_mask=kpm, need_weights=False)
        out.square().sum().backward()
        grads.append([xi.grad] + [p.grad for p in m.parameters()])
    for g, w in zip(grads[1], grads[0]):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)


def test_torch_path_cases_match_exactly(spy):
    """need_weights=True runs torch's own implementation: identical results; dropout in training
    runs on ours (tests/kernels/test_dropout.py checks its statistics)."""
    ref, ours = _pair(dropout=0.25, batch_first=True)
    ref.eval(), ours.eval()
    x = torch.randn(2, 6, 32)
    for average in (True, False):
        want, w = ref(x, x, x, average_attn_weights=average)
        got, g = ours(x, x, x, average_attn_weights=average)
        torch.testing.assert_close(got, want, atol=0, rtol=0)
        torch.testing.assert_close(g, w, atol=0, rtol=0)
    assert len(spy) == 0
    ours(x, x, x, need_weights=False)  # eval: ours
    ours.train()
    ours(x, x, x, need_weights=False)  # dropout active in training: ours too
    assert len(spy) == 2


def test_state_dict_and_signature_compatible():
    import inspect
    ref, ours = _pair(kdim=16, vdim=8, add_bias_kv=True)
    assert list(ours.state_dict()) == list(ref.state_dict())
    assert isinstance(ours, torch.nn.MultiheadAttention)

    def params(f):
        return [(p.name, p.kind, p.default) for p in inspect.signature(f).parameters.values()]

    assert params(tnn.MultiheadAttention.forward) == params(torch.nn.MultiheadAttention.forward)
    assert params(tnn.MultiheadAttention.__init__) == params(torch.nn.MultiheadAttention.__init__)
    ref.load_state_dict(ours.state_dict())  # and back


def test_errors_name_the_argument():
    _, ours = _pair(batch_first=True)
    x = torch.randn(2, 6, 32)
    with pytest.raises(RuntimeError, match="is_causal"):
        ours(x, x, x, is_causal=True, need_weights=False)
    with pytest.raises((AssertionError, RuntimeError, ValueError), match="key_padding_mask"):
        ours(x, x, x, key_padding_mask=torch.zeros(2, 5, dtype=torch.bool), need_weights=False)
    with pytest.raises(RuntimeError, match="attn_mask"):
        ours(x, x, x, attn_mask=torch.zeros(5, 6, dtype=torch.bool), need_weights=False)
    with pytest.raises(TypeError, match="model"):
        tnn.swap_attention("not a module")


def _model():
    torch.manual_seed(3)
    layer = torch.nn.TransformerEncoderLayer(32, 4, dim_feedforward=64, dropout=0.0, batch_first=True)
    return torch.nn.Sequential(torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False),
                               torch.nn.MultiheadAttention(32, 4))


def test_swap_attention_in_place(spy):
    model = _model()
    params = {name: p for name, p in model.named_parameters()}
    keys = list(model.state_dict())
    x = torch.randn(2, 9, 32)
    kpm = torch.zeros(2, 9, dtype=torch.bool)
    kpm[0, 7:] = True
    want = model[0](x, src_key_padding_mask=kpm, is_causal=False)
    assert tnn.swap_attention(model) is model
    swapped = [m for m in model.modules() if isinstance(m, tnn.MultiheadAttention)]
    assert len(swapped) == 3
    assert {name: p for name, p in model.named_parameters()} == params and list(model.state_dict()) == keys
    got = model[0](x, src_key_padding_mask=kpm, is_causal=False)
    assert len(spy) == 2  # both encoder layers ran on torch_metal_flash
    torch.testing.assert_close(got, want, **TOL)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    got.sum().backward()
    opt.step()
    tnn.restore_attention(model)
    assert not any(isinstance(m, tnn.MultiheadAttention) for m in model.modules())


@pytest.mark.skipif(not torch.backends.mps.is_available(), reason="needs an MPS device")
def test_mps():  # pragma: no cover - macOS only
    ref, ours = _pair(batch_first=True)
    ref, ours = ref.to("mps"), ours.to("mps")
    x = torch.randn(2, 33, 32, device="mps")
    want, _ = ref(x, x, x, need_weights=False)
    got, _ = ours(x, x, x, need_weights=False)
    torch.testing.assert_close(got.cpu(), want.cpu(), atol=1e-4, rtol=1e-4)
