// The C ABI between the emulator runtime (runtime.cpp), the shim headers
// (compiled into the kernel translation unit) and the Python driver (ctypes).
// Keep in sync with torch_metal_flash/emulator/runtime.py.
#pragma once
#ifdef __MTL_SHIM__  // the kernel translation unit sees no host headers
typedef int int32_t;  // as in Metal (and mtl_types.h); same layout as <stdint.h>'s
typedef unsigned int uint32_t;
typedef unsigned long uint64_t;
#else
#include <stdint.h>
#endif

#define MTL_ABI_VERSION 6
#define MTL_MAX_BUFFERS 64
#define MTL_MAX_TG_PARAMS 32
#define MTL_MSG 2048

#ifdef __cplusplus
extern "C" {
#endif

// Built-in indices (thread position attributes); values are uint3.
enum MtlBuiltin {
  MTL_B_THREAD_POSITION_IN_GRID = 0,
  MTL_B_THREAD_POSITION_IN_THREADGROUP,
  MTL_B_THREADGROUP_POSITION_IN_GRID,
  MTL_B_THREADS_PER_THREADGROUP,
  MTL_B_THREADGROUPS_PER_GRID,
  MTL_B_THREADS_PER_GRID,
  MTL_B_THREAD_INDEX_IN_THREADGROUP,
  MTL_B_SIMDGROUP_INDEX_IN_THREADGROUP,
  MTL_B_THREAD_INDEX_IN_SIMDGROUP,
  MTL_B_SIMDGROUPS_PER_THREADGROUP,
  MTL_B_THREADS_PER_SIMDGROUP,
  MTL_B_DISPATCH_THREADS_PER_THREADGROUP,
  MTL_B_QUADGROUP_INDEX_IN_THREADGROUP,
  MTL_B_THREAD_INDEX_IN_QUADGROUP,
  MTL_B_QUADGROUPS_PER_THREADGROUP,
  MTL_B_GRID_ORIGIN,
  MTL_B_COUNT
};

// Parameter kinds in the generated kernel wrappers.
enum MtlParamKind { MTL_P_BUFFER = 1, MTL_P_THREADGROUP = 2, MTL_P_BUILTIN = 3 };

typedef struct MtlParamSpec { int32_t kind, index; } MtlParamSpec;

// What the Python side learns about each kernel parameter's C++ type.
typedef struct MtlParamInfo {
  int32_t is_pointer, is_reference;
  int32_t type_code;  // MtlTypeCode of the pointee / referee / value
  int32_t size;       // sizeof pointee / referee / value
  int32_t is_const;   // pointee / referee is const (read-only buffer)
} MtlParamInfo;

enum MtlTypeCode { MTL_T_OTHER = 0, MTL_T_BOOL, MTL_T_SINT, MTL_T_UINT, MTL_T_HALF, MTL_T_BFLOAT, MTL_T_FLOAT, MTL_T_DOUBLE };

// Per-thread information, built by the runtime on the fiber's own stack.
typedef struct MtlThreadInfo {
  void* const* buffers;          // [MTL_MAX_BUFFERS]
  void* const* tg_params;        // [MTL_MAX_TG_PARAMS]
  uint32_t builtin[MTL_B_COUNT][3];
} MtlThreadInfo;

// One lane's part in a simd collective.  The shim fills it on the lane's stack.
typedef struct MtlCollRec MtlCollRec;
#ifdef __MTL_RULES__  // the rules pass has no function pointers (and never runs)
typedef void* MtlCollFn;
#else
typedef void (*MtlCollFn)(MtlCollRec* const* lanes /*[32], NULL = inactive*/, uint32_t active_mask);
#endif
struct MtlCollRec {
  MtlCollFn fn;        // completes the collective for the active lanes (NULL = plain sync)
  const void* in;      // lane's input
  void* out;           // lane's output
  uint64_t arg;        // per-lane extra argument (shuffle lane, delta ...)
  const void* in2;     // extra inputs (matrix operands)
  const void* in3;
  const char* file;    // call site
  uint32_t line, col;
  int32_t kind;        // MtlCollKind
  uint32_t lane;       // filled by the runtime
};
// MTL_C_TENSOR_MATMUL: a tensor-op matmul2d (arg = its multiply-adds)
enum MtlCollKind { MTL_C_SIMD = 0, MTL_C_SIMD_BARRIER = 1, MTL_C_MMA = 2, MTL_C_TG_BARRIER = 3, MTL_C_TENSOR_MATMUL = 4 };

// Element-to-lane layouts of cooperative tensors, per GPU family (shim/mtl_tensor_ops.h).
enum MtlTensorLayout { MTL_LAYOUT_APPLE10 = 0, MTL_LAYOUT_APPLE8 = 1 };

#ifndef __MTL_SHIM__  // host side only
typedef struct MtlBinding {
  void* host;          // bound memory (tensor data at its storage offset)
  uint64_t nbytes;     // extent in bytes (first to last element of the view)
  int32_t index;       // [[buffer(index)]]
  int32_t writable;    // copy results back
} MtlBinding;

typedef struct MtlStats {
  uint64_t buf_read[MTL_MAX_BUFFERS], buf_written[MTL_MAX_BUFFERS];
  uint64_t device_read, device_written;
  uint64_t tg_read, tg_written;
  uint64_t tg_peak;               // threadgroup memory bytes per threadgroup (max)
  uint64_t barriers;              // completed threadgroup barriers (per threadgroup)
  uint64_t simd_collectives;      // completed simd collectives (per simdgroup)
  uint64_t simd_barriers;
  uint64_t mma;                   // simdgroup matrix multiplies (per simdgroup)
  uint64_t atomics;               // atomic operations (per thread)
  uint64_t switches;              // fiber switches
  uint64_t threadgroups, threads;
  uint64_t loads, stores;         // instrumented accesses (checked mode)
  uint64_t tensor_matmuls;        // tensor-op matmul2d runs (per simdgroup)
  uint64_t tensor_macs;           // their multiply-adds (m * n * k each)
} MtlStats;

enum MtlErrorCode {
  MTL_OK = 0, MTL_E_GENERIC = 1, MTL_E_DIVERGENT_BARRIER = 2, MTL_E_MMA_DIVERGENCE = 3,
  MTL_E_OUT_OF_BOUNDS = 4, MTL_E_TG_MEMORY = 5, MTL_E_RACE = 6, MTL_E_TIMEOUT = 7,
  MTL_E_CRASH = 8, MTL_E_BAD_LAUNCH = 9, MTL_E_FPE = 10, MTL_E_COLLECTIVE = 11, MTL_E_MISALIGNED = 12,
  MTL_E_UNBOUND = 13  // an access through a buffer argument nothing is bound to (err.buffer: its index)
};

typedef struct MtlError {
  int32_t code;
  char msg[MTL_MSG];
  uint32_t tg[3];          // threadgroup position
  uint32_t thread_pos[3];  // thread position in threadgroup
  int32_t has_thread;
  uint64_t pc_offset;      // pc relative to the kernel library (0 = unknown)
  uint64_t pc2_offset;     // the other access of a race (0 = unknown)
  char file[512];          // source location when known directly
  int32_t line;
  int32_t buffer;          // buffer index involved (-1 = none)
} MtlError;

typedef struct MtlLaunch {
  void (*entry)(MtlThreadInfo*);
  uint32_t grid[3];        // in threads
  uint32_t tg[3];          // threads per threadgroup
  int32_t order;           // 0 forward, 1 reverse, 2 random
  int32_t checked;
  uint64_t seed;
  double timeout_s;
  int32_t nbind;
  const MtlBinding* binds;
  uint64_t tg_param_bytes[MTL_MAX_TG_PARAMS];
  int32_t max_workers;     // fast mode may use several OS threads
  MtlStats* stats;
  MtlError* err;
  int32_t tensor_layout;   // cooperative-tensor layout of tensor ops: MtlTensorLayout
} MtlLaunch;

#endif

#ifdef __cplusplus
}
#endif
