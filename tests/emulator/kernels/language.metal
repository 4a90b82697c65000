// The MSL subset: vectors, constructors, swizzles, as_type, math, select/clamp/dot,
// integer and bit ops, half rounding, bfloat, enums/constexpr, #include, built-in types.
#define METAL_FUNC_INLINE inline
#include "lang_helpers.h"

kernel void vectors(device float* out [[buffer(0)]], device const half4* h [[buffer(1)]],
                    device uint* bits [[buffer(2)]], constant Params& p [[buffer(3)]],
                    uint gid [[thread_position_in_grid]]) {
  if (gid != 0) return;
  float2 f2 = float2(1.0f, 2.0f);
  float4 a = float4(f2, 3.0f, 4);           // concatenate, int converts
  float4 b = float4(h[0]);                  // convert half4 -> float4
  float4 c = float4(0.5f);                  // splat
  float3 d = float3(a.xy, 7.0f);
  a.xz = float2(10.0f, 30.0f);              // swizzle write
  int4 iv = int4(a);
  uint2 u2 = uint2(5);
  out[0] = a.x + a.y + a.z + a.w;           // 10 + 2 + 30 + 4
  out[1] = dot(b, c);
  out[2] = d.z + float(iv.w) + float(u2.y);
  out[3] = length(float2(3, 4));
  out[4] = select(1.0f, 2.0f, a.x > 5.0f);
  float4 s = select(float4(0), float4(1), a > float4(5));
  out[5] = s.x * 1000 + s.y * 100 + s.z * 10 + s.w;
  out[6] = clamp(12.0f, 0.0f, 10.0f) + saturate(-1.0f);
  out[7] = metal::fast::exp2(3.0f) + metal::precise::sqrt(16.0f) + metal::log2(8.0f);
  out[8] = fmax(1.0f, NAN) + fmin(-1.0f, 2.0f) + abs(-2.5f) + floor(2.7f) + ceil(2.2f) + fract(1.25f);
  out[9] = as_type<float>(0x3f800000u);
  bits[0] = as_type<uint>(1.0f);
  bits[1] = popcount(0xF0F0u) + clz(1u) * 100 + ctz(8u) * 10000;
  bits[2] = (7u << 4) | (0xFFu & 0x0Fu) ^ 1u;
  bits[3] = extract_bits(0xABCDu, 4u, 8u);
  bits[4] = as_type<uint>(half2(1.0h, -2.0h));
  bits[5] = uint(int(-7) / 2 + 100) + uint(-7 % 3 + 10) * 1000;
  out[10] = apply<float, Op::Add>(2.0f, 3.0f) * kScale + apply<float, Op::Mul>(2.0f, 3.0f);
  out[11] = float(p.n) + p.alpha + float(p.ivec.w) + p.p3.y + p.tail;
  float acc = 0;
#pragma clang loop unroll(full)
  for (int i = 0; i < 4; i++) acc += float(i);
  out[12] = acc;
  out[13] = max(float3(1, 5, 3), 2.0f).x + min(int2(4, -4), int2(0, 0)).y;
  out[14] = mix(0.0f, 10.0f, 0.25f) + step(0.5f, 0.7f) + sign(-3.0f);
  out[15] = numeric_limits<half>::max() == half(65504) ? 1.0f : 0.0f;
  out[16] = is_floating_point_v<half> && is_floating_point_v<bfloat> && !is_floating_point_v<int> ? 1.0f : 0.0f;
  out[17] = M_PI_F;
  out[18] = float(bfloat(1.0f) + bfloat(0.00390625f));   // bf16 rounding: 1 + 2^-8 ties to even -> 1
  out[19] = metal::isinf(INFINITY) && metal::isnan(NAN) ? 1.0f : 0.0f;
}

// half arithmetic rounds after every operation, as on the GPU.
kernel void half_math(device const half* a [[buffer(0)]], device const half* b [[buffer(1)]],
                      device half* out [[buffer(2)]], uint i [[thread_position_in_grid]]) {
  half x = a[i], y = b[i];
  half t = x * y + x;           // two roundings
  t = t * half(0.1h) - y;
  out[i] = t / (y + 3.0h);
}

kernel void builtins(device uint* out [[buffer(0)]],
                     uint3 gpos [[thread_position_in_grid]], ushort2 tpos [[thread_position_in_threadgroup]],
                     uint2 tgpos [[threadgroup_position_in_grid]], uint3 tptg [[threads_per_threadgroup]],
                     uint3 tgpg [[threadgroups_per_grid]], ushort tidx [[thread_index_in_threadgroup]],
                     uint sgi [[simdgroup_index_in_threadgroup]], ushort lane [[thread_index_in_simdgroup]],
                     uint nsg [[simdgroups_per_threadgroup]], uint w [[thread_execution_width]],
                     uint tpsg [[threads_per_simdgroup]], uint3 grid [[threads_per_grid]]) {
  uint i = gpos.z * grid.y * grid.x + gpos.y * grid.x + gpos.x;
  device uint* o = out + i * 16;
  o[0] = gpos.x; o[1] = gpos.y; o[2] = gpos.z;
  o[3] = tpos.x; o[4] = tpos.y;
  o[5] = tgpos.x; o[6] = tgpos.y;
  o[7] = tptg.x; o[8] = tptg.y; o[9] = tgpg.x;
  o[10] = tidx; o[11] = sgi; o[12] = lane; o[13] = nsg; o[14] = w + tpsg; o[15] = tgpg.y;
}

kernel void atomics(device atomic_uint* counter [[buffer(0)]], device atomic_float* fsum [[buffer(1)]],
                    device atomic_int* imax [[buffer(2)]], device uint* per_tg [[buffer(3)]],
                    device const float* x [[buffer(4)]], uint gid [[thread_position_in_grid]],
                    uint tid [[thread_index_in_threadgroup]], uint tg [[threadgroup_position_in_grid]]) {
  threadgroup atomic_uint local;
  if (tid == 0) atomic_store_explicit(&local, 0u, memory_order_relaxed);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  atomic_fetch_add_explicit(&local, 1u, memory_order_relaxed);
  atomic_fetch_add_explicit(counter, 1u, memory_order_relaxed);
  atomic_fetch_add_explicit(fsum, x[gid], memory_order_relaxed);
  atomic_fetch_max_explicit(imax, int(x[gid] * 1000), memory_order_relaxed);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (tid == 0) per_tg[tg] = atomic_load_explicit(&local, memory_order_relaxed);
}

// Dynamic threadgroup memory: [[threadgroup(n)]] parameters.
kernel void tg_param(device const float* x [[buffer(0)]], device float* y [[buffer(1)]],
                     threadgroup float* scratch [[threadgroup(0)]], threadgroup int* other [[threadgroup(1)]],
                     uint tid [[thread_index_in_threadgroup]], uint n [[threads_per_threadgroup]],
                     uint gid [[thread_position_in_grid]]) {
  scratch[tid] = x[gid];
  if (tid == 0) other[0] = 7;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  y[gid] = scratch[n - 1 - tid] + float(other[0]);
}
