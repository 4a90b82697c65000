// A small tiled FlashAttention forward, written MLX-style to exercise what real
// kernels use: templates instantiated by macros with # stringification, attribute
// lists, a params struct, function constants gating an optional buffer,
// address-space specialisations, threadgroup tiles, simdgroup_load with origin and
// transpose, multiply-accumulate, thread_elements() and simd shuffles.
//
// Q, K, V, O: [H, L|S, D] with row strides from the params; LSE: [H, L] (natural log).
// Each simdgroup owns 8 query rows; K/V tiles of BK rows stream through threadgroup memory.
#include <metal_stdlib>
#include <metal_simdgroup_matrix>
#pragma METAL internals : enable

using namespace metal;

#define METAL_FUNC inline __attribute__((always_inline))
#define ATTN_UNROLL _Pragma("clang loop unroll(full)")

struct AttnParams {
  int L, S;
  int q_head_stride, k_head_stride, v_head_stride, o_head_stride;
  int q_row_stride, k_row_stride, v_row_stride, o_row_stride;
  float scale_log2;  // softmax scale * log2(e)
};

constant bool has_mask [[function_constant(300)]];
constant bool is_causal [[function_constant(301)]];

template <typename T> struct pointer_element {};
template <typename T> struct pointer_element<thread T*> { using type = remove_cv_t<T>; };
template <typename T> struct pointer_element<device T*> { using type = remove_cv_t<T>; };
template <typename T> struct pointer_element<constant T*> { using type = remove_cv_t<T>; };
template <typename T> struct pointer_element<threadgroup T*> { using type = remove_cv_t<T>; };
template <typename T> using pointer_element_t = typename pointer_element<remove_cv_t<T>>::type;

// The (row, col) of the two elements a lane owns in an 8x8 simdgroup matrix.
METAL_FUNC short2 frag_coord(ushort lane) {
  const short qid = lane / 4;
  return short2((qid & 2) * 2 + (lane % 2) * 2, (qid & 4) + (lane / 2) % 4);
}

template <int ROWS, int D, int LD, typename Ptr>
METAL_FUNC void load_tile(threadgroup float* dst, Ptr src, int row0, int nrows, int stride, float scale, ushort tid,
                          ushort nthreads) {
  using T = pointer_element_t<Ptr>;
  static_assert(sizeof(T) <= 4, "float, half or bfloat");
  for (int i = tid; i < ROWS * D; i += nthreads) {
    const int r = i / D, c = i % D;
    dst[r * LD + c] = row0 + r < nrows ? float(src[(row0 + r) * stride + c]) * scale : 0.0f;
  }
}

