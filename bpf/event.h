/* The header every probing event starts with; shared by all families and
 * mirrored by probing/node/bpf/families.py (HEADER). */
#ifndef PROBING_EVENT_H
#define PROBING_EVENT_H

#define PROBING_HAS_RET 1 /* hdr.flags: ret and dur_ns come from a return probe */

struct probing_hdr {
    u64 ts;     /* entry time, CLOCK_MONOTONIC ns (bpf_ktime_get_ns) */
    u64 dur_ns; /* return - entry; 0 for entry-only probes */
    u32 tid;
    s32 ret; /* the function's return code (PROBING_HAS_RET) */
    u16 fn;  /* the family's function id (enum in <family>.h) */
    u16 flags;
    u32 stack_id; /* the calling thread's Python stack (bpf/pyframes.h), 0: none */
};

#endif
