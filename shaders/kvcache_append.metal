// The append step of flash_attn_with_kvcache: rotary embedding of the new k
// (and of q), and the write of the new k/v rows into the cache, contiguous or
// paged, at the positions read on the GPU (kvcache_index.h).
//
// kvcache_append_<dtype>_r<rotary dtype>[_q<q dtype>]
//   One threadgroup per row, 32 * ceil(max(head_dim, head_dim_v) / 32) threads
//   (head dims <= kMaxRow; v's may differ from k's and q's):
//   rows [0, kv_rows) are the (b, t, h) rows of the new k/v (b-major), written
//   to cache position base_b + t; the rest, when rotary is on, are the
//   (b, i, h) rows of q, rotated into a scratch q at position base_b + i
//   (q_local: causal or windowed) or base_b.  One thread locates the row (index
//   reads, kvcache_index.h); a row whose destination is ignored returns.  Every
//   element of the source rows and of the rotary table is read once.
// Rotary: the first rotary_dim features rotate in pairs, (2f, 2f + 1) when
// interleaved, else (f, f + rotary_dim / 2), by the angle of table row
// min(pos, seqlen_ro - 1); in float32, stored as T.  The rest are copied.
//
// Types: T is the caches' (and the new k/v's) dtype, R the rotary table's, TQ
// q's (float32 over a float16 / bfloat16 cache: "_q<dtype>").
// Quantized caches (kv_affine / kv_symmetric, kv_quant.h): buffers 2 and 3 hold
// the packed words and the cache strides count rows; the k row (rotated,
// rounded to T) is staged in threadgroup memory, then the k and v rows are
// quantized in registers (group min/max or max|x| by simdgroup reductions)
// and written as words, scales and biases -- what tmf.quantize() gives for
// them, bit for bit.
//
// Buffers: 0 k, 1 v (B, Lnew, Hkv, D), 2 k_cache, 3 v_cache, 4 AppendParams,
// 5 cache_seqlens (int, (B,)), 6 cache_batch_idx (int), 7 block_table (int),
// 8 rotary_cos, 9 rotary_sin (R, (seqlen_ro, rotary_dim / 2)), 10 q (B, Lq, Hq, D),
// 11 rotated q, 12 k scales, 13 k biases, 14 v scales, 15 v biases (T, affine),
// 16 k scales, 17 v scales (half, symmetric).
#include <metal_stdlib>
#include "function_constants.h"
#include "kv_quant.h"
#include "kvcache_append_params.h"
#include "kvcache_index.h"

using namespace metal;

constant bool paged [[function_constant(FC_APPEND_PAGED)]];
constant bool has_seqlens [[function_constant(FC_APPEND_HAS_SEQLENS)]];
constant bool has_batch_idx [[function_constant(FC_APPEND_HAS_BATCH_IDX)]];
constant bool has_rotary [[function_constant(FC_APPEND_HAS_ROTARY)]];
constant bool rotary_interleaved [[function_constant(FC_APPEND_ROTARY_INTERLEAVED)]];
constant bool kv_affine [[function_constant(FC_APPEND_KV_AFFINE)]];
constant bool kv_symmetric [[function_constant(FC_APPEND_KV_SYMMETRIC)]];

#define KVCACHE_APPEND_ARGS(T, R, TQ)                                                  \
  const device T* k [[buffer(0)]], const device T* v [[buffer(1)]],                     \
      device T* kc [[buffer(2)]], device T* vc [[buffer(3)]],                           \
      constant AppendParams& p [[buffer(4)]],                                           \
      const device int* cache_seqlens [[buffer(5), function_constant(has_seqlens)]],    \
      const device int* batch_idx [[buffer(6), function_constant(has_batch_idx)]],      \
      const device int* block_table [[buffer(7), function_constant(paged)]],            \
      const device R* rcos [[buffer(8), function_constant(has_rotary)]],                \
      const device R* rsin [[buffer(9), function_constant(has_rotary)]],                \
      const device TQ* q [[buffer(10), function_constant(has_rotary)]],                 \
      device TQ* q_rot [[buffer(11), function_constant(has_rotary)]],                   \
      device T* k_scales [[buffer(12), function_constant(kv_affine)]],                  \
      device T* k_biases [[buffer(13), function_constant(kv_affine)]],                  \
      device T* v_scales [[buffer(14), function_constant(kv_affine)]],                  \
      device T* v_biases [[buffer(15), function_constant(kv_affine)]],                  \
      device half* k_scales_sym [[buffer(16), function_constant(kv_symmetric)]],        \
      device half* v_scales_sym [[buffer(17), function_constant(kv_symmetric)]],        \
      uint tgid [[threadgroup_position_in_grid]], ushort tid [[thread_index_in_threadgroup]], \
      ushort sg [[simdgroup_index_in_threadgroup]], ushort lane [[thread_index_in_simdgroup]],  \
      ushort nthreads [[threads_per_threadgroup]]

