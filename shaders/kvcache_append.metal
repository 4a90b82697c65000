// The append step of flash_attn_with_kvcache: rotary embedding of the new k
// (and of q), and the write of the new k/v rows into the cache, contiguous or
// paged, at the positions read on the GPU (kvcache_index.h).
//
// kvcache_append_<dtype>_r<rotary dtype>
//   One threadgroup per row, one thread per feature (head_dim <= 256):
//   rows [0, kv_rows) are the (b, t, h) rows of the new k/v (b-major), written
//   to cache position base_b + t; the rest, when rotary is on, are the
//   (b, i, h) rows of q, rotated into a scratch q at position base_b + i
//   (q_local: causal or windowed) or base_b.  No barriers, no threadgroup
//   memory; a row whose destination is ignored (kvcache_index.h) returns.
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

// Feature c of the row x rotated to position pos (copied when c >= rotary_dim).
template <typename T, typename R>
inline T rotate(const device T* x, int c, int pos, const device R* rcos, const device R* rsin,
                constant AppendParams& p) {
  const int rd = has_rotary ? p.rotary_dim : 0;
  if (c >= rd) return x[c];
  const int half_rd = rd / 2;
  const bool first = rotary_interleaved ? (c & 1) == 0 : c < half_rd;
  const int f = rotary_interleaved ? c / 2 : (first ? c : c - half_rd);
  const int partner = rotary_interleaved ? (c ^ 1) : (first ? c + half_rd : c - half_rd);
  const long row = long(min(pos, p.seqlen_ro - 1));
  const float cs = float(rcos[row * p.cos_stride + f]);
  const float sn = float(rsin[row * p.sin_stride + f]);
  const float self = float(x[c]);
  const float other = float(x[partner]);
  return T(first ? self * cs - other * sn : other * sn + self * cs);
}

template <typename T, typename R>
[[kernel, max_total_threads_per_threadgroup(256)]] void kvcache_append(KVCACHE_APPEND_ARGS(T, R)) {
  const int c = int(tid);
  if (c >= p.head_dim) return;
  long row = long(tgid);
  const bool is_kv = !has_rotary || row < long(p.kv_rows);  // q rows exist only with rotary
  if (!is_kv) row -= p.kv_rows;
  const int nh = is_kv ? p.kv_heads : p.heads;
  const int nl = is_kv ? p.seqlen_new : p.seqlen_q;
  const int h = int(row % nh);
  const int t = int((row / nh) % nl);  // new row t, or query row
  const int b = int(row / (long(nh) * nl));

  const int crow = has_batch_idx ? kv_cache_row(batch_idx[b], p.cache_rows) : b;
  const KvRow r = kv_row(has_seqlens ? cache_seqlens[b] : p.seqlen_fixed, 0, crow < 0, p.seqlen_new, p.capacity);
  if (!is_kv) {
    const int pos = r.base + (p.q_local ? t : 0);
    const device T* src = q + long(b) * p.q_stride_b + long(t) * p.q_stride_l + long(h) * p.q_stride_h;
    q_rot[long(b) * p.qr_stride_b + long(t) * p.qr_stride_l + long(h) * p.qr_stride_h + c] =
        rotate(src, c, pos, rcos, rsin, p);
    return;
  }
  const int pos = r.base + t;
  if (crow < 0 || pos >= r.end) return;  // ignored cache row, or past the capacity
  long kdst = long(h) * p.kc_stride_h;
  long vdst = long(h) * p.vc_stride_h;
  if (paged) {
    const int page = pos / p.page_size;
    const long blk = kv_block(block_table + long(b) * p.bt_stride_b, page, p.cache_rows);
    if (blk < 0) return;
    const long off = long(pos - page * p.page_size);
    kdst += blk * p.kc_stride_b + off * p.kc_stride_l;
    vdst += blk * p.vc_stride_b + off * p.vc_stride_l;
  } else {
    kdst += long(crow) * p.kc_stride_b + long(pos) * p.kc_stride_l;
    vdst += long(crow) * p.vc_stride_b + long(pos) * p.vc_stride_l;
  }
  const device T* ksrc = k + long(b) * p.k_stride_b + long(t) * p.k_stride_l + long(h) * p.k_stride_h;
  kc[kdst + c] = rotate(ksrc, c, pos, rcos, rsin, p);
  vc[vdst + c] = v[long(b) * p.v_stride_b + long(t) * p.v_stride_l + long(h) * p.v_stride_h + c];
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
