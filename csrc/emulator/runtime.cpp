// The emulator runtime: runs one Metal compute dispatch on the CPU.
//
// Each GPU thread is a fiber; one OS thread runs one threadgroup at a time.
// A simdgroup runs until every lane waits (at a simd collective, a barrier)
// or has exited; collectives then complete for the lanes waiting at the same
// call site, and the threadgroup barrier completes when every live thread
// waits at the same barrier.  Simdgroups are scheduled independently, in the
// order the launch asks for (forward / reverse / random), so a missing barrier
// shows up as a race (checked mode) or as poisoned threadgroup memory.
//
// Checked mode: the kernel translation unit is built with SanitizerCoverage
// load/store callbacks (below), which count device bytes exactly, bounds-check
// every access and keep per-byte shadow state to find data races.
//
// Errors never take the process down: they are reported through MtlError,
// faults in kernel code are turned into errors by a signal handler that jumps
// back to the scheduler, and a watchdog interrupts kernels that never finish.
//
// One translation unit, one concern per part: this file holds the types, the
// API the shim calls, the checked-build callbacks and the launch; runtime/
// holds signals.h (faults, watchdog), scheduler.h (workers, fibers,
// collectives, barriers), race_detector.h (bounds and races in checked
// builds), staging.h (guarded copies of the buffers) and atomics.h.
#include "mtl_abi.h"
#include "fiber.h"

#include <dlfcn.h>
#if defined(__APPLE__)
#include <mach-o/dyld.h>
#include <mach-o/loader.h>
#else
#include <link.h>
#endif
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

#define RT_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

constexpr size_t kStackBytes = 256 * 1024;
constexpr size_t kScratchBytes = 64 * 1024;
constexpr size_t kThreadInfoBytes = 512;
constexpr size_t kTgLimit = 32 * 1024;        // Apple GPUs: 32 KiB per threadgroup
constexpr size_t kArenaBytes = 256 * 1024;    // room to detect overflows past the limit
constexpr size_t kRedzone = 64;               // between threadgroup variables
constexpr size_t kGuardBytes = 16u << 20;     // around each staged buffer
// Regions larger than this are bound in place instead of staged: huge, sparsely
// touched views (element offsets beyond 2^32 over lazily committed memory) must not
// be copied.  Checked mode still checks every access exactly; fast mode has no guard
// zones there, and writes reach the caller's memory even when the launch fails.
constexpr size_t kDirectBytes = size_t(256) << 20;
constexpr int kMaxTgVars = 256;
constexpr int kSimd = 32;
#if defined(__APPLE__)
constexpr int kWatchdogSignal = SIGURG;
#else
constexpr int kWatchdogSignal = SIGURG;       // default action: ignore (safe if it arrives late)
#endif

enum FState { F_READY, F_RUNNING, F_WAIT_COLL, F_WAIT_BARRIER, F_DONE };

struct Fiber {
  void* sp;
  char* stack_lo;
  char* stack_hi;
  int state;
  MtlCollRec* rec;
  uint32_t index, lane, sg;
  uint32_t pos[3];
};

// Race-detection shadow: one per byte.  iv = barrier interval (0 = never
// accessed); th = thread index in its threadgroup, 0x8000|sg = several readers
// of one simdgroup, 0xFFFF = readers of several simdgroups; ep = simdgroup
// sync epoch.
struct Stamp { uint32_t iv; uint16_t th; uint16_t ep; };
struct Shadow { Stamp w, r; void* wpc; void* rpc; };

struct Region {          // a staging copy of one or more overlapping bindings
  bool direct;             // bound in place (no copy, no guard zones): see kDirectBytes
  char* map; size_t map_len;
  char* data; size_t len;   // data = staging copy of host[0, len)
  char* host;
  bool writable;
  Shadow* shadow;
};
struct Bind { int index; char* dev; uint64_t nbytes; int region; };
struct Segment { uintptr_t lo, hi; };

struct Launch;

struct TgVar { const void* key; char* ptr; size_t size; };

// A store whose value is checked once it has happened (race_detector.h, check_simd_store).
struct PendingStore {
  uintptr_t a; size_t size; uint32_t mask;  // mask: the bytes to check (0 = nothing pending)
  unsigned char old[16];
  bool device; uint64_t off; int bindex;
  Stamp prev; void* prev_pc; void* pc;
};

