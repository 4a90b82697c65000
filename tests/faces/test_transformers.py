"""The transformers ``"metal_sdpa"`` attention implementation against transformers' own ones.

Tiny random models built from configs in code (no hub weights): Llama (GQA),
Mistral (sliding window), Gemma2 (softcap + sliding window), GPT-OSS (sinks +
sliding window).  Logits must equal the ``sdpa`` implementation's (``eager``
for the features sdpa lacks) on left-padded batches, and greedy ``generate()``
must give the same tokens.
"""
import types
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="5.0")

from torch_metal_flash.faces import functional  # noqa: E402
from torch_metal_flash.integrations import transformers as tmf_hf  # noqa: E402

TOL = dict(atol=2e-5, rtol=2e-5)
VOCAB = 61


def _model_class(name):
    cls = getattr(transformers, name, None)
    if cls is None:
        msg = f"transformers {transformers.__version__} has no {name}"
        print(msg)
        pytest.skip(msg)
    return cls


def _build(kind):
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0)
    if kind == "llama":
        cfg = _model_class("LlamaConfig")(**common)
        cls, reference = _model_class("LlamaForCausalLM"), "sdpa"
    elif kind == "mistral":
        cfg = _model_class("MistralConfig")(sliding_window=4, head_dim=8, **common)
        cls, reference = _model_class("MistralForCausalLM"), "sdpa"
    elif kind == "gemma2":
        cfg = _model_class("Gemma2Config")(head_dim=8, sliding_window=4, attn_logit_softcapping=2.0,
                                           final_logit_softcapping=30.0, query_pre_attn_scalar=8, **common)
        cls, reference = _model_class("Gemma2ForCausalLM"), "eager"  # sdpa has no softcap
    elif kind == "gpt_oss":
        common.update(intermediate_size=32)
        cfg = _model_class("GptOssConfig")(head_dim=8, sliding_window=4, num_local_experts=4,
                                           num_experts_per_tok=2, layer_types=["sliding_attention",
                                                                               "full_attention"], **common)
        cls, reference = _model_class("GptOssForCausalLM"), "eager"  # sdpa has no sinks
    else:
        raise AssertionError(kind)
    torch.manual_seed(0)
    model = cls(cfg).eval()
    if kind == "gpt_oss":
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_()  # zero-initialised: make the sinks count
    model.set_attn_implementation(reference)
    return model, reference


@pytest.fixture(scope="module", autouse=True)
def _registered():
    tmf_hf.register()


@pytest.fixture
def spy(monkeypatch):
    calls = []
    real = functional._attention

    def counting(*args):
        calls.append(args)
        return real(*args)

    monkeypatch.setattr(functional, "_attention", counting)
    return calls


def _batch():
    torch.manual_seed(1)
    ids = torch.randint(1, VOCAB, (3, 10))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # left padding
    mask[1, :1] = 0
    ids[mask == 0] = 0
    return ids, mask


def _use(model, name):
    if name == tmf_hf.NAME:
        tmf_hf.set_attention(model)
    else:
        model.set_attn_implementation(name)
    assert model.config._attn_implementation == name


MODELS = ["llama", "mistral", "gemma2", "gpt_oss"]


@pytest.mark.parametrize("kind", MODELS)
def test_logits_and_generate_match(kind, spy):
    model, reference = _build(kind)
    ids, mask = _batch()
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).logits
        want_full = model(input_ids=ids[2:]).logits  # unpadded, no mask: the causal-skip path
        want_gen = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
        _use(model, tmf_hf.NAME)
        got = model(input_ids=ids, attention_mask=mask).logits
        got_full = model(input_ids=ids[2:]).logits
        n = len(spy)
        got_gen = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    assert n == 2 * model.config.num_hidden_layers and len(spy) > n
    valid = mask.bool()
    torch.testing.assert_close(got[valid], want[valid], **TOL)
    torch.testing.assert_close(got_full, want_full, **TOL)
    assert torch.isfinite(got).all()
    assert torch.equal(got_gen, want_gen), (got_gen, want_gen)


def test_padded_batch_gets_a_mask(spy):
    """The mask function is registered: padded batches reach the attention with a mask."""
    model, _ = _build("llama")
    _use(model, tmf_hf.NAME)
    ids, mask = _batch()
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    masks = [args[3] for args in spy]
    assert all(m is not None and m.dtype == torch.bool for m in masks)
    assert not masks[0][0, 0, -1, :4].any()  # the padded keys of row 0 are masked


