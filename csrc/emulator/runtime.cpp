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

// ---------------------------------------------------------------- signals & watchdog

std::mutex g_sig_mu;
int g_sig_users = 0;
struct sigaction g_old[65];
const int kSignals[] = {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGTRAP, kWatchdogSignal};

void* uctx_pc(void* uctx) {
  ucontext_t* uc = (ucontext_t*)uctx;
#if defined(__APPLE__) && defined(__x86_64__)
  return (void*)uc->uc_mcontext->__ss.__rip;
#elif defined(__APPLE__) && defined(__aarch64__)
  return (void*)uc->uc_mcontext->__ss.__pc;
#elif defined(__x86_64__)
  return (void*)uc->uc_mcontext.gregs[REG_RIP];
#elif defined(__aarch64__)
  return (void*)uc->uc_mcontext.pc;
#else
  return nullptr;
#endif
}

int uctx_is_write(void* uctx) {
#if defined(__x86_64__) && !defined(__APPLE__)
  ucontext_t* uc = (ucontext_t*)uctx;
  return (uc->uc_mcontext.gregs[REG_ERR] & 2) ? 1 : 0;
#else
  (void)uctx;
  return -1;
#endif
}

void on_signal(int sig, siginfo_t* si, void* uctx) {
  Worker* w = tls_w;
  if (w && w->jb_active) {
    if (sig == kWatchdogSignal) {
      w->timeout_flag = 1;
      if (!w->cur) return;  // in the scheduler: it polls the flag
    }
    w->fault_sig = sig;
    w->fault_addr = si ? si->si_addr : nullptr;
    w->fault_pc = uctx_pc(uctx);
    w->fault_write = uctx_is_write(uctx);
    siglongjmp(w->jb, 1);
  }
  if (sig == kWatchdogSignal) return;
  // Not ours: hand over to whoever was installed before us.
  struct sigaction* old = &g_old[sig];
  if (old->sa_flags & SA_SIGINFO) {
    if (old->sa_sigaction) { old->sa_sigaction(sig, si, uctx); return; }
  } else if (old->sa_handler == SIG_IGN) {
    return;
  } else if (old->sa_handler != SIG_DFL) {
    old->sa_handler(sig);
    return;
  }
  sigaction(sig, old, nullptr);  // default action: re-executing the fault now kills as usual
  if (sig != SIGSEGV && sig != SIGBUS && sig != SIGFPE && sig != SIGILL) raise(sig);
}

void signals_acquire() {
  std::lock_guard<std::mutex> g(g_sig_mu);
  if (g_sig_users++ > 0) return;
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_sigaction = on_signal;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigemptyset(&sa.sa_mask);
  for (int s : kSignals) sigaction(s, &sa, &g_old[s]);
}

void signals_release() {
  std::lock_guard<std::mutex> g(g_sig_mu);
  if (--g_sig_users > 0) return;
  for (int s : kSignals) sigaction(s, &g_old[s], nullptr);
}

struct Watch { Worker* w; pthread_t th; double deadline; };
std::mutex g_wd_mu;
std::condition_variable g_wd_cv;
std::vector<Watch> g_watches;
bool g_wd_started = false;

void watchdog_loop() {
  std::unique_lock<std::mutex> lk(g_wd_mu);
  for (;;) {
    g_wd_cv.wait_for(lk, std::chrono::milliseconds(50));
    double t = now_s();
    for (Watch& x : g_watches)
      if (t > x.deadline) {
        x.w->timeout_flag = 1;
        pthread_kill(x.th, kWatchdogSignal);
      }
  }
}

void watch_add(Worker* w, double timeout_s) {
  if (timeout_s <= 0) return;
  std::lock_guard<std::mutex> g(g_wd_mu);
  if (!g_wd_started) {
    std::thread(watchdog_loop).detach();
    g_wd_started = true;
  }
  g_watches.push_back({w, pthread_self(), now_s() + timeout_s});
}

void watch_remove(Worker* w) {
  std::lock_guard<std::mutex> g(g_wd_mu);
  for (size_t i = 0; i < g_watches.size(); i++)
    if (g_watches[i].w == w) { g_watches.erase(g_watches.begin() + i); break; }
}

// ---------------------------------------------------------------- workers

std::mutex g_pool_mu;
std::vector<Worker*> g_free_workers;

