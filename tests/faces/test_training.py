"""Training end to end through the fused backward, in the emulator backend.

A tiny two-layer causal transformer learns a synthetic task (predict the
token seen ``LAG`` positions earlier).  Layer 1 calls
``torch_metal_flash.scaled_dot_product_attention`` ((B, H, L, D), top-left
causal, GQA 2:1), layer 2 calls ``flash_attn_func`` ((B, L, H, D),
bottom-right causal, sliding window, MQA).  The same model trained on the
reference backend gives the loss curve to match.  Strict mode: any fallback
to the reference path fails the test.  Then ``torch.compile(fullgraph=True)``
of a training step traces forward and backward (the ``metal_flash`` ops)
without a graph break and runs them in the emulator.

These tests need the emulator: they fail (not skip) when it or its compiler
is missing.  Checked mode is used so that they share the kernel builds of the
kernel tests (the emulator's disk cache).
"""
from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

import torch_metal_flash as tmf
from torch_metal_flash import backends

VOCAB, LAG, SEQ, BATCH = 8, 2, 16, 4
D_MODEL, HEADS, HEAD_DIM = 32, 4, 8
STEPS = 12


class Block(nn.Module):
    def __init__(self, face: str, kv_heads: int):
        super().__init__()
        self.face, self.kv_heads = face, kv_heads
        self.ln1 = nn.LayerNorm(D_MODEL)
        self.q = nn.Linear(D_MODEL, HEADS * HEAD_DIM)
        self.kv = nn.Linear(D_MODEL, 2 * kv_heads * HEAD_DIM)
        self.o = nn.Linear(HEADS * HEAD_DIM, D_MODEL)
        self.ln2 = nn.LayerNorm(D_MODEL)
        self.mlp = nn.Sequential(nn.Linear(D_MODEL, 2 * D_MODEL), nn.GELU(), nn.Linear(2 * D_MODEL, D_MODEL))

    def forward(self, x):
        B, L, _ = x.shape
        h = self.ln1(x)
        q = self.q(h).view(B, L, HEADS, HEAD_DIM)
        k, v = self.kv(h).view(B, L, 2, self.kv_heads, HEAD_DIM).unbind(2)
        if self.face == "sdpa":
            a = tmf.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                 is_causal=True, enable_gqa=True).transpose(1, 2)
        else:
            a = tmf.flash_attn_func(q, k, v, causal=True, window_size=(6, 0))
        x = x + self.o(a.reshape(B, L, HEADS * HEAD_DIM))
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D_MODEL)
        self.pos = nn.Parameter(torch.randn(SEQ, D_MODEL) * 0.1)
        self.blocks = nn.ModuleList([Block("sdpa", HEADS // 2), Block("flash", 1)])
        self.head = nn.Linear(D_MODEL, VOCAB)

    def forward(self, tokens):
        x = self.emb(tokens) + self.pos[: tokens.shape[1]]
        for blk in self.blocks:
            x = blk(x)
        return self.head(x)


def batches(steps: int):
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        t = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        target = torch.roll(t, LAG, dims=1)
        target[:, :LAG] = -100  # nothing to copy yet
        yield t, target


def loss_fn(model, tokens, target):
    logits = model(tokens)
    return F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1), ignore_index=-100)


def train(model, backend_name: str, steps: int = STEPS) -> list[float]:
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    with backends.backend(backend_name, strict=True):
        for tokens, target in batches(steps):
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model, tokens, target)
            loss.backward()
            opt.step()
            losses.append(loss.item())
    return losses


def test_training_loss_curve_matches_reference():
    torch.manual_seed(0)
    model = TinyLM()
    ref_model = copy.deepcopy(model)
    backends.run_counts(reset=True)
    losses = train(model, "emulator")
    counts = backends.run_counts(reset=True)
    ref = train(ref_model, "reference")
    # 2 attention layers x (forward + backward) per step, all on the kernels.
    assert counts.get("emulator", 0) >= 4 * STEPS, counts
    assert counts.get("reference", 0) == 0, counts
    # It learns ...
    assert sum(losses[-4:]) / 4 < 0.9 * sum(losses[:4]) / 4, losses
    # ... exactly like the reference (float32; small drift accumulates through Adam).
    for step, (a, b) in enumerate(zip(losses, ref)):
        assert abs(a - b) <= 2e-3 * max(1.0, abs(b)), (step, a, b, losses, ref)
    # (Final weights are not compared: the key-bias gradient is exactly zero in
    # exact math -- softmax ignores a per-row constant -- so Adam turns its
    # rounding noise into full-size steps on both sides.)


def test_gradients_match_reference_one_step():
    """One step's parameter gradients, emulator kernels vs reference backend."""
    torch.manual_seed(1)
    model = TinyLM()
    tokens, target = next(batches(1))
    grads = {}
    for name in ("emulator", "reference"):
        model.zero_grad(set_to_none=True)
        with backends.backend(name, strict=True):
            loss_fn(model, tokens, target).backward()
        grads[name] = {n: p.grad.clone() for n, p in model.named_parameters()}
    for n in grads["reference"]:
        torch.testing.assert_close(grads["emulator"][n], grads["reference"][n], rtol=1e-3, atol=1e-5, msg=n)


def test_torch_compile_training_step_fullgraph():
    """fullgraph=True: forward and the AOT-traced backward contain the
    metal_flash ops (no graph break), and run on the emulator kernels."""
    torch._dynamo.reset()
    torch.manual_seed(2)
    model = TinyLM()
    eager = copy.deepcopy(model)
    step = torch.compile(lambda t, y: loss_fn(model, t, y), fullgraph=True, backend="aot_eager")
    tokens, target = next(batches(1))
    backends.run_counts(reset=True)
    with backends.backend("emulator", strict=True):
        loss = step(tokens, target)
        loss.backward()
        counts = backends.run_counts(reset=True)
        eager_loss = loss_fn(eager, tokens, target)
        eager_loss.backward()
    assert counts.get("emulator", 0) >= 4, counts  # 2 forward + 2 backward op calls
    torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=1e-6)
    for (n, p), (_, pe) in zip(model.named_parameters(), eager.named_parameters()):
        torch.testing.assert_close(p.grad, pe.grad, rtol=1e-4, atol=1e-6, msg=n)
