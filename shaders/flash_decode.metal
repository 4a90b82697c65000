// Split-K flash-decoding: a few query rows against a long (optionally paged) KV cache.
//
// flash_decode_<dtype>[_kv<kv dtype>]_d<BD>[_v<BDV>]_k<BK>[_s]  (the partial / single-pass kernel)
//   Grid: (num_splits, kv_heads * row_blocks, batch) threadgroups.  A threadgroup
//   owns ONE KV head of one batch row and the query rows of its whole GQA group:
//   rows r = g * seqlen_q + i (g = head within the group, i = query row), up to
//   rows_per_tg of them, 8 per simdgroup (ceil(rows_per_tg / 8) simdgroups compute;
//   the planner may add simdgroups that only help load the tiles: num_threads).
//   It streams its share of the key range (whole tiles of BK cache positions,
//   split s takes the s-th run of tiles) through threadgroup memory: each K/V
//   row is read from device memory ONCE and applied to every query head of the
//   group and every query row of the step (simdgroup-matrix 8x8 multiplies,
//   online softmax in natural units as in flash_fwd.metal: the scores, the
//   running max and lse keep the rounding of the plain math, exp2 takes
//   (s - m) * log2(e); log2-domain scores would add a rounding of every
//   q element and of lse, which shows at large scores).
//   num_splits == 1 (use_splits false): writes out / lse directly.
//   Otherwise: writes a partial per (row, split): unnormalised O (float, only
//   when the split saw something, flash::saw_keys) and (m, l).  A sink is one extra
//   logit with no value: split 0 starts its rows at m = sink, l = 1.
//   Query rows of a threadgroup whose band misses a tile skip its multiplies.
//
// Types: TQ is q's and out's (the name's dtype), TK the K/V tiles' (the
// caches' dtype; "_kv<dtype>" when it differs from q's: float32 q over a
// float16/bfloat16 cache).  The caches are stored as TK (kv_affine and
// kv_symmetric false) or quantized (kv_quant.h): buffers 1 and 2 then hold
// the packed uint words, their strides count rows, and each word is
// dequantized in registers into the TK tile as it is loaded (its scale and
// bias read once per tile row), so a packed row is read once per GQA group.
//
// flash_decode_combine_<dtype>
//   Grid: ceil(batch * heads * seqlen_q / 8) threadgroups of 8 simdgroups, one
//   simdgroup per (b, h, i) row.  Merges the partials of a row with log-sum-exp weights; reads O only of splits that saw keys.
//
// Per batch row b the keys are the cache positions [start_b, end_b) of
// kvcache_index.h: end_b = cache_seqlens[b] (or seqlen_fixed) + seqlen_new,
// start_b = leftpad[b] (0 without leftpad), both clamped; out-of-range cache rows
// and blocks are ignored.  Positions for the band and ALiBi count from start_b;
// the band is aligned bottom-right: diag_b = (end_b - start_b) - seqlen_q + diag_adjust.
// Contiguous caches: (batch_cache, L_max, Hkv, D) via strides, cache row
// batch_idx[b] (or b).  Paged caches: (num_blocks, page_size, Hkv, D), position
// pos of row b lives in block block_table[b, pos / page_size], row pos % page_size
// (read through the table: no gather copy).
//
// Masks (the general op's): bool or float (kind in the params) read through
// strides at (b, h, i, j) with j = position - start; float masks are added to
// the scores after softcap and ALiBi.
//
// Buffers: 0 q, 1 k_cache, 2 v_cache, 3 out, 4 lse (float, contiguous (B, Hq, Lq)),
// 5 DecodeParams, 6 cache_seqlens (int, (B,)), 7 leftpad (int), 8 batch_idx (int),
// 9 block_table (int), 10 alibi slopes (float), 11 partial O (float), 12 partial (m, l) (float),
// 13 mask (bytes), 14 sinks (float, (Hq,)), 15 k scales, 16 k biases, 17 v scales,
// 18 v biases (TK, affine), 19 k scales, 20 v scales (half, symmetric).
#include "flash_common.h"
#include "flash_decode_params.h"
#include "function_constants.h"
#include "kv_quant.h"
#include "kvcache_index.h"