Worker* worker_get(int nthreads, bool checked) {
  Worker* w = nullptr;
  {
    std::lock_guard<std::mutex> g(g_pool_mu);
    if (!g_free_workers.empty()) { w = g_free_workers.back(); g_free_workers.pop_back(); }
  }
  if (!w) {
    w = new Worker();
    w->page = (size_t)sysconf(_SC_PAGESIZE);
    w->arena = (char*)mmap(nullptr, kArenaBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  }
  if (w->cap_fibers < nthreads) {
    if (w->pool) munmap(w->pool, w->pool_len);
    delete[] w->fibers;
    size_t per = kStackBytes + w->page;  // stack + guard page below it
    w->pool_len = kScratchBytes + per * (size_t)nthreads;
    w->pool = (char*)mmap(nullptr, w->pool_len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (w->pool == MAP_FAILED) { w->pool = nullptr; w->cap_fibers = 0; return w; }
    w->scratch = w->pool;
    w->fibers = new Fiber[nthreads];
    for (int i = 0; i < nthreads; i++) {
      char* lo = w->pool + kScratchBytes + per * (size_t)i;
      mprotect(lo, w->page, PROT_NONE);
      w->fibers[i].stack_lo = lo + w->page;
      w->fibers[i].stack_hi = lo + per;
    }
    w->cap_fibers = nthreads;
  }
  if (checked && !w->tg_shadow)
    w->tg_shadow = (Shadow*)mmap(nullptr, kArenaBytes * sizeof(Shadow), PROT_READ | PROT_WRITE,
                                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  w->bufptr = (void**)w->scratch;
  w->tgptr = (void**)(w->scratch + sizeof(void*) * MTL_MAX_BUFFERS);
  memset(&w->st, 0, sizeof w->st);
  w->arena_dirty = kArenaBytes;  // poison everything once per launch
  return w;
}

void worker_put(Worker* w) {
  w->L = nullptr;
  std::lock_guard<std::mutex> g(g_pool_mu);
  g_free_workers.push_back(w);
}

// ---------------------------------------------------------------- scheduler

void fiber_main(void* arg) {
  Fiber* f = (Fiber*)arg;
  Worker* w = tls_w;
  MtlThreadInfo* ti = (MtlThreadInfo*)(f->stack_hi - kThreadInfoBytes);
  w->L->d->entry(ti);
  f->state = F_DONE;
  mtl_fiber_switch(&f->sp, w->sched_sp);
  __builtin_trap();
}

void run_fiber(Worker* w, Fiber* f) {
  f->state = F_RUNNING;
  w->cur = f;
  mtl_fiber_switch(&w->sched_sp, f->sp);
  w->cur = nullptr;
  w->st.switches += 2;
}

bool same_site(const MtlCollRec* a, const MtlCollRec* b) {
  if (a->line != b->line || a->col != b->col || a->kind != b->kind || a->fn != b->fn) return false;
  return a->file == b->file || (a->file && b->file && strcmp(a->file, b->file) == 0);
}

// Source order of two call sites (same file: line, column; else by file name).
bool site_before(const MtlCollRec* a, const MtlCollRec* b) {
  if (a->file != b->file && a->file && b->file) {
    int c = strcmp(a->file, b->file);
    if (c) return c < 0;
  }
  if (a->line != b->line) return a->line < b->line;
  return a->col < b->col;
}

const char* kind_name(int kind) {
  switch (kind) {
    case MTL_C_MMA: return "simdgroup matrix operation";
    case MTL_C_SIMD_BARRIER: return "simdgroup_barrier";
    case MTL_C_TG_BARRIER: return "threadgroup_barrier";
    default: return "simd collective";
  }
}

void complete_group(Worker* w, uint32_t sg, uint32_t group) {
  Fiber* base = w->fibers + sg * kSimd;
  MtlCollRec* recs[kSimd] = {};
  int first = __builtin_ctz(group);
  for (int l = 0; l < kSimd; l++)
    if (group & (1u << l)) recs[l] = base[l].rec;
  MtlCollRec* r0 = recs[first];
  if (r0->kind == MTL_C_MMA && group != 0xFFFFFFFFu) {
    set_error(w, MTL_E_MMA_DIVERGENCE, (int)(sg * kSimd + first), r0->file, (int)r0->line,
              "%s at %s:%u executed by %d of 32 lanes of simdgroup %u (active lane mask 0x%08x); "
              "all 32 lanes of a simdgroup must execute simdgroup matrix operations together",
              kind_name(r0->kind), r0->file ? r0->file : "?", r0->line, __builtin_popcount(group), sg, group);
    return;
  }
  if (r0->fn) r0->fn(recs, group);
  if (r0->kind == MTL_C_MMA) w->st.mma++;
  else if (r0->kind == MTL_C_SIMD_BARRIER) w->st.simd_barriers++;
  else w->st.simd_collectives++;
  w->sg_epoch[sg]++;
  for (int l = 0; l < kSimd; l++)
    if (group & (1u << l)) base[l].state = F_READY;
}

// Runs every ready lane of one simdgroup once, then completes the collectives
// its lanes wait at.  Returns whether anything happened.
bool sg_round(Worker* w, uint32_t sg) {
  Launch* L = w->L;
  uint32_t base = sg * kSimd;
  uint32_t cnt = w->n - base < (uint32_t)kSimd ? w->n - base : (uint32_t)kSimd;
  if (L->d->order == 2) shuffle(w->lane_order, kSimd, w->rng);
  bool ran = false;
  for (int k = 0; k < kSimd; k++) {
    uint32_t lane = (uint32_t)w->lane_order[k];
    if (lane >= cnt) continue;
    Fiber* f = &w->fibers[base + lane];
    if (f->state != F_READY) continue;
    run_fiber(w, f);
    ran = true;
    if (L->failed.load(std::memory_order_relaxed)) return false;
  }
  uint32_t waiting = 0;
  for (uint32_t l = 0; l < cnt; l++)
    if (w->fibers[base + l].state == F_WAIT_COLL) waiting |= 1u << l;
  if (!waiting) return ran;
  // Lanes wait at different call sites when the simdgroup diverged.  A GPU runs
  // the divergent paths one after the other and reconverges after them, so
  // complete only the earliest site in source order (a loop body before the
  // code after the loop, an `if` branch before an `else` branch); the other
  // lanes keep waiting and join the lanes that catch up with them.
  MtlCollRec* best = nullptr;
  for (uint32_t l = 0; l < cnt; l++)
    if ((waiting & (1u << l)) && (!best || site_before(w->fibers[base + l].rec, best))) best = w->fibers[base + l].rec;
  uint32_t group = 0;
  for (uint32_t l = 0; l < cnt; l++)
    if ((waiting & (1u << l)) && same_site(best, w->fibers[base + l].rec)) group |= 1u << l;
  complete_group(w, sg, group);
  return !L->failed.load(std::memory_order_relaxed);
}

bool sg_has_work(Worker* w, uint32_t sg) {
  uint32_t base = sg * kSimd;
  uint32_t end = base + kSimd < w->n ? base + kSimd : w->n;
  for (uint32_t i = base; i < end; i++)
    if (w->fibers[i].state == F_READY || w->fibers[i].state == F_WAIT_COLL) return true;
  return false;
}

void* arena_alloc(Worker* w, const void* key, size_t size, size_t align) {
  if (align < 16) align = 16;
  size_t off = (w->arena_used + align - 1) & ~(align - 1);
  size_t rounded = (size + 15) & ~(size_t)15;
  if (off + rounded + kRedzone > kArenaBytes || w->ntgvars >= kMaxTgVars) return nullptr;
  TgVar& v = w->tgvars[w->ntgvars++];
  v.key = key;
  v.ptr = w->arena + off;
  v.size = size;
  w->arena_used = off + rounded + kRedzone;
  w->tg_bytes += rounded;
  return v.ptr;
}

void fail_tg_memory(Worker* w, int thread, const char* file, int line) {
  set_error(w, MTL_E_TG_MEMORY, thread, file, line,
            "threadgroup memory of %zu bytes exceeds the %zu-byte (32 KiB) limit per threadgroup",
            w->tg_bytes, kTgLimit);
}

// Runs one threadgroup to completion (or to the launch's first error).
void run_threadgroup(Worker* w, uint32_t lin) {
  Launch* L = w->L;
  const MtlLaunch* d = L->d;
  w->tg_pos[0] = lin % L->ntg[0];
  w->tg_pos[1] = (lin / L->ntg[0]) % L->ntg[1];
  w->tg_pos[2] = lin / (L->ntg[0] * L->ntg[1]);
  for (int k = 0; k < 3; k++) {
    uint32_t start = w->tg_pos[k] * d->tg[k];
    uint32_t rest = d->grid[k] - start;
    w->tg_size[k] = rest < d->tg[k] ? rest : d->tg[k];  // non-uniform edge threadgroups
  }
  w->n = w->tg_size[0] * w->tg_size[1] * w->tg_size[2];
  w->nsg = (w->n + kSimd - 1) / kSimd;
  w->st.threadgroups++;
  w->st.threads += w->n;

  // Threadgroup memory: poisoned (all-ones bytes are NaN in every float type).
  size_t dirty = w->arena_dirty > w->arena_used ? w->arena_dirty : w->arena_used;
  memset(w->arena, 0xFF, dirty);
  w->arena_dirty = 0;
  w->arena_used = 0;
  w->ntgvars = 0;
  w->tg_bytes = 0;
  for (int i = 0; i < MTL_MAX_TG_PARAMS; i++) {
    w->tgptr[i] = nullptr;
    if (d->tg_param_bytes[i]) {
      w->tgptr[i] = arena_alloc(w, (const void*)(uintptr_t)(i + 1), d->tg_param_bytes[i], 16);
      if (!w->tgptr[i] || w->tg_bytes > kTgLimit) {
        fail_tg_memory(w, -1, nullptr, 0);
        return;
      }
    }
  }

  if (L->checked) {
    w->iv = w->tg_start_iv = ++g_iv;
    L->tg_first_iv.push_back(w->iv);
    L->tg_lin.push_back(lin);
  }
  for (int s = 0; s < kSimd; s++) w->sg_epoch[s] = 1;

  // Fibers, each with its built-ins on top of its stack.
  uint32_t ntgpg[3] = {L->ntg[0], L->ntg[1], L->ntg[2]};
  for (uint32_t i = 0; i < w->n; i++) {
    Fiber* f = &w->fibers[i];
    f->index = i;
    f->lane = i % kSimd;
    f->sg = i / kSimd;
    thread_pos(w, i, f->pos);
    f->state = F_READY;
    f->rec = nullptr;
    MtlThreadInfo* ti = (MtlThreadInfo*)(f->stack_hi - kThreadInfoBytes);
    ti->buffers = w->bufptr;
    ti->tg_params = w->tgptr;
    auto set = [&](int b, uint32_t x, uint32_t y, uint32_t z) {
      ti->builtin[b][0] = x; ti->builtin[b][1] = y; ti->builtin[b][2] = z;
    };
    set(MTL_B_THREAD_POSITION_IN_GRID, w->tg_pos[0] * d->tg[0] + f->pos[0], w->tg_pos[1] * d->tg[1] + f->pos[1],
        w->tg_pos[2] * d->tg[2] + f->pos[2]);
    set(MTL_B_THREAD_POSITION_IN_THREADGROUP, f->pos[0], f->pos[1], f->pos[2]);
    set(MTL_B_THREADGROUP_POSITION_IN_GRID, w->tg_pos[0], w->tg_pos[1], w->tg_pos[2]);
    set(MTL_B_THREADS_PER_THREADGROUP, w->tg_size[0], w->tg_size[1], w->tg_size[2]);
    set(MTL_B_THREADGROUPS_PER_GRID, ntgpg[0], ntgpg[1], ntgpg[2]);
    set(MTL_B_THREADS_PER_GRID, d->grid[0], d->grid[1], d->grid[2]);
    set(MTL_B_THREAD_INDEX_IN_THREADGROUP, i, 0, 0);
    set(MTL_B_SIMDGROUP_INDEX_IN_THREADGROUP, i / kSimd, 0, 0);
    set(MTL_B_THREAD_INDEX_IN_SIMDGROUP, i % kSimd, 0, 0);
    set(MTL_B_SIMDGROUPS_PER_THREADGROUP, w->nsg, 0, 0);
    set(MTL_B_THREADS_PER_SIMDGROUP, kSimd, 0, 0);
    set(MTL_B_DISPATCH_THREADS_PER_THREADGROUP, d->tg[0], d->tg[1], d->tg[2]);
    set(MTL_B_QUADGROUP_INDEX_IN_THREADGROUP, i / 4, 0, 0);
    set(MTL_B_THREAD_INDEX_IN_QUADGROUP, i % 4, 0, 0);
    set(MTL_B_QUADGROUPS_PER_THREADGROUP, (w->n + 3) / 4, 0, 0);
    set(MTL_B_GRID_ORIGIN, 0, 0, 0);
    f->sp = mtl_fiber_init((char*)ti - 64, fiber_main, f);
  }

  for (uint32_t s = 0; s < w->nsg; s++) w->sg_order[s] = (int)s;
  for (int l = 0; l < kSimd; l++) w->lane_order[l] = l;
  if (d->order == 1) {
    for (uint32_t s = 0; s < w->nsg; s++) w->sg_order[s] = (int)(w->nsg - 1 - s);
    for (int l = 0; l < kSimd; l++) w->lane_order[l] = kSimd - 1 - l;
  }

  for (;;) {
    if (d->order == 2) {
      // Random: advance a random simdgroup by one round at a time.
      for (;;) {
        int cand[kSimd], nc = 0;
        for (uint32_t s = 0; s < w->nsg; s++)
          if (sg_has_work(w, s)) cand[nc++] = (int)s;
        if (!nc) break;
        sg_round(w, (uint32_t)cand[rng_next(w->rng) % (uint64_t)nc]);
        if (L->failed.load(std::memory_order_relaxed)) return;
        if (w->timeout_flag) goto timeout;
      }
    } else {
      for (uint32_t k = 0; k < w->nsg; k++) {
        uint32_t s = (uint32_t)w->sg_order[k];
        while (sg_round(w, s)) {
          if (w->timeout_flag) goto timeout;
        }
        if (L->failed.load(std::memory_order_relaxed)) return;
      }
    }
    // Every live thread now waits at a threadgroup barrier (or all are done).
    Fiber* b0 = nullptr;
    for (uint32_t i = 0; i < w->n; i++) {
      Fiber* f = &w->fibers[i];
      if (f->state == F_DONE) continue;
      if (!b0) { b0 = f; continue; }
      if (!same_site(b0->rec, f->rec)) {
        set_error(w, MTL_E_DIVERGENT_BARRIER, (int)f->index, f->rec->file, (int)f->rec->line,
                  "divergent threadgroup_barrier: thread %u waits at %s:%u while thread %u waits at %s:%u; "
                  "every thread of a threadgroup must reach the same barrier",
                  f->index, f->rec->file ? f->rec->file : "?", f->rec->line, b0->index,
                  b0->rec->file ? b0->rec->file : "?", b0->rec->line);
        return;
      }
    }
    if (!b0) break;
    w->st.barriers++;
    if (L->checked) w->iv = ++g_iv;
    for (uint32_t i = 0; i < w->n; i++)
      if (w->fibers[i].state == F_WAIT_BARRIER) w->fibers[i].state = F_READY;
    if (w->timeout_flag) goto timeout;
  }
  if (w->arena_used > w->arena_dirty) w->arena_dirty = w->arena_used;
  if (w->tg_bytes > w->st.tg_peak) w->st.tg_peak = w->tg_bytes;
  return;
timeout:
  set_error(w, MTL_E_TIMEOUT, -1, nullptr, 0,
            "kernel did not finish within %.1f s (infinite loop, or a thread spinning on another "
            "thread's progress); raise `timeout=` or TORCH_METAL_FLASH_EMULATOR_TIMEOUT if it is just slow",
            d->timeout_s);
}

void describe_fault(Worker* w);

// Apple GPUs flush float denormals to zero (in every math mode); so do the
// worker threads while they run kernels.  Fibers inherit the mode from the
// thread that creates them.
struct FlushDenormals {
#if defined(__x86_64__)
  uint32_t saved;
  FlushDenormals() { __asm__ volatile("stmxcsr %0" : "=m"(saved)); uint32_t v = saved | 0x8040; __asm__ volatile("ldmxcsr %0" : : "m"(v)); }
  ~FlushDenormals() { __asm__ volatile("ldmxcsr %0" : : "m"(saved)); }
#elif defined(__aarch64__)
  uint64_t saved;
  FlushDenormals() { __asm__ volatile("mrs %0, fpcr" : "=r"(saved)); uint64_t v = saved | (1ull << 24); __asm__ volatile("msr fpcr, %0" : : "r"(v)); }
  ~FlushDenormals() { __asm__ volatile("msr fpcr, %0" : : "r"(saved)); }
#endif
};

void run_worker(Worker* w) {
  Launch* L = w->L;
  FlushDenormals ftz;
  tls_w = w;
  w->thread = pthread_self();
  // An alternate signal stack, so faults on a fiber's guard page can be handled.
  const size_t alt_size = 64 * 1024;
  if (!w->altstack) w->altstack = (char*)malloc(alt_size);
  stack_t ss, old_ss;
  ss.ss_sp = w->altstack;
  ss.ss_size = alt_size;
  ss.ss_flags = 0;
  sigaltstack(&ss, &old_ss);
  watch_add(w, L->d->timeout_s);
  if (sigsetjmp(w->jb, 1)) {
    w->jb_active = 0;
    describe_fault(w);
    w->cur = nullptr;
  } else {
    w->jb_active = 1;
    for (;;) {
      if (L->failed.load(std::memory_order_relaxed)) break;
      uint32_t k = L->next_tg.fetch_add(1);
      if (k >= L->tg_order.size()) break;
      run_threadgroup(w, L->tg_order[k]);
    }
    w->jb_active = 0;
  }
  watch_remove(w);
  if (old_ss.ss_flags & SS_DISABLE) {
    stack_t dis;
    memset(&dis, 0, sizeof dis);
    dis.ss_flags = SS_DISABLE;
    sigaltstack(&dis, nullptr);
  } else {
    sigaltstack(&old_ss, nullptr);
  }
  tls_w = nullptr;
}

// ---------------------------------------------------------------- memory classification

// The binding an address belongs to, or -1.  *region receives the region.
int find_bind(Launch* L, uintptr_t a, size_t size, int* region) {
  *region = -1;
  for (size_t r = 0; r < L->regions.size(); r++) {
    Region& R = L->regions[r];
    if (a >= (uintptr_t)R.map && a < (uintptr_t)R.map + R.map_len) { *region = (int)r; break; }
  }
  if (*region < 0) return -1;
  for (size_t b = 0; b < L->binds.size(); b++) {
    Bind& B = L->binds[b];
    if (B.region == *region && a >= (uintptr_t)B.dev && a + size <= (uintptr_t)B.dev + B.nbytes) return (int)b;
  }
  return -1;
}

// The binding nearest to an address, for error messages.
int nearest_bind(Launch* L, uintptr_t a, int64_t* off) {
  int best = -1;
  uint64_t bestd = ~0ull;
  for (size_t b = 0; b < L->binds.size(); b++) {
    Bind& B = L->binds[b];
    uintptr_t lo = (uintptr_t)B.dev, hi = lo + B.nbytes;
    uint64_t dist = a < lo ? lo - a : (a >= hi ? a - hi + 1 : 0);
    if (dist < bestd) { bestd = dist; best = (int)b; *off = (int64_t)(a - lo); }
  }
  return best;
}

bool in_segments(Launch* L, uintptr_t a) {
  for (const Segment& s : L->segs)
    if (a >= s.lo && a < s.hi) return true;
  return false;
}

void oob_error(Worker* w, uintptr_t a, size_t size, int wr, void* pc) {
  Launch* L = w->L;
  int64_t off = 0;
  int b = nearest_bind(L, a, &off);
  const char* what = wr == 1 ? "write" : (wr == 0 ? "read" : "access");
  int thread = w->cur ? (int)w->cur->index : -1;
  if (b >= 0) {
    Bind& B = L->binds[b];
    char sz[48] = "";
    if (size) snprintf(sz, sizeof sz, " of %zu bytes", size);
    set_error(w, MTL_E_OUT_OF_BOUNDS, thread, nullptr, 0,
              "out-of-bounds device %s%s at byte offset %lld of buffer(%d), which is %llu bytes long%s",
              what, sz, (long long)off, B.index, (unsigned long long)B.nbytes,
              size ? "" : " (fast mode: found by a guard page; run checked for the exact access)");
    L->d->err->buffer = B.index;
  } else {
    set_error(w, MTL_E_OUT_OF_BOUNDS, thread, nullptr, 0,
              "out-of-bounds %s of %zu bytes at address %p (no bound buffer there)", what, size, (void*)a);
  }
  L->d->err->pc_offset = pc_offset(pc);
}

void describe_fault(Worker* w) {
  Launch* L = w->L;
  int sig = w->fault_sig;
  uintptr_t a = (uintptr_t)w->fault_addr;
  int thread = w->cur ? (int)w->cur->index : -1;
  if (L->failed.load()) return;
  if (sig == kWatchdogSignal) {
    set_error(w, MTL_E_TIMEOUT, thread, nullptr, 0,
              "kernel did not finish within %.1f s (infinite loop, or a thread spinning on another "
              "thread's progress); raise `timeout=` or TORCH_METAL_FLASH_EMULATOR_TIMEOUT if it is just slow",
              L->d->timeout_s);
  } else if (sig == SIGFPE) {
    set_error(w, MTL_E_FPE, thread, nullptr, 0, "arithmetic fault (integer division by zero or overflow) in kernel code");
  } else if ((sig == SIGSEGV || sig == SIGBUS) && w->cur && a >= (uintptr_t)w->cur->stack_lo - w->page &&
             a < (uintptr_t)w->cur->stack_lo) {
    set_error(w, MTL_E_CRASH, thread, nullptr, 0,
              "stack overflow in a kernel thread (each thread has %zu KiB of stack; large thread-local arrays?)",
              kStackBytes / 1024);
  } else if (sig == SIGSEGV || sig == SIGBUS) {
    int region = -1;
    for (size_t r = 0; r < L->regions.size(); r++) {
      Region& R = L->regions[r];
      if (a >= (uintptr_t)R.map - kGuardBytes && a < (uintptr_t)R.map + R.map_len + kGuardBytes) region = (int)r;
    }
    if (region >= 0 || w->cur) {
      oob_error(w, a, 0, w->fault_write, w->fault_pc);
      return;
    }
    set_error(w, MTL_E_CRASH, thread, nullptr, 0, "segmentation fault at address %p (emulator internal error)", (void*)a);
  } else {
    set_error(w, MTL_E_CRASH, thread, nullptr, 0, "kernel code crashed with signal %d (trap / illegal instruction)", sig);
  }
  L->d->err->pc_offset = pc_offset(w->fault_pc);
}

// ---------------------------------------------------------------- race detection

constexpr uint16_t kManyCross = 0xFFFF;

inline bool many(uint16_t th) { return th & 0x8000; }

// Whether an earlier access p and the current one are unordered.  Device
// memory: accesses of different threadgroups are never ordered.
inline bool unordered(const Worker* w, Stamp p, uint32_t th, uint32_t ep, bool device) {
  if (p.iv == 0) return false;
  if (p.iv < w->tg_start_iv) return device;  // another threadgroup (threadgroup memory: stale)
  if (p.iv != w->iv) return false;           // a barrier in between
  uint32_t sg = th / kSimd;
  if (p.th == kManyCross) return true;
  if (many(p.th)) return !((p.th & 0x7FFF) == sg && p.ep != ep);
  if (p.th == th) return false;
  return !(p.th / kSimd == sg && p.ep != ep);
}

uint32_t tg_of_iv(Launch* L, uint32_t iv) {
  size_t lo = 0, hi = L->tg_first_iv.size();
  while (hi - lo > 1) {
    size_t mid = (lo + hi) / 2;
    if (L->tg_first_iv[mid] <= iv) lo = mid; else hi = mid;
  }
  return L->tg_lin.empty() ? 0 : L->tg_lin[lo];
}

void race_error(Worker* w, bool device, const char* space, uint64_t off, int bindex, bool cur_write,
                bool prev_write, Stamp p, void* prev_pc, void* pc) {
  Launch* L = w->L;
  char other[160];
  if (p.iv < w->tg_start_iv) {
    uint32_t lin = tg_of_iv(L, p.iv);
    snprintf(other, sizeof other, "a thread of threadgroup (%u,%u,%u)", lin % L->ntg[0], (lin / L->ntg[0]) % L->ntg[1],
             lin / (L->ntg[0] * L->ntg[1]));
  } else if (p.th == kManyCross) {
    snprintf(other, sizeof other, "threads of other simdgroups");
  } else if (many(p.th)) {
    snprintf(other, sizeof other, "other threads of simdgroup %u", p.th & 0x7FFF);
  } else {
    uint32_t pos[3];
    thread_pos(w, p.th, pos);
    snprintf(other, sizeof other, "thread (%u,%u,%u) (index %u)", pos[0], pos[1], pos[2], p.th);
  }
  char where[64] = "";
  if (device) snprintf(where, sizeof where, " of buffer(%d)", bindex);
  set_error(w, MTL_E_RACE, (int)w->cur->index, nullptr, 0,
            "data race on %s memory at byte offset %llu%s: this %s and a %s by %s are not ordered by a %s",
            space, (unsigned long long)off, where, cur_write ? "write" : "read", prev_write ? "write" : "read", other,
            device ? (p.iv < w->tg_start_iv ? "kernel boundary (different threadgroups)" : "barrier")
                   : "threadgroup_barrier or simd synchronisation");
  L->d->err->pc_offset = pc_offset(pc);
  L->d->err->pc2_offset = pc_offset(prev_pc);
  if (device) L->d->err->buffer = bindex;
}

// Returns false (and records the error) on a race.
bool shadow_access(Worker* w, Shadow* sh, size_t size, bool wr, void* pc, bool device, const char* space,
                   uint64_t off, int bindex) {
  Fiber* f = w->cur;
  uint32_t th = f->index, sg = f->sg, ep = w->sg_epoch[sg];
  for (size_t i = 0; i < size; i++) {
    Shadow& s = sh[i];
    if (!device) {  // threadgroup memory: forget earlier threadgroups
      if (s.w.iv && s.w.iv < w->tg_start_iv) s.w.iv = 0;
      if (s.r.iv && s.r.iv < w->tg_start_iv) s.r.iv = 0;
    }
    if (unordered(w, s.w, th, ep, device)) {
      race_error(w, device, space, off + i, bindex, wr, true, s.w, s.wpc, pc);
      return false;
    }
    if (wr) {
      if (unordered(w, s.r, th, ep, device)) {
        race_error(w, device, space, off + i, bindex, true, false, s.r, s.rpc, pc);
        return false;
      }
      s.w = Stamp{w->iv, (uint16_t)th, (uint16_t)ep};
      s.wpc = pc;
      s.r = Stamp{0, 0, 0};
    } else {
      Stamp& r = s.r;
      if (r.iv && r.iv < w->tg_start_iv) continue;  // device: an earlier threadgroup's read dominates
      if (r.iv != w->iv) {
        r = Stamp{w->iv, (uint16_t)th, (uint16_t)ep};
        s.rpc = pc;
      } else if (r.th == th || r.th == kManyCross) {
      } else if (many(r.th)) {
        if ((r.th & 0x7FFF) == sg) {
          if (r.ep != ep) { r = Stamp{w->iv, (uint16_t)th, (uint16_t)ep}; s.rpc = pc; }
        } else {
          r.th = kManyCross;
        }
      } else if (r.th / kSimd == sg) {
        if (r.ep != ep) { r = Stamp{w->iv, (uint16_t)th, (uint16_t)ep}; s.rpc = pc; }
        else r.th = (uint16_t)(0x8000 | sg);
      } else {
        r.th = kManyCross;
      }
    }
  }
  return true;
}

// Every instrumented load/store of kernel code lands here (checked mode).
__attribute__((noinline)) void slow_access(Worker* w, uintptr_t a, size_t size, bool wr, void* pc) {
  Launch* L = w->L;
  if (!L || L->failed.load(std::memory_order_relaxed)) return;
  if (wr) w->st.stores++; else w->st.loads++;
  // threadgroup memory
  if (a - (uintptr_t)w->arena < kArenaBytes) {
    for (int i = 0; i < w->ntgvars; i++) {
      TgVar& v = w->tgvars[i];
      if (a >= (uintptr_t)v.ptr && a + size <= (uintptr_t)v.ptr + v.size) {
        if (wr) w->st.tg_written += size; else w->st.tg_read += size;
        uint64_t off = a - (uintptr_t)w->arena;
        if (!shadow_access(w, w->tg_shadow + off, size, wr, pc, false, "threadgroup", off, -1)) abort_fiber(w);
        return;
      }
    }
    set_error(w, MTL_E_OUT_OF_BOUNDS, (int)w->cur->index, nullptr, 0,
              "out-of-bounds threadgroup memory %s of %zu bytes at arena offset %llu (outside every threadgroup "
              "variable / [[threadgroup(n)]] allocation)",
              wr ? "write" : "read", size, (unsigned long long)(a - (uintptr_t)w->arena));
    L->d->err->pc_offset = pc_offset(pc);
    abort_fiber(w);
  }
  int region;
  int b = find_bind(L, a, size, &region);
  if (b >= 0) {
    Bind& B = L->binds[b];
    if (wr) { w->st.device_written += size; w->st.buf_written[B.index] += size; }
    else { w->st.device_read += size; w->st.buf_read[B.index] += size; }
    Region& R = L->regions[B.region];
    uint64_t roff = a - (uintptr_t)R.data;
    if (R.shadow && !shadow_access(w, R.shadow + roff, size, wr, pc, true, "device", a - (uintptr_t)B.dev, B.index))
      abort_fiber(w);
    return;
  }
  if (region < 0 && in_segments(L, a)) return;  // the kernel library's own constants
  oob_error(w, a, size, wr ? 1 : 0, pc);
  abort_fiber(w);
}

inline void on_access(void* p, size_t size, bool wr, void* pc) {
  Worker* w = tls_w;
  if (__builtin_expect(!w || !w->cur, 0)) return;
  uintptr_t a = (uintptr_t)p;
  if (a - (uintptr_t)w->pool < w->pool_len) return;  // thread-private (fiber stacks, scratch)
  slow_access(w, a, size, wr, pc);
}

// ---------------------------------------------------------------- launch setup

#if defined(__APPLE__)
// The segments of the Mach-O image that contains `addr`.
void image_segments(uintptr_t addr, std::vector<Segment>* out) {
  for (uint32_t i = 0; i < _dyld_image_count(); i++) {
    const mach_header_64* h = (const mach_header_64*)_dyld_get_image_header(i);
    intptr_t slide = _dyld_get_image_vmaddr_slide(i);
    std::vector<Segment> segs;
    bool mine = false;
    const load_command* lc = (const load_command*)(h + 1);
    for (uint32_t c = 0; c < h->ncmds; c++) {
      if (lc->cmd == LC_SEGMENT_64) {
        const segment_command_64* sc = (const segment_command_64*)lc;
        uintptr_t lo = (uintptr_t)sc->vmaddr + slide, hi = lo + sc->vmsize;
        if (sc->vmsize) segs.push_back({lo, hi});
        if (addr >= lo && addr < hi) mine = true;
      }
      lc = (const load_command*)((const char*)lc + lc->cmdsize);
    }
    if (mine) { *out = segs; return; }
  }
}
#else
int collect_segments(struct dl_phdr_info* info, size_t, void* data) {
  auto* arg = (std::pair<uintptr_t, std::vector<Segment>*>*)data;
  bool mine = false;
  for (int i = 0; i < info->dlpi_phnum; i++) {
    const auto& ph = info->dlpi_phdr[i];
    if (ph.p_type != PT_LOAD) continue;
    uintptr_t lo = info->dlpi_addr + ph.p_vaddr, hi = lo + ph.p_memsz;
    if (arg->first >= lo && arg->first < hi) mine = true;
  }
  if (!mine) return 0;
  for (int i = 0; i < info->dlpi_phnum; i++) {
    const auto& ph = info->dlpi_phdr[i];
    if (ph.p_type != PT_LOAD) continue;
    uintptr_t lo = info->dlpi_addr + ph.p_vaddr;
    arg->second->push_back({lo, lo + ph.p_memsz});
  }
  return 1;
}

void image_segments(uintptr_t addr, std::vector<Segment>* out) {
  std::pair<uintptr_t, std::vector<Segment>*> arg{addr, out};
  dl_iterate_phdr(collect_segments, &arg);
}
#endif

bool stage_buffers(Launch* L, size_t page) {
  const MtlLaunch* d = L->d;
  // Merge overlapping bindings (aliases of one storage) into one region.
  std::vector<int> idx;
  for (int i = 0; i < d->nbind; i++) idx.push_back(i);
  std::sort(idx.begin(), idx.end(), [&](int a, int b) { return (uintptr_t)d->binds[a].host < (uintptr_t)d->binds[b].host; });
  L->binds.resize(d->nbind);
  for (size_t k = 0; k < idx.size();) {
    const MtlBinding& b0 = d->binds[idx[k]];
    uintptr_t lo = (uintptr_t)b0.host, hi = lo + (b0.nbytes ? b0.nbytes : 1);
    bool writable = b0.writable;
    size_t k2 = k + 1;
    while (k2 < idx.size() && (uintptr_t)d->binds[idx[k2]].host < hi) {
      const MtlBinding& b = d->binds[idx[k2]];
      uintptr_t bh = (uintptr_t)b.host + (b.nbytes ? b.nbytes : 1);
      if (bh > hi) hi = bh;
      writable |= b.writable != 0;
      k2++;
    }
    Region R;
    R.host = (char*)lo;
    R.len = hi - lo;
    R.writable = writable;
    R.direct = R.len > kDirectBytes;
    size_t mis = lo % 16;
    size_t body = (R.len + mis + 15) & ~(size_t)15;
    size_t body_pages = (body + page - 1) / page * page;
    R.map_len = body_pages;
    // Inaccessible guard zones on both sides turn overruns into faults even in fast mode.
    if (R.direct) {
      R.map = R.data = R.host;
      R.map_len = R.len;
    } else {
      size_t total = body_pages + 2 * kGuardBytes;
      char* m = (char*)mmap(nullptr, total, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
      if (m == MAP_FAILED) return false;
      if (mprotect(m + kGuardBytes, body_pages, PROT_READ | PROT_WRITE) != 0) return false;
      R.map = m + kGuardBytes;
      // End the data right before the trailing guard page (keeping the alignment mod 16).
      R.data = R.map + body_pages - body + mis;
      memcpy(R.data, R.host, R.len);
    }
    R.shadow = nullptr;
    if (L->checked) {
      R.shadow = (Shadow*)mmap(nullptr, R.len * sizeof(Shadow), PROT_READ | PROT_WRITE,
                               MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
      if (R.shadow == MAP_FAILED) return false;
    }
    int rid = (int)L->regions.size();
    L->regions.push_back(R);
    for (size_t j = k; j < k2; j++) {
      const MtlBinding& b = d->binds[idx[j]];
      Bind& B = L->binds[idx[j]];
      B.index = b.index;
      B.nbytes = b.nbytes;
      B.region = rid;
      B.dev = R.data + ((uintptr_t)b.host - lo);
      L->bufptr[b.index] = B.dev;
    }
    k = k2;
  }
  return true;
}

void unstage_buffers(Launch* L, size_t page, bool copy_back) {
  for (Region& R : L->regions) {
    if (!R.direct) {
      if (copy_back && R.writable) memcpy(R.host, R.data, R.len);
      munmap(R.map - kGuardBytes, R.map_len + 2 * kGuardBytes);
    }
    if (R.shadow) munmap(R.shadow, R.len * sizeof(Shadow));
  }
  L->regions.clear();
}

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

// Atomic operations (threadgroup or device memory).  Exempt from race checks,
// bounds-checked and counted like ordinary accesses.
enum { A_LOAD, A_STORE, A_XCHG, A_ADD, A_SUB, A_MIN, A_MAX, A_AND, A_OR, A_XOR, A_CAS };
enum { AT_I32, AT_U32, AT_F32, AT_I64, AT_U64 };

template <class T>
static int atomic_op(T* p, int op, const void* val, void* cmp, void* out) {
  T v = *(const T*)val;
  T old;
  switch (op) {
    case A_LOAD: old = __atomic_load_n(p, __ATOMIC_RELAXED); break;
    case A_STORE: __atomic_store_n(p, v, __ATOMIC_RELAXED); old = v; break;
    case A_XCHG: old = __atomic_exchange_n(p, v, __ATOMIC_RELAXED); break;
    case A_ADD: old = __atomic_fetch_add(p, v, __ATOMIC_RELAXED); break;
    case A_SUB: old = __atomic_fetch_sub(p, v, __ATOMIC_RELAXED); break;
    case A_AND: old = __atomic_fetch_and(p, v, __ATOMIC_RELAXED); break;
    case A_OR: old = __atomic_fetch_or(p, v, __ATOMIC_RELAXED); break;
    case A_XOR: old = __atomic_fetch_xor(p, v, __ATOMIC_RELAXED); break;
    case A_MIN:
    case A_MAX: {
      old = __atomic_load_n(p, __ATOMIC_RELAXED);
      for (;;) {
        T nv = op == A_MIN ? (v < old ? v : old) : (v > old ? v : old);
        if (__atomic_compare_exchange_n(p, &old, nv, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) break;
      }
      break;
    }
    case A_CAS: {
      T expected = *(T*)cmp;
      bool ok = __atomic_compare_exchange_n(p, &expected, v, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
      *(T*)cmp = expected;
      old = expected;
      if (out) *(T*)out = old;
      return ok;
    }
    default: return 0;
  }
  if (out) *(T*)out = old;
  return 1;
}

static int atomic_float(uint32_t* p, int op, const void* val, void* cmp, void* out) {
  float v = *(const float*)val;
  if (op == A_LOAD || op == A_STORE || op == A_XCHG || op == A_CAS) return atomic_op<uint32_t>(p, op, val, cmp, out);
  uint32_t old = __atomic_load_n(p, __ATOMIC_RELAXED);
  for (;;) {
    float o;
    memcpy(&o, &old, 4);
    float n = op == A_ADD ? o + v : op == A_SUB ? o - v : op == A_MIN ? (v < o ? v : o) : (v > o ? v : o);
    uint32_t nb;
    memcpy(&nb, &n, 4);
    if (__atomic_compare_exchange_n(p, &old, nb, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) break;
  }
  if (out) memcpy(out, &old, 4);
  return 1;
}

RT_EXPORT int __mtl_rt_atomic(void* addr, int op, int type, const void* val, void* cmp, void* out) {
  Worker* w = tls_w;
  size_t size = (type == AT_I64 || type == AT_U64) ? 8 : 4;
  w->st.atomics++;
  if (w->L && w->L->checked && w->cur) {
    uintptr_t a = (uintptr_t)addr;
    void* pc = __builtin_return_address(0);
    if (a % size) {
      set_error(w, MTL_E_OUT_OF_BOUNDS, (int)w->cur->index, nullptr, 0, "misaligned atomic access at %p", addr);
      w->L->d->err->pc_offset = pc_offset(pc);
      abort_fiber(w);
    }
    if (a - (uintptr_t)w->arena >= kArenaBytes) {
      int region;
      int b = find_bind(w->L, a, size, &region);
      if (b < 0) {
        oob_error(w, a, size, op == A_LOAD ? 0 : 1, pc);
        abort_fiber(w);
      }
      Bind& B = w->L->binds[b];
      if (op != A_STORE) { w->st.device_read += size; w->st.buf_read[B.index] += size; }
      if (op != A_LOAD) { w->st.device_written += size; w->st.buf_written[B.index] += size; }
    }
  }
  switch (type) {
    case AT_I32: return atomic_op<int32_t>((int32_t*)addr, op, val, cmp, out);
    case AT_U32: return atomic_op<uint32_t>((uint32_t*)addr, op, val, cmp, out);
    case AT_F32: return atomic_float((uint32_t*)addr, op, val, cmp, out);
    case AT_I64: return atomic_op<int64_t>((int64_t*)addr, op, val, cmp, out);
    default: return atomic_op<uint64_t>((uint64_t*)addr, op, val, cmp, out);
  }
}

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
