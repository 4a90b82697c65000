// The [[function_constant(i)]] indices of every kernel family, in one place.
// The shaders declare their constants with these names; the host reads this
// file and sets them by name (torch_metal_flash/planner/shader_constants.py),
// so no index is written twice.  Names are FC_<FAMILY>_<CONSTANT>; within a
// family (ATTN with FWD, ATTN with BWD, DECODE, APPEND) an index has one
// meaning.  Keep to plain `#define NAME <integer>` lines: that is what the host
// parser reads.
#pragma once

// The attention kernels' shared features (flash_fwd.metal and flash_bwd.metal):
// one set of constants, so the backward recomputes the forward's scores under
// exactly the forward's settings.
#define FC_ATTN_HAS_MASK 0
#define FC_ATTN_MASK_KIND 1
#define FC_ATTN_HAS_ALIBI 2
#define FC_ATTN_HAS_SINKS 3
#define FC_ATTN_HAS_SOFTCAP 4
#define FC_ATTN_HAS_BAND 5
#define FC_ATTN_DIMS_ALIGNED 6
#define FC_ATTN_IS_VARLEN 9
#define FC_ATTN_HAS_SEQUSED_K 10
#define FC_ATTN_HAS_DROPOUT 12

// Forward only (flash_fwd.metal, flash_fwd_variants.metal).
#define FC_FWD_KV_VEC_ALIGNED 7
#define FC_FWD_HAS_AUX 8
#define FC_FWD_IS_PAGED 11
#define FC_FWD_HAS_PROBS 13

// Backward only (flash_bwd.metal, flash_bwd_variants.metal).
#define FC_BWD_HAS_DBIAS 7
#define FC_BWD_HAS_DLSE 8

// Split-K decode (flash_decode.metal, flash_decode_variants.metal).
#define FC_DECODE_PAGED 0
#define FC_DECODE_HAS_LEFTPAD 1
#define FC_DECODE_HAS_BATCH_IDX 2
#define FC_DECODE_HAS_ALIBI 3
#define FC_DECODE_HAS_SOFTCAP 4
#define FC_DECODE_HAS_BAND 5
#define FC_DECODE_USE_SPLITS 6
#define FC_DECODE_HAS_SEQLENS 7
#define FC_DECODE_HAS_MASK 8
#define FC_DECODE_HAS_SINKS 9
#define FC_DECODE_KV_AFFINE 10
#define FC_DECODE_KV_SYMMETRIC 11

// KV-cache append (kvcache_append.metal).
#define FC_APPEND_PAGED 0
#define FC_APPEND_HAS_SEQLENS 1
#define FC_APPEND_HAS_BATCH_IDX 2
#define FC_APPEND_HAS_ROTARY 3
#define FC_APPEND_ROTARY_INTERLEAVED 4
#define FC_APPEND_KV_AFFINE 5
#define FC_APPEND_KV_SYMMETRIC 6