constant bool paged [[function_constant(FC_DECODE_PAGED)]];
constant bool has_leftpad [[function_constant(FC_DECODE_HAS_LEFTPAD)]];
constant bool has_batch_idx [[function_constant(FC_DECODE_HAS_BATCH_IDX)]];
constant bool has_alibi [[function_constant(FC_DECODE_HAS_ALIBI)]];
constant bool has_softcap [[function_constant(FC_DECODE_HAS_SOFTCAP)]];
constant bool has_band [[function_constant(FC_DECODE_HAS_BAND)]];
constant bool use_splits [[function_constant(FC_DECODE_USE_SPLITS)]];
constant bool has_seqlens [[function_constant(FC_DECODE_HAS_SEQLENS)]];
constant bool has_mask [[function_constant(FC_DECODE_HAS_MASK)]];
constant bool has_sinks [[function_constant(FC_DECODE_HAS_SINKS)]];
constant bool kv_affine [[function_constant(FC_DECODE_KV_AFFINE)]];
constant bool kv_symmetric [[function_constant(FC_DECODE_KV_SYMMETRIC)]];

#define FLASH_DECODE_ARGS(TQ, TK)                                                      \
  const device TQ* q [[buffer(0)]], const device TK* kc [[buffer(1)]],                \
      const device TK* vc [[buffer(2)]], device TQ* o [[buffer(3)]],                  \
      device float* lse [[buffer(4)]], constant DecodeParams& p [[buffer(5)]],         \
      const device int* cache_seqlens [[buffer(6), function_constant(has_seqlens)]],  \
      const device int* leftpad [[buffer(7), function_constant(has_leftpad)]],        \
      const device int* batch_idx [[buffer(8), function_constant(has_batch_idx)]],    \
      const device int* block_table [[buffer(9), function_constant(paged)]],          \
      const device float* alibi [[buffer(10), function_constant(has_alibi)]],         \
      device float* part_o [[buffer(11), function_constant(use_splits)]],             \
      device float* part_ml [[buffer(12), function_constant(use_splits)]],            \
      const device uchar* mask [[buffer(13), function_constant(has_mask)]],           \
      const device float* sinks [[buffer(14), function_constant(has_sinks)]],        \
      const device TK* k_scales [[buffer(15), function_constant(kv_affine)]],         \
      const device TK* k_biases [[buffer(16), function_constant(kv_affine)]],         \
      const device TK* v_scales [[buffer(17), function_constant(kv_affine)]],         \
      const device TK* v_biases [[buffer(18), function_constant(kv_affine)]],         \
      const device half* k_scales_sym [[buffer(19), function_constant(kv_symmetric)]], \
      const device half* v_scales_sym [[buffer(20), function_constant(kv_symmetric)]], \
      uint3 tgid [[threadgroup_position_in_grid]],                                    \
      ushort tid [[thread_index_in_threadgroup]],                                     \
      ushort sg [[simdgroup_index_in_threadgroup]],                                   \
      ushort lane [[thread_index_in_simdgroup]]

// Params and per-row scalars are read from device/constant memory by a few
// threads and shared through threadgroup memory (one read per threadgroup,
// not one per thread).
constant constexpr int kParamWords = sizeof(DecodeParams) / 8;
static_assert(sizeof(DecodeParams) % 8 == 0, "DecodeParams is a whole number of 8-byte words");


inline void copy_params(threadgroup long* dst, constant DecodeParams& p, ushort tid) {
  const constant long* src = reinterpret_cast<const constant long*>(&p);
  for (int w = int(tid); w < kParamWords; w += 32) dst[w] = src[w];
}

// One K or V tile: BK rows of `cols` values (a plain cache row read as TK, or a
// quantized row dequantized as it is loaded), zero outside the keys and, for a
// plain cache, past `cols` up to the bucket W.  Every thread calls it.
template <typename TK, int W>
inline void load_rows(threadgroup TK* tile, int ld, const threadgroup long* row, int rows, int cols,
                      const device TK* cache, bool quantized, bool symmetric, const threadgroup DecodeParams& P,
                      const device TK* scales, const device TK* biases, const device half* sym_scales,
                      int nthreads, ushort tid, ushort sg, ushort lane) {
  if (quantized) {
    const kvq::Format fmt = kvq::Format::make(symmetric, P.kv_bits, P.kv_group_size, cols);
    const device uint* words = reinterpret_cast<const device uint*>(cache);
    // Each format's scale buffers are referenced only under its own constant.
    if (symmetric) {
      kvq::load_quantized_rows<TK>(tile, ld, row, rows, fmt, words, nullptr, nullptr, sym_scales, nthreads, sg, lane);
    } else {
      kvq::load_quantized_rows<TK>(tile, ld, row, rows, fmt, words, scales, biases, nullptr, nthreads, sg, lane);
    }
    return;
  }
  for (int idx = int(tid); idx < rows * W; idx += nthreads) {
    const int r = idx / W;
    const int c = idx - r * W;
    const long at = row[r];
    tile[r * ld + c] = at >= 0 && c < cols ? cache[at + c] : TK(0);
  }
}