struct Worker {
  // memory, reused across launches
  char* pool = nullptr; size_t pool_len = 0; int cap_fibers = 0;
  char* scratch = nullptr;
  Fiber* fibers = nullptr;
  char* arena = nullptr;
  Shadow* tg_shadow = nullptr;
  size_t page = 4096;
  // per launch / threadgroup
  Launch* L = nullptr;
  void* sched_sp = nullptr;
  Fiber* volatile cur = nullptr;
  sigjmp_buf jb;
  volatile int jb_active = 0;
  volatile int timeout_flag = 0;
  volatile int fault_sig = 0;
  void* volatile fault_addr = nullptr;
  void* volatile fault_pc = nullptr;
  volatile int fault_write = -1;
  uint32_t tg_pos[3], tg_size[3], n = 0, nsg = 0;
  uint32_t iv = 0, tg_start_iv = 0;
  uint16_t sg_epoch[kSimd];
  TgVar tgvars[kMaxTgVars]; int ntgvars = 0;
  size_t arena_used = 0, arena_dirty = 0, tg_bytes = 0;
  void** bufptr = nullptr;   // in scratch (private to the kernel's view)
  void** tgptr = nullptr;
  MtlStats st;
  uint64_t rng = 1;
  PendingStore pending{};
  int sg_order[kSimd];
  int lane_order[kSimd];
  pthread_t thread;
  char* altstack = nullptr;  // signal stack while this worker runs
};

struct Launch {
  const MtlLaunch* d;
  bool checked;
  std::vector<Region> regions;
  std::vector<Bind> binds;
  std::vector<Segment> segs;
  void* bufptr[MTL_MAX_BUFFERS];
  uint32_t ntg[3];
  std::vector<uint32_t> tg_order;
  std::atomic<uint32_t> next_tg{0};
  std::atomic<int> failed{0};
  std::mutex err_mu;
  std::vector<uint32_t> tg_first_iv;    // checked: interval where each run threadgroup started
  std::vector<uint32_t> tg_lin;         // checked: linear index of each run threadgroup
};

std::atomic<uint32_t> g_iv{0};  // barrier intervals, unique per process

thread_local Worker* tls_w __attribute__((tls_model("initial-exec"))) = nullptr;

// ---------------------------------------------------------------- utilities

uint64_t rng_next(uint64_t& s) {
  s += 0x9E3779B97F4A7C15ull;
  uint64_t z = s;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

template <class T>
void shuffle(T* a, int n, uint64_t& s) {
  for (int i = n - 1; i > 0; i--) {
    int j = (int)(rng_next(s) % (uint64_t)(i + 1));
    T t = a[i]; a[i] = a[j]; a[j] = t;
  }
}

double now_s() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

uint64_t pc_offset(void* pc) {
  if (!pc) return 0;
  Dl_info info;
  if (dladdr(pc, &info) && info.dli_fbase) return (uint64_t)((char*)pc - (char*)info.dli_fbase);
  return 0;
}

void thread_pos(Worker* w, uint32_t index, uint32_t out[3]) {
  out[0] = index % w->tg_size[0];
  out[1] = (index / w->tg_size[0]) % w->tg_size[1];
  out[2] = index / (w->tg_size[0] * w->tg_size[1]);
}

// Records the launch's first error.  `thread` < 0: no particular thread.
__attribute__((format(printf, 6, 7)))
void set_error(Worker* w, int code, int thread, const char* file, int line, const char* fmt, ...) {
  Launch* L = w->L;
  std::lock_guard<std::mutex> g(L->err_mu);
  if (L->failed.load()) return;
  MtlError* e = L->d->err;
  e->code = code;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(e->msg, sizeof e->msg, fmt, ap);
  va_end(ap);
  memcpy(e->tg, w->tg_pos, sizeof e->tg);
  e->has_thread = thread >= 0;
  if (thread >= 0) thread_pos(w, (uint32_t)thread, e->thread_pos);
  if (file) snprintf(e->file, sizeof e->file, "%s", file);
  e->line = line;
  L->failed.store(1);
}

// Leaves the current fiber for good after an error (the launch is aborted).
[[noreturn]] void abort_fiber(Worker* w) {
  Fiber* f = w->cur;
  f->state = F_DONE;
  mtl_fiber_switch(&f->sp, w->sched_sp);
  __builtin_trap();
}

#include "runtime/signals.h"
#include "runtime/scheduler.h"
#include "runtime/race_detector.h"
#include "runtime/staging.h"

}  // namespace

// ---------------------------------------------------------------- API for the shim

