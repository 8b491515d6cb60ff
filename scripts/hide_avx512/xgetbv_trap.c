/* Emulates the `xgetbv` instructions that hide_avx512.py replaced with `int3; nop; nop`.
 *
 * Loaded first in every Python process of a patched venv (a .pth file). On the trap it runs
 * the real xgetbv and clears the ZMM/opmask state bits (5-7) and the AMX tile bits (17-18),
 * exactly what an OS that does not enable AVX-512/AMX reports. Every library that asks the
 * OS before using AVX-512 (ONNX Runtime's MLAS, oneDNN, cpuinfo, ATen, numpy) then picks its
 * AVX2 kernels, which run natively at full speed: only the ISA choice is emulated. */
#define _GNU_SOURCE
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <ucontext.h>

static struct sigaction previous;

static void on_trap(int sig, siginfo_t *info, void *context) {
    ucontext_t *uc = context;
    greg_t *regs = uc->uc_mcontext.gregs;
    const unsigned char *next = (const unsigned char *)regs[REG_RIP];
    if (next[-1] == 0xCC && next[0] == 0x90 && next[1] == 0x90) {
        uint32_t eax, edx, ecx = (uint32_t)regs[REG_RCX];
        __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(ecx));
        eax &= ~((7u << 5) | (3u << 17));
        regs[REG_RAX] = eax;   /* xgetbv zero-extends into rax/rdx */
        regs[REG_RDX] = edx;
        regs[REG_RIP] = (greg_t)(next + 2);
        return;
    }
    /* Not one of ours: behave as if this handler was never installed. */
    if (previous.sa_flags & SA_SIGINFO) {
        previous.sa_sigaction(sig, info, context);
    } else if (previous.sa_handler != SIG_DFL && previous.sa_handler != SIG_IGN) {
        previous.sa_handler(sig);
    } else {
        signal(sig, SIG_DFL);
        raise(sig);
    }
}

__attribute__((constructor)) static void install(void) {
    struct sigaction action;
    memset(&action, 0, sizeof action);
    action.sa_sigaction = on_trap;
    action.sa_flags = SA_SIGINFO | SA_NODEFER | SA_RESTART;
    sigemptyset(&action.sa_mask);
    sigaction(SIGTRAP, &action, &previous);
}
