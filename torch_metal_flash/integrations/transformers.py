"""Hugging Face transformers (5.x) attention implementation ``"metal_sdpa"``.

::

    from torch_metal_flash.integrations import transformers as tmf_hf
    tmf_hf.register()                                   # once per process
    model = AutoModelForCausalLM.from_pretrained(..., attn_implementation="metal_sdpa")
    # or, on an existing model (also for models transformers marks as "no sdpa", see below):
    tmf_hf.set_attention(model)

:func:`register` adds :func:`metal_sdpa_attention_forward` to
``transformers.AttentionInterface`` **and** transformers' ``sdpa_mask`` to
``AttentionMaskInterface`` under the same name: transformers builds no mask
at all for an implementation missing from the mask interface, which would
silently drop the padding of batched inputs.

The name contains no "flash" (transformers 5.x treats such names as hub
kernels to download).  It does contain "sdpa", and transformers refuses any
name containing "sdpa" for models declaring ``_supports_sdpa = False``
(Gemma2 for its softcap, GPT-OSS for its sinks), although this implementation
supports both: :func:`set_attention` sets the implementation on such models
directly.

What the attention function handles: the interface's layouts ((B, H, L, D)
in, (B, L, H, D) contiguous out, no attention weights), GQA/MQA without
repeating K/V, ``scaling``, ``dropout`` (training; in the kernels), bool and
additive float masks, ``position_bias``, ``softcap``, ``s_aux`` (attention
sinks), ``sliding_window``, ``is_causal``, and ``attention_mask=None`` meaning
top-left causal when the module is causal and Lq > 1 (exactly as transformers'
``sdpa``).

Packed sequences (padding-free training: TRL / ``DataCollatorWithFlattening``)
run on the varlen kernels, one call for all sequences, each attended on its
own (causal and sliding window per sequence), as transformers' flash-attention
integrations do:

* with the ``cu_seq_lens_q``/``cu_seq_lens_k``/``max_length_q``/``max_length_k``
  kwargs (``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``): no
  host synchronisation, traceable by ``torch.compile``;
* with ``position_ids`` alone (restarting at each sequence, batch of 1): the
  boundaries are read from them (one host synchronisation per mask, as
  transformers' own flash-attention path), and only when the mask transformers
  built is exactly causal (or sliding-window) within those sequences -- checked
  once per mask -- so a mask with padding or any other pattern keeps the mask
  path.  Eager mode only (a compiled model passes the kwargs above).

:class:`QuantizedKVCache` (``past_key_values=QuantizedKVCache(bits=4)``) keeps
K/V quantized; its layers hand QuantizedTensor views to this attention
function, which passes them to the kernels as they are (see
``torch_metal_flash/integrations/quantized_cache.py``).
"""
from __future__ import annotations

import logging
from typing import Optional

import torch
from torch.utils.weak import WeakIdKeyDictionary

import torch_metal_flash.faces.functional as functional
import torch_metal_flash.problem.checks as checks
from ..problem.quant import QuantizedTensor

__all__ = ["NAME", "register", "set_attention", "metal_sdpa_attention_forward", "QuantizedKVCache"]

NAME = "metal_sdpa"
log = logging.getLogger("torch_metal_flash.transformers")
_warned_output_attentions = False


def _as_float(name: str, value) -> float:
    if isinstance(value, torch.Tensor):
        value = value.item()
    if not isinstance(value, (int, float)):
        raise TypeError(f"{name}: expected a number, got {type(value).__name__}")
    return float(value)


