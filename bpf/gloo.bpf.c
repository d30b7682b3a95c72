/* gloo: uprobes on gloo's collective entry points (gloo::allreduce(opts) and
 * friends, exported by libtorch_cpu). Gloo on CPU is synchronous: the call
 * lasts the whole collective, so entry + return give real durations, and the
 * entry time is when this rank arrived. */
#include "event.h"
#include "gloo.h"
#define EVENT struct gloo_event
#include "common.h"
#include "pyframes.h"

/* -- the ring buffer, drop counter and pairing map (see common.h) -- */
BPF_RINGBUF_OUTPUT(events, RINGBUF_PAGES);
BPF_ARRAY(dropped, u64, 1);
BPF_HASH(inflight, struct inflight_key, EVENT, 16384);

/* -- Python stacks (see pyframes.h): the maps and the one helper that uses them -- */
#ifdef PY_STACKS
BPF_HASH(py_threads, u32, u64, 65536);
BPF_PERCPU_ARRAY(py_scratch, struct py_stack, 1);
BPF_HASH(py_stacks, u32, struct py_stack, PY_STACKS_MAX);
static __always_inline u32 py_stack_id(void) {
    u32 tid = (u32)bpf_get_current_pid_tgid();
    u64 *tstate = py_threads.lookup(&tid);
    int zero = 0;
    struct py_stack *st = tstate ? py_scratch.lookup(&zero) : 0;
    u32 id = st ? py_walk(*tstate, st) : 0;
    if (id)
        py_stacks.insert(&id, st); /* no-op when this stack is known already */
    return id;
}
#else
static __always_inline u32 py_stack_id(void) { return 0; }
#endif
/* every event carries the calling thread's Python stack (0 without one) */
static __always_inline void hdr_init(struct probing_hdr *h, u16 fn) {
    hdr_init_stack(h, fn, py_stack_id());
}

static __always_inline void count_drop(void) {
    int zero = 0;
    u64 *n = dropped.lookup(&zero);
    if (n)
        __sync_fetch_and_add(n, 1);
}
/* submit with no wake-up: the probe drains on a timer; a full ring counts a drop */
static __always_inline void emit(EVENT *ev) {
    if (events.ringbuf_output(ev, sizeof(*ev), BPF_RB_NO_WAKEUP) != 0)
        count_drop();
}
/* entry of a call whose return is probed too */
static __always_inline void park(EVENT *ev) {
    struct inflight_key key = {.tid = ev->hdr.tid, .fn = ev->hdr.fn};
    if (inflight.update(&key, ev) != 0)
        count_drop();
}
/* its return: the parked event, completed (NULL if the entry was not seen).
 * It stays in the map, marked returned (hdr.flags), until the thread's next
 * call overwrites it: a delete would cost a second hash operation. */
static __always_inline EVENT *unpark(struct pt_regs *ctx, u16 fn, struct inflight_key *key) {
    inflight_key_of(key, fn);
    EVENT *ev = inflight.lookup(key);
    if (ev)
        complete(ctx, &ev->hdr);
    return ev;
}

BPF_HASH(context_seq, u64, u64, 4096);

/* torch runs Gloo collectives on ProcessGroupGloo's worker threads, which
 * have no Python stack: the stack is the one of the Python thread that
 * enqueued the work. ProcessGroupGloo::enqueue(intrusive_ptr<AsyncWork>)
 * runs on that thread (the pointer arrives by invisible reference), and
 * AsyncWork::execute(const intrusive_ptr<AsyncWork>&) on the worker. */
BPF_HASH(work_stack, u64, u32, 4096);        /* AsyncWork* -> enqueuer's stack id */
BPF_HASH(worker_stack, u32, u32, 4096);      /* worker tid -> stack id of its work */

int gloo_enqueue(struct pt_regs *ctx) {
    u64 work = read_u64(arg(ctx, 2));
    u32 id = py_stack_id();
    if (work && id)
        work_stack.update(&work, &id);
    return 0;
}
int gloo_execute(struct pt_regs *ctx) {
    u64 work = read_u64(arg(ctx, 1));
    u32 tid = (u32)bpf_get_current_pid_tgid();
    u32 *id = work_stack.lookup(&work);
    u32 v = id ? *id : 0;
    if (id)
        work_stack.delete(&work);
    worker_stack.update(&tid, &v);
    return 0;
}

/* every gloo::<collective>(Options&) takes one reference to its options */
static __always_inline int collective(struct pt_regs *ctx, u16 fn) {
    EVENT ev = {};
    hdr_init(&ev.hdr, fn);
    if (!ev.hdr.stack_id) {
        u32 *w = worker_stack.lookup(&ev.hdr.tid);
        if (w)
            ev.hdr.stack_id = *w;
    }
    u64 opts = arg(ctx, 1);
    u64 context = read_u64(opts);
    ev.context = context;
    if (context) {
        bpf_probe_read_user(ev.ctx_head, sizeof(ev.ctx_head), (void *)context);
        u64 zero = 0;
        u64 *seq = context_seq.lookup_or_try_init(&context, &zero);
        if (seq)
            ev.seq = __sync_fetch_and_add(seq, 1);
    }
    if (fn == GLOO_ALLREDUCE) {
        ev.elements = read_u64(opts + GLOO_ALLREDUCE_ELEMENTS_OFF);
        ev.elem_size = read_u64(opts + GLOO_ALLREDUCE_ELEMSIZE_OFF);
    }
    park(&ev);
    return 0;
}

#define GLOO_PROBE(name, fn)                                 \
    int gloo_##name(struct pt_regs *ctx) { return collective(ctx, fn); } \
    RETURN_PROBE(gloo, fn)

GLOO_PROBE(allreduce, GLOO_ALLREDUCE)
GLOO_PROBE(allgather, GLOO_ALLGATHER)
GLOO_PROBE(allgatherv, GLOO_ALLGATHERV)
GLOO_PROBE(broadcast, GLOO_BROADCAST)
GLOO_PROBE(reduce, GLOO_REDUCE)
GLOO_PROBE(gather, GLOO_GATHER)
GLOO_PROBE(scatter, GLOO_SCATTER)
GLOO_PROBE(alltoall, GLOO_ALLTOALL)
GLOO_PROBE(alltoallv, GLOO_ALLTOALLV)
GLOO_PROBE(barrier, GLOO_BARRIER)