template <typename T, int BQ, int BK, int D>
[[kernel, max_total_threads_per_threadgroup(BQ * 4)]] void attention(
    const device T* Q [[buffer(0)]], const device T* K [[buffer(1)]], const device T* V [[buffer(2)]],
    device T* O [[buffer(3)]], device float* LSE [[buffer(4)]], constant AttnParams& p [[buffer(5)]],
    const device bool* mask [[buffer(6), function_constant(has_mask)]],
    uint3 tg [[threadgroup_position_in_grid]], ushort sg [[simdgroup_index_in_threadgroup]],
    ushort lane [[thread_index_in_simdgroup]], ushort tid [[thread_index_in_threadgroup]]) {
  static_assert(BQ % 8 == 0 && BK % 8 == 0 && D % 8 == 0, "tiles are made of 8x8 fragments");
  constexpr int NT = BQ / 8 * 32;
  constexpr int LDQ = D + 4, LDP = BK + 4;  // padded rows
  threadgroup float Qs[BQ * LDQ];
  threadgroup float Ks[BK * LDQ], Vs[BK * LDQ];
  threadgroup float Ps[BQ * LDP];

  const int h = tg.y, q0 = tg.x * BQ;
  Q += h * p.q_head_stride;
  K += h * p.k_head_stride;
  V += h * p.v_head_stride;
  O += h * p.o_head_stride;
  load_tile<BQ, D, LDQ>(Qs, Q, q0, p.L, p.q_row_stride, p.scale_log2, tid, NT);

  simdgroup_matrix<float, 8, 8> Oacc[D / 8];
  ATTN_UNROLL for (int d = 0; d < D / 8; d++) Oacc[d] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  const short2 fc = frag_coord(lane);
  const int row = q0 + sg * 8 + fc.y;
  float m_i = -INFINITY, l_i = 0.0f;

  for (int k0 = 0; k0 < p.S; k0 += BK) {
    if (is_causal && k0 > q0 + BQ - 1) break;  // block entirely above the diagonal
    threadgroup_barrier(mem_flags::mem_threadgroup);  // everyone is done with the previous tiles
    load_tile<BK, D, LDQ>(Ks, K, k0, p.S, p.k_row_stride, 1.0f, tid, NT);
    load_tile<BK, D, LDQ>(Vs, V, k0, p.S, p.v_row_stride, 1.0f, tid, NT);
    threadgroup_barrier(mem_flags::mem_threadgroup);

    // S = Q K^T for this simdgroup's 8 rows
    simdgroup_matrix<float, 8, 8> Sf[BK / 8];
    ATTN_UNROLL for (int j = 0; j < BK / 8; j++) {
      Sf[j] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
      ATTN_UNROLL for (int d = 0; d < D / 8; d++) {
        simdgroup_matrix<float, 8, 8> qa, kb;
        simdgroup_load(qa, Qs, LDQ, ulong2(d * 8, sg * 8));
        simdgroup_load(kb, Ks, LDQ, ulong2(d * 8, j * 8), true);
        simdgroup_multiply_accumulate(Sf[j], qa, kb, Sf[j]);
      }
    }

    // online softmax (log2 domain); a row's 8 values live in lanes l, l^1, l^8, l^9
    float rowmax = m_i;
    ATTN_UNROLL for (int j = 0; j < BK / 8; j++) {
      ATTN_UNROLL for (int e = 0; e < 2; e++) {
        const int col = k0 + j * 8 + fc.x + e;
        bool keep = col < p.S && row < p.L;
        if (is_causal) keep = keep && col <= row;
        if (has_mask) keep = keep && mask[row * p.S + col];
        const float s = keep ? Sf[j].thread_elements()[e] : -INFINITY;
        Sf[j].thread_elements()[e] = s;
        rowmax = max(rowmax, s);
      }
    }
    rowmax = max(rowmax, simd_shuffle_xor(rowmax, 1));
    rowmax = max(rowmax, simd_shuffle_xor(rowmax, 8));
    const float alpha = rowmax == -INFINITY ? 1.0f : fast::exp2(m_i - rowmax);
    float rowsum = 0.0f;
    ATTN_UNROLL for (int j = 0; j < BK / 8; j++) {
      ATTN_UNROLL for (int e = 0; e < 2; e++) {
        const float s = Sf[j].thread_elements()[e];
        const float pv = rowmax == -INFINITY ? 0.0f : fast::exp2(s - rowmax);
        Sf[j].thread_elements()[e] = pv;
        rowsum += pv;
      }
    }
    rowsum += simd_shuffle_xor(rowsum, 1);
    rowsum += simd_shuffle_xor(rowsum, 8);
    l_i = l_i * alpha + rowsum;
    m_i = rowmax;
    ATTN_UNROLL for (int d = 0; d < D / 8; d++) Oacc[d].thread_elements() *= alpha;

    // O += P V (P goes through threadgroup memory: only this simdgroup's rows)
    ATTN_UNROLL for (int j = 0; j < BK / 8; j++) simdgroup_store(Sf[j], Ps, LDP, ulong2(j * 8, sg * 8));
    simdgroup_barrier(mem_flags::mem_threadgroup);
    ATTN_UNROLL for (int d = 0; d < D / 8; d++) {
      ATTN_UNROLL for (int j = 0; j < BK / 8; j++) {
        simdgroup_matrix<float, 8, 8> pa, vb;
        simdgroup_load(pa, Ps, LDP, ulong2(j * 8, sg * 8));
        simdgroup_load(vb, Vs, LDQ, ulong2(d * 8, j * 8));
        simdgroup_multiply_accumulate(Oacc[d], pa, vb, Oacc[d]);
      }
    }
  }

  if (row < p.L) {
    const float inv = l_i > 0.0f ? 1.0f / l_i : 0.0f;
    ATTN_UNROLL for (int d = 0; d < D / 8; d++) {
      const float2 v = Oacc[d].thread_elements() * inv;
      O[row * p.o_row_stride + d * 8 + fc.x] = static_cast<T>(v.x);
      O[row * p.o_row_stride + d * 8 + fc.x + 1] = static_cast<T>(v.y);
    }
    if (fc.x == 0) LSE[h * p.L + row] = l_i > 0.0f ? (m_i + metal::log2(l_i)) * M_LN2_F : -INFINITY;
  }
}

#define instantiate_attention(tname, type, bq, bk, d)                                              \
  template [[host_name("attention_" #tname "_bq" #bq "_bk" #bk "_d" #d)]] [[kernel]]             \
  decltype(attention<type, bq, bk, d>) attention<type, bq, bk, d>;
#define instantiate_attention_dims(tname, type) \
  instantiate_attention(tname, type, 16, 16, 32) instantiate_attention(tname, type, 16, 8, 64)

instantiate_attention_dims(float32, float)
instantiate_attention_dims(float16, half)
instantiate_attention_dims(bfloat16, bfloat)
