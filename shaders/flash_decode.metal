// Split-K flash-decoding: a few query rows against a long (optionally paged) KV cache.
//
// flash_decode_<dtype>_d<BD>_k<BK>  (the partial / single-pass kernel)
//   Grid: (num_splits, kv_heads * row_blocks, batch) threadgroups.  A threadgroup
//   owns ONE KV head of one batch row and the query rows of its whole GQA group:
//   rows r = g * seqlen_q + i (g = head within the group, i = query row), up to
//   rows_per_tg of them, 8 per simdgroup (ceil(rows_per_tg / 8) simdgroups compute;
//   the planner may add simdgroups that only help load the tiles: num_threads).
//   It streams its share of the key range (whole tiles of BK cache positions,
//   split s takes the s-th run of tiles) through threadgroup memory: each K/V
//   row is read from device memory ONCE and applied to every query head of the
//   group and every query row of the step (simdgroup-matrix 8x8 multiplies,
//   online softmax in the log2 domain as in flash_fwd.metal).
//   num_splits == 1 (use_splits false): writes out / lse directly.
//   Otherwise: writes a partial per (row, split): unnormalised O (float, only
//   when the split saw something, l > 0) and (m, l) (log2 units).
//
// flash_decode_combine_<dtype>
//   Grid: ceil(batch * heads * seqlen_q / 8) threadgroups of 8 simdgroups, one
//   simdgroup per (b, h, i) row.  Merges the partials of a row with log-sum-exp weights; reads O only of splits with l > 0.
//
// Per batch row b the keys are the cache positions [start_b, end_b): start_b =
// leftpad[b] (0 without leftpad), end_b = seqlens_k[b] (cache_seqlens + new
// rows).  Positions for the band and ALiBi count from start_b; the band is
// aligned bottom-right: diag_b = (end_b - start_b) - seqlen_q + diag_adjust.
// Contiguous caches: (batch_cache, L_max, Hkv, D) via strides, cache row
// batch_idx[b] (or b).  Paged caches: (num_blocks, page_size, Hkv, D), position
// pos of row b lives in block block_table[b, pos / page_size], row pos % page_size
// (read through the table: no gather copy).
//
// Buffers: 0 q, 1 k_cache, 2 v_cache, 3 out, 4 lse (float, contiguous (B, Hq, Lq)),
// 5 DecodeParams, 6 seqlens_k (int, (B,)), 7 leftpad (int), 8 batch_idx (int),
// 9 block_table (int), 10 alibi slopes (float), 11 partial O (float), 12 partial (m, l) (float).
#include "flash_common.h"

// Host mirror: torch_metal_flash/planner/decode.py (DecodeParams, ctypes).
struct DecodeParams {
  // q and out viewed as (B, Hq, Lq, D)
  long q_stride_b, q_stride_h, q_stride_l;
  // caches: (B_cache | num_blocks, L_max | page_size, Hkv, D)
  long k_stride_b, k_stride_l, k_stride_h;
  long v_stride_b, v_stride_l, v_stride_h;
  long o_stride_b, o_stride_h, o_stride_l;
  long bt_stride_b;            // block_table row stride
  long a_stride_b, a_stride_h;  // alibi slopes (B, Hq)
  int batch, heads, kv_heads, gqa;
  int seqlen_q, head_dim, page_size, num_splits;
  int diag_adjust, window_left, window_right, rows_per_tg;
  int row_blocks, num_threads;  // threads per threadgroup of flash_decode (>= 32 * ceil(rows_per_tg / 8))
  // q is multiplied by qk_scale when loaded: scale * log2(e) without softcap,
  // scale / softcap with softcap; softcap_log2 = softcap * log2(e).
  float qk_scale, softcap_log2;
};

constant bool paged [[function_constant(0)]];
constant bool has_leftpad [[function_constant(1)]];
constant bool has_batch_idx [[function_constant(2)]];
constant bool has_alibi [[function_constant(3)]];
constant bool has_softcap [[function_constant(4)]];
constant bool has_band [[function_constant(5)]];
constant bool use_splits [[function_constant(6)]];

#define FLASH_DECODE_ARGS(T)                                                          \
  const device T* q [[buffer(0)]], const device T* kc [[buffer(1)]],                  \
      const device T* vc [[buffer(2)]], device T* o [[buffer(3)]],                    \
      device float* lse [[buffer(4)]], constant DecodeParams& p [[buffer(5)]],         \
      const device int* seqlens_k [[buffer(6)]],                                      \
      const device int* leftpad [[buffer(7), function_constant(has_leftpad)]],        \
      const device int* batch_idx [[buffer(8), function_constant(has_batch_idx)]],    \
      const device int* block_table [[buffer(9), function_constant(paged)]],          \
      const device float* alibi [[buffer(10), function_constant(has_alibi)]],         \
      device float* part_o [[buffer(11), function_constant(use_splits)]],             \
      device float* part_ml [[buffer(12), function_constant(use_splits)]],            \
      uint3 tgid [[threadgroup_position_in_grid]],                                    \
      ushort tid [[thread_index_in_threadgroup]],                                     \
      ushort sg [[simdgroup_index_in_threadgroup]],                                   \
      ushort lane [[thread_index_in_simdgroup]]

