// Checked builds: which binding an address belongs to, bounds, and the per-byte shadow state
// that finds data races.
// Part of the emulator runtime's one translation unit: included by ../runtime.cpp (inside its anonymous namespace),
// after the types and helpers it declares; not a self-contained header.


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

// Buffer arguments nothing is bound to point into a reserved, inaccessible range, one slot per index (the
// pointer in the middle of its slot): the kernel may compute with such a pointer, and an access through it
// is reported with the argument's index (checked: by the access callback; fast: by the fault handler).
constexpr uint64_t kUnboundSlot = uint64_t(1) << 33;

char* unbound_base() {
  static char* base = [] {
    void* p = mmap(nullptr, kUnboundSlot * MTL_MAX_BUFFERS, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                   -1, 0);
    return p == MAP_FAILED ? (char*)nullptr : (char*)p;
  }();
  return base;
}

void* unbound_pointer(int index) {
  char* base = unbound_base();
  return base ? base + kUnboundSlot * index + kUnboundSlot / 2 : nullptr;
}

int unbound_index(uintptr_t a) {
  char* base = unbound_base();
  if (!base || a < (uintptr_t)base || a >= (uintptr_t)base + kUnboundSlot * MTL_MAX_BUFFERS) return -1;
  return (int)((a - (uintptr_t)base) / kUnboundSlot);
}

void unbound_error(Worker* w, int index, int wr, void* pc) {
  Launch* L = w->L;
  set_error(w, MTL_E_UNBOUND, w->cur ? (int)w->cur->index : -1, nullptr, 0,
            "%s through buffer(%d), which is not bound", wr == 1 ? "write" : (wr == 0 ? "read" : "access"), index);
  L->d->err->buffer = index;
  L->d->err->pc_offset = pc_offset(pc);
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
  } else if ((sig == SIGSEGV || sig == SIGBUS) && unbound_index(a) >= 0) {
    unbound_error(w, unbound_index(a), w->fault_write, w->fault_pc);
    return;
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
// A write by another lane of the same simdgroup, in the same simd epoch, at the same store site: on a GPU
// the lanes' stores of one step are one SIMD store, so it is no race if every lane stores the same value.
inline bool simd_store_candidate(const Worker* w, const Shadow& s, uint32_t th, uint32_t sg, uint32_t ep, void* pc) {
  return s.wpc == pc && s.w.iv == w->iv && s.w.iv >= w->tg_start_iv && !many(s.w.th) && s.w.th != th &&
         s.w.th / kSimd == sg && s.w.ep == ep;
}

// A read stamp of this simdgroup in this epoch (read after the lane's own part of a SIMD store).
inline bool same_simd_step(const Worker* w, Stamp r, uint32_t sg, uint32_t ep) {
  return r.iv == w->iv && r.th != kManyCross && (many(r.th) ? (r.th & 0x7FFF) == sg : r.th / kSimd == sg) &&
         r.ep == ep;
}

// The value check of a same-site store is made once the store has happened (SanitizerCoverage calls back
// before it): the bytes must be those the other lanes stored.
bool check_simd_store(Worker* w) {
  PendingStore& ps = w->pending;
  if (!ps.mask) return true;
  uint32_t mask = ps.mask;
  ps.mask = 0;
  for (size_t i = 0; i < ps.size; i++)
    if ((mask >> i & 1) && ((const unsigned char*)ps.a)[i] != ps.old[i]) {
      race_error(w, ps.device, ps.device ? "device" : "threadgroup", ps.off + i, ps.bindex, true, true, ps.prev,
                 ps.prev_pc, ps.pc);
      char* m = w->L->d->err->msg;
      size_t n = strlen(m);
      snprintf(m + n, MTL_MSG - n, " (lanes of one simdgroup stored different values at one store site)");
      return false;
    }
  return true;
}

bool shadow_access(Worker* w, Shadow* sh, size_t size, bool wr, void* pc, bool device, const char* space,
                   uint64_t off, int bindex, uintptr_t a) {
  Fiber* f = w->cur;
  uint32_t th = f->index, sg = f->sg, ep = w->sg_epoch[sg];
  for (size_t i = 0; i < size; i++) {
    Shadow& s = sh[i];
    if (!device) {  // threadgroup memory: forget earlier threadgroups
      if (s.w.iv && s.w.iv < w->tg_start_iv) s.w.iv = 0;
      if (s.r.iv && s.r.iv < w->tg_start_iv) s.r.iv = 0;
    }
    bool simd_store = wr && size <= sizeof w->pending.old && simd_store_candidate(w, s, th, sg, ep, pc);
    if (simd_store) {
      PendingStore& ps = w->pending;
      if (!ps.mask) {
        ps.a = a; ps.size = size; ps.device = device; ps.off = off; ps.bindex = bindex; ps.prev = s.w;
        ps.prev_pc = s.wpc; ps.pc = pc;
        memcpy(ps.old, (const void*)a, size);
      }
      ps.mask |= 1u << i;
    } else if (unordered(w, s.w, th, ep, device)) {
      race_error(w, device, space, off + i, bindex, wr, true, s.w, s.wpc, pc);
      return false;
    }
    if (wr) {
      if (unordered(w, s.r, th, ep, device) && !(simd_store && same_simd_step(w, s.r, sg, ep))) {
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
  if (!check_simd_store(w)) abort_fiber(w);
  int unbound = unbound_index(a);
  if (unbound >= 0) {
    unbound_error(w, unbound, wr ? 1 : 0, pc);
    abort_fiber(w);
  }
  if (wr) w->st.stores++; else w->st.loads++;
  // threadgroup memory
  if (a - (uintptr_t)w->arena < kArenaBytes) {
    for (int i = 0; i < w->ntgvars; i++) {
      TgVar& v = w->tgvars[i];
      if (a >= (uintptr_t)v.ptr && a + size <= (uintptr_t)v.ptr + v.size) {
        if (wr) w->st.tg_written += size; else w->st.tg_read += size;
        uint64_t off = a - (uintptr_t)w->arena;
        if (!shadow_access(w, w->tg_shadow + off, size, wr, pc, false, "threadgroup", off, -1, a)) abort_fiber(w);
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
    if (R.shadow && !shadow_access(w, R.shadow + roff, size, wr, pc, true, "device", a - (uintptr_t)B.dev, B.index, a))
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