RT_EXPORT void __mtl_rt_collective(MtlCollRec* r) {
  Worker* w = tls_w;
  Fiber* f = w->cur;
  r->lane = f->lane;
  f->rec = r;
  f->state = r->kind == MTL_C_TG_BARRIER ? F_WAIT_BARRIER : F_WAIT_COLL;
  mtl_fiber_switch(&f->sp, w->sched_sp);
}

RT_EXPORT uint32_t __mtl_rt_lane(void) { return tls_w->cur->lane; }

RT_EXPORT int __mtl_rt_tensor_layout(void) { return tls_w->L->d->tensor_layout; }

RT_EXPORT void* __mtl_rt_tg_alloc(const void* key, uint64_t size, uint64_t align, const char* file, uint32_t line) {
  Worker* w = tls_w;
  for (int i = 0; i < w->ntgvars; i++)
    if (w->tgvars[i].key == key) return w->tgvars[i].ptr;
  void* p = arena_alloc(w, key, size, align);
  if (!p || w->tg_bytes > kTgLimit) {
    if (!p) w->tg_bytes += size;
    fail_tg_memory(w, (int)w->cur->index, file, (int)line);
    abort_fiber(w);
  }
  return p;
}

RT_EXPORT void __mtl_rt_fail(int code, const char* msg, const char* file, uint32_t line) {
  Worker* w = tls_w;
  set_error(w, code ? code : MTL_E_GENERIC, w->cur ? (int)w->cur->index : -1, file, (int)line, "%s", msg);
  if (w->cur) abort_fiber(w);
}

#include "runtime/atomics.h"

// ---------------------------------------------------------------- alignment checks (checked builds)
// -fsanitize=alignment checks every typed access against its type's
// alignment (vector types: their size, up to 16 bytes).  Apple GPUs need
// aligned accesses; x86 would tolerate these silently.
namespace {
struct UbsanLocation { const char* file; uint32_t line, column; };
struct UbsanType { uint16_t kind, info; char name[1]; };
struct UbsanTypeMismatch { UbsanLocation loc; const UbsanType* type; unsigned char log_align, check_kind; };

[[noreturn]] void misaligned(UbsanTypeMismatch* d, uintptr_t a) {
  Worker* w = tls_w;
  static const char* kinds[] = {"load", "store", "reference binding", "member access", "member call",
                                "constructor call"};
  const char* what = d->check_kind < 6 ? kinds[d->check_kind] : "access";
  char where[160];
  int region;
  if (w && w->L && a - (uintptr_t)w->arena < kArenaBytes)
    snprintf(where, sizeof where, "threadgroup memory (arena offset %llu)", (unsigned long long)(a - (uintptr_t)w->arena));
  else if (w && w->L && find_bind(w->L, a, 1, &region) >= 0) {
    Bind& B = w->L->binds[find_bind(w->L, a, 1, &region)];
    snprintf(where, sizeof where, "device buffer %d (byte offset %llu)", B.index, (unsigned long long)(a - (uintptr_t)B.dev));
    w->L->d->err->buffer = B.index;
  } else
    snprintf(where, sizeof where, "thread memory");
  if (w && w->L && w->cur) {
    set_error(w, MTL_E_MISALIGNED, (int)w->cur->index, d->loc.file, (int)d->loc.line,
              "misaligned %s of type %s in %s: the address is not a multiple of its %u-byte alignment "
              "(Apple GPUs need aligned accesses; use a packed type or aligned offsets)",
              what, d->type->name, where, 1u << d->log_align);
    abort_fiber(w);
  }
  __builtin_trap();
}
}  // namespace

RT_EXPORT void __ubsan_handle_type_mismatch_v1_abort(UbsanTypeMismatch* d, uintptr_t ptr) {
  if (ptr && (ptr & ((uintptr_t(1) << d->log_align) - 1))) misaligned(d, ptr);
}
RT_EXPORT void __ubsan_handle_type_mismatch_v1(UbsanTypeMismatch* d, uintptr_t ptr) {
  __ubsan_handle_type_mismatch_v1_abort(d, ptr);
}

// ---------------------------------------------------------------- SanitizerCoverage callbacks

#define MTL_CB(n)                                                                                     \
  RT_EXPORT void __sanitizer_cov_load##n(void* p) { on_access(p, n, false, __builtin_return_address(0)); } \
  RT_EXPORT void __sanitizer_cov_store##n(void* p) { on_access(p, n, true, __builtin_return_address(0)); }