// At most 16 simdgroups (planner/decode.py: MAX_ROWS_PER_TG); the attribute makes the
// compiler keep the pipeline's maxTotalThreadsPerThreadgroup at 512.
// BD: the bucket of q's and K's head dim; BDV: of V's and out's (BD for most
// models; 512 under BD 576 for multi-head latent attention).  SHARED_KV: the K
// and V tiles take turns in one buffer (V loaded after the scores: two more
// barriers per tile), where two would not fit in threadgroup memory.
template <typename TQ, typename TK, int BD, int BDV, int BK, bool SHARED_KV>
[[kernel, max_total_threads_per_threadgroup(512)]] void flash_decode(FLASH_DECODE_ARGS(TQ, TK)) {
  constexpr int LD = BD + flash::TilePad<TK>::value;
  constexpr int LDV = BDV + flash::TilePad<TK>::value;
  constexpr int NF = BD / 8;    // fragments along q's / K's head dim
  constexpr int NFV = BDV / 8;  // fragments along V's / out's head dim
  constexpr int NK = BK / 8;    // fragments along the keys
  static_assert(BD % 8 == 0 && BDV % 8 == 0 && BK % 8 == 0, "tile sizes");

  constexpr int LD_MAX = LD > LDV ? LD : LDV;
  threadgroup TK kv_tiles[SHARED_KV ? BK * LD_MAX : BK * (LD + LDV)];
  threadgroup TK* k_tile = kv_tiles;
  threadgroup TK* v_tile = SHARED_KV ? kv_tiles : kv_tiles + BK * LD;
  threadgroup long k_row[BK];  // element (quantized: row) offset of each tile row in kc (-1: not a key)
  threadgroup long v_row[BK];
  threadgroup long params_words[kParamWords];
  threadgroup int row_meta[4];  // end, start, cache row of batch row b

  const int b = int(tgid.z);
  copy_params(params_words, p, tid);
  if (tid == 31) {
    const int crow = has_batch_idx ? kv_cache_row(batch_idx[b], p.cache_rows) : b;
    const KvRow r = kv_row(has_seqlens ? cache_seqlens[b] : p.seqlen_fixed, has_leftpad ? leftpad[b] : 0,
                           crow < 0, p.seqlen_new, p.capacity);
    row_meta[0] = r.end;
    row_meta[1] = r.start;
    row_meta[2] = crow;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  const threadgroup DecodeParams& P = *reinterpret_cast<const threadgroup DecodeParams*>(params_words);

  // No infinity enters the arithmetic (fast math assumes none): masked scores
  // are -FLT_MAX for the row max plus a bit in `hidden` that zeroes their
  // probability, so a visible -FLT_MAX score (finfo.min mask) still counts.
  const float kNeg = -FLT_MAX;
  const int nthreads = P.num_threads;
  const int split = int(tgid.x);
  const int kvh = int(tgid.y) % P.kv_heads;
  const int rblock = int(tgid.y) / P.kv_heads;
  const int Lq = P.seqlen_q;
  const int D = P.head_dim;
  const int Dv = P.head_dim_v;
  const int row0 = rblock * P.rows_per_tg;
  const int rows_here = min(P.rows_per_tg, P.gqa * Lq - row0);

  const flash::FragCoord fc = flash::frag_coord(lane);
  const int my_r = int(sg) * 8 + fc.row;  // row within the threadgroup
  const bool row_ok = my_r < rows_here;
  const int gr = row0 + my_r;  // row within the GQA group
  const int g = gr / Lq;
  const int i = gr - g * Lq;   // query row
  const int h = kvh * P.gqa + g;  // query head
  const bool sg_active = int(sg) * 8 < rows_here;

  // Geometry of this batch row.
  const int end = row_meta[0];
  const int start = row_meta[1];
  const int lk = end - start;
  const int diag = lk - Lq + P.diag_adjust;
  const flash::Band band{diag, P.window_left, P.window_right};
  // Keys the rows of this threadgroup (and of this simdgroup) can see.
  int i0, i1, lo = 0, hi = lk;
  flash::packed_row_span(row0, row0 + rows_here - 1, Lq, i0, i1);
  if (has_band) band.key_range(i0, i1, lk, lo, hi);
  const int key_lo = start + lo;  // absolute cache positions [key_lo, key_hi)
  const int key_hi = start + hi;
  int sg_key_lo = key_lo, sg_key_hi = key_hi;
  if (has_band && sg_active) {
    flash::packed_row_span(row0 + int(sg) * 8, min(row0 + int(sg) * 8 + 7, row0 + rows_here - 1), Lq, i0, i1);
    band.key_range(i0, i1, lk, lo, hi);
    sg_key_lo = start + lo;
    sg_key_hi = start + hi;
  }
  int t_begin = 0;
  int t_end = 0;
  if (key_hi > key_lo) {
    const int t0 = key_lo / BK;
    const int t1 = (key_hi + BK - 1) / BK;
    const int per = (t1 - t0 + P.num_splits - 1) / P.num_splits;
    t_begin = min(t1, t0 + split * per);
    t_end = min(t1, t_begin + per);
  }

  long k_base = long(kvh) * P.k_stride_h;
  long v_base = long(kvh) * P.v_stride_h;
  if (!paged) {
    const long crow = long(max(row_meta[2], 0));  // an ignored row has no keys
    k_base += crow * P.k_stride_b;
    v_base += crow * P.v_stride_b;
  }

  // Q fragments of this simdgroup's 8 rows, pre-scaled (zero past the rows / head dim).
  const long q_off = long(b) * P.q_stride_b + long(h) * P.q_stride_h + long(i) * P.q_stride_l;
  simdgroup_float8x8 Qf[NF];
  simdgroup_float8x8 Of[NFV];
  for (int dd = 0; dd < NF; ++dd) {
    flash::load_frag_rows(Qf[dd], q + q_off + dd * 8, row_ok, D - dd * 8, fc, P.qk_scale);
  }
  for (int dd = 0; dd < NFV; ++dd) {
    Of[dd] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  }
  float m_i = kNeg;
  float l_i = 0.0f;
  if (has_sinks && split == 0 && row_ok) {  // the sink counts once per row: in split 0
    m_i = sinks[h];
    l_i = 1.0f;
  }
  float slope = 0.0f;
  if (has_alibi && row_ok) slope = alibi[long(b) * P.a_stride_b + long(h) * P.a_stride_h];
  long mask_row = 0;
  if (has_mask && row_ok) mask_row = long(b) * P.m_stride_b + long(h) * P.m_stride_h + long(i) * P.m_stride_q;

  const bool quantized = kv_affine || kv_symmetric;
  if (quantized && SHARED_KV) {  // the dequantizing loads fill columns < D (K) and < Dv (V) only:
    // zero the buffer once; past those columns it then holds zeros or finite values of the other
    // tile, which multiply zeros of q or land in out's columns past Dv (never stored)
    for (int idx = int(tid); idx < BK * LD_MAX; idx += nthreads) kv_tiles[idx] = TK(0.0f);
  } else if (quantized) {  // separate buffers: each one's columns past its head dim, once
    for (int idx = int(tid); idx < BK * BD; idx += nthreads) {
      const int r = idx / BD;
      const int c = idx - r * BD;
      if (c >= D) k_tile[r * LD + c] = TK(0.0f);
    }
    for (int idx = int(tid); idx < BK * BDV; idx += nthreads) {
      const int r = idx / BDV;
      const int c = idx - r * BDV;
      if (c >= Dv) v_tile[r * LDV + c] = TK(0.0f);
    }
  }

  for (int t = t_begin; t < t_end; ++t) {
    const int kb = t * BK;
    // Where each tile row lives (one block-table read per row and tile).
    for (int r = int(tid); r < BK; r += nthreads) {
      const int pos = kb + r;
      long ko = -1;
      long vo = -1;
      if (pos >= key_lo && pos < key_hi) {
        if (paged) {
          const int page = pos / P.page_size;
          const long blk = kv_block(block_table + long(b) * P.bt_stride_b, page, P.cache_rows);
          const long off = long(pos - page * P.page_size);
          if (blk >= 0) {  // an ignored block: not keys (masked below)
            ko = k_base + blk * P.k_stride_b + off * P.k_stride_l;
            vo = v_base + blk * P.v_stride_b + off * P.v_stride_l;
          }
        } else {
          ko = k_base + long(pos) * P.k_stride_l;
          vo = v_base + long(pos) * P.v_stride_l;
        }
      }
      k_row[r] = ko;
      v_row[r] = vo;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    // K and V tiles: every element (packed word) read once, zero outside the keys / head dims.
    load_rows<TK, BD>(k_tile, LD, k_row, BK, D, kc, quantized, kv_symmetric, P, k_scales, k_biases, k_scales_sym,
                      nthreads, tid, sg, lane);
    if (!SHARED_KV) {
      load_rows<TK, BDV>(v_tile, LDV, v_row, BK, Dv, vc, quantized, kv_symmetric, P, v_scales, v_biases,
                         v_scales_sym, nthreads, tid, sg, lane);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);

    // Simdgroup-uniform: rows whose band misses this tile do no multiplies.
    const bool sg_sees = sg_active && kb < sg_key_hi && kb + BK > sg_key_lo;
    simdgroup_float8x8 S[NK];
    if (sg_sees) {
      uint hidden = 0;  // bit 2 * kk + e: element e of S[kk] is invisible
      flash::qk_block<NF, NK, LD>(S, Qf, k_tile, fc);
      const bool need_bounds = paged || kb < key_lo || kb + BK > key_hi;
      if (has_softcap || has_alibi || has_band || has_mask || need_bounds) {
        const flash::ScoreFeatures feat{has_softcap, has_alibi, has_mask, P.mask_kind};
        for (int kk = 0; kk < NK; ++kk) {
          for (int e = 0; e < 2; ++e) {
            const int pos = kb + kk * 8 + fc.col + e;
            const int j = pos - start;
            bool vis = pos >= key_lo && pos < key_hi;
            if (paged) vis = vis && k_row[kk * 8 + fc.col + e] >= 0;
            if (has_band) vis = vis && band.visible(i, j);
            const float s = flash::transform_score(S[kk].thread_elements()[e], i, j, diag, slope, P.softcap, feat,
                                                   mask, mask_row + long(j) * P.m_stride_k, row_ok, vis).s;
            S[kk].thread_elements()[e] = vis ? s : kNeg;
            hidden |= vis ? 0u : 1u << (2 * kk + e);
          }
        }
      }
      flash::softmax_step<NK, NFV>(S, hidden, m_i, l_i, Of);
    }
    if (SHARED_KV) {  // every simdgroup is done with K: bring V into the same buffer
      threadgroup_barrier(mem_flags::mem_threadgroup);
      load_rows<TK, BDV>(v_tile, LDV, v_row, BK, Dv, vc, quantized, kv_symmetric, P, v_scales, v_biases,
                         v_scales_sym, nthreads, tid, sg, lane);
      threadgroup_barrier(mem_flags::mem_threadgroup);
    }
    if (sg_sees) {
      for (int kk = 0; kk < NK; ++kk) {
        for (int dd = 0; dd < NFV; ++dd) {
          simdgroup_float8x8 Vf;
          flash::load_frag(Vf, v_tile + kk * 8 * LDV + dd * 8, LDV, fc);
          simdgroup_multiply_accumulate(Of[dd], S[kk], Vf, Of[dd]);
        }
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }

  if (!row_ok) return;
  const long row_id = (long(b) * P.heads + h) * long(Lq) + i;  // (b, h, i) in lse order
  if (!use_splits) {
    const float inv_l = flash::inv_row_sum(l_i);
    const long o_off = long(b) * P.o_stride_b + long(h) * P.o_stride_h + long(i) * P.o_stride_l;
    for (int dd = 0; dd < NFV; ++dd) {
      flash::store_frag_rows(Of[dd], o + o_off + dd * 8, true, Dv - dd * 8, fc, inv_l);
    }
    if (fc.col == 0) {
      flash::store_lse(lse + row_id, m_i, l_i);
    }
  } else {
    const long prow = row_id * P.num_splits + split;
    if (flash::saw_keys(l_i)) {  // the combine reads O only of splits that saw a key
      for (int dd = 0; dd < NFV; ++dd) {
        const int c = dd * 8 + fc.col;
        if (c < Dv) part_o[prow * Dv + c] = Of[dd].thread_elements()[0];
        if (c + 1 < Dv) part_o[prow * Dv + c + 1] = Of[dd].thread_elements()[1];
      }
    }
    if (fc.col == 0) {
      part_ml[prow * 2] = m_i;
      part_ml[prow * 2 + 1] = l_i;
    }
  }
}

// ---------------------------------------------------------------------------
// Combine: one simdgroup per (b, h, i) row, kCombineRows rows per threadgroup;
// at most 32 * kMaxSplitChunks splits and 32 * kMaxDimChunks head-dim elements.
// ---------------------------------------------------------------------------
constant constexpr int kMaxSplitChunks = 4;  // 128 splits
constant constexpr int kMaxDimChunks = 16;   // head dim 512 (V's)
constant constexpr int kCombineRows = 8;     // simdgroups per threadgroup

template <typename T>
[[kernel, max_total_threads_per_threadgroup(256)]] void flash_decode_combine(device T* o [[buffer(3)]], device float* lse [[buffer(4)]],
                                     constant DecodeParams& p [[buffer(5)]],
                                     const device float* part_o [[buffer(11)]],
                                     const device float* part_ml [[buffer(12)]],
                                     uint3 tgid [[threadgroup_position_in_grid]],
                                     ushort tid [[thread_index_in_threadgroup]],
                                     ushort sg [[simdgroup_index_in_threadgroup]],
                                     ushort lane [[thread_index_in_simdgroup]]) {
  threadgroup long params_words[kParamWords];
  copy_params(params_words, p, tid);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  const threadgroup DecodeParams& P = *reinterpret_cast<const threadgroup DecodeParams*>(params_words);

  const int S = P.num_splits;
  const int D = P.head_dim_v;  // out's
  const int Lq = P.seqlen_q;
  const long row_id = long(tgid.x) * kCombineRows + long(sg);
  if (row_id >= long(P.batch) * P.heads * Lq) return;  // whole simdgroups leave together
  const int i = int(row_id % Lq);
  const int h = int((row_id / Lq) % P.heads);
  const int b = int(row_id / (long(Lq) * P.heads));
  const long base = row_id * S;

  float m[kMaxSplitChunks];
  float l[kMaxSplitChunks];
  float mx = -FLT_MAX;  // the max over splits that saw something (flash::saw_keys), whose m is finite
  for (int c = 0; c < kMaxSplitChunks; ++c) {
    const int s = c * 32 + int(lane);
    m[c] = 0.0f;
    l[c] = 0.0f;
    if (s < S) {
      m[c] = part_ml[(base + s) * 2];
      l[c] = part_ml[(base + s) * 2 + 1];
      if (flash::saw_keys(l[c])) mx = max(mx, m[c]);
    }
  }
  mx = simd_max(mx);
  float w[kMaxSplitChunks];
  float lsum = 0.0f;
  for (int c = 0; c < kMaxSplitChunks; ++c) {
    w[c] = flash::saw_keys(l[c]) ? flash::exp_shifted(m[c] - mx) : 0.0f;
    lsum += w[c] * l[c];
  }
  lsum = simd_sum(lsum);

  float acc[kMaxDimChunks];
  for (int c = 0; c < kMaxDimChunks; ++c) acc[c] = 0.0f;
  for (int s = 0; s < S; ++s) {  // uniform loop: the shuffles see all 32 lanes
    const float ws = simd_shuffle(w[s / 32], ushort(s % 32));
    if (ws > 0.0f) {
      const device float* po = part_o + (base + s) * D;
      for (int c = 0; c < kMaxDimChunks; ++c) {
        const int d = c * 32 + int(lane);
        if (d < D) acc[c] += ws * po[d];
      }
    }
  }
  const float inv = flash::inv_row_sum(lsum);
  const long o_off = long(b) * P.o_stride_b + long(h) * P.o_stride_h + long(i) * P.o_stride_l;
  for (int c = 0; c < kMaxDimChunks; ++c) {
    const int d = c * 32 + int(lane);
    if (d < D) o[o_off + d] = T(acc[c] * inv);
  }
  if (lane == 0) {
    flash::store_lse(lse + row_id, mx, lsum);
  }
}

// Echoes every DecodeParams field (the host/kernel layout test).
[[kernel]] void flash_decode_params_echo(constant DecodeParams& p [[buffer(5)]],
                                         device long* out_l [[buffer(0)]],
                                         device int* out_i [[buffer(1)]],
                                         device float* out_f [[buffer(2)]],
                                         uint tid [[thread_position_in_grid]]) {
  if (tid != 0) return;
  out_l[0] = p.q_stride_b; out_l[1] = p.q_stride_h; out_l[2] = p.q_stride_l;
  out_l[3] = p.k_stride_b; out_l[4] = p.k_stride_l; out_l[5] = p.k_stride_h;
  out_l[6] = p.v_stride_b; out_l[7] = p.v_stride_l; out_l[8] = p.v_stride_h;
  out_l[9] = p.o_stride_b; out_l[10] = p.o_stride_h; out_l[11] = p.o_stride_l;
  out_l[12] = p.bt_stride_b; out_l[13] = p.a_stride_b; out_l[14] = p.a_stride_h;
  out_l[15] = p.m_stride_b; out_l[16] = p.m_stride_h; out_l[17] = p.m_stride_q; out_l[18] = p.m_stride_k;
  out_i[0] = p.batch; out_i[1] = p.heads; out_i[2] = p.kv_heads; out_i[3] = p.gqa;
  out_i[4] = p.seqlen_q; out_i[5] = p.head_dim; out_i[6] = p.page_size; out_i[7] = p.num_splits;
  out_i[8] = p.diag_adjust; out_i[9] = p.window_left; out_i[10] = p.window_right; out_i[11] = p.rows_per_tg;
  out_i[12] = p.row_blocks; out_i[13] = p.num_threads;
  out_i[14] = p.seqlen_fixed; out_i[15] = p.seqlen_new; out_i[16] = p.capacity; out_i[17] = p.cache_rows;
  out_i[18] = p.mask_kind; out_i[19] = p.kv_bits; out_i[20] = p.kv_group_size; out_i[21] = p.head_dim_v;
  out_f[0] = p.qk_scale; out_f[1] = p.softcap;
}

// ---------------------------------------------------------------------------
// Instantiations (the planner's table, torch_metal_flash/planner/decode.py).
// ---------------------------------------------------------------------------
// q and the caches in one dtype ("flash_decode_<dtype>_d<BD>_k<BK>"), and
// float32 q over a float16 / bfloat16 cache ("flash_decode_f32_kv<dtype>_...",
// the cache dtype's tiles).
#define FLASH_DECODE_INSTANTIATE(name, TQ, TK, BD, BK)                            \
  template [[host_name("flash_decode_" #name "_d" #BD "_k" #BK)]] [[kernel]] void \
  flash_decode<TQ, TK, BD, BD, BK, false>(FLASH_DECODE_ARGS(TQ, TK));
// K and V sharing one tile buffer: "_s"
#define FLASH_DECODE_INSTANTIATE_SHARED(name, TQ, TK, BD, BK)                          \
  template [[host_name("flash_decode_" #name "_d" #BD "_k" #BK "_s")]] [[kernel]] void \
  flash_decode<TQ, TK, BD, BD, BK, true>(FLASH_DECODE_ARGS(TQ, TK));
// V (and out) with their own bucket BDV: "_v<BDV>"
#define FLASH_DECODE_INSTANTIATE_DV(name, TQ, TK, BD, BDV, BK, SHARED, suffix)                     \
  template [[host_name("flash_decode_" #name "_d" #BD "_v" #BDV "_k" #BK suffix)]] [[kernel]] void \
  flash_decode<TQ, TK, BD, BDV, BK, SHARED>(FLASH_DECODE_ARGS(TQ, TK));

#ifndef FLASH_DECODE_TEMPLATES_ONLY  // the tuning variants' file includes this one for the templates only
FLASH_DECODE_INSTANTIATE(f32, float, float, 32, 32)
FLASH_DECODE_INSTANTIATE(f32, float, float, 64, 32)
FLASH_DECODE_INSTANTIATE(f32, float, float, 96, 16)
FLASH_DECODE_INSTANTIATE(f32, float, float, 128, 16)
FLASH_DECODE_INSTANTIATE(f32, float, float, 192, 8)
FLASH_DECODE_INSTANTIATE(f32, float, float, 256, 8)
FLASH_DECODE_INSTANTIATE_SHARED(f32, float, float, 384, 8)
FLASH_DECODE_INSTANTIATE_SHARED(f32, float, float, 512, 8)
FLASH_DECODE_INSTANTIATE_DV(f32, float, float, 576, 512, 8, true, "_s")
FLASH_DECODE_INSTANTIATE(f16, half, half, 32, 64)
FLASH_DECODE_INSTANTIATE(f16, half, half, 64, 64)
FLASH_DECODE_INSTANTIATE(f16, half, half, 96, 32)
FLASH_DECODE_INSTANTIATE(f16, half, half, 128, 32)
FLASH_DECODE_INSTANTIATE(f16, half, half, 192, 16)
FLASH_DECODE_INSTANTIATE(f16, half, half, 256, 16)
FLASH_DECODE_INSTANTIATE(f16, half, half, 384, 8)
FLASH_DECODE_INSTANTIATE(f16, half, half, 512, 8)
FLASH_DECODE_INSTANTIATE_DV(f16, half, half, 576, 512, 8, false, "")
FLASH_DECODE_INSTANTIATE(bf16, bfloat, bfloat, 32, 64)
FLASH_DECODE_INSTANTIATE(bf16, bfloat, bfloat, 64, 64)
FLASH_DECODE_INSTANTIATE(bf16, bfloat, bfloat, 96, 32)
FLASH_DECODE_INSTANTIATE(bf16, bfloat, bfloat, 128, 32)
FLASH_DECODE_INSTANTIATE(bf16, bfloat, bfloat, 192, 16)
FLASH_DECODE_INSTANTIATE(bf16, bfloat, bfloat, 256, 16)
FLASH_DECODE_INSTANTIATE(bf16, bfloat, bfloat, 384, 8)
FLASH_DECODE_INSTANTIATE(bf16, bfloat, bfloat, 512, 8)
FLASH_DECODE_INSTANTIATE_DV(bf16, bfloat, bfloat, 576, 512, 8, false, "")
FLASH_DECODE_INSTANTIATE(f32_kvf16, float, half, 32, 64)
FLASH_DECODE_INSTANTIATE(f32_kvf16, float, half, 64, 64)
FLASH_DECODE_INSTANTIATE(f32_kvf16, float, half, 96, 32)
FLASH_DECODE_INSTANTIATE(f32_kvf16, float, half, 128, 32)
FLASH_DECODE_INSTANTIATE(f32_kvf16, float, half, 192, 16)
FLASH_DECODE_INSTANTIATE(f32_kvf16, float, half, 256, 16)
FLASH_DECODE_INSTANTIATE(f32_kvf16, float, half, 384, 8)
FLASH_DECODE_INSTANTIATE(f32_kvf16, float, half, 512, 8)
FLASH_DECODE_INSTANTIATE_DV(f32_kvf16, float, half, 576, 512, 8, false, "")
FLASH_DECODE_INSTANTIATE(f32_kvbf16, float, bfloat, 32, 64)
FLASH_DECODE_INSTANTIATE(f32_kvbf16, float, bfloat, 64, 64)
FLASH_DECODE_INSTANTIATE(f32_kvbf16, float, bfloat, 96, 32)
FLASH_DECODE_INSTANTIATE(f32_kvbf16, float, bfloat, 128, 32)
FLASH_DECODE_INSTANTIATE(f32_kvbf16, float, bfloat, 192, 16)
FLASH_DECODE_INSTANTIATE(f32_kvbf16, float, bfloat, 256, 16)
FLASH_DECODE_INSTANTIATE(f32_kvbf16, float, bfloat, 384, 8)
FLASH_DECODE_INSTANTIATE(f32_kvbf16, float, bfloat, 512, 8)
FLASH_DECODE_INSTANTIATE_DV(f32_kvbf16, float, bfloat, 576, 512, 8, false, "")

#define FLASH_DECODE_COMBINE_INSTANTIATE(tname, T)                                     \
  template [[host_name("flash_decode_combine_" #tname)]] [[kernel]] void                \
  flash_decode_combine<T>(device T* o [[buffer(3)]], device float* lse [[buffer(4)]], \
                          constant DecodeParams& p [[buffer(5)]],                     \
                          const device float* part_o [[buffer(11)]],                  \
                          const device float* part_ml [[buffer(12)]],                 \
                          uint3 tgid [[threadgroup_position_in_grid]],                \
                          ushort tid [[thread_index_in_threadgroup]],                 \
                          ushort sg [[simdgroup_index_in_threadgroup]],               \
                          ushort lane [[thread_index_in_simdgroup]]);

FLASH_DECODE_COMBINE_INSTANTIATE(f32, float)
FLASH_DECODE_COMBINE_INSTANTIATE(f16, half)
FLASH_DECODE_COMBINE_INSTANTIATE(bf16, bfloat)
#endif  // FLASH_DECODE_TEMPLATES_ONLY