// Params are read once per threadgroup and shared through threadgroup memory, as
// in flash_decode.metal (one read per threadgroup, not one per thread).
constant constexpr int kAppendParamWords = sizeof(AppendParams) / 8;
static_assert(sizeof(AppendParams) % 8 == 0 && kAppendParamWords <= 32, "AppendParams: 8-byte words, one per thread");

// Where row `row` reads and writes (one thread per threadgroup):
// meta = {source row (k or q), destination row (k cache or rotated q; -1: not
// written), v source row, v destination row, rotary position}.
inline void locate_row(const threadgroup AppendParams& P, long row, const device int* cache_seqlens,
                       const device int* batch_idx, const device int* block_table, threadgroup long* meta) {
  const bool is_kv = !has_rotary || row < long(P.kv_rows);  // q rows exist only with rotary
  if (!is_kv) row -= P.kv_rows;
  const int nh = is_kv ? P.kv_heads : P.heads;
  const int nl = is_kv ? P.seqlen_new : P.seqlen_q;
  const int h = int(row % nh);
  const int t = int((row / nh) % nl);  // new row t, or query row
  const int b = int(row / (long(nh) * nl));
  const int crow = has_batch_idx ? kv_cache_row(batch_idx[b], P.cache_rows) : b;
  const KvRow r = kv_row(has_seqlens ? cache_seqlens[b] : P.seqlen_fixed, 0, crow < 0, P.seqlen_new, P.capacity);
  if (!is_kv) {
    meta[0] = long(b) * P.q_stride_b + long(t) * P.q_stride_l + long(h) * P.q_stride_h;
    meta[1] = long(b) * P.qr_stride_b + long(t) * P.qr_stride_l + long(h) * P.qr_stride_h;
    meta[4] = r.base + (P.q_local ? t : 0);
    return;
  }
  const int pos = r.base + t;
  long kdst = -1;
  long vdst = -1;
  if (crow >= 0 && pos < r.end) {  // else: an ignored cache row, or past the capacity
    if (paged) {
      const int page = pos / P.page_size;
      const long blk = kv_block(block_table + long(b) * P.bt_stride_b, page, P.cache_rows);
      const long off = long(pos - page * P.page_size);
      if (blk >= 0) {
        kdst = blk * P.kc_stride_b + off * P.kc_stride_l + long(h) * P.kc_stride_h;
        vdst = blk * P.vc_stride_b + off * P.vc_stride_l + long(h) * P.vc_stride_h;
      }
    } else {
      kdst = long(crow) * P.kc_stride_b + long(pos) * P.kc_stride_l + long(h) * P.kc_stride_h;
      vdst = long(crow) * P.vc_stride_b + long(pos) * P.vc_stride_l + long(h) * P.vc_stride_h;
    }
  }
  meta[0] = long(b) * P.k_stride_b + long(t) * P.k_stride_l + long(h) * P.k_stride_h;
  meta[1] = kdst;
  meta[2] = long(b) * P.v_stride_b + long(t) * P.v_stride_l + long(h) * P.v_stride_h;
  meta[3] = vdst;
  meta[4] = pos;
}

// The longest row: latent attention's 576-wide keys (one thread per element).
constant constexpr int kMaxRow = 576;

