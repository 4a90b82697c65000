// Launch setup: the kernel image's segments and the staging of buffers into guarded copies.
#pragma once

#include "state.h"

namespace {

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