// Params and per-row scalars are read from device/constant memory by a few
// threads and shared through threadgroup memory (one read per threadgroup,
// not one per thread).
constant constexpr int kParamWords = sizeof(DecodeParams) / 8;
static_assert(sizeof(DecodeParams) % 8 == 0, "DecodeParams is a whole number of 8-byte words");

// softcap * tanh(x) * log2(e) (cap_log2 = softcap * log2(e)), finite for any |x| under fast math.
inline float decode_softcap_log2(float x, float cap_log2) {
  const float t = exp2(-2.0f * flash::kLog2e * abs(x));
  return copysign((1.0f - t) / (1.0f + t), x) * cap_log2;
}

inline void copy_params(threadgroup long* dst, constant DecodeParams& p, ushort tid) {
  const constant long* src = reinterpret_cast<const constant long*>(&p);
  for (int w = int(tid); w < kParamWords; w += 32) dst[w] = src[w];
}

// At most 16 simdgroups (planner/decode.py: MAX_ROWS_PER_TG); the attribute makes the
// compiler keep the pipeline's maxTotalThreadsPerThreadgroup at 512.
template <typename T, int BD, int BK>
[[kernel, max_total_threads_per_threadgroup(512)]] void flash_decode(FLASH_DECODE_ARGS(T)) {
  constexpr int LD = BD + flash::TilePad<T>::value;
  constexpr int NF = BD / 8;  // fragments along the head dim
  constexpr int NK = BK / 8;  // fragments along the keys
  static_assert(BD % 8 == 0 && BK % 8 == 0, "tile sizes");

  threadgroup T k_tile[BK * LD];
  threadgroup T v_tile[BK * LD];
  threadgroup long k_row[BK];  // element offset of each tile row in kc (-1: not a key)
  threadgroup long v_row[BK];
  threadgroup long params_words[kParamWords];
  threadgroup int row_meta[4];  // end, start, cache row of batch row b

  const int b = int(tgid.z);
  copy_params(params_words, p, tid);
  if (tid == 31) row_meta[0] = seqlens_k[b];
  if (tid == 30) row_meta[1] = has_leftpad ? leftpad[b] : 0;
  if (tid == 29) row_meta[2] = has_batch_idx ? batch_idx[b] : b;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  const threadgroup DecodeParams& P = *reinterpret_cast<const threadgroup DecodeParams*>(params_words);

  const float kNeg = -1.0e38f;  // finite "minus infinity" (fast math)
  const int nthreads = P.num_threads;
  const int split = int(tgid.x);
  const int kvh = int(tgid.y) % P.kv_heads;
  const int rblock = int(tgid.y) / P.kv_heads;
  const int Lq = P.seqlen_q;
  const int D = P.head_dim;
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
  int lo = 0;
  int hi = lk;
  if (has_band) band.key_range(0, Lq - 1, lk, lo, hi);
  const int key_lo = start + lo;  // absolute cache positions [key_lo, key_hi)
  const int key_hi = start + hi;
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
    const long crow = long(row_meta[2]);
    k_base += crow * P.k_stride_b;
    v_base += crow * P.v_stride_b;
  }

  // Q fragments of this simdgroup's 8 rows, pre-scaled (zero past the rows / head dim).
  const long q_off = long(b) * P.q_stride_b + long(h) * P.q_stride_h + long(i) * P.q_stride_l;
  simdgroup_float8x8 Qf[NF];
  simdgroup_float8x8 Of[NF];
  for (int dd = 0; dd < NF; ++dd) {
    float e0 = 0.0f, e1 = 0.0f;
    const int c = dd * 8 + fc.col;
    if (row_ok && c < D) e0 = float(q[q_off + c]) * P.qk_scale;
    if (row_ok && c + 1 < D) e1 = float(q[q_off + c + 1]) * P.qk_scale;
    Qf[dd].thread_elements()[0] = e0;
    Qf[dd].thread_elements()[1] = e1;
    Of[dd] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  }
  float m_i = kNeg;
  float l_i = 0.0f;
  float slope = 0.0f;
  if (has_alibi && row_ok) slope = alibi[long(b) * P.a_stride_b + long(h) * P.a_stride_h] * flash::kLog2e;

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
          const long blk = long(block_table[long(b) * P.bt_stride_b + page]);
          const long off = long(pos - page * P.page_size);
          ko = k_base + blk * P.k_stride_b + off * P.k_stride_l;
          vo = v_base + blk * P.v_stride_b + off * P.v_stride_l;
        } else {
          ko = k_base + long(pos) * P.k_stride_l;
          vo = v_base + long(pos) * P.v_stride_l;
        }
      }
      k_row[r] = ko;
      v_row[r] = vo;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    // K and V tiles: every element read once, zero outside the keys / head dim.
    for (int idx = int(tid); idx < BK * BD; idx += nthreads) {
      const int r = idx / BD;
      const int c = idx - r * BD;
      const long ko = k_row[r];
      const long vo = v_row[r];
      T kx = T(0);
      T vx = T(0);
      if (ko >= 0 && c < D) kx = kc[ko + c];
      if (vo >= 0 && c < D) vx = vc[vo + c];
      k_tile[r * LD + c] = kx;
      v_tile[r * LD + c] = vx;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);

    if (sg_active) {
      simdgroup_float8x8 S[NK];
      for (int kk = 0; kk < NK; ++kk) {
        S[kk] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
        for (int dd = 0; dd < NF; ++dd) {
          simdgroup_float8x8 Kt;
          flash::load_frag_t(Kt, k_tile + kk * 8 * LD + dd * 8, LD, fc);
          simdgroup_multiply_accumulate(S[kk], Qf[dd], Kt, S[kk]);
        }
      }
      const bool need_bounds = kb < key_lo || kb + BK > key_hi;
      if (has_softcap || has_alibi || has_band || need_bounds) {
        for (int kk = 0; kk < NK; ++kk) {
          for (int e = 0; e < 2; ++e) {
            float s = S[kk].thread_elements()[e];
            const int pos = kb + kk * 8 + fc.col + e;
            const int j = pos - start;
            if (has_softcap) s = decode_softcap_log2(s, P.softcap_log2);
            if (has_alibi) s -= slope * float(abs(i + diag - j));
            bool vis = pos >= key_lo && pos < key_hi;
            if (has_band) vis = vis && band.visible(i, j);
            S[kk].thread_elements()[e] = vis ? s : kNeg;
          }
        }
      }
      // Online softmax; the 4 lanes of a fragment row differ in lane bits 0 and 3.
      float mx = kNeg;
      for (int kk = 0; kk < NK; ++kk) {
        mx = max(mx, max(S[kk].thread_elements()[0], S[kk].thread_elements()[1]));
      }
      mx = flash::row_max(mx);
      const float m_new = max(m_i, mx);
      const float m_use = (m_new <= kNeg) ? 0.0f : m_new;
      const float factor = exp2(m_i - m_use);
      float rs = 0.0f;
      for (int kk = 0; kk < NK; ++kk) {
        const float p0 = exp2(S[kk].thread_elements()[0] - m_use);
        const float p1 = exp2(S[kk].thread_elements()[1] - m_use);
        S[kk].thread_elements()[0] = p0;
        S[kk].thread_elements()[1] = p1;
        rs += p0 + p1;
      }
      rs = flash::row_sum(rs);
      l_i = l_i * factor + rs;
      m_i = m_new;
      for (int dd = 0; dd < NF; ++dd) flash::frag_scale(Of[dd], factor);
      for (int kk = 0; kk < NK; ++kk) {
        for (int dd = 0; dd < NF; ++dd) {
          simdgroup_float8x8 Vf;
          flash::load_frag(Vf, v_tile + kk * 8 * LD + dd * 8, LD, fc);
          simdgroup_multiply_accumulate(Of[dd], S[kk], Vf, Of[dd]);
        }
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }

  if (!row_ok) return;
  const long row_id = (long(b) * P.heads + h) * long(Lq) + i;  // (b, h, i) in lse order
  if (!use_splits) {
    const float inv_l = l_i != 0.0f ? 1.0f / l_i : 0.0f;
    const long o_off = long(b) * P.o_stride_b + long(h) * P.o_stride_h + long(i) * P.o_stride_l;
    for (int dd = 0; dd < NF; ++dd) {
      const int c = dd * 8 + fc.col;
      if (c < D) o[o_off + c] = T(Of[dd].thread_elements()[0] * inv_l);
      if (c + 1 < D) o[o_off + c + 1] = T(Of[dd].thread_elements()[1] * inv_l);
    }
    if (fc.col == 0) {
      const float pos_inf = as_type<float>(0x7f800000u);
      lse[row_id] = l_i != 0.0f ? (m_i + log2(l_i)) * flash::kLn2 : pos_inf;
    }
  } else {
    const long prow = row_id * P.num_splits + split;
    if (l_i != 0.0f) {  // the combine reads O only of splits that saw a key
      for (int dd = 0; dd < NF; ++dd) {
        const int c = dd * 8 + fc.col;
        if (c < D) part_o[prow * D + c] = Of[dd].thread_elements()[0];
        if (c + 1 < D) part_o[prow * D + c + 1] = Of[dd].thread_elements()[1];
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
constant constexpr int kMaxDimChunks = 8;    // head dim 256
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

  const float kNeg = -1.0e38f;
  const int S = P.num_splits;
  const int D = P.head_dim;
  const int Lq = P.seqlen_q;
  const long row_id = long(tgid.x) * kCombineRows + long(sg);
  if (row_id >= long(P.batch) * P.heads * Lq) return;  // whole simdgroups leave together
  const int i = int(row_id % Lq);
  const int h = int((row_id / Lq) % P.heads);
  const int b = int(row_id / (long(Lq) * P.heads));
  const long base = row_id * S;

  float m[kMaxSplitChunks];
  float l[kMaxSplitChunks];
  float mx = kNeg;
  for (int c = 0; c < kMaxSplitChunks; ++c) {
    const int s = c * 32 + int(lane);
    m[c] = kNeg;
    l[c] = 0.0f;
    if (s < S) {
      m[c] = part_ml[(base + s) * 2];
      l[c] = part_ml[(base + s) * 2 + 1];
      if (l[c] != 0.0f) mx = max(mx, m[c]);
    }
  }
  mx = simd_max(mx);
  float w[kMaxSplitChunks];
  float lsum = 0.0f;
  for (int c = 0; c < kMaxSplitChunks; ++c) {
    w[c] = l[c] != 0.0f ? exp2(m[c] - mx) : 0.0f;
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
  const float inv = lsum != 0.0f ? 1.0f / lsum : 0.0f;
  const long o_off = long(b) * P.o_stride_b + long(h) * P.o_stride_h + long(i) * P.o_stride_l;
  for (int c = 0; c < kMaxDimChunks; ++c) {
    const int d = c * 32 + int(lane);
    if (d < D) o[o_off + d] = T(acc[c] * inv);
  }
  if (lane == 0) {
    const float pos_inf = as_type<float>(0x7f800000u);
    lse[row_id] = lsum != 0.0f ? (mx + log2(lsum)) * flash::kLn2 : pos_inf;
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
  out_i[0] = p.batch; out_i[1] = p.heads; out_i[2] = p.kv_heads; out_i[3] = p.gqa;
  out_i[4] = p.seqlen_q; out_i[5] = p.head_dim; out_i[6] = p.page_size; out_i[7] = p.num_splits;
  out_i[8] = p.diag_adjust; out_i[9] = p.window_left; out_i[10] = p.window_right; out_i[11] = p.rows_per_tg;
  out_i[12] = p.row_blocks; out_i[13] = p.num_threads;
  out_f[0] = p.qk_scale; out_f[1] = p.softcap_log2;
}

// ---------------------------------------------------------------------------
// Instantiations (the planner's table, torch_metal_flash/planner/decode.py).
// ---------------------------------------------------------------------------
#define FLASH_DECODE_INSTANTIATE(tname, T, BD, BK)                                  \
  template [[host_name("flash_decode_" #tname "_d" #BD "_k" #BK)]] [[kernel]] void \
  flash_decode<T, BD, BK>(FLASH_DECODE_ARGS(T));

FLASH_DECODE_INSTANTIATE(f32, float, 32, 32)
FLASH_DECODE_INSTANTIATE(f32, float, 64, 32)
FLASH_DECODE_INSTANTIATE(f32, float, 96, 16)
FLASH_DECODE_INSTANTIATE(f32, float, 128, 16)
FLASH_DECODE_INSTANTIATE(f32, float, 192, 8)
FLASH_DECODE_INSTANTIATE(f32, float, 256, 8)
FLASH_DECODE_INSTANTIATE(f16, half, 32, 64)
FLASH_DECODE_INSTANTIATE(f16, half, 64, 64)
FLASH_DECODE_INSTANTIATE(f16, half, 96, 32)
FLASH_DECODE_INSTANTIATE(f16, half, 128, 32)
FLASH_DECODE_INSTANTIATE(f16, half, 192, 16)
FLASH_DECODE_INSTANTIATE(f16, half, 256, 16)
FLASH_DECODE_INSTANTIATE(bf16, bfloat, 32, 64)
FLASH_DECODE_INSTANTIATE(bf16, bfloat, 64, 64)
FLASH_DECODE_INSTANTIATE(bf16, bfloat, 96, 32)
FLASH_DECODE_INSTANTIATE(bf16, bfloat, 128, 32)
FLASH_DECODE_INSTANTIATE(bf16, bfloat, 192, 16)
FLASH_DECODE_INSTANTIATE(bf16, bfloat, 256, 16)

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
