/* sampler: where one process's threads spend their wall-clock time, per
 * Python stack, while it is traced.
 *
 * - on-CPU: a CPU-clock perf event on every CPU (sample_ns apart) samples
 *   whatever runs; a thread of the traced process adds one sample to its
 *   current stack (stack 0: a thread without Python, e.g. torch's intra-op
 *   pool).
 * - off-CPU: the raw sched_switch tracepoint. When a thread of ours leaves
 *   a CPU its stack and the time are parked; when it next leaves a CPU, the
 *   time it came back is the previous switch on that CPU (nothing else ran
 *   there in between), so the gap is charged to the parked stack: as
 *   "runq" when it left runnable (preempted: it waited for a CPU), and when
 *   it blocked (sleep, read, lock, a collective's wait) as "off" until it
 *   was woken (the sched_wakeup tracepoint stamps the parked thread) and as
 *   "runq" from then until it ran. A new thread (sched_wakeup_new) waits
 *   for its first CPU as "runq". Only the tracepoints' own fields and the
 *   current task are read: no task_struct field, so no kernel header has to
 *   match the kernel.
 *
 * Totals accumulate in `samples` (tid, stack, kind) -> (count, ns); the probe
 * reads them on a timer and stores the differences (probing/node/bpf/sampler.py).
 * The traced process and the period are in `config` (written by the probe),
 * so the bytecode is the same for every process and is compiled once per
 * node; WAKEUP_PID_OFF (the woken pid's offset in the sched_wakeup record,
 * from tracefs) comes as a -D define.
 */
#include "sampler.h"
#define EVENT struct probing_hdr
#include "common.h"
#include "pyframes.h"

BPF_ARRAY(config, struct sampler_config, 1);
BPF_HASH(samples, struct sample_key, struct sample_val, SAMPLES_MAX);
BPF_HASH(parked, u32, struct parked_thread, 65536);
BPF_PERCPU_ARRAY(last_switch, u64, 1);
BPF_ARRAY(dropped, u64, 1);

/* -- Python stacks (see pyframes.h) -- */
#ifdef PY_STACKS
BPF_HASH(py_threads, u32, u64, 65536);
BPF_PERCPU_ARRAY(py_scratch, struct py_stack, 1);
BPF_PERCPU_ARRAY(py_windows, struct py_window, 1);
BPF_HASH(py_stacks, u32, struct py_stack, PY_STACKS_MAX);
static __always_inline u32 py_stack_id(u32 tid) {
    u64 *tstate = py_threads.lookup(&tid);
    int zero = 0;
    struct py_stack *st = tstate ? py_scratch.lookup(&zero) : 0;
    struct py_window *w = st ? py_windows.lookup(&zero) : 0;
    u32 id = w ? py_walk(*tstate, st, w) : 0;
    if (id && !py_stacks.lookup(&id)) /* known: found without the insert's lock */
        py_stacks.insert(&id, st);
    return id;
}
#else
static __always_inline u32 py_stack_id(u32 tid) { return 0; }
#endif

static __always_inline void add(u32 tid, u32 stack_id, u32 kind, u64 ns) {
    struct sample_key key = {.tid = tid, .stack_id = stack_id, .kind = kind};
    struct sample_val *v = samples.lookup(&key);
    if (v) {
        __sync_fetch_and_add(&v->count, 1);
        __sync_fetch_and_add(&v->ns, ns);
        return;
    }
    struct sample_val init = {.count = 1, .ns = ns};
    if (samples.update(&key, &init) != 0) {
        int zero = 0;
        u64 *n = dropped.lookup(&zero);
        if (n)
            __sync_fetch_and_add(n, 1);
    }
}

int on_cpu(void *ctx) { /* a perf event program (its data is not used) */
    int zero = 0;
    struct sampler_config *cfg = config.lookup(&zero);
    u64 id = bpf_get_current_pid_tgid();
    if (!cfg || (id >> 32) != cfg->tgid)
        return 0;
    u32 tid = (u32)id;
    add(tid, py_stack_id(tid), KIND_CPU, cfg->sample_ns);
    return 0;
}

/* args: bool preempt, struct task_struct *prev, *next, unsigned int prev_state */
RAW_TRACEPOINT_PROBE(sched_switch) {
    u64 now = bpf_ktime_get_ns();
    int zero = 0;
    u64 *last = last_switch.lookup(&zero);
    if (!last)
        return 0;
    u64 came_in = *last; /* when the task leaving now got this CPU */
    *last = now;
    struct sampler_config *cfg = config.lookup(&zero);
    u64 id = bpf_get_current_pid_tgid();
    if (!cfg || (id >> 32) != cfg->tgid)
        return 0;
    u32 tid = (u32)id;
    struct parked_thread *p = parked.lookup(&tid);
    if (p && came_in > p->ts) {
        u64 woken = p->woken;
        if (woken > p->ts && woken < came_in) { /* blocked, then waited for a CPU */
            add(tid, p->stack_id, KIND_OFF, woken - p->ts);
            add(tid, p->stack_id, KIND_RUNQ, came_in - woken);
        } else {
            add(tid, p->stack_id, p->kind, came_in - p->ts);
        }
    }
    struct parked_thread out = {.ts = now, .stack_id = py_stack_id(tid)};
    u32 runnable = ctx->args[0] || (u32)ctx->args[3] == 0; /* TASK_RUNNING */
    out.kind = runnable ? KIND_RUNQ : KIND_OFF;
    parked.update(&tid, &out);
    return 0;
}

/* sched_wakeup (a tracepoint program: ctx is the event's record): a blocked
 * thread of ours is runnable from now on */
int on_wakeup(void *ctx) {
    u32 tid = *(u32 *)((char *)ctx + WAKEUP_PID_OFF);
    struct parked_thread *p = parked.lookup(&tid);
    if (p && p->kind == KIND_OFF && !p->woken)
        p->woken = bpf_ktime_get_ns();
    return 0;
}

/* sched_wakeup_new: a thread a thread of ours created waits for its first
 * CPU (a forked child's entry is never charged: its switches are not ours) */
int on_wakeup_new(void *ctx) {
    int zero = 0;
    struct sampler_config *cfg = config.lookup(&zero);
    if (!cfg || (bpf_get_current_pid_tgid() >> 32) != cfg->tgid)
        return 0;
    u32 tid = *(u32 *)((char *)ctx + WAKEUP_PID_OFF);
    struct parked_thread out = {.ts = bpf_ktime_get_ns(), .kind = KIND_RUNQ};
    parked.update(&tid, &out);
    return 0;
}
