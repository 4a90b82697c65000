// Valid Metal in the idioms of real kernels (tiled GEMM/attention libraries,
// llama.cpp-style argument structs): the emulator must accept all of it.
#include <metal_stdlib>
using namespace metal;

// ---------------------------------------------------------------- traits
static_assert(is_same_v<remove_addrspace_t<device float>, float>, "");
static_assert(is_same_v<remove_addrspace_t<threadgroup const half>, const half>, "");
static_assert(is_same_v<make_scalar_t<half4>, half> && is_same_v<make_scalar_t<int>, int>, "");
static_assert(vec_elements<float4>::value == 4 && vec_elements<float>::value == 0, "");
static_assert(is_scalar_v<bfloat> && !is_scalar_v<float2> && is_vector_v<ushort3>, "");
static_assert(is_floating_point_v<half> && is_integral_v<ushort> && is_signed_v<char>, "");
static_assert(is_same_v<make_unsigned_t<int>, uint> && is_same_v<make_signed_t<ulong>, long>, "");
static_assert(numeric_limits<half>::max() == half(65504.0f) && numeric_limits<uint>::max() == UINT_MAX, "");

enum : uint { BK = 16 };     // tile sizes as enumerators with a fixed underlying type
enum class Layout : ushort { RowMajor, ColMajor };

// Element type of a pointer in any address space (partial specialisations
// that differ only in the address space).
template <typename P> struct pointer_element;
template <typename T> struct pointer_element<device T*> { using type = T; };
template <typename T> struct pointer_element<threadgroup T*> { using type = T; };
template <typename T> struct pointer_element<constant T*> { using type = T; };
template <typename T> struct pointer_element<thread T*> { using type = T; };
template <typename P> using pointer_element_t = typename pointer_element<P>::type;

// A sum over n elements in blocks of BK, from any address space.
template <typename Ptr>
METAL_FUNC float block_sum(Ptr p, uint n) {
  using T = remove_cv_t<pointer_element_t<Ptr>>;
  static_assert(is_scalar_v<T>, "scalars only");
  float s = 0.0f;
  for (uint j = 0; j < n; j += BK) {
    const uint m = min(BK, n - j);  // enum and uint
    for (uint t = 0; t < m; t++) {
      s += float(p[j + t]);
    }
  }
  return s;
}

// Overloads that differ only in the address space of the pointer.
METAL_FUNC float first(device const float* p) { return p[0]; }
METAL_FUNC float first(constant float* p) { return -p[0]; }

// Member functions for objects in each address space, a constructor per
// address space and a conversion operator.
struct Accum {
  float4 v;
  Accum() thread : v(0.0f) {}
  Accum(float x) thread : v(x) {}
  METAL_FUNC float total() const thread { return v.x + v.y + v.z + v.w; }
  METAL_FUNC float total() const device { return 1000.0f + v.x + v.y + v.z + v.w; }
  METAL_FUNC float total() const constant { return 2000.0f + v.x + v.y + v.z + v.w; }
  METAL_FUNC void add(float4 x) threadgroup { v += x; }
  METAL_FUNC void add(float4 x) thread { v += x; }
  METAL_FUNC operator float() const thread { return total(); }
};

struct Params {
  float scale;
  uint n;
  Layout layout;
  metal::array<float, 4> w;
};

// integral_constant as a compile-time tile size
using Four = integral_constant<int, 4>;

