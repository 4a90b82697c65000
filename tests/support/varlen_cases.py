"""Packed (varlen) problems for the kernel tests: build them, run them through the ops on the
emulator backend, and check them sequence by sequence against the float64 oracle.

A case is a dict: ``dtype``, ``h``/``hkv`` (GQA/MQA), ``d``/``dv``, ``lens_q``/``lens_k``
(per sequence), ``window`` (left, right; causal is (-1, 0)) aligned to each sequence's
bottom-right corner, ``softcap``, ``alibi`` ("h" or "bh"), ``sinks``, ``seqused`` (keys
used per sequence), ``page`` (paged K/V of that page size), ``dropout``.
The oracle of a dropout case applies the kernel's own mask, recovered from
``fwd_probs`` (the sign of flash-attn's ``S_dmask``).
"""
from __future__ import annotations

import zlib
from typing import Optional

import torch

from torch_metal_flash import backends, emulator
import torch_metal_flash.ops as ops
from torch_metal_flash.problem.spec import make_spec
from torch_metal_flash.testing.oracle import check_backward, check_forward, randn

DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


def case_id(c: dict) -> str:
    feats = [k for k in ("softcap", "alibi", "sinks", "seqused", "page", "dropout") if c.get(k)]
    return (f"{c['dtype']}-h{c['h']}:{c['hkv']}-d{c['d']}v{c.get('dv', c['d'])}-n{len(c['lens_q'])}"
            f"-w{c.get('window', (-1, -1))}-{'-'.join(feats) or 'plain'}")


