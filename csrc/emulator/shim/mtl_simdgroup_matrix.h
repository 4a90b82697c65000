// simdgroup_matrix<T, 8, 8>: each lane owns two elements, in the layout of
// Apple GPUs (reverse-engineered, as MLX uses it through thread_elements()):
//   qid = lane / 4; row = (qid & 4) + (lane / 2) % 4; col = (qid & 2) * 2 + (lane % 2) * 2
// lane owns (row, col) and (row, col + 1).  Loads and stores are per lane;
// multiplies are a rendezvous of all 32 lanes of the simdgroup.
#pragma once
#pragma clang system_header

namespace __mtl {
MTL_INLINE void sg_coord(uint lane, thread uint& row, thread uint& col) {
  uint qid = lane / 4;
  row = (qid & 4) + (lane / 2) % 4;
  col = (qid & 2) * 2 + (lane % 2) * 2;
}
}  // namespace __mtl

namespace metal {

template <class T, int Cols, int Rows>
struct simdgroup_matrix {
  static_assert(Cols == 8 && Rows == 8, "the emulator supports 8x8 simdgroup matrices");
  vec<T, 2> __e;
  simdgroup_matrix() = default;
  // Diagonal matrix with `d` on the diagonal.
  MTL_INLINE simdgroup_matrix(T d) {
    uint r, c;
    __mtl::sg_coord(__mtl_rt_lane(), r, c);
    __e[0] = r == c ? d : T(0);
    __e[1] = r == c + 1 ? d : T(0);
  }
  MTL_INLINE thread vec<T, 2>& thread_elements() thread { return __e; }
  MTL_INLINE const thread vec<T, 2>& thread_elements() const thread { return __e; }
};

typedef simdgroup_matrix<half, 8, 8> simdgroup_half8x8;
typedef simdgroup_matrix<bfloat, 8, 8> simdgroup_bfloat8x8;
typedef simdgroup_matrix<float, 8, 8> simdgroup_float8x8;

template <class T, int Cols, int Rows = Cols>
MTL_INLINE simdgroup_matrix<T, Cols, Rows> make_filled_simdgroup_matrix(T v) {
  simdgroup_matrix<T, Cols, Rows> m;
  m.__e = vec<T, 2>(v);
  return m;
}

// Element (r, c) of the 8x8 block is src[(origin.y + r) * elements_per_row + origin.x + c];
// with transpose it is src[(origin.y + c) * elements_per_row + origin.x + r].
template <class T, class U, int C, int R>
MTL_INLINE void simdgroup_load(thread simdgroup_matrix<T, C, R>& d, const U* src, size_t elements_per_row = C,
                               ulong2 matrix_origin = ulong2(0), bool transpose_matrix = false) {
  uint r, c;
  __mtl::sg_coord(__mtl_rt_lane(), r, c);
  const U* base = src + matrix_origin.y * elements_per_row + matrix_origin.x;
  for (int j = 0; j < 2; j++) {
    size_t off = transpose_matrix ? (size_t)(c + j) * elements_per_row + r : (size_t)r * elements_per_row + (c + j);
    d.__e[j] = static_cast<T>(base[off]);
  }
}

template <class T, class U, int C, int R>
MTL_INLINE void simdgroup_store(const thread simdgroup_matrix<T, C, R>& a, U* dst, size_t elements_per_row = C,
                                ulong2 matrix_origin = ulong2(0), bool transpose_matrix = false) {
  uint r, c;
  __mtl::sg_coord(__mtl_rt_lane(), r, c);
  U* base = dst + matrix_origin.y * elements_per_row + matrix_origin.x;
  for (int j = 0; j < 2; j++) {
    size_t off = transpose_matrix ? (size_t)(c + j) * elements_per_row + r : (size_t)r * elements_per_row + (c + j);
    base[off] = static_cast<__mtl::plain_t<U>>(a.__e[j]);
  }
}

}  // namespace metal

namespace __mtl {

template <class T>
MTL_INLINE void gather(MtlCollRec* const* L, const void* MtlCollRec::*field, float (&m)[8][8]) {
  for (uint l = 0; l < 32; l++) {
    uint r, c;
    sg_coord(l, r, c);
    const metal::vec<T, 2>& e = *(const metal::vec<T, 2>*)(L[l]->*field);
    m[r][c] = (float)e[0];
    m[r][c + 1] = (float)e[1];
  }
}

// D = A * B + C, accumulated in float (fused multiply-adds along k), rounded to D's type.
template <class TD, class TA, class TB, class TC, bool Acc>
MTL_RUNTIME_SIDE void op_mma(MtlCollRec* const* L, uint32_t) {
  float a[8][8], b[8][8], c[8][8];
  gather<TA>(L, &MtlCollRec::in, a);
  gather<TB>(L, &MtlCollRec::in2, b);
  if (Acc) gather<TC>(L, &MtlCollRec::in3, c);
  for (uint l = 0; l < 32; l++) {
    uint r, col;
    sg_coord(l, r, col);
    metal::vec<TD, 2>& e = *(metal::vec<TD, 2>*)L[l]->out;
    for (int j = 0; j < 2; j++) {
      float s = Acc ? c[r][col + j] : 0.0f;
      for (int k = 0; k < 8; k++) s = __builtin_fmaf(a[r][k], b[k][col + j], s);
      e[j] = (TD)s;
    }
  }
}

template <class TD, class TA, class TB, class TC, bool Acc>
MTL_INLINE void mma(void* d, const void* a, const void* b, const void* c, const thread Site& s) MTL_IMPL({
  MtlCollRec r;
  r.fn = &op_mma<TD, TA, TB, TC, Acc>;
  r.in = a;
  r.in2 = b;
  r.in3 = c;
  r.out = d;
  r.arg = 0;
  r.file = (const char*)(uintptr_t)s.file;
  r.line = s.line;
  r.col = s.col;
  r.kind = MTL_C_MMA;
  __mtl_rt_collective(&r);
})

}  // namespace __mtl

namespace metal {

template <class TD, class TA, class TB, class TC, int C, int R, int K>
MTL_INLINE void simdgroup_multiply_accumulate(thread simdgroup_matrix<TD, C, R>& d, const thread simdgroup_matrix<TA, K, R>& a,
                                              const thread simdgroup_matrix<TB, C, K>& b,
                                              const thread simdgroup_matrix<TC, C, R>& c, __mtl::Site s = {}) {
  __mtl::mma<TD, TA, TB, TC, true>(&d.__e, &a.__e, &b.__e, &c.__e, s);
}

template <class TD, class TA, class TB, int C, int R, int K>
MTL_INLINE void simdgroup_multiply(thread simdgroup_matrix<TD, C, R>& d, const thread simdgroup_matrix<TA, K, R>& a,
                                   const thread simdgroup_matrix<TB, C, K>& b, __mtl::Site s = {}) {
  __mtl::mma<TD, TA, TB, TD, false>(&d.__e, &a.__e, &b.__e, nullptr, s);
}

}  // namespace metal