MTL_CB(1)
MTL_CB(2)
MTL_CB(4)
MTL_CB(8)
MTL_CB(16)
#undef MTL_CB
RT_EXPORT void __sanitizer_cov_trace_pc_guard_init(uint32_t*, uint32_t*) {}
RT_EXPORT void __sanitizer_cov_trace_pc_guard(uint32_t*) {}
RT_EXPORT void __sanitizer_cov_8bit_counters_init(char*, char*) {}

// ---------------------------------------------------------------- launch

RT_EXPORT int mtl_abi_version(void) { return MTL_ABI_VERSION; }

RT_EXPORT int mtl_launch(const MtlLaunch* d) {
  MtlError* err = d->err;
  memset(err, 0, sizeof *err);
  err->buffer = -1;
  memset(d->stats, 0, sizeof *d->stats);
  uint64_t nthreads = (uint64_t)d->tg[0] * d->tg[1] * d->tg[2];
  if (!d->entry || nthreads == 0 || nthreads > 1024 || !d->grid[0] || !d->grid[1] || !d->grid[2]) {
    err->code = MTL_E_BAD_LAUNCH;
    snprintf(err->msg, sizeof err->msg, "bad launch: threadgroup (%u,%u,%u) must have 1..1024 threads, grid (%u,%u,%u) must be non-empty",
             d->tg[0], d->tg[1], d->tg[2], d->grid[0], d->grid[1], d->grid[2]);
    return err->code;
  }
  size_t page = (size_t)sysconf(_SC_PAGESIZE);
  Launch* L = new Launch();
  L->d = d;
  L->checked = d->checked != 0;
  memset(L->bufptr, 0, sizeof L->bufptr);
  image_segments((uintptr_t)d->entry, &L->segs);
  if (!stage_buffers(L, page)) {
    unstage_buffers(L, page, false);
    err->code = MTL_E_BAD_LAUNCH;
    snprintf(err->msg, sizeof err->msg, "could not map staging memory for the bound buffers");
    delete L;
    return err->code;
  }
  for (int i = 0; i < MTL_MAX_BUFFERS; i++)
    if (!L->bufptr[i]) L->bufptr[i] = unbound_pointer(i);
  uint64_t total = 1;
  for (int k = 0; k < 3; k++) {
    L->ntg[k] = (d->grid[k] + d->tg[k] - 1) / d->tg[k];
    total *= L->ntg[k];
  }
  L->tg_order.resize(total);
  for (uint64_t i = 0; i < total; i++) L->tg_order[i] = (uint32_t)(d->order == 1 ? total - 1 - i : i);
  uint64_t seed = d->seed * 0x2545F4914F6CDD1Dull + 12345;
  if (d->order == 2) shuffle(L->tg_order.data(), (int)total, seed);

  int nworkers = 1;
  if (!L->checked && d->max_workers > 1 && total > 1) {
    nworkers = d->max_workers;
    if ((uint64_t)nworkers > total) nworkers = (int)total;
  }
  std::vector<Worker*> ws;
  for (int i = 0; i < nworkers; i++) {
    Worker* w = worker_get((int)nthreads, L->checked);
    if (!w->pool) { err->code = MTL_E_BAD_LAUNCH; snprintf(err->msg, sizeof err->msg, "could not map fiber stacks"); break; }
    w->L = L;
    w->rng = seed + 7919 * (uint64_t)i;
    memcpy(w->bufptr, L->bufptr, sizeof L->bufptr);
    w->timeout_flag = 0;
    ws.push_back(w);
  }
  if (!err->code) {
    signals_acquire();
    std::vector<std::thread> threads;
    for (int i = 1; i < (int)ws.size(); i++) threads.emplace_back(run_worker, ws[i]);
    run_worker(ws[0]);
    for (auto& t : threads) t.join();
    signals_release();
  }
  MtlStats* st = d->stats;
  for (Worker* w : ws) {
    const uint64_t* src = (const uint64_t*)&w->st;
    uint64_t* dst = (uint64_t*)st;
    for (size_t k = 0; k < sizeof(MtlStats) / 8; k++) dst[k] += src[k];
    if (w->st.tg_peak > st->tg_peak) st->tg_peak = w->st.tg_peak;
  }
  // tg_peak is a maximum, not a sum
  st->tg_peak = 0;
  for (Worker* w : ws)
    if (w->st.tg_peak > st->tg_peak) st->tg_peak = w->st.tg_peak;
  for (Worker* w : ws) worker_put(w);
  unstage_buffers(L, page, err->code == 0);
  int code = err->code;
  delete L;
  return code;
}