def metal_sdpa_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                                 value: torch.Tensor, attention_mask: Optional[torch.Tensor], dropout: float = 0.0,
                                 scaling: Optional[float] = None, is_causal: Optional[bool] = None,
                                 sliding_window: Optional[int] = None, softcap: Optional[float] = None,
                                 s_aux: Optional[torch.Tensor] = None, position_bias: Optional[torch.Tensor] = None,
                                 **kwargs) -> tuple[torch.Tensor, None]:
    """transformers ``AttentionInterface`` function on torch_metal_flash.

    ``query`` (B, Hq, Lq, D), ``key``/``value`` (B, Hkv, Lk, D) with Hq a
    multiple of Hkv (tensors, or QuantizedTensors from :class:`QuantizedKVCache`);
    ``attention_mask`` None, bool (True = attend) or additive
    float, broadcastable to (B, Hq, Lq, Lk) (a longer last dim is cut to Lk).
    Returns ``(out (B, Lq, Hq, Dv) contiguous, None)``.
    """
    global _warned_output_attentions
    if kwargs.get("output_attentions", False) and not _warned_output_attentions:
        _warned_output_attentions = True
        log.warning("metal_sdpa does not return attention weights (output_attentions=True); use 'eager' for them")
    for name, t in (("query", query), ("key", key), ("value", value)):
        tensor_like = isinstance(t, (torch.Tensor, QuantizedTensor))
        if not tensor_like or t.dim() != 4:
            raise ValueError(f"{name}: expected a 4-D tensor (batch, heads, seq_len, head_dim), got "
                             f"{tuple(t.shape) if tensor_like else type(t).__name__}")
    B, Hq, Lq, D = query.shape
    Hkv, Lk = key.shape[1], key.shape[2]
    if isinstance(key, QuantizedTensor):
        checks.inference_only("quantized key/value (QuantizedKVCache)", (("query", query),))
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(f"key: {Hkv} key/value heads do not divide the {Hq} query heads")

    is_causal_module = getattr(module, "is_causal", True) if is_causal is None else bool(is_causal)
    causal = Lq > 1 and attention_mask is None and is_causal_module

    mask = attention_mask
    if mask is not None:
        if not isinstance(mask, torch.Tensor):
            raise TypeError(f"attention_mask: expected a tensor or None, got {type(mask).__name__} (register() "
                            f"installs the sdpa mask function for {NAME!r})")
        if mask.dim() == 2:
            mask = mask[None, None]
        elif mask.dim() == 3:
            mask = mask[:, None]
        if mask.shape[-1] > Lk:
            mask = mask[..., :Lk]
        if mask.dtype != torch.bool and not mask.is_floating_point():
            raise TypeError(f"attention_mask: expected dtype bool or a float dtype, got {mask.dtype}")
    if position_bias is not None:
        bias = position_bias[..., :Lk] if position_bias.shape[-1] > Lk else position_bias
        if causal:
            i = torch.arange(Lq, device=query.device)[:, None]
            j = torch.arange(Lk, device=query.device)[None, :]
            bias = bias.masked_fill(j > i, float("-inf"))
            causal = False
        if mask is None:
            mask = bias
        elif mask.dtype == torch.bool:
            mask = bias.masked_fill(~mask, float("-inf"))
        else:
            mask = bias + mask
    if mask is not None:
        try:
            mask = mask.expand(B, Hq, Lq, Lk)
        except RuntimeError:
            raise ValueError(f"attention_mask: shape {tuple(mask.shape)} does not broadcast to "
                             f"{(B, Hq, Lq, Lk)} (batch, heads, q_len, kv_len)") from None

    scale = D ** -0.5 if scaling is None else _as_float("scaling", scaling)
    cap = 0.0 if softcap is None else _as_float("softcap", softcap)
    if cap < 0:
        raise ValueError(f"softcap: expected a value >= 0, got {cap}")
    window_left, window_right = -1, -1
    if causal:
        window_right = 0
        if sliding_window is not None and mask is None:
            # no mask: transformers' mask function found the window inactive; keep it exact anyway,
            # aligned like the causal mask (top-left)
            window_left = int(sliding_window) - 1
    sinks = None
    if s_aux is not None:
        if not isinstance(s_aux, torch.Tensor) or s_aux.numel() != Hq:
            raise ValueError(f"s_aux: expected one sink logit per query head ({Hq},), got "
                             f"{tuple(s_aux.shape) if isinstance(s_aux, torch.Tensor) else type(s_aux).__name__}")
        sinks = s_aux.reshape(Hq)
    dropout = _as_float("dropout", dropout)
    varlen = None
    if position_bias is None and not isinstance(key, QuantizedTensor):
        varlen = _packed_sequences(query, key, attention_mask, kwargs, is_causal_module, sliding_window)
    if varlen is not None:
        # Each packed sequence on its own: causal (bottom-right = top-left, Lq_b = Lk_b) and the window per sequence.
        window_left = int(sliding_window) - 1 if (is_causal_module and sliding_window is not None) else -1
        out, _ = functional._attention(query, key, value, None, None, sinks, scale, 0, window_left,
                                       0 if is_causal_module else -1, cap, dropout, varlen=varlen)
    else:
        out, _ = functional._attention(query, key, value, mask, None, sinks, scale, 0, window_left, window_right,
                                       cap, dropout)
    return out.transpose(1, 2).contiguous(), None


