/* The part every probe family's program shares: the loader
 * (probing/node/bpf/loader.py) puts this file in front of bpf/<family>.bpf.c and
 * compiles the two as one source, with -DPROBING_FAMILY_H="<family>.h"
 * naming the family's header, which defines EVENT (its event struct).
 * Map calls are written here, in the main source, because BCC rewrites only
 * those (not the ones in headers or inside macros).
 *
 * probing_dispatch is the one program a multi-uprobe link runs (Linux >= 6.6,
 * BPF_TRACE_UPROBE_MULTI): one link per library and direction attaches it
 * at every probed function, and the attach cookie names the handler it
 * tail-calls, the same handler a single uprobe runs on older kernels. */
#include "event.h"
#include PROBING_FAMILY_H
#include "common.h"
#include "pyframes.h"

#ifndef PROBING_HANDLERS
#define PROBING_HANDLERS 64
#endif

/* -- the ring buffer, drop counter and pairing map (see common.h) -- */
BPF_RINGBUF_OUTPUT(events, RINGBUF_PAGES);
/* [0] events lost; [1] events a second try saved: a reserve or output may
 * fail with room in the ring (Linux >= 6.15 takes the ring's lock with a
 * resilient spinlock, which can give up). What looked like that was the
 * drain's consumer position written byte by byte (bpf/ringbuf.py): with it
 * written whole, no try has failed at 1 M events/s for 60 s. */
BPF_ARRAY(dropped, u64, 2);
BPF_HASH(inflight, struct inflight_key, EVENT, 16384);

/* -- Python stacks (see pyframes.h): the maps and the one helper that uses them -- */
#ifdef PY_STACKS
BPF_HASH(py_threads, u32, u64, 65536);
BPF_PERCPU_ARRAY(py_scratch, struct py_stack, 1);
BPF_PERCPU_ARRAY(py_windows, struct py_window, 1);
BPF_HASH(py_stacks, u32, struct py_stack, PY_STACKS_MAX);
static __always_inline u32 py_stack_id(void) {
    u32 tid = (u32)bpf_get_current_pid_tgid();
    u64 *tstate = py_threads.lookup(&tid);
    int zero = 0;
    struct py_stack *st = tstate ? py_scratch.lookup(&zero) : 0;
    struct py_window *w = st ? py_windows.lookup(&zero) : 0;
    u32 id = w ? py_walk(*tstate, st, w) : 0;
    /* a known stack (most calls' after the first few) is found without the
     * bucket lock an insert takes, even one that finds it there */
    if (id && !py_stacks.lookup(&id))
        py_stacks.insert(&id, st);
    return id;
}
#else
static __always_inline u32 py_stack_id(void) { return 0; }
#endif
/* every event carries the calling thread's Python stack (0 without one) */
static __always_inline void hdr_init(struct probing_hdr *h, u16 fn) {
    hdr_init_stack(h, fn, py_stack_id());
}

#define DROPPED 0 /* the slots of `dropped` */
#define SAVED 1
static __always_inline void count_n(int slot, u64 k) {
    u64 *n = dropped.lookup(&slot);
    if (n)
        __sync_fetch_and_add(n, k);
}
static __always_inline void count(int slot) { count_n(slot, 1); }
static __always_inline void count_drop(void) { count(DROPPED); }
/* output with no wake-up (the probe drains on a timer); one more try after
 * a failure (BCC has no ringbuf_query to tell a full ring from a busy lock:
 * a full ring fails the second try as fast), then `lost` events dropped */
static __always_inline void output(void *rec, u64 size, u32 lost) {
    if (events.ringbuf_output(rec, size, BPF_RB_NO_WAKEUP) == 0)
        return;
    if (events.ringbuf_output(rec, size, BPF_RB_NO_WAKEUP) == 0)
        count(SAVED);
    else
        count_n(DROPPED, lost);
}