kernel void idioms(device const half* xh [[buffer(0)]], constant float* xc [[buffer(1)]],
                   device const float* xd [[buffer(2)]], constant Params& p [[buffer(3)]],
                   device Accum* acc [[buffer(4)]], device float* out [[buffer(5)]],
                   constant Accum& cacc [[buffer(6)]], device metal::array<float, 4>* arr [[buffer(7)]],
                   uint lid [[thread_position_in_threadgroup]]) {
  threadgroup float tile[40];
  threadgroup Accum tacc;
  for (uint i = lid; i < 40; i += 32) tile[i] = float(i);
  if (lid == 0) tacc = Accum(0.5f);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (lid == 1) tacc.add(float4(1.0f));
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (lid != 0) return;

  out[0] = block_sum(xh, 37);
  out[1] = block_sum(xc, 37);
  out[2] = block_sum(tile, 40);
  thread const float local[3] = {1.0f, 2.0f, 3.0f};
  out[3] = block_sum(local, 3);
  out[4] = first(xd) + first(xc);  // xd[0] - xc[0]

  Params q = p;  // a copy out of constant memory
  q.scale *= 2.0f;
  out[5] = q.scale + float(q.n) + (q.layout == Layout::ColMajor ? 100.0f : 0.0f) + q.w[3] + float(q.w.size());
  out[6] = acc[0].total() + cacc.total();  // device and constant member functions
  Accum a(1.0f);
  a.add(float4(1.0f, 2.0f, 3.0f, 4.0f));
  out[7] = float(a);  // 4 + 10
  Accum b = tacc;     // a copy out of threadgroup memory
  out[8] = b.total();  // 4 * 1.5
  acc[1] = a;          // a store into device memory
  (*arr)[2] = arr->front() + float(arr->size());

  constexpr int four = Four();
  const int tiles = Four::value * 2 + Four{};
  float4 v = float4(-1.5f, 0.25f, 2.0f, 7.0f);
  float4 c = clamp(v, 0.0f, 1.0f);  // vector with scalar bounds
  float4 m = mix(v, float4(1.0f), 0.5f);
  out[9] = float(four + tiles) + c.x + c.y + c.z + c.w + m.w + max(2u, lid) + min(half(1.5h), half(3.0h));
  out[10] = fma(2.0f, 3.0f, 1.0f) + pow(2.0f, 3) + fmin(1.0f, 2) + clamp(5, 0, 3) + abs(-2) + select(1.0f, 2.0f, true);
}

// llama.cpp-style: one argument struct, byte pointers cast to typed rows,
// a threadgroup scratch parameter, simdgroup reductions, a templated kernel
// instantiated through a typedef.
struct RmsArgs {
  int32_t ne00;    // row length (multiple of 4)
  uint64_t nb01;   // row stride in bytes
  float eps;
};

template <typename T>
kernel void kernel_rms_norm(constant RmsArgs& args, device const char* src0, device char* dst,
                            threadgroup float* shmem [[threadgroup(0)]],
                            uint3 tgpig [[threadgroup_position_in_grid]],
                            ushort tpitg [[thread_position_in_threadgroup]],
                            ushort sgitg [[simdgroup_index_in_threadgroup]],
                            ushort tiisg [[thread_index_in_simdgroup]],
                            ushort ntg [[threads_per_threadgroup]]) {
  device const T* x = (device const T*)(src0 + tgpig.x * args.nb01);
  if (sgitg == 0) shmem[tiisg] = 0.0f;
  float sumf = 0.0f;
  for (int i00 = tpitg; i00 < args.ne00 / 4; i00 += ntg) {
    sumf += dot(float4(x[i00]), float4(x[i00]));
  }
  sumf = simd_sum(sumf);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (tiisg == 0) shmem[sgitg] = sumf;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  sumf = simd_sum(shmem[tiisg]);
  const float scale = 1.0f / sqrt(sumf / args.ne00 + args.eps);
  device T* y = (device T*)(dst + tgpig.x * args.nb01);
  for (int i00 = tpitg; i00 < args.ne00 / 4; i00 += ntg) {
    y[i00] = T(float4(x[i00]) * scale);
  }
}

typedef decltype(kernel_rms_norm<float4>) kernel_rms_norm_t;
template [[host_name("rms_norm_f32")]] kernel kernel_rms_norm_t kernel_rms_norm<float4>;
template [[host_name("rms_norm_f16")]] kernel kernel_rms_norm_t kernel_rms_norm<half4>;

// A launch limit that depends on a template parameter.
template <int BN>
[[kernel, max_total_threads_per_threadgroup(BN * 32)]] void scaled_copy(device const float* x [[buffer(0)]],
                                                                        device float* y [[buffer(1)]],
                                                                        uint i [[thread_position_in_grid]]) {
  y[i] = x[i] * float(BN);
}
template [[host_name("scaled_copy_2")]] [[kernel]] decltype(scaled_copy<2>) scaled_copy<2>;
