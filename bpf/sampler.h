/* The sampler's map entries; mirrored by probing/node/bpf/sampler.py (KINDS and
 * the config it writes). */
#ifndef PROBING_SAMPLER_H
#define PROBING_SAMPLER_H

#define KIND_CPU 0  /* on a CPU (perf-event samples) */
#define KIND_OFF 1  /* blocked: sleep, I/O, a lock, a collective's wait */
#define KIND_RUNQ 2 /* runnable, waiting for a CPU: preempted, or woken and not run yet */

#ifndef SAMPLES_MAX
#define SAMPLES_MAX 16384
#endif

/* what varies from process to process, written by the probe before it
 * attaches: so one compiled program serves every process of a node */
struct sampler_config {
    u32 tgid;      /* the traced process */
    u32 pad;
    u64 sample_ns; /* the CPU-clock sampling period */
};

struct sample_key {
    u32 tid;
    u32 stack_id; /* Python stack (bpf/pyframes.h), 0: none */
    u32 kind;
    u32 pad;
};

struct sample_val {
    u64 count; /* samples, or off-CPU intervals */
    u64 ns;
};

struct parked_thread {
    u64 ts;    /* when it left the CPU (or, new, was first woken) */
    u64 woken; /* when a blocked thread was woken, 0 until then */
    u32 stack_id;
    u32 kind;
};

#endif
