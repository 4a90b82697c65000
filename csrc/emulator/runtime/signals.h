// Fault signals (turned into errors that jump back to the scheduler) and the watchdog that stops
// kernels that never finish.
#pragma once

#include "state.h"

namespace {

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

}  // namespace
