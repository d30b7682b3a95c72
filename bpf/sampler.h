/* The sampler's map entries; mirrored by probing/bpf/sampler.py (KEY, VAL, KINDS). */
#ifndef PROBING_SAMPLER_H
#define PROBING_SAMPLER_H

#define KIND_CPU 0  /* on a CPU (perf-event samples) */
#define KIND_OFF 1  /* blocked: sleep, I/O, a lock, a collective's wait */
#define KIND_RUNQ 2 /* runnable but preempted: waiting for a CPU */

#ifndef SAMPLES_MAX
#define SAMPLES_MAX 16384
#endif

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
    u64 ts; /* when it left the CPU */
    u32 stack_id;
    u32 kind;
};

#endif
