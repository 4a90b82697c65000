"""The ``torch.ops.metal_flash`` custom ops: schemas, fake kernels, autograd.

Schemas (flat: tensors, optional tensors, int, float, bool)::

    fwd(Tensor q, Tensor k, Tensor v, Tensor? attn_mask, Tensor? alibi_slopes, Tensor? sinks,
        float scale, int diag_offset, int window_left, int window_right, float softcap,
        bool return_aux, float dropout_p=0., Tensor? rng_state=None, Tensor? cu_seqlens_q=None,
        Tensor? cu_seqlens_k=None, Tensor? seqused_k=None, Tensor? block_table=None,
        int max_seqlen_q=0, int max_seqlen_k=0) -> (Tensor out, Tensor lse, Tensor aux)
    bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor aux, Tensor? dlse,
        Tensor? attn_mask, Tensor? alibi_slopes, Tensor? sinks, float scale, int diag_offset,
        int window_left, int window_right, float softcap, bool compute_dbias, float dropout_p=0.,
        Tensor? rng_state=None, Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_k=None,
        Tensor? seqused_k=None, int max_seqlen_q=0, int max_seqlen_k=0)
        -> (Tensor dq, Tensor dk, Tensor dv, Tensor dbias, Tensor dsinks)
    fwd_probs(<fwd's arguments without return_aux>) -> Tensor probs

Dropout and varlen are optional trailing arguments of the same two ops, not
ops of their own: both are features of the one pair of kernels (function
constants of flash_fwd.metal / flash_bwd.metal), so the autograd formula, the
plan cache, the fallbacks and the reference path stay one path; the existing
calls keep their meaning (the defaults switch both off).

* ``dropout_p`` > 0 drops attention probabilities, each by Philox
  (:mod:`torch_metal_flash.problem.philox`) from ``rng_state`` = (seed, offset), int64
  (2,) on q's device, and rescales the kept ones by 1 / (1 - p); the backward
  regenerates the mask from the same ``rng_state`` (nothing stored: memory stays
  O(L)).  The faces draw ``rng_state`` from the device's default generator per
  call (``philox.new_rng_state``).
* ``cu_seqlens_q``/``cu_seqlens_k`` (int32 (num_seqs + 1,)) make the call varlen:
  ``q`` (1, Hq, total_q, D), ``k``/``v`` (1, Hkv, total_k, D) views of packed
  sequences, each attended on its own with its band aligned to its bottom-right
  corner (``diag_offset`` counts from there), ``alibi_slopes`` (num_seqs, Hq) or
  (Hq,); outputs (1, Hq, total_q, ...).  ``max_seqlen_q``/``max_seqlen_k`` (ints:
  no data-dependent shapes) bound the sequence lengths; ``seqused_k``
  (num_seqs,) uses only the first keys of each sequence; ``block_table``
  (num_seqs, max_blocks) makes ``k``/``v`` paged caches (num_blocks, Hkv,
  page_size, D)-indexed (``bwd`` takes packed K/V only: fwd's autograd formula
  gathers paged K/V into a packed layout and sums dK/dV back into the blocks,
  :mod:`torch_metal_flash.ops.paged`).  The kernels read these index vectors
  on the GPU (no host synchronisation) and clamp what is out of range to the
  tensors: offsets to [0, total], each length to [0, max_seqlen] (an end before
  its start: an empty sequence), ``seqused_k`` to [0, the sequence's keys], block
  numbers to the pool -- never an access outside them (sequences that overlap
  after clamping race on their shared rows: garbage in, garbage out).
  ``TORCH_METAL_FLASH_DEBUG=1`` validates the values on the host instead (clear
  errors, one sync per call).  No ``attn_mask`` with varlen.
* ``fwd_probs`` (debug) returns flash-attn's ``S_dmask`` of a ``fwd`` call with
  the same arguments: (num_seqs, Hq, max_seqlen_q, max_seqlen_k) in q's dtype
  (padded problems: (B, Hq, Lq, Lk)), ``exp(s - m)`` per element with ``m`` the
  row's max, the sign bit set where dropout drops it, 0 where nothing is seen:
  ``probs >= 0`` (``~signbit``) recovers the keep mask, ``|probs| * exp(m - lse)``
  the probabilities.  It is O(L^2): for tests.

``aux`` is the row state the backward needs (:mod:`torch_metal_flash.problem.spec`:
row max and sum, and the unrounded output for fp16/bf16), written only when
``return_aux`` (the faces pass ``True`` when an input requires grad), else an
empty tensor; either side of a training step may fall back to the reference
path, aux is the same contract for both.  Both take the general problem of
:mod:`torch_metal_flash.problem.spec` so that the SDPA and flash-attn faces map onto
them without copies.  ``fwd_kvcache`` (``flash_attn_with_kvcache``) appends to
a KV cache in place and attends to it.

Their bodies run in the C++ core (:mod:`torch_metal_flash.core`): each op is a
:class:`~torch_metal_flash.core.CoreOp` (outputs, planner, reference path) and
a call replays a cached launch template, planning once per problem signature;
configurations the kernels do not cover fall back to the reference path with a
one-time warning naming the reason.  The Python bodies below only serve devices
the core does not (CUDA ...) and hand the first kernel call over to the core.

Schema notes: the kernels take ``alibi_slopes`` as float32 and ``sinks`` as a
contiguous float32 vector (other dtypes take the reference path; the faces
convert), and ``bwd`` takes ``dout`` with a contiguous last dim and a
contiguous ``dlse`` (the autograd formula makes them so).  ``fwd`` and
``fwd_kvcache`` also take K/V (caches) in float16 / bfloat16 under a float32 q
(mixed precision, on the decode kernels).

Quantized K/V (:mod:`torch_metal_flash.problem.quant`, inference only) have their own
ops, each the plain op's arguments with ``k``/``v`` (``k_cache``/``v_cache``)
the packed data, followed by the scales, the biases (None: symmetric int8) and
the format ``kv_bits, kv_group_size, kv_dtype`` (dtype code of
:data:`~torch_metal_flash.problem.quant.DTYPE_CODES`):

* ``fwd_quantized(q, k, v, attn_mask, alibi_slopes, sinks, scale, diag_offset,
  window_left, window_right, softcap, k_scales, k_biases, v_scales, v_biases,
  kv_bits, kv_group_size, kv_dtype) -> (out, lse)``; its backward raises.
* ``fwd_kvcache_quantized(<fwd_kvcache's arguments>, k_cache_scales,
  k_cache_biases, v_cache_scales, v_cache_biases, kv_bits, kv_group_size,
  kv_dtype) -> (out, lse)``, mutating the caches' data, scales and biases (the
  new rows are quantized by the append kernel).


Modules: :mod:`.arguments` (the checks of direct calls), :mod:`.attention` (``fwd``,
``bwd``, ``fwd_probs``, the autograd formula), :mod:`.kvcache`, :mod:`.quantized`,
:mod:`.paged` (the backward's gather/scatter of paged K/V), :mod:`.flex` (``flex_fwd`` and
``flex_bwd``: FlexAttention with the mods compiled into the kernels; schemas there).
"""
from .arguments import OpCall, check_args, check_dropout_varlen
from .attention import (BWD, FWD, FWD_PROBS, bwd, bwd_call, fwd, fwd_call, fwd_probs, fwd_probs_call, needs_grad,
                        unsupported_reason)
from .flex import flex_bwd, flex_fwd
from .kvcache import FWD_KVCACHE, FWD_KVCACHE_QUANTIZED, fwd_kvcache, fwd_kvcache_quantized
from .quantized import FWD_QUANTIZED, fwd_quantized
