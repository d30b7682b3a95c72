/* Shared by every probe family: the event header, argument access, the ring
 * buffer with its drop counter, and entry/return pairing through a map.
 *
 * The family's header defines EVENT (its event struct, which starts with
 * `struct probing_hdr hdr`) before bpf/preamble.c includes this file;
 * RINGBUF_PAGES comes from the loader (-D).
 * Events are submitted with BPF_RB_NO_WAKEUP: the probe drains the ring on a
 * timer, so a traced call never pays for waking a reader.
 */
#ifndef PROBING_COMMON_H
#define PROBING_COMMON_H

#include <uapi/linux/ptrace.h>
#include "event.h"

#ifndef BPF_RB_NO_WAKEUP
#define BPF_RB_NO_WAKEUP 1
#endif

/* Calls in flight: a thread's entry waits here for its return. Keyed by
 * thread and function, so a probed function called from inside another
 * probed function of the same family pairs correctly. */
struct inflight_key {
    u32 tid;
    u32 fn;
};

/* The maps and the helpers that touch them (count_drop, emit, park, unpark,
 * py_stack_id) live in bpf/preamble.c, compiled as part of the main source:
 * BCC only rewrites map calls written there, not in headers or macros. */

static __always_inline u64 read_u64(u64 addr) {
    u64 v = 0;
    if (addr)
        bpf_probe_read_user(&v, sizeof(v), (void *)addr);
    return v;
}

/* The header of a new event; hdr_init (pyframes.h) adds the caller's stack. */
static __always_inline void hdr_init_stack(struct probing_hdr *h, u16 fn, u32 stack_id) {
    h->ts = bpf_ktime_get_ns();
    h->stack_id = stack_id;
    h->tid = (u32)bpf_get_current_pid_tgid();
    h->fn = fn;
}

/* Every field of the header of an entry-only event, written in place (a
 * reserved ring-buffer record is not zeroed). */
static __always_inline void hdr_fill(struct probing_hdr *h, u16 fn, u32 stack_id) {
    h->ts = bpf_ktime_get_ns();
    h->dur_ns = 0;
    h->tid = (u32)bpf_get_current_pid_tgid();
    h->ret = 0;
    h->fn = fn;
    h->flags = 0;
    h->stack_id = stack_id;
}

static __always_inline void inflight_key_of(struct inflight_key *key, u16 fn) {
    key->tid = (u32)bpf_get_current_pid_tgid();
    key->fn = fn;
}

/* A parked entry meets its return: duration and return code. */
static __always_inline void complete(struct pt_regs *ctx, struct probing_hdr *h) {
    h->dur_ns = bpf_ktime_get_ns() - h->ts;
    h->ret = (s32)PT_REGS_RC(ctx);
    h->flags |= PROBING_HAS_RET;
}

/* A generic return probe for function `fn`: <family>_ret_<fn>. */
#define RETURN_PROBE(family, fn)                                     \
    int family##_ret_##fn(struct pt_regs *ctx) {                     \
        struct inflight_key key;                                     \
        EVENT *ev = unpark(ctx, fn, &key);                           \
        if (ev)                                                      \
            emit(ev);                                                \
        return 0;                                                    \
    }

/* The n-th integer argument (1-based) at function entry, registers first,
 * then the stack (above the return address on x86_64). */
#if defined(__x86_64__)
#define ARG_REGS 6
#define STACK_ARG_BASE 8
#elif defined(__aarch64__)
#define ARG_REGS 8
#define STACK_ARG_BASE 0
#else
#error "probing's BPF programs support x86_64 and aarch64"
#endif

static __always_inline u64 arg(struct pt_regs *ctx, int n);

/* Arguments n .. n+count-1 (1-based, count <= 4) into out: those in
 * registers read one by one, those on the stack with one read (each read
 * of user memory costs more than all the register loads). n and count are
 * constants once inlined, so the branches fold away. */
static __always_inline void args_from(struct pt_regs *ctx, int n, u64 *out, int count) {
    int i = 0;
#pragma unroll
    for (; i < 4; i++) {
        if (i >= count || n + i > ARG_REGS)
            break;
        out[i] = arg(ctx, n + i);
    }
    if (i < count)
        bpf_probe_read_user(out + i, 8 * (count - i),
                            (void *)(PT_REGS_SP(ctx) + STACK_ARG_BASE + 8 * (n + i - ARG_REGS - 1)));
}

static __always_inline u64 arg(struct pt_regs *ctx, int n) {
    /* an if-chain, not a switch: a jump table is an indirect jump BPF lacks */
    if (n == 1) return PT_REGS_PARM1(ctx);
    if (n == 2) return PT_REGS_PARM2(ctx);
    if (n == 3) return PT_REGS_PARM3(ctx);
    if (n == 4) return PT_REGS_PARM4(ctx);
    if (n == 5) return PT_REGS_PARM5(ctx);
#if defined(__x86_64__)
    if (n == 6) return PT_REGS_PARM6(ctx);
#else
    if (n == 6) return ctx->regs[5];
    if (n == 7) return ctx->regs[6];
    if (n == 8) return ctx->regs[7];
#endif
    u64 v = 0;
    bpf_probe_read_user(&v, sizeof(v),
                        (void *)(PT_REGS_SP(ctx) + STACK_ARG_BASE + 8 * (n - ARG_REGS - 1)));
    return v;
}

#endif