template <typename T, typename R, typename TQ>
[[kernel, max_total_threads_per_threadgroup(576)]] void kvcache_append(KVCACHE_APPEND_ARGS(T, R, TQ)) {
  threadgroup long params_words[kAppendParamWords];
  threadgroup long meta[5];
  threadgroup float k_stage[kMaxRow];  // quantized caches: the rotated k row
  threadgroup float red_k[64];         // and the group reductions of k and v
  threadgroup float red_v[64];
  if (tid < kAppendParamWords) params_words[tid] = reinterpret_cast<const constant long*>(&p)[tid];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  const threadgroup AppendParams& P = *reinterpret_cast<const threadgroup AppendParams*>(params_words);
  if (tid == 0) locate_row(P, long(tgid), cache_seqlens, batch_idx, block_table, meta);
  threadgroup_barrier(mem_flags::mem_threadgroup);

  const long dst = meta[1];
  if (dst < 0) return;
  const bool is_kv = !has_rotary || long(tgid) < long(P.kv_rows);
  const bool quantized = kv_affine || kv_symmetric;
  const int D = P.head_dim;
  const int Dv = P.head_dim_v;
  const int c = int(tid);
  if (is_kv && !quantized && c < Dv) vc[meta[3] + c] = v[meta[2] + c];
  // Work item c: the rotary pair c (each element, cos and sin read once), then
  // the features past rotary_dim, copied: up to two outputs (index e, value y).
  const int rd = has_rotary ? P.rotary_dim : 0;
  const int half_rd = rd / 2;
  int e0 = -1, e1 = -1;
  float y0 = 0.0f, y1 = 0.0f;
  if (c < half_rd) {
    e0 = rotary_interleaved ? 2 * c : c;
    e1 = rotary_interleaved ? 2 * c + 1 : c + half_rd;
    const long row = long(min(int(meta[4]), P.seqlen_ro - 1));
    const float cs = float(rcos[row * P.cos_stride + c]);
    const float sn = float(rsin[row * P.sin_stride + c]);
    const float x0 = is_kv ? float(k[meta[0] + e0]) : float(q[meta[0] + e0]);
    const float x1 = is_kv ? float(k[meta[0] + e1]) : float(q[meta[0] + e1]);
    y0 = x0 * cs - x1 * sn;
    y1 = x0 * sn + x1 * cs;
  } else if (rd + c - half_rd < D) {
    e0 = rd + c - half_rd;
    y0 = is_kv ? float(k[meta[0] + e0]) : float(q[meta[0] + e0]);
  }
  if (!is_kv) {  // a row of q (rotary on), into the rotated q
    if (e0 >= 0) q_rot[dst + e0] = TQ(y0);
    if (e1 >= 0) q_rot[dst + e1] = TQ(y1);
    return;
  }
  if (!quantized) {
    if (e0 >= 0) kc[dst + e0] = T(y0);
    if (e1 >= 0) kc[dst + e1] = T(y1);
    return;
  }
  // Quantized caches: stage the k row as stored values (rounded to T), then quantize both rows.
  if (e0 >= 0) k_stage[e0] = float(T(y0));
  if (e1 >= 0) k_stage[e1] = float(T(y1));
  threadgroup_barrier(mem_flags::mem_threadgroup);
  const kvq::Format f = kvq::Format::make(kv_symmetric, P.kv_bits, P.kv_group_size, D);
  const kvq::Format fv = kvq::Format::make(kv_symmetric, P.kv_bits, P.kv_group_size, Dv);
  const int nsg = (int(nthreads) + 31) / 32;
  const float kx = c < D ? k_stage[c] : 0.0f;
  const float vx = c < Dv ? float(v[meta[2] + c]) : 0.0f;
  device uint* kw = reinterpret_cast<device uint*>(kc);
  device uint* vw = reinterpret_cast<device uint*>(vc);
  // Each format's scale buffers are referenced only under its own constant.
  if (kv_symmetric) {
    kvq::quantize_row<T>(kx, c, f, dst, kw, nullptr, nullptr, k_scales_sym, red_k, sg, lane, nsg);
    kvq::quantize_row<T>(vx, c, fv, meta[3], vw, nullptr, nullptr, v_scales_sym, red_v, sg, lane, nsg);
  } else {
    kvq::quantize_row<T>(kx, c, f, dst, kw, k_scales, k_biases, nullptr, red_k, sg, lane, nsg);
    kvq::quantize_row<T>(vx, c, fv, meta[3], vw, v_scales, v_biases, nullptr, red_v, sg, lane, nsg);
  }
}

// Echoes every AppendParams field (the host/kernel layout test).
[[kernel]] void kvcache_append_params_echo(constant AppendParams& p [[buffer(4)]],
                                           device long* out_l [[buffer(0)]],
                                           device int* out_i [[buffer(1)]],
                                           uint tid [[thread_position_in_grid]]) {
  if (tid != 0) return;
  const constant long* words = reinterpret_cast<const constant long*>(&p);
  for (int w = 0; w < 21; ++w) out_l[w] = words[w];
  out_i[0] = p.batch; out_i[1] = p.seqlen_new; out_i[2] = p.seqlen_q; out_i[3] = p.heads;
  out_i[4] = p.kv_heads; out_i[5] = p.head_dim; out_i[6] = p.rotary_dim; out_i[7] = p.seqlen_ro;
  out_i[8] = p.page_size; out_i[9] = p.capacity; out_i[10] = p.cache_rows; out_i[11] = p.seqlen_fixed;
  out_i[12] = p.kv_rows; out_i[13] = p.q_local; out_i[14] = p.kv_bits; out_i[15] = p.kv_group_size;
  out_i[16] = p.head_dim_v; out_i[17] = p.pad_i;
}

// ---------------------------------------------------------------------------
// Instantiations (the planner's table, torch_metal_flash/planner/kvcache.py):
// the rotary table in the cache dtype or in float32; q in the cache dtype, or
// float32 over a float16 / bfloat16 cache (whose rotary table is then float32).
// ---------------------------------------------------------------------------
#define KVCACHE_APPEND_INSTANTIATE(name, T, R, TQ)                              \
  template [[host_name("kvcache_append_" #name)]] [[kernel]] void               \
  kvcache_append<T, R, TQ>(KVCACHE_APPEND_ARGS(T, R, TQ));

KVCACHE_APPEND_INSTANTIATE(f32_rf32, float, float, float)
KVCACHE_APPEND_INSTANTIATE(f16_rf16, half, half, half)
KVCACHE_APPEND_INSTANTIATE(f16_rf32, half, float, half)
KVCACHE_APPEND_INSTANTIATE(bf16_rbf16, bfloat, bfloat, bfloat)
KVCACHE_APPEND_INSTANTIATE(bf16_rf32, bfloat, float, bfloat)
KVCACHE_APPEND_INSTANTIATE(f16_rf32_qf32, half, float, float)
KVCACHE_APPEND_INSTANTIATE(bf16_rf32_qf32, bfloat, float, float)