#ifdef STAGE_EVENTS
/* Staged events (the cuda family: -DSTAGE_EVENTS=8). A ring-buffer record
 * costs a reserve and a submit, each taking the ring's lock: ~90 ns, most
 * of what a launch's probe adds to the bare uprobe. So the hot calls'
 * events are written in place in a per-CPU stage, and the stage goes to
 * the ring as one record of STAGE_EVENTS events when full (a launch then
 * costs ~1.17x a bare uprobe, not 1.25x: trace_bench calls). Every record
 * of the ring is a stage, `n` of its events valid (bpf/ringbuf.py:
 * unstage). A stage is also sent whole, first, when an event of another
 * kind is emitted or a blocking call is entered on that CPU (what ran
 * before a wait is out before the wait); when a thread leaves the CPU
 * (probing_flush at sched_switch: a thread that moves keeps its order);
 * and when the probe drains (probing_flush run on every CPU by
 * BPF_PROG_TEST_RUN: for every query, at least every 0.5 s otherwise), so
 * a query sees every call made before it. `busy`: a launch is filling the
 * stage, which a flush that interrupts it leaves alone (that launch sends
 * it, or the next flush does). */
struct stage {
    u32 n;
    u32 busy;
    EVENT ev[STAGE_EVENTS];
};
BPF_PERCPU_ARRAY(stage, struct stage, 1);

static __always_inline struct stage *stage_open(void) {
    int zero = 0;
    struct stage *st = stage.lookup(&zero);
    if (st) {
        st->busy = 1;
        asm volatile("" ::: "memory");
    }
    return st;
}
static __always_inline void stage_close(struct stage *st) {
    asm volatile("" ::: "memory");
    st->busy = 0;
}
static __always_inline void stage_send(struct stage *st) {
    if (st->n) {
        output(st, sizeof(*st), st->n);
        st->n = 0;
    }
}
/* the stage's next free slot (a full stage is sent at once, so it has one;
 * the check is also the bound the verifier wants) */
static __always_inline u32 stage_slot(struct stage *st) {
    u32 i = st->n;
    if (i >= STAGE_EVENTS) {
        stage_send(st);
        i = 0;
    }
    return i;
}
/* the hot calls' way: a slot of this CPU's stage, filled field by field,
 * then submit() */
static __always_inline EVENT *reserve(void) {
    struct stage *st = stage_open();
    if (!st)
        return 0;
    return &st->ev[stage_slot(st)];
}
static __always_inline void submit(EVENT *ev) {
    int zero = 0;
    struct stage *st = stage.lookup(&zero);
    if (!st)
        return;
    u32 i = st->n + 1;
    st->n = i;
    if (i >= STAGE_EVENTS)
        stage_send(st);
    stage_close(st);
}
/* an event of another kind: after what is staged, in the same record */
static __always_inline void emit(EVENT *ev) {
    struct stage *st = stage_open();
    if (!st)
        return;
    u32 i = stage_slot(st);
    __builtin_memcpy(&st->ev[i], ev, sizeof(EVENT));
    st->n = i + 1;
    stage_send(st);
    stage_close(st);
}
static __always_inline void stage_flush(void) {
    struct stage *st = stage_open();
    if (st) {
        stage_send(st);
        stage_close(st);
    }
}
/* at sched_switch, and run by the probe on each CPU before it drains */
int probing_flush(void *ctx) {
    int zero = 0;
    struct stage *st = stage.lookup(&zero);
    if (st && !st->busy)
        stage_send(st);
    return 0;
}
#else
static __always_inline void emit(EVENT *ev) { output(ev, sizeof(*ev), 1); }
/* The hot calls' way (kernel launches, asynchronous copies): the event is
 * written in place in the ring buffer, neither zeroed nor built on the
 * stack and copied (reserve, fill every field, submit); NULL, counted as a
 * drop, when a second try fails too. */
static __always_inline EVENT *reserve(void) {
    EVENT *ev = events.ringbuf_reserve(sizeof(EVENT));
    if (ev)
        return ev;
    ev = events.ringbuf_reserve(sizeof(EVENT));
    count(ev ? SAVED : DROPPED);
    return ev;
}
static __always_inline void submit(EVENT *ev) { events.ringbuf_submit(ev, BPF_RB_NO_WAKEUP); }
static __always_inline void stage_flush(void) {}
#endif
/* entry of a call whose return is probed too (what is staged goes first) */
static __always_inline void park(EVENT *ev) {
    stage_flush();
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

/* -- the multi-uprobe entry point: cookie = the handler's slot -- */
BPF_PROG_ARRAY(handlers, PROBING_HANDLERS);
int probing_dispatch(struct pt_regs *ctx) {
    handlers.call(ctx, (u32)bpf_get_attach_cookie(ctx));
    return 0;
}
