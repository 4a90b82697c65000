"""``torch_metal_flash.nn``: a drop-in :class:`torch.nn.MultiheadAttention` and a helper to swap it in.

:class:`MultiheadAttention` subclasses :class:`torch.nn.MultiheadAttention`:
same constructor, same ``forward`` signature and return values, same
parameters and ``state_dict`` keys (checkpoints load both ways, ``isinstance``
checks keep working).  Its ``need_weights=False`` path runs the attention on
torch_metal_flash (the Metal kernels on MPS; on CPU the selected backend:
reference or emulator), with ``key_padding_mask``, ``attn_mask`` (bool or
float, 2-D or 3-D), ``is_causal``, ``batch_first``, unbatched inputs,
``kdim``/``vdim``, ``add_bias_kv``, ``add_zero_attn`` and, in training mode,
``dropout`` (in the kernels, as torch applies it: on the attention weights).  Q, K and V stay views
of the projections (no transposes or copies), the output comes back in the
layout ``out_proj`` wants.

It hands the call to torch's implementation (identical results, by
construction) when:

* ``need_weights=True`` (torch's default!): the weights are the L x S matrix a
  fused kernel exists to avoid, torch computes them explicitly either way;
  pass ``need_weights=False`` to get the fused path;
* the input is a nested tensor.

:func:`swap_attention` converts the ``nn.MultiheadAttention`` modules of a
model in place (the same parameter objects, hooks and buffers stay, so an
optimizer built before keeps working); :func:`restore_attention` undoes it.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .faces.functional import scaled_dot_product_attention

__all__ = ["MultiheadAttention", "swap_attention", "restore_attention"]


class MultiheadAttention(torch.nn.MultiheadAttention):
    __doc__ = (
        "Drop-in for :class:`torch.nn.MultiheadAttention` running on torch_metal_flash when "
        "``need_weights=False`` (see :mod:`torch_metal_flash.nn`).\n\n" + (torch.nn.MultiheadAttention.__doc__ or "")
    )

    def _torch_path_reason(self, query: Tensor, key: Tensor, value: Tensor, need_weights: bool) -> Optional[str]:
        if need_weights:
            return "need_weights=True"
        if query.is_nested or key.is_nested or value.is_nested:
            return "nested tensors"
        return None

    def forward(self, query: Tensor, key: Tensor, value: Tensor, key_padding_mask: Optional[Tensor] = None,
                need_weights: bool = True, attn_mask: Optional[Tensor] = None, average_attn_weights: bool = True,
                is_causal: bool = False) -> tuple[Tensor, Optional[Tensor]]:
        if self._torch_path_reason(query, key, value, need_weights) is not None:
            return super().forward(query, key, value, key_padding_mask=key_padding_mask, need_weights=need_weights,
                                   attn_mask=attn_mask, average_attn_weights=average_attn_weights,
                                   is_causal=is_causal)
        return self._flash_forward(query, key, value, key_padding_mask, attn_mask, is_causal)

    # -- the fused path -------------------------------------------------------------------------------------------

    def _flash_forward(self, query, key, value, key_padding_mask, attn_mask, is_causal):
        H = self.num_heads
        is_batched = F._mha_shape_check(query, key, value, key_padding_mask, attn_mask, H)
        if not is_batched:
            query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
            if attn_mask is not None and attn_mask.dim() == 3:
                attn_mask = attn_mask.unsqueeze(0)
            batch_dim = 0
        else:
            batch_dim = 0 if self.batch_first else 1
        seq_dim = 1 - batch_dim
        bsz, tgt_len = query.shape[batch_dim], query.shape[seq_dim]
        src_len = key.shape[seq_dim]
        E = self.embed_dim
        if query.shape[-1] != E:
            raise ValueError(f"query: expected embedding dim {E} (embed_dim), got {query.shape[-1]}")
        if key.shape[:2] != value.shape[:2]:
            raise ValueError(f"key/value: expected the same batch and sequence dims, got {tuple(key.shape[:2])} "
                             f"and {tuple(value.shape[:2])}")

        if is_causal and attn_mask is None:
            raise RuntimeError("Need attn_mask if specifying the is_causal hint. You may use the Transformer module "
                               "method `generate_square_subsequent_mask` to create this mask.")
        if is_causal and key_padding_mask is None:
            attn_mask = None  # torch: the is_causal hint replaces the (causal) attn_mask
        elif key_padding_mask is not None:
            is_causal = False  # torch: the merged mask is no longer causal

        q, k, v = self._project(query, key, value)  # (B, L|S, E) or (L|S, B, E): the input's layout
        if self.bias_k is not None and self.bias_v is not None:
            k = torch.cat([k, self.bias_k.expand_as(k.narrow(seq_dim, 0, 1))], dim=seq_dim)
            v = torch.cat([v, self.bias_v.expand_as(v.narrow(seq_dim, 0, 1))], dim=seq_dim)
        elif self.bias_k is not None or self.bias_v is not None:
            raise AssertionError("bias_k and bias_v must be both None or both set")
        if self.add_zero_attn:
            k = torch.cat([k, k.new_zeros(()).expand_as(k.narrow(seq_dim, 0, 1))], dim=seq_dim)
            v = torch.cat([v, v.new_zeros(()).expand_as(v.narrow(seq_dim, 0, 1))], dim=seq_dim)
        extra = k.shape[seq_dim] - src_len

        mask = self._merged_mask(key_padding_mask, attn_mask, query, bsz, tgt_len, src_len, extra)

        def heads(t):  # (B, L, E) / (L, B, E) -> (B, H, L, D) view
            t = t.unflatten(-1, (H, t.shape[-1] // H))
            return t.transpose(1, 2) if batch_dim == 0 else t.permute(1, 2, 0, 3)

        out = scaled_dot_product_attention(heads(q), heads(k), heads(v), attn_mask=mask,
                                           dropout_p=self.dropout if self.training else 0.0, is_causal=bool(is_causal))
        # (B, H, L, D) dense in the query's (B, L, H, D) / (L, B, H, D) memory order: flattening is free
        out = out.transpose(1, 2) if batch_dim == 0 else out.permute(2, 0, 1, 3)
        out = F.linear(out.flatten(-2), self.out_proj.weight, self.out_proj.bias)
        if not is_batched:
            out = out.squeeze(0)
        return out, None

    def _project(self, query, key, value):
        b = self.in_proj_bias
        if self._qkv_same_embed_dim:
            w = self.in_proj_weight
            if query is key and key is value:
                return F.linear(query, w, b).unflatten(-1, (3, self.embed_dim)).unbind(-2)
            wq, wk, wv = w.chunk(3)
        else:
            wq, wk, wv = self.q_proj_weight, self.k_proj_weight, self.v_proj_weight
        bq, bk, bv = b.chunk(3) if b is not None else (None, None, None)
        return F.linear(query, wq, bq), F.linear(key, wk, bk), F.linear(value, wv, bv)

    def _merged_mask(self, key_padding_mask, attn_mask, query, bsz, tgt_len, src_len, extra):
        """One SDPA mask (bool: True = attend, or additive float), broadcastable to (B, H, L, S + extra)."""
        H = self.num_heads
        if attn_mask is not None:
            if attn_mask.dim() == 2:
                if tuple(attn_mask.shape) != (tgt_len, src_len):
                    raise RuntimeError(f"The shape of the 2D attn_mask is {attn_mask.shape}, but should be "
                                       f"{(tgt_len, src_len)}.")
                attn_mask = attn_mask[None, None]
            elif attn_mask.dim() == 3 or (attn_mask.dim() == 4 and attn_mask.shape[0] == 1):
                if attn_mask.numel() != bsz * H * tgt_len * src_len or attn_mask.shape[-2:] != (tgt_len, src_len):
                    raise RuntimeError(f"The shape of the 3D attn_mask is {attn_mask.shape}, but should be "
                                       f"{(bsz * H, tgt_len, src_len)}.")
                attn_mask = attn_mask.reshape(bsz, H, tgt_len, src_len)
            else:
                raise RuntimeError(f"attn_mask's dimension {attn_mask.dim()} is not supported")
        if key_padding_mask is not None:
            if tuple(key_padding_mask.shape) != (bsz, src_len):
                raise ValueError(f"key_padding_mask: expected shape {(bsz, src_len)} (batch, source length), got "
                                 f"{tuple(key_padding_mask.shape)}")
            key_padding_mask = key_padding_mask[:, None, None, :]
        masks = [m for m in (attn_mask, key_padding_mask) if m is not None]
        if not masks:
            return None
        if all(m.dtype == torch.bool for m in masks):
            allowed = ~masks[0]
            for m in masks[1:]:
                allowed = allowed & ~m
            return F.pad(allowed, (0, extra), value=True) if extra else allowed
        merged = None
        for m in masks:
            if m.dtype == torch.bool:
                m = torch.zeros(m.shape, dtype=query.dtype, device=m.device).masked_fill_(m, float("-inf"))
            elif not torch.is_floating_point(m):
                raise AssertionError(f"only bool and floating types of masks are supported, got {m.dtype}")
            else:
                m = m.to(query.dtype)
            merged = m if merged is None else merged + m
        return F.pad(merged, (0, extra)) if extra else merged


def swap_attention(model: torch.nn.Module) -> torch.nn.Module:
    """Make every ``torch.nn.MultiheadAttention`` in ``model`` (the model itself included) a
    :class:`torch_metal_flash.nn.MultiheadAttention`, in place, and return ``model``.

    Parameters, buffers, hooks and ``state_dict`` keys are unchanged: only the
    modules' class changes, so optimizers and references keep pointing at the
    same tensors.  Subclasses of ``nn.MultiheadAttention`` (which may override
    ``forward``) are left alone.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    for module in model.modules():
        if type(module) is torch.nn.MultiheadAttention:
            module.__class__ = MultiheadAttention
    return model


def restore_attention(model: torch.nn.Module) -> torch.nn.Module:
    """Undo :func:`swap_attention`: our modules become ``torch.nn.MultiheadAttention`` again, in place."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    for module in model.modules():
        if type(module) is MultiheadAttention:
            module.__class__ = torch.nn.MultiheadAttention
    return model
