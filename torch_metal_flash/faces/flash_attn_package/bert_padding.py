"""``flash_attn.bert_padding`` as provided by torch_metal_flash's shim: moving between a padded
batch ``(batch, seqlen, ...)`` and the packed rows ``(total, ...)`` that
``flash_attn_varlen_func`` takes.  Same names, signatures and return values as flash-attn 2.7+
(``unpad_input`` returns five values, the last the rows of ``attention_mask`` per sequence).

``unpad_input`` returns ``max_seqlen_in_batch`` as a Python int, as flash-attn does: that reads
one number back from the device (on MPS a GPU synchronisation), once per batch, not per layer.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["index_first_axis", "index_put_first_axis", "unpad_input", "pad_input",
           "unpad_input_for_concatenated_sequences"]


def _check_indices(indices: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    if not isinstance(indices, torch.Tensor) or indices.ndim != 1 or indices.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"indices: expected a 1-d int32/int64 tensor, got "
                        f"{getattr(indices, 'dtype', type(indices).__name__)} of shape "
                        f"{tuple(getattr(indices, 'shape', ()))}")
    if tensor.ndim < 2:
        raise ValueError(f"{name}: expected at least 2 dims (rows, ...), got shape {tuple(tensor.shape)}")


class _IndexFirstAxis(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, indices):
        ctx.save_for_backward(indices)
        ctx.rows = input.shape[0]
        return input[indices.long()]

    @staticmethod
    def backward(ctx, grad):
        (indices,) = ctx.saved_tensors
        out = grad.new_zeros((ctx.rows, *grad.shape[1:]))
        return out.index_copy_(0, indices.long(), grad), None


class _IndexPutFirstAxis(torch.autograd.Function):
    @staticmethod
    def forward(ctx, values, indices, first_axis_dim):
        ctx.save_for_backward(indices)
        out = values.new_zeros((first_axis_dim, *values.shape[1:]))
        return out.index_copy_(0, indices.long(), values)

    @staticmethod
    def backward(ctx, grad):
        (indices,) = ctx.saved_tensors
        return grad[indices.long()], None, None


def index_first_axis(input: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """``input[indices]`` along dim 0, with a gradient that scatters back (rows not selected get 0)."""
    _check_indices(indices, input, "input")
    return _IndexFirstAxis.apply(input, indices)


def index_put_first_axis(values: torch.Tensor, indices: torch.Tensor, first_axis_dim: int) -> torch.Tensor:
    """A zero tensor of ``first_axis_dim`` rows with ``values`` written at ``indices``."""
    _check_indices(indices, values, "values")
    if indices.shape[0] != values.shape[0]:
        raise ValueError(f"indices: expected {values.shape[0]} entries (one per row of values), "
                         f"got {indices.shape[0]}")
    return _IndexPutFirstAxis.apply(values, indices, int(first_axis_dim))


def _check_padded(hidden_states: torch.Tensor, mask: torch.Tensor, name: str) -> None:
    if mask.ndim != 2 or hidden_states.ndim < 2 or tuple(hidden_states.shape[:2]) != tuple(mask.shape):
        raise ValueError(f"{name}: expected shape (batch, seqlen) = {tuple(hidden_states.shape[:2])} "
                         f"(the first two dims of hidden_states), got {tuple(mask.shape)}")


def unpad_input(hidden_states: torch.Tensor, attention_mask: torch.Tensor, unused_mask=None):
    """Pack the rows of ``hidden_states`` (batch, seqlen, ...) that ``attention_mask`` (batch,
    seqlen; bool or int, nonzero = a token) keeps, plus those of ``unused_mask`` (allocated but
    unused rows, kept so that they can be written back).

    Returns ``(hidden_states (total, ...), indices (total,) into the flattened (batch * seqlen)
    rows, cu_seqlens int32 (batch + 1,), max_seqlen_in_batch int, seqused int32 (batch,))``;
    ``seqused`` counts the rows of ``attention_mask`` alone (``seqused_k`` of the varlen call).
    """
    _check_padded(hidden_states, attention_mask, "attention_mask")
    tokens = attention_mask != 0
    keep = tokens
    if unused_mask is not None:
        _check_padded(hidden_states, unused_mask, "unused_mask")
        keep = keep | (unused_mask != 0)
    used = tokens.sum(dim=-1, dtype=torch.int32)
    return (*_pack(hidden_states, keep, keep.sum(dim=-1, dtype=torch.int32)), used)


def unpad_input_for_concatenated_sequences(hidden_states: torch.Tensor, attention_mask_in_length: torch.Tensor):
    """Packing for rows that each hold several concatenated sequences: ``attention_mask_in_length``
    (batch, seqlen) lists each row's sequence lengths first, zeros after (e.g. ``[[2, 3, 0, 0,
    0, 0], [3, 2, 1, 0, 0, 0]]`` for ``[[1, 1, 2, 2, 2, 0], [1, 1, 1, 2, 2, 3]]``).

    Returns ``(hidden_states (total, ...), indices, cu_seqlens int32, max_seqlen_in_batch int)``
    with one entry of ``cu_seqlens`` per sequence (not per row).
    """
    _check_padded(hidden_states, attention_mask_in_length, "attention_mask_in_length")
    lengths = attention_mask_in_length.to(torch.int64)
    batch, seqlen = lengths.shape
    # row r keeps its first sum(lengths[r]) positions
    keep = torch.arange(seqlen, device=lengths.device).expand(batch, seqlen) < lengths.sum(-1, keepdim=True)
    seqlens = lengths.flatten()
    return _pack(hidden_states, keep, seqlens[seqlens > 0].to(torch.int32))


def _pack(hidden_states: torch.Tensor, keep: torch.Tensor, seqlens: torch.Tensor):
    """The rows of ``hidden_states`` (batch, seqlen, ...) where ``keep`` (batch, seqlen) is set,
    packed in order, for sequences of ``seqlens`` (int32) rows: (rows, indices, cu_seqlens, max_seqlen)."""
    indices = torch.nonzero(keep.flatten()).flatten()
    max_seqlen = int(seqlens.max()) if seqlens.numel() else 0
    cu_seqlens = F.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    rows = index_first_axis(hidden_states.reshape(-1, *hidden_states.shape[2:]), indices)
    return rows, indices, cu_seqlens, max_seqlen


def pad_input(hidden_states: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    """The inverse of :func:`unpad_input`: packed rows (total, ...) back to (batch, seqlen, ...),
    zeros where nothing was packed."""
    out = index_put_first_axis(hidden_states, indices, int(batch) * int(seqlen))
    return out.reshape(int(batch), int(seqlen), *hidden_states.shape[1:])
