"""torch.compile over every drop-in: one graph (fullgraph=True, no graph breaks), forward and backward,
results equal to eager torch, and the graphs contain the opaque metal_flash ops.

Runs on CPU with the reference backend and the emulator backend; on macOS also on MPS.
"""

import pytest
import torch
import torch.nn.functional as F
from torch.nn.functional import scaled_dot_product_attention as captured_sdpa

import torch_metal_flash as tmf
from torch_metal_flash import nn as tnn
from torch_metal_flash.faces.flash_attn_shim import install_flash_attn_shim, uninstall_flash_attn_shim
from torch_metal_flash.faces.sdpa_override import reset_sdpa_stats, sdpa_override, sdpa_stats

BACKENDS = ["reference", "emulator"]
TOL = dict(atol=1e-4, rtol=1e-4)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def ran_on():
    """Asserts at the end of a test that the kernels of ``backend`` executed op calls."""
    from torch_metal_flash import backends
    expected = []
    before = dict(backends.run_counts())
    yield expected.append
    after = backends.run_counts()
    for name in expected:
        if name != "reference":
            assert after.get(name, 0) > before.get(name, 0), (name, before, after)


class Recorder:
    """An aot_eager-like backend that keeps the forward and backward graphs."""

    def __init__(self):
        self.graphs = {"fw": [], "bw": []}

    def backend(self):
        from functorch.compile import make_boxed_func
        from torch._dynamo.backends.common import aot_autograd

        def keep(kind):
            def compiler(gm, example_inputs):
                self.graphs[kind].append(gm)
                return make_boxed_func(gm.forward)
            return compiler

        return aot_autograd(fw_compiler=keep("fw"), bw_compiler=keep("bw"))

    def ops(self, kind):
        return {str(n.target) for gm in self.graphs[kind] for n in gm.graph.nodes if n.op == "call_function"}


def _run(fn, inputs):
    leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    out = fn(*leaves)
    out.square().sum().backward()
    return out.detach(), [t.grad for t in leaves if t.grad is not None]


def _check(eager_fn, compiled_fn, inputs, rec=None, ops=True, want=None):
    """Forward and backward of ``compiled_fn`` equal ``eager_fn``'s (or ``want``); the graphs hold our ops."""
    want, want_grads = want if want is not None else _run(eager_fn, inputs)
    got, got_grads = _run(compiled_fn, inputs)
    torch.testing.assert_close(got, want, **TOL)
    assert len(got_grads) == len(want_grads)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, **TOL)
    if rec is not None:
        assert len(rec.graphs["fw"]) == 1 and len(rec.graphs["bw"]) == 1, rec.graphs
        if ops:
            assert "metal_flash.fwd.default" in rec.ops("fw"), rec.ops("fw")
            assert "metal_flash.bwd.default" in rec.ops("bw"), rec.ops("bw")


class Block(torch.nn.Module):
    """Attention written against torch's SDPA, as user code is."""

    def __init__(self, e=32, h=4, hkv=2, captured=False):
        super().__init__()
        self.h, self.hkv, self.d = h, hkv, e // h
        self.q = torch.nn.Linear(e, e)
        self.kv = torch.nn.Linear(e, 2 * hkv * self.d)
        self.sdpa = captured_sdpa if captured else None

    def forward(self, x, mask):
        b, n, _ = x.shape
        q = self.q(x).view(b, n, self.h, self.d).transpose(1, 2)
        k, v = self.kv(x).view(b, n, 2, self.hkv, self.d).permute(2, 0, 3, 1, 4)
        sdpa = self.sdpa or F.scaled_dot_product_attention
        causal = sdpa(q, k, v, is_causal=True, enable_gqa=True)
        masked = sdpa(q, k, v, attn_mask=mask, enable_gqa=True)
        return (causal + masked).transpose(1, 2).reshape(b, n, -1)


@pytest.mark.parametrize("backend,captured", [("reference", False), ("reference", True), ("emulator", False)])
def test_sdpa_override(backend, captured, ran_on):
    ran_on(backend)
    torch.manual_seed(0)
    model = Block(captured=captured)
    x = torch.randn(2, 9, 32)
    # reference: a float mask that gets a gradient; emulator: a bool mask (fewer kernel variants to build)
    mask = torch.randn(2, 1, 9, 9) if backend == "reference" else torch.rand(2, 1, 9, 9) > 0.3
    rec = Recorder()
    compiled = torch.compile(model, fullgraph=True, backend=rec.backend())
    want = _run(model, (x, mask))  # torch's own SDPA
    reset_sdpa_stats()
    with tmf.backend(backend), sdpa_override(cpu=True if backend == "reference" else None):
        _check(None, compiled, (x, mask), rec, want=want)
    stats = sdpa_stats()
    assert stats["traced_routed"] >= 2 and stats["traced_original"] == 0 and stats["routed"] == 0, stats
    # the compiled graph keeps the routing it was traced with (no guard on the override; see docs/dropins.md)
    torch.testing.assert_close(compiled(x, mask), want[0], **TOL)


