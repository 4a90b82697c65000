// Minimal stackful fibers: a hand-written context switch for x86-64 (System V)
// and arm64 (AAPCS64).  Only callee-saved registers are saved; the switch is a
// plain function call, so the compiler already spilled everything else.
#pragma once

extern "C" {
// Saves the current context on the current stack, stores its sp in *save_sp,
// then resumes the context whose sp is new_sp.
void mtl_fiber_switch(void** save_sp, void* new_sp);
// First code a new fiber runs: calls fn(arg) from callee-saved registers.
void mtl_fiber_trampoline(void);
}

// Prepares a fresh stack so that switching to the returned sp calls fn(arg).
// fn must never return (it switches away at its end).
void* mtl_fiber_init(char* stack_top, void (*fn)(void*), void* arg);

#if defined(__x86_64__)
#if defined(__APPLE__)
#define MTL_SYM(x) "_" #x
#else
#define MTL_SYM(x) #x
#endif
// Frame layout (low to high): mxcsr+x87cw (8), r15, r14, r13, r12, rbx, rbp, return address.
__asm__(
    ".text\n"
    ".globl " MTL_SYM(mtl_fiber_switch) "\n"
#if !defined(__APPLE__)
    ".type mtl_fiber_switch,@function\n"
    ".hidden mtl_fiber_switch\n"
#endif
    MTL_SYM(mtl_fiber_switch) ":\n"
    "  pushq %rbp\n  pushq %rbx\n  pushq %r12\n  pushq %r13\n  pushq %r14\n  pushq %r15\n"
    "  subq $8, %rsp\n  stmxcsr (%rsp)\n  fnstcw 4(%rsp)\n"
    "  movq %rsp, (%rdi)\n"
    "  movq %rsi, %rsp\n"
    "  ldmxcsr (%rsp)\n  fldcw 4(%rsp)\n  addq $8, %rsp\n"
    "  popq %r15\n  popq %r14\n  popq %r13\n  popq %r12\n  popq %rbx\n  popq %rbp\n"
    "  ret\n"
    ".globl " MTL_SYM(mtl_fiber_trampoline) "\n"
#if !defined(__APPLE__)
    ".hidden mtl_fiber_trampoline\n"
#endif
    MTL_SYM(mtl_fiber_trampoline) ":\n"
    "  movq %r12, %rdi\n"
    "  callq *%r13\n"
    "  ud2\n");

#include <stdint.h>
inline void* mtl_fiber_init(char* stack_top, void (*fn)(void*), void* arg) {
  uintptr_t top = (uintptr_t)stack_top & ~(uintptr_t)15;
  uint64_t* sp = (uint64_t*)top;
  // After `ret` pops the trampoline address, rsp == top (16-aligned), so the
  // trampoline's call leaves the callee with the ABI's rsp % 16 == 8.
  *--sp = (uint64_t)(uintptr_t)&mtl_fiber_trampoline;  // return address
  *--sp = 0;                                           // rbp
  *--sp = 0;                                           // rbx
  *--sp = (uint64_t)(uintptr_t)arg;                    // r12
  *--sp = (uint64_t)(uintptr_t)fn;                     // r13
  *--sp = 0;                                           // r14
  *--sp = 0;                                           // r15
  uint32_t csr[2];
  __asm__ volatile("stmxcsr %0" : "=m"(csr[0]));
  __asm__ volatile("fnstcw %0" : "=m"(*(uint16_t*)&csr[1]));
  *--sp = (uint64_t)csr[0] | ((uint64_t)(csr[1] & 0xffff) << 32);
  return sp;
}

#elif defined(__aarch64__)
#if defined(__APPLE__)
#define MTL_SYM(x) "_" #x
#else
#define MTL_SYM(x) #x
#endif
// Frame (176 bytes): x19..x30 at 0..95, d8..d15 at 96..159.
__asm__(
    ".text\n"
    ".globl " MTL_SYM(mtl_fiber_switch) "\n"
    ".p2align 2\n"
    MTL_SYM(mtl_fiber_switch) ":\n"
    "  sub sp, sp, #176\n"
    "  stp x19, x20, [sp, #0]\n  stp x21, x22, [sp, #16]\n  stp x23, x24, [sp, #32]\n"
    "  stp x25, x26, [sp, #48]\n  stp x27, x28, [sp, #64]\n  stp x29, x30, [sp, #80]\n"
    "  stp d8, d9, [sp, #96]\n  stp d10, d11, [sp, #112]\n  stp d12, d13, [sp, #128]\n  stp d14, d15, [sp, #144]\n"
    "  mov x9, sp\n  str x9, [x0]\n"
    "  mov sp, x1\n"
    "  ldp x19, x20, [sp, #0]\n  ldp x21, x22, [sp, #16]\n  ldp x23, x24, [sp, #32]\n"
    "  ldp x25, x26, [sp, #48]\n  ldp x27, x28, [sp, #64]\n  ldp x29, x30, [sp, #80]\n"
    "  ldp d8, d9, [sp, #96]\n  ldp d10, d11, [sp, #112]\n  ldp d12, d13, [sp, #128]\n  ldp d14, d15, [sp, #144]\n"
    "  add sp, sp, #176\n"
    "  ret\n"
    ".globl " MTL_SYM(mtl_fiber_trampoline) "\n"
    ".p2align 2\n"
    MTL_SYM(mtl_fiber_trampoline) ":\n"
    "  mov x0, x19\n"
    "  blr x20\n"
    "  brk #0\n");

#include <stdint.h>
inline void* mtl_fiber_init(char* stack_top, void (*fn)(void*), void* arg) {
  uintptr_t top = (uintptr_t)stack_top & ~(uintptr_t)15;
  uint64_t* sp = (uint64_t*)(top - 176);
  for (int i = 0; i < 22; i++) sp[i] = 0;
  sp[0] = (uint64_t)(uintptr_t)arg;                    // x19
  sp[1] = (uint64_t)(uintptr_t)fn;                     // x20
  sp[11] = (uint64_t)(uintptr_t)&mtl_fiber_trampoline; // x30 (return address)
  return sp;
}
#else
#error "torch_metal_flash emulator: fibers need x86-64 or arm64"
#endif
