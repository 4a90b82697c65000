// The emulator runtime's types and the helpers every part uses: the launch, its workers and
// fibers, their shadow state, errors.  Each runtime header includes it, so each compiles alone.
#pragma once

#include "../mtl_abi.h"
#include "../fiber.h"

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

}  // namespace