def test_training_gradients_match():
    model, reference = _build("llama")
    model.train()
    ids, mask = _batch()
    grads = []
    for name in (reference, tmf_hf.NAME):
        _use(model, name)
        model.zero_grad()
        out = model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
        out.loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], atol=1e-5, rtol=1e-4, msg=n)


def test_gpt_oss_sink_gradients():
    model, _ = _build("gpt_oss")
    _use(model, tmf_hf.NAME)
    model.train()
    ids, mask = _batch()
    model(input_ids=ids, attention_mask=mask).logits[mask.bool()].square().mean().backward()
    sink_grads = [layer.self_attn.sinks.grad for layer in model.model.layers]
    assert all(g is not None and g.abs().sum() > 0 for g in sink_grads)


# --- the attention function itself --------------------------------------------------------------------------


def _qkv(b=2, hq=4, hkv=2, lq=6, lk=6, d=8):
    torch.manual_seed(2)
    q = torch.randn(b, lq, hq, d).transpose(1, 2)  # the interface's (B, H, L, D) views of (B, L, H, D)
    k = torch.randn(b, hkv, lk, d)
    v = torch.randn(b, hkv, lk, d)
    return q, k, v


def _sdpa_interface(module, q, k, v, mask, **kw):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    return sdpa_attention_forward(module, q, k, v, mask, **kw)


@pytest.mark.parametrize("case", ["causal_module", "bidirectional_module", "is_causal_kwarg_false", "decode",
                                  "float_mask", "scaling", "longer_mask", "position_bias"])
def test_attention_function_matches_sdpa_interface(case):
    module = types.SimpleNamespace(is_causal=case != "bidirectional_module", num_key_value_groups=2)
    q, k, v = _qkv(lq=1 if case == "decode" else 6, lk=9 if case == "decode" else 6)
    mask, kw = None, {}
    if case == "is_causal_kwarg_false":
        kw["is_causal"] = False
    if case == "float_mask":
        mask = torch.randn(2, 1, q.shape[2], k.shape[2])
    if case == "scaling":
        kw["scaling"] = 0.7
    if case == "longer_mask":
        mask = torch.rand(2, 1, 6, 11) > 0.3
        mask[..., 0] = True
    if case == "position_bias":
        kw["position_bias"] = torch.randn(1, 4, 6, 6)
    want, _ = _sdpa_interface(module, q, k, v, mask[..., :6] if case == "longer_mask" else mask, **kw)
    got, weights = tmf_hf.metal_sdpa_attention_forward(module, q, k, v, mask, **kw)
    assert weights is None and got.is_contiguous() and got.shape == (2, q.shape[2], 4, 8)
    torch.testing.assert_close(got, want, **TOL)


def test_dropout_in_training():
    module = types.SimpleNamespace(is_causal=True)
    q, k, v = _qkv()
    base, _ = tmf_hf.metal_sdpa_attention_forward(module, q, k, v, None, dropout=0.0)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "dropout runs on the reference path" (warned once per process)
        dropped, _ = tmf_hf.metal_sdpa_attention_forward(module, q, k, v, None, dropout=0.5)
    assert dropped.shape == base.shape and torch.isfinite(dropped).all() and not torch.allclose(dropped, base)


def test_gqa_is_not_repeated(spy):
    q, k, v = _qkv(hq=8, hkv=2)
    module = types.SimpleNamespace(is_causal=True, num_key_value_groups=4)
    tmf_hf.metal_sdpa_attention_forward(module, q, k, v, None)
    _, k_seen, v_seen = spy[0][:3]
    assert k_seen.data_ptr() == k.data_ptr() and k_seen.shape[1] == 2 and v_seen.shape[1] == 2