def _packed_sequences(query, key, attention_mask, kwargs: dict, causal: bool,
                      sliding_window: Optional[int]) -> Optional[functional.Varlen]:
    """The varlen arguments of a packed batch (see the module doc), or None."""
    B, _, Lq, _ = query.shape
    names = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
    cu_q, cu_k, max_q, max_k = (kwargs.get(n) for n in names)
    if B == 1 and all(x is not None for x in (cu_q, cu_k, max_q, max_k)):
        # A tensor max length is read on the host (transformers' flash-attention path does the same).
        max_q, max_k = (int(x) for x in (max_q, max_k))
        return functional.Varlen(cu_q.to(torch.int32), cu_k.to(torch.int32), None, None, max_q, max_k)
    position_ids = kwargs.get("position_ids")
    # transformers builds a mask for packed inputs (and none for unpacked, unpadded ones: mask None
    # means "not packed" here, with no host synchronisation).
    if position_ids is None or attention_mask is None or B != 1 or Lq < 2 or key.shape[2] != Lq \
            or torch.compiler.is_compiling():
        return None
    window = int(sliding_window) if (causal and sliding_window is not None) else None
    return _packed_from_positions(attention_mask, position_ids, causal, window)


# The verdict per mask tensor (transformers builds one mask per forward and hands it to every layer).
_VERDICTS = WeakIdKeyDictionary()


def _packed_from_positions(mask, position_ids, causal: bool, window: Optional[int]):
    """Varlen arguments from position_ids restarting at each sequence, when ``mask`` (a bool
    (1, 1, L, L) mask) is exactly causal / sliding-window within those sequences."""
    if mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[:2] != (1, 1):
        return None
    key = (id(position_ids), causal, window)
    known = _VERDICTS.get(mask, {})
    if key in known:
        return known[key]
    pos = position_ids.reshape(-1)
    L = pos.shape[0]
    starts = torch.ones(L, dtype=torch.bool, device=pos.device)
    starts[1:] = pos[1:] - pos[:-1] != 1  # a sequence starts where positions do not step by 1
    first = starts.nonzero().flatten()  # the host synchronisation
    verdict = None
    if first.shape[0] > 1:
        cu = torch.cat([first, first.new_tensor([L])]).to(torch.int32)
        longest = int((cu[1:] - cu[:-1]).max())
        if _is_packed_mask(mask[0, 0], starts.cumsum(0), causal, window):
            verdict = functional.Varlen(cu, cu, None, None, longest, longest)
    _VERDICTS.setdefault(mask, {})[key] = verdict
    return verdict


def _is_packed_mask(mask: torch.Tensor, seq: torch.Tensor, causal: bool, window: Optional[int]) -> bool:
    """Whether a bool (L, L) mask is "same sequence", and causal / within the window."""
    i = torch.arange(seq.shape[0], device=seq.device)[:, None]
    j = i.T
    want = seq[:, None] == seq[None, :]
    if causal:
        want &= j <= i
    if window is not None:
        want &= j > i - window
    return bool(torch.equal(mask.to(want.device), want))


def register(name: str = NAME) -> str:
    """Register the attention function and the mask function under ``name``; returns ``name``.

    Idempotent.  Then use ``attn_implementation=name`` (``from_pretrained``,
    ``from_config``, ``model.set_attn_implementation``) or :func:`set_attention`.
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"name: expected a non-empty str, got {name!r}")
    if "flash" in name.lower():
        raise ValueError(f"name: {name!r} contains 'flash'; transformers would treat it as a hub kernel to download")
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    except ImportError as exc:
        raise ImportError("torch_metal_flash.integrations.transformers needs transformers>=5 "
                          "(pip install 'transformers>=5,<6')") from exc
    AttentionInterface.register(name, metal_sdpa_attention_forward)
    AttentionMaskInterface.register(name, sdpa_mask)
    return name


def set_attention(model, name: str = NAME):
    """Register ``name`` and switch ``model`` (a ``PreTrainedModel``) to it, in place; returns ``model``.

    Uses ``model.set_attn_implementation``; for models that declare no SDPA
    support (transformers then rejects every name containing "sdpa", e.g.
    Gemma2's softcap or GPT-OSS's sinks, which this implementation handles), it
    sets the implementation on the model's configs directly.
    """
    register(name)
    try:
        model.set_attn_implementation(name)
    except ValueError as exc:
        if "sdpa" not in name or "scaled_dot_product_attention" not in str(exc):
            raise
        from transformers import PreTrainedModel
        for module in model.modules():
            if isinstance(module, PreTrainedModel):
                module.config._attn_implementation = name
    return model


def __getattr__(name: str):
    # The cache class subclasses transformers' Cache: imported on first use only.
    if name in ("QuantizedKVCache", "QuantizedKVLayer"):
        import torch_metal_flash.integrations.quantized_cache as quantized_cache
        return getattr(quantized_cache, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