@pytest.mark.parametrize("backend", BACKENDS)
def test_functional_faces(backend, ran_on):
    ran_on(backend)
    torch.manual_seed(1)
    install_flash_attn_shim()
    try:
        from flash_attn import flash_attn_func

        def f(q, k, v):
            a = tmf.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                 is_causal=True, enable_gqa=True).transpose(1, 2)
            b = flash_attn_func(q, k, v, causal=True, window_size=(3, 0), softcap=4.0)
            return a + b

        q, k, v = torch.randn(2, 9, 4, 16), torch.randn(2, 9, 2, 16), torch.randn(2, 9, 2, 16)
        rec = Recorder()
        with tmf.backend(backend):
            _check(f, torch.compile(f, fullgraph=True, backend=rec.backend()), (q, k, v), rec)
        assert len([n for gm in rec.graphs["fw"] for n in gm.graph.nodes
                    if str(n.target) == "metal_flash.fwd.default"]) == 2
    finally:
        uninstall_flash_attn_shim()


@pytest.mark.parametrize("backend", BACKENDS)
def test_multihead_attention(backend, ran_on):
    ran_on(backend)
    torch.manual_seed(2)
    layer = torch.nn.TransformerEncoderLayer(32, 4, dim_feedforward=64, dropout=0.0, batch_first=True)
    ref_layer = torch.nn.TransformerEncoderLayer(32, 4, dim_feedforward=64, dropout=0.0, batch_first=True)
    ref_layer.load_state_dict(layer.state_dict())
    tnn.swap_attention(layer)
    x = torch.randn(2, 9, 32)
    kpm = torch.zeros(2, 9, dtype=torch.bool)
    kpm[1, 6:] = True
    rec = Recorder()
    compiled = torch.compile(lambda x: layer(x, src_key_padding_mask=kpm), fullgraph=True, backend=rec.backend())
    with tmf.backend(backend):
        _check(lambda x: ref_layer(x, src_key_padding_mask=kpm), compiled, (x,), rec)


@pytest.mark.parametrize("backend", BACKENDS)
def test_transformers_model(backend, ran_on):
    ran_on(backend)
    transformers = pytest.importorskip("transformers", minversion="5.0")
    from torch_metal_flash.integrations import transformers as tmf_hf
    cfg = transformers.LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(3)
    model = transformers.LlamaForCausalLM(cfg)
    ref = transformers.LlamaForCausalLM(cfg)
    ref.load_state_dict(model.state_dict())
    ref.set_attn_implementation("sdpa")
    tmf_hf.set_attention(model)
    ids = torch.randint(1, 61, (2, 8))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0

    def loss(m):
        logits = m(input_ids=ids, attention_mask=mask, use_cache=False).logits
        return logits[mask.bool()].square().mean()

    rec = Recorder()
    compiled = torch.compile(lambda: loss(model), fullgraph=True, backend=rec.backend())
    with tmf.backend(backend):
        got = compiled()
        got.backward()
    want = loss(ref)
    want.backward()
    torch.testing.assert_close(got, want, **TOL)
    grads = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, atol=1e-4, rtol=1e-3, msg=name)
    assert len(rec.graphs["fw"]) == 1 and "metal_flash.fwd.default" in rec.ops("fw")
    assert "metal_flash.bwd.default" in rec.ops("bw")


def test_inductor():
    """The real compiler: the opaque op's fake kernel layouts survive Inductor's codegen."""
    torch.manual_seed(4)
    model = Block()
    x = torch.randn(2, 9, 32)
    mask = torch.randn(2, 1, 9, 9)
    want = _run(model, (x, mask))
    with sdpa_override(cpu=True):
        _check(None, torch.compile(model, fullgraph=True), (x, mask), want=want)


@pytest.mark.skipif(not torch.backends.mps.is_available(), reason="needs an MPS device")
def test_mps():  # pragma: no cover - macOS only
    torch.manual_seed(5)
    model = Block().to("mps")
    x = torch.randn(2, 33, 32, device="mps")
    mask = torch.randn(2, 1, 33, 33, device="mps")
    want = _run(model, (x, mask))
    rec = Recorder()
    with sdpa_override():
        _check(None, torch.compile(model, fullgraph=True, backend=rec.backend()), (x, mask), rec, want=want)