def build(c: dict, seed: Optional[int] = None) -> dict:
    """Tensors of a case: packed q/k/v ((total, H, D), or paged caches), cu_seqlens, the rest."""
    seed = zlib.crc32(case_id(c).encode()) if seed is None else seed
    g = torch.Generator().manual_seed(seed)
    dt = DTYPES[c["dtype"]]
    lens_q, lens_k = c["lens_q"], c["lens_k"]
    n, H, Hkv, D, Dv = len(lens_q), c["h"], c["hkv"], c["d"], c.get("dv", c["d"])
    cu = (lambda lens: torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32))
    x = dict(c=c, cu_q=cu(lens_q), cu_k=cu(lens_k), scale=D ** -0.5)
    x["q"] = randn(sum(lens_q), H, D, generator=g).to(dt)
    x["k"] = randn(sum(lens_k), Hkv, D, generator=g).to(dt)
    x["v"] = randn(sum(lens_k), Hkv, Dv, generator=g).to(dt)
    x["dout"] = randn(1, H, sum(lens_q), Dv, generator=g).to(dt)
    x["alibi"] = {"h": torch.rand(H, generator=g) * 0.3, "bh": torch.rand(n, H, generator=g) * 0.3}.get(c.get("alibi"))
    x["sinks"] = randn(H, generator=g) if c.get("sinks") else None
    x["seqused"] = torch.tensor(c["seqused"], dtype=torch.int32) if c.get("seqused") else None
    x["rng"] = torch.tensor([seed, 11], dtype=torch.int64) if c.get("dropout") else None
    x["table"] = None
    if c.get("page"):
        # Each sequence's keys in pages of a shared pool, in shuffled block order (unused table entries: 0).
        page = c["page"]
        pages = [-(-lk // page) for lk in lens_k]
        order = torch.randperm(sum(pages) + 2, generator=g)
        table = torch.zeros(n, max(max(pages), 1), dtype=torch.int32)
        kc = torch.zeros(sum(pages) + 2, page, Hkv, D, dtype=dt)
        vc = torch.zeros(sum(pages) + 2, page, Hkv, Dv, dtype=dt)
        used = 0
        for b, lk in enumerate(lens_k):
            k0 = int(x["cu_k"][b])
            for pg in range(pages[b]):
                blk = int(order[used])
                used += 1
                table[b, pg] = blk
                rows = slice(pg * page, min(lk, (pg + 1) * page))
                kc[blk, :rows.stop - rows.start] = x["k"][k0 + rows.start:k0 + rows.stop]
                vc[blk, :rows.stop - rows.start] = x["v"][k0 + rows.start:k0 + rows.stop]
        x["table"], x["k_cache"], x["v_cache"] = table, kc, vc
    return x


def fwd_args(x: dict) -> dict:
    """metal_flash.fwd's arguments for case ``x``, by name (return_aux when it has a backward)."""
    c = x["c"]
    wl, wr = c.get("window", (-1, -1))
    q = x["q"].transpose(0, 1)[None]
    if x["table"] is not None:
        k, v = x["k_cache"].transpose(1, 2), x["v_cache"].transpose(1, 2)
    else:
        k, v = x["k"].transpose(0, 1)[None], x["v"].transpose(0, 1)[None]
    return dict(q=q, k=k, v=v, attn_mask=None, alibi_slopes=x["alibi"], sinks=x["sinks"], scale=x["scale"],
                diag_offset=0, window_left=wl, window_right=wr, softcap=float(c.get("softcap", 0.0)),
                return_aux=x["table"] is None, dropout_p=float(c.get("dropout", 0.0)), rng_state=x["rng"],
                cu_seqlens_q=x["cu_q"], cu_seqlens_k=x["cu_k"], seqused_k=x["seqused"], block_table=x["table"],
                max_seqlen_q=max(c["lens_q"]), max_seqlen_k=max(c["lens_k"]))


def run(x: dict, order: str = "forward", checked: bool = True, backend: str = "emulator") -> dict:
    """Forward and backward through the ops on ``backend``: metal_flash.bwd, or for paged
    K/V fwd's autograd formula (``cache_grads``: dK/dV of the caches; ``grads``: them read
    back through the table in the packed layout, for :func:`check`)."""
    args = fwd_args(x)
    res = {}
    with emulator.settings(order=order, checked=checked), backends.backend(backend, strict=backend != "reference"):
        if x["table"] is None:
            res["out"], res["lse"], aux = ops.fwd_call(**args)
            shared = {n: a for n, a in args.items() if n not in ("return_aux", "block_table")}
            res["grads"] = ops.bwd_call(**shared, dout=x["dout"], out=res["out"], aux=aux, dlse=None,
                                        compute_dbias=False)
        else:
            q, k, v = (args[n].detach().requires_grad_(True) for n in ("q", "k", "v"))
            res["out"], res["lse"], _ = ops.fwd_call(**{**args, "q": q, "k": k, "v": v, "return_aux": True})
            res["cache_grads"] = torch.autograd.grad(res["out"], (q, k, v), x["dout"])
            dq, dk, dv = res["cache_grads"]
            res["grads"] = (dq, packed_from_cache(x, dk.transpose(1, 2)), packed_from_cache(x, dv.transpose(1, 2)))
            res["out"], res["lse"] = res["out"].detach(), res["lse"].detach()
        if args["dropout_p"] > 0:
            res["probs"] = ops.fwd_probs_call(**{n: a for n, a in args.items() if n != "return_aux"})
    return res


def packed_from_cache(x: dict, cache: torch.Tensor) -> torch.Tensor:
    """A (num_blocks, page, Hkv, D) cache (or its gradient) read through case ``x``'s table
    as the packed (1, Hkv, total_k, D) tensor of its sequences' keys."""
    page, rows = x["c"]["page"], []
    for b, lk in enumerate(x["c"]["lens_k"]):
        pos = torch.arange(lk)
        rows.append(cache[x["table"][b, pos // page].long(), pos % page])
    return torch.cat(rows).transpose(0, 1)[None]


def sequence_spec(x: dict, b: int):
    """The padded (batch 1) spec of sequence ``b``: what one per-sequence call computes."""
    c = x["c"]
    q0, q1 = int(x["cu_q"][b]), int(x["cu_q"][b + 1])
    k0, k1 = int(x["cu_k"][b]), int(x["cu_k"][b + 1])
    lk = int(x["seqused"][b]) if x["seqused"] is not None else k1 - k0
    wl, wr = c.get("window", (-1, -1))
    alibi = x["alibi"][b] if x["alibi"] is not None and x["alibi"].dim() == 2 else x["alibi"]
    spec = make_spec(x["q"][None, q0:q1].transpose(1, 2), x["k"][None, k0:k0 + lk].transpose(1, 2),
                     x["v"][None, k0:k0 + lk].transpose(1, 2), None, alibi, x["sinks"], scale=x["scale"],
                     diag_offset=lk - (q1 - q0), window_left=wl, window_right=wr,
                     softcap=float(c.get("softcap", 0.0)), dropout_p=float(c.get("dropout", 0.0)),
                     rng_state=x["rng"])
    return spec, (q0, q1), (k0, k1), lk


def check(x: dict, res: dict) -> None:
    """Every sequence against its own oracle call; dK/dV of unused keys exactly zero."""
    for b in range(len(x["c"]["lens_q"])):
        spec, (q0, q1), (k0, k1), lk = sequence_spec(x, b)
        keep = None
        if "probs" in res:
            keep = ~torch.signbit(res["probs"][b:b + 1, :, :q1 - q0, :lk])
        check_forward(spec, res["out"][:, :, q0:q1], res["lse"][:, :, q0:q1], keep)
        if "grads" not in res:
            continue
        dq, dk, dv = res["grads"][:3]
        if q1 > q0 and lk > 0:
            check_backward(spec, x["dout"][:, :, q0:q1], None,
                           (dq[:, :, q0:q1], dk[:, :, k0:k0 + lk], dv[:, :, k0:k0 + lk], None, None), keep=keep)
        else:
            assert not dq[:, :, q0:q1].any(), f"sequence {b}: dq of a sequence without keys"
        assert not dk[:, :, k0 + lk:k1].any() and not dv[:, :, k0 + lk:k1].any(), \
            f"sequence {b}: dK/dV of keys past seqused_k must be zero"
        if lk and q1 == q0:
            assert not dk[:, :, k0:k1].any(), f"sequence {b}: dK of a sequence without queries"
    if "cache_grads" in res:
        page = x["c"]["page"]
        read = {int(x["table"][b, p]) for b, lk in enumerate(x["c"]["lens_k"]) for p in range(-(-lk // page))}
        unread = [n for n in range(x["k_cache"].shape[0]) if n not in read]
        assert unread, "the case has no unused block"
        for g in res["cache_grads"][1:]:
            assert not g[unread].any(), "dK/dV of blocks no sequence reads must be zero"


def same_bits(a: dict, b: dict) -> None:
    for name in a:
        xs, ys = (a[name], b[name]) if name in ("grads", "cache_grads") else ((a[name],), (b[name],))
        for x, y in zip(xs, ys):
            assert torch.equal(x.view(torch.uint8) if x.numel() else x, y.view(torch.uint8) if y.numel() else y), \
                f"{name} depends on the schedule order"
