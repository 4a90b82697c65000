// Matrix types (<metal_matrix>): matrix<T, Cols, Rows> holds Cols column vectors
// vec<T, Rows>, laid out as on the GPU (a float3x3 is three 16-byte float3
// columns); m[c] is column c, m[c][r] an element.  floatCxR and halfCxR are
// declared for C, R in 2..4, as in Apple's metal_stdlib (which has no bfloat
// names: code that wants them spells matrix<bfloat, 4, 4>).
#pragma once

namespace metal {

template <typename T, int C, int R>
struct matrix {
  typedef vec<T, R> column_type;
  column_type columns[C];

  matrix() = default;
  explicit matrix(T d) {  // d on the diagonal
    for (int c = 0; c < C; c++)
      for (int r = 0; r < R; r++) columns[c][r] = c == r ? d : T(0);
  }
  template <class... V, enable_if_t<sizeof...(V) == C && (C > 1), int> = 0>
  matrix(V... v) : columns{__mtl::make_vec<T, R>(v)...} {}
#define MTL_MATRIX_AS(AS)                                                                   \
  template <class U> explicit matrix(const AS matrix<U, C, R>& m) {                        \
    for (int c = 0; c < C; c++) columns[c] = __builtin_convertvector(m.columns[c], column_type); \
  }                                                                                         \
  MTL_INLINE const AS column_type& operator[](int c) const AS { return columns[c]; }
  MTL_EACH_ADDRESS_SPACE(MTL_MATRIX_AS)
#define MTL_MATRIX_MUT(AS) MTL_INLINE AS column_type& operator[](int c) AS { return columns[c]; }
  MTL_EACH_WRITABLE_ADDRESS_SPACE(MTL_MATRIX_MUT)
#undef MTL_MATRIX_AS
#undef MTL_MATRIX_MUT
};

#define MTL_MATRIX_NAMES(T)                                                                 \
  typedef matrix<T, 2, 2> T##2x2; typedef matrix<T, 2, 3> T##2x3; typedef matrix<T, 2, 4> T##2x4; \
  typedef matrix<T, 3, 2> T##3x2; typedef matrix<T, 3, 3> T##3x3; typedef matrix<T, 3, 4> T##3x4; \
  typedef matrix<T, 4, 2> T##4x2; typedef matrix<T, 4, 3> T##4x3; typedef matrix<T, 4, 4> T##4x4;
MTL_MATRIX_NAMES(float)
MTL_MATRIX_NAMES(half)
#undef MTL_MATRIX_NAMES

template <typename T, int C, int R>
MTL_INLINE matrix<T, C, R> operator+(matrix<T, C, R> a, matrix<T, C, R> b) {
  for (int c = 0; c < C; c++) a.columns[c] += b.columns[c];
  return a;
}
template <typename T, int C, int R>
MTL_INLINE matrix<T, C, R> operator-(matrix<T, C, R> a, matrix<T, C, R> b) {
  for (int c = 0; c < C; c++) a.columns[c] -= b.columns[c];
  return a;
}
template <typename T, int C, int R>
MTL_INLINE matrix<T, C, R> operator-(matrix<T, C, R> a) {
  for (int c = 0; c < C; c++) a.columns[c] = -a.columns[c];
  return a;
}
template <typename T, int C, int R>
MTL_INLINE matrix<T, C, R> operator*(matrix<T, C, R> a, T s) {
  for (int c = 0; c < C; c++) a.columns[c] *= s;
  return a;
}
template <typename T, int C, int R>
MTL_INLINE matrix<T, C, R> operator*(T s, matrix<T, C, R> a) { return a * s; }
// matrix x column vector, row vector x matrix, matrix x matrix
template <typename T, int C, int R>
MTL_INLINE vec<T, R> operator*(matrix<T, C, R> m, vec<T, C> v) {
  vec<T, R> r = m.columns[0] * v[0];
  for (int c = 1; c < C; c++) r += m.columns[c] * v[c];
  return r;
}
template <typename T, int C, int R>
MTL_INLINE vec<T, C> operator*(vec<T, R> v, matrix<T, C, R> m) {
  vec<T, C> r;
  for (int c = 0; c < C; c++) r[c] = dot(v, m.columns[c]);
  return r;
}
template <typename T, int K, int C, int R>
MTL_INLINE matrix<T, K, R> operator*(matrix<T, C, R> a, matrix<T, K, C> b) {
  matrix<T, K, R> r;
  for (int k = 0; k < K; k++) r.columns[k] = a * b.columns[k];
  return r;
}
template <typename T, int C, int R>
MTL_INLINE bool operator==(matrix<T, C, R> a, matrix<T, C, R> b) {
  for (int c = 0; c < C; c++)
    if (!all(a.columns[c] == b.columns[c])) return false;
  return true;
}
template <typename T, int C, int R>
MTL_INLINE bool operator!=(matrix<T, C, R> a, matrix<T, C, R> b) { return !(a == b); }
template <typename T, int C, int R>
MTL_INLINE matrix<T, R, C> transpose(matrix<T, C, R> m) {
  matrix<T, R, C> t;
  for (int c = 0; c < C; c++)
    for (int r = 0; r < R; r++) t.columns[r][c] = m.columns[c][r];
  return t;
}

}  // namespace metal
