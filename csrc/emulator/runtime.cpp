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
// One translation unit, one concern per part: this file holds the API the shim
// calls, the checked-build callbacks and the launch; runtime/ holds state.h (the
// types and shared helpers), signals.h (faults, watchdog), scheduler.h (workers,
// fibers, collectives, barriers), race_detector.h (bounds and races in checked
// builds), staging.h (guarded copies of the buffers) and atomics.h.  Each header
// includes what it uses and compiles on its own (tests/emulator/test_runtime_headers.py).
#include "runtime/state.h"
#include "runtime/signals.h"
#include "runtime/scheduler.h"
#include "runtime/race_detector.h"
#include "runtime/staging.h"


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
