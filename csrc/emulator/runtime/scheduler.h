// Worker threads, fibers, simd collectives and barriers, threadgroup memory: the scheduler.
// Part of the emulator runtime's one translation unit: included by ../runtime.cpp (inside its anonymous namespace),
// after the types and helpers it declares; not a self-contained header.


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

bool check_simd_store(Worker* w);  // race_detector.h

void run_fiber(Worker* w, Fiber* f) {
  f->state = F_RUNNING;
  w->cur = f;
  mtl_fiber_switch(&w->sched_sp, f->sp);
  if (w->pending.mask && !w->L->failed.load(std::memory_order_relaxed)) check_simd_store(w);
  w->pending.mask = 0;
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
    case MTL_C_TENSOR_MATMUL: return "tensor-op matmul2d";
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
  bool matrix = r0->kind == MTL_C_MMA || r0->kind == MTL_C_TENSOR_MATMUL;
  if (matrix && group != 0xFFFFFFFFu) {
    set_error(w, MTL_E_MMA_DIVERGENCE, (int)(sg * kSimd + first), r0->file, (int)r0->line,
              "%s at %s:%u executed by %d of 32 lanes of simdgroup %u (active lane mask 0x%08x); "
              "all 32 lanes of a simdgroup must execute simdgroup matrix operations together",
              kind_name(r0->kind), r0->file ? r0->file : "?", r0->line, __builtin_popcount(group), sg, group);
    return;
  }
  if (r0->fn) r0->fn(recs, group);
  if (r0->kind == MTL_C_MMA) w->st.mma++;
  else if (r0->kind == MTL_C_TENSOR_MATMUL) { w->st.tensor_matmuls++; w->st.tensor_macs += r0->arg; }
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
