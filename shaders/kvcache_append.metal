// The append step of flash_attn_with_kvcache: rotary embedding of the new k
// (and of q), and the write of the new k/v rows into the cache, contiguous or
// paged, at the positions read on the GPU (kvcache_index.h).
//
// kvcache_append_<dtype>_r<rotary dtype>
//   One threadgroup per row, 32 * ceil(head_dim / 32) threads (head_dim <= 256):
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
// Buffers: 0 k, 1 v (B, Lnew, Hkv, D), 2 k_cache, 3 v_cache, 4 AppendParams,
// 5 cache_seqlens (int, (B,)), 6 cache_batch_idx (int), 7 block_table (int),
// 8 rotary_cos, 9 rotary_sin (R, (seqlen_ro, rotary_dim / 2)), 10 q (B, Lq, Hq, D),
// 11 rotated q.
#include <metal_stdlib>
#include "kvcache_index.h"

using namespace metal;

// Host mirror: torch_metal_flash/planner/kvcache.py (AppendParams, ctypes).
struct AppendParams {
  long k_stride_b, k_stride_l, k_stride_h;     // new k, v: (B, Lnew, Hkv, D)
  long v_stride_b, v_stride_l, v_stride_h;
  long kc_stride_b, kc_stride_l, kc_stride_h;  // caches: (B_cache | num_blocks, L_max | page_size, Hkv, D)
  long vc_stride_b, vc_stride_l, vc_stride_h;
  long q_stride_b, q_stride_l, q_stride_h;     // q: (B, Lq, Hq, D)
  long qr_stride_b, qr_stride_l, qr_stride_h;  // rotated q
  long bt_stride_b;                            // block_table row stride
  long cos_stride, sin_stride;                 // rotary table row strides
  int batch, seqlen_new, seqlen_q, heads;
  int kv_heads, head_dim, rotary_dim, seqlen_ro;
  int page_size, capacity, cache_rows, seqlen_fixed;  // seqlen_fixed: cache_seqlens when no tensor is given
  int kv_rows, q_local;                        // kv_rows = B * Lnew * Hkv
};

constant bool paged [[function_constant(0)]];
constant bool has_seqlens [[function_constant(1)]];
constant bool has_batch_idx [[function_constant(2)]];
constant bool has_rotary [[function_constant(3)]];
constant bool rotary_interleaved [[function_constant(4)]];

#define KVCACHE_APPEND_ARGS(T, R)                                                      \
  const device T* k [[buffer(0)]], const device T* v [[buffer(1)]],                     \
      device T* kc [[buffer(2)]], device T* vc [[buffer(3)]],                           \
      constant AppendParams& p [[buffer(4)]],                                           \
      const device int* cache_seqlens [[buffer(5), function_constant(has_seqlens)]],    \
      const device int* batch_idx [[buffer(6), function_constant(has_batch_idx)]],      \
      const device int* block_table [[buffer(7), function_constant(paged)]],            \
      const device R* rcos [[buffer(8), function_constant(has_rotary)]],                \
      const device R* rsin [[buffer(9), function_constant(has_rotary)]],                \
      const device T* q [[buffer(10), function_constant(has_rotary)]],                  \
      device T* q_rot [[buffer(11), function_constant(has_rotary)]],                    \
      uint tgid [[threadgroup_position_in_grid]], ushort tid [[thread_index_in_threadgroup]]

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

template <typename T, typename R>
[[kernel, max_total_threads_per_threadgroup(256)]] void kvcache_append(KVCACHE_APPEND_ARGS(T, R)) {
  threadgroup long params_words[kAppendParamWords];
  threadgroup long meta[5];
  if (tid < kAppendParamWords) params_words[tid] = reinterpret_cast<const constant long*>(&p)[tid];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  const threadgroup AppendParams& P = *reinterpret_cast<const threadgroup AppendParams*>(params_words);
  if (tid == 0) locate_row(P, long(tgid), cache_seqlens, batch_idx, block_table, meta);
  threadgroup_barrier(mem_flags::mem_threadgroup);

  const long dst = meta[1];
  if (dst < 0) return;
  const bool is_kv = !has_rotary || long(tgid) < long(P.kv_rows);
  const int D = P.head_dim;
  const int c = int(tid);
  if (is_kv && c < D) vc[meta[3] + c] = v[meta[2] + c];
  // Work item c: the rotary pair c (each element, cos and sin read once), then
  // the features past rotary_dim, copied.
  const device T* x = (is_kv ? k : q) + meta[0];
  device T* y = (is_kv ? kc : q_rot) + dst;
  const int rd = has_rotary ? P.rotary_dim : 0;
  const int half_rd = rd / 2;
  if (c < half_rd) {
    const int a = rotary_interleaved ? 2 * c : c;
    const int b = rotary_interleaved ? 2 * c + 1 : c + half_rd;
    const long row = long(min(int(meta[4]), P.seqlen_ro - 1));
    const float cs = float(rcos[row * P.cos_stride + c]);
    const float sn = float(rsin[row * P.sin_stride + c]);
    const float x0 = float(x[a]);
    const float x1 = float(x[b]);
    y[a] = T(x0 * cs - x1 * sn);
    y[b] = T(x0 * sn + x1 * cs);
  } else if (rd + c - half_rd < D) {
    const int e = rd + c - half_rd;
    y[e] = x[e];
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
  out_i[12] = p.kv_rows; out_i[13] = p.q_local;
}

// ---------------------------------------------------------------------------
// Instantiations (the planner's table, torch_metal_flash/planner/kvcache.py):
// the rotary table in the cache dtype or in float32.
// ---------------------------------------------------------------------------
#define KVCACHE_APPEND_INSTANTIATE(tname, T, rname, R)                                     \
  template [[host_name("kvcache_append_" #tname "_r" #rname)]] [[kernel]] void             \
  kvcache_append<T, R>(KVCACHE_APPEND_ARGS(T, R));

KVCACHE_APPEND_INSTANTIATE(f32, float, f32, float)
KVCACHE_APPEND_INSTANTIATE(f16, half, f16, half)
KVCACHE_APPEND_INSTANTIATE(f16, half, f32, float)
KVCACHE_APPEND_INSTANTIATE(bf16, bfloat, bf16, bfloat)
KVCACHE_APPEND_INSTANTIATE(bf16, bfloat, f32, float)