def test_softcap_sinks_window_against_eager_math():
    q, k, v = _qkv(lq=7, lk=7)
    module = types.SimpleNamespace(is_causal=True)
    sinks = torch.randn(4)
    got, _ = tmf_hf.metal_sdpa_attention_forward(module, q, k, v, None, scaling=0.4, softcap=3.0, s_aux=sinks,
                                                 sliding_window=3)
    kr, vr = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    s = 3.0 * torch.tanh((q @ kr.transpose(-1, -2)) * 0.4 / 3.0)
    i, j = torch.arange(7)[:, None], torch.arange(7)[None, :]
    s = s.masked_fill((j > i) | (j <= i - 3), float("-inf"))
    s = torch.cat([s, sinks[None, :, None, None].expand(2, 4, 7, 1)], -1)
    want = (torch.softmax(s, -1)[..., :-1] @ vr).transpose(1, 2)
    torch.testing.assert_close(got, want, **TOL)


def test_errors_name_the_argument():
    module = types.SimpleNamespace(is_causal=True)
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="^query"):
        tmf_hf.metal_sdpa_attention_forward(module, q[0], k, v, None)
    with pytest.raises(ValueError, match="^key"):
        tmf_hf.metal_sdpa_attention_forward(module, q, k[:, :1].expand(2, 3, 6, 8), v, None)
    with pytest.raises(ValueError, match="^attention_mask"):
        tmf_hf.metal_sdpa_attention_forward(module, q, k, v, torch.ones(3, 1, 6, 6, dtype=torch.bool))
    with pytest.raises(TypeError, match="^attention_mask"):
        tmf_hf.metal_sdpa_attention_forward(module, q, k, v, torch.ones(2, 1, 6, 6, dtype=torch.int64))
    with pytest.raises(ValueError, match="^s_aux"):
        tmf_hf.metal_sdpa_attention_forward(module, q, k, v, None, s_aux=torch.zeros(3))
    with pytest.raises(ValueError, match="^name"):
        tmf_hf.register("metal_flash")


def test_registered_in_both_interfaces():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    assert AttentionInterface._global_mapping[tmf_hf.NAME] is tmf_hf.metal_sdpa_attention_forward
    assert AttentionMaskInterface._global_mapping[tmf_hf.NAME] is sdpa_mask
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2)
    model = transformers.LlamaForCausalLM._from_config(cfg, attn_implementation=tmf_hf.NAME)
    assert model.config._attn_implementation == tmf_hf.NAME


# ---------------------------------------------------------------------------
# QuantizedKVCache: K/V stay quantized and reach the kernels as they are
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("kind,fmt", [("llama", dict(bits=4, group_size=32)),
                                      ("gpt_oss", dict(bits=8, group_size=32, mode="symmetric"))])
def test_quantized_cache_generate_matches_dequantized_caches(kind, fmt, spy):
    """generate(past_key_values=QuantizedKVCache) on metal_sdpa runs every step on the kernels
    (emulator, strict) with quantized K/V, and gives the same tokens as the same model fed the
    dequantize()d cache through sdpa (eager for GPT-OSS's sinks); the cache memory is reported."""
    from torch_metal_flash import backends, emulator
    from torch_metal_flash.problem.quant import QuantizedTensor

    model, reference = _build(kind)
    ids, mask = _batch()
    backends.run_counts(reset=True)
    with torch.no_grad(), backends.backend("emulator", strict=True), emulator.settings(checked=True), \
            warnings.catch_warnings():
        warnings.filterwarnings("ignore", "`past_key_values` is deprecated", FutureWarning)
        _use(model, tmf_hf.NAME)
        cache = tmf_hf.QuantizedKVCache(**fmt)
        got = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=5, do_sample=False)
        assert backends.run_counts() == {"emulator": 2 * len(spy)}  # each layer and step: append + attention
        assert all(isinstance(args[1], QuantizedTensor) and isinstance(args[2], QuantizedTensor) for args in spy)
        model.set_attn_implementation(reference)
        want = model.generate(ids, attention_mask=mask, past_key_values=tmf_hf.QuantizedKVCache(**fmt, dequantize=True),
                              max_new_tokens=5, do_sample=False)
    assert torch.equal(got, want), (got, want)
    memory = cache.memory()
    print(f"\n{kind} {fmt}: QuantizedKVCache memory {memory}")
    layers, heads, head_dim = model.config.num_hidden_layers, model.config.num_key_value_heads, 8
    assert memory["dense"] == 2 * layers * ids.shape[0] * heads * cache.get_seq_length() * head_dim * 4
    assert memory["used"] < memory["dense"] / 2
