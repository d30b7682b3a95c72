/* gloo: uprobes on gloo's collective entry points (gloo::allreduce(opts) and
 * friends, exported by libtorch_cpu). Gloo on CPU is synchronous: the call
 * lasts the whole collective, so entry + return give real durations, and the
 * entry time is when this rank arrived. */
/* The maps and helpers every family shares (ring buffer, drop counter,
 * pairing map, Python stacks, hdr_init/emit/park/unpark) come from
 * bpf/preamble.c, which the loader puts in front of this file. */
BPF_HASH(context_seq, u64, u64, 4096);

/* torch runs Gloo collectives on ProcessGroupGloo's worker threads, which
 * have no Python stack: the stack is the one of the Python thread that
 * enqueued the work, and so is the thread the event names (`caller`: the
 * thread that trains, whatever its name). ProcessGroupGloo::enqueue
 * (intrusive_ptr<AsyncWork>) runs on that thread (the pointer arrives by
 * invisible reference), and AsyncWork::execute(const intrusive_ptr<AsyncWork>&)
 * on the worker. */
struct enqueued {
    u32 stack_id; /* the enqueuer's Python stack (0: none) */
    u32 tid;      /* the enqueuer */
    u64 rs;       /* the reduce-scatter it is a part of (rs_calls), 0: none */
};
BPF_HASH(work_stack, u64, struct enqueued, 4096);   /* AsyncWork* -> who enqueued it */
BPF_HASH(worker_stack, u32, struct enqueued, 4096); /* worker tid -> who enqueued its work */

/* Reduce-scatter. torch's Gloo has no reduce-scatter of its own: each of
 * its entry points (ProcessGroupGloo::reduce_scatter,
 * reduce_scatter_tensor_coalesced, and _reduce_scatter_base, which calls
 * the second) enqueues all-reduces of copies of its inputs (one per tensor;
 * for the list form one per rank) and returns a work that copies this
 * rank's chunk out when waited. Each call is one event, its all-reduces
 * none: the entry point opens the call on the caller's thread (rs_open),
 * every all-reduce that thread enqueues in it is one of its parts
 * (enqueued.rs), and the workers run the parts (collective(),
 * gloo_ret_GLOO_ALLREDUCE). The call's ts is its first part's start (when
 * this rank joined, as for any Gloo collective), its seq is taken then,
 * once, dur_ns runs to its last part's end and elements sums its parts'.
 * `pending` counts the parts not returned, plus one until the entry point
 * returns (a part may end before): whoever takes it to zero emits. */
struct rs_open {
    u64 call; /* its key in rs_calls */
    u64 sp;   /* the stack pointer at its entry: an entry point it calls is deeper */
};
struct rs_call {
    EVENT ev;
    u64 pending; /* parts not returned, + 1 until the entry point returns */
    u64 started; /* parts started */
    u64 end;     /* when its last part returned */
};
BPF_HASH(rs_open, u32, struct rs_open, 4096); /* caller tid -> the call it is in */
BPF_HASH(rs_calls, u64, struct rs_call, 4096);
BPF_ARRAY(rs_next, u64, 1); /* the next call's key */

static __always_inline void rs_release(u64 call) {
    struct rs_call *rs = rs_calls.lookup(&call);
    if (!rs || __sync_fetch_and_add(&rs->pending, -1) != 1)
        return;
    if (rs->started) { /* a call whose parts never ran is no collective */
        rs->ev.hdr.dur_ns = rs->end - rs->ev.hdr.ts;
        rs->ev.hdr.flags |= PROBING_HAS_RET;
        emit(&rs->ev);
    }
    rs_calls.delete(&call);
}
static __always_inline int rs_enter(struct pt_regs *ctx, u16 fn) {
    u32 tid = (u32)bpf_get_current_pid_tgid();
    u64 sp = PT_REGS_SP(ctx);
    struct rs_open *open = rs_open.lookup(&tid);
    if (open) {
        if (open->sp > sp)
            return 0; /* called by the entry point this thread is in: the same call */
        rs_release(open->call); /* one an exception left (its return probe never ran) */
        rs_open.delete(&tid);
    }
    int zero = 0;
    u64 *next = rs_next.lookup(&zero);
    if (!next)
        return 0;
    struct rs_open o = {.call = __sync_fetch_and_add(next, 1) + 1, .sp = sp};
    struct rs_call rs = {.pending = 1};
    hdr_init(&rs.ev.hdr, fn);
    rs.ev.peer = -1;
    rs.ev.caller = tid;
    if (rs_calls.update(&o.call, &rs) == 0)
        rs_open.update(&tid, &o);
    return 0;
}
static __always_inline int rs_leave(struct pt_regs *ctx) {
    u32 tid = (u32)bpf_get_current_pid_tgid();
    struct rs_open *open = rs_open.lookup(&tid);
    if (!open || PT_REGS_SP(ctx) < open->sp)
        return 0; /* an entry point it called returned, not the call */
    u64 call = open->call;
    rs_open.delete(&tid);
    rs_release(call);
    return 0;
}
int gloo_reducescatter(struct pt_regs *ctx) { return rs_enter(ctx, GLOO_REDUCESCATTER); }
int gloo_reducescatter_tensor(struct pt_regs *ctx) {
    return rs_enter(ctx, GLOO_REDUCESCATTER_TENSOR);
}
int gloo_reducescatter_coalesced(struct pt_regs *ctx) {
    return rs_enter(ctx, GLOO_REDUCESCATTER_COALESCED);
}
int gloo_ret_GLOO_REDUCESCATTER(struct pt_regs *ctx) { return rs_leave(ctx); }
int gloo_ret_GLOO_REDUCESCATTER_TENSOR(struct pt_regs *ctx) { return rs_leave(ctx); }
int gloo_ret_GLOO_REDUCESCATTER_COALESCED(struct pt_regs *ctx) { return rs_leave(ctx); }

int gloo_enqueue(struct pt_regs *ctx) {
    u64 work = read_u64(arg(ctx, 2));
    if (!work)
        return 0;
    u32 tid = (u32)bpf_get_current_pid_tgid();
    struct enqueued by = {.stack_id = py_stack_id(), .tid = tid};
    struct rs_open *open = rs_open.lookup(&tid);
    if (open) { /* enqueued by a reduce-scatter: one of its parts */
        struct rs_call *rs = rs_calls.lookup(&open->call);
        if (rs) {
            __sync_fetch_and_add(&rs->pending, 1);
            by.rs = open->call;
        }
    }
    work_stack.update(&work, &by);
    return 0;
}
int gloo_execute(struct pt_regs *ctx) {
    u64 work = read_u64(arg(ctx, 1));
    u32 tid = (u32)bpf_get_current_pid_tgid();
    struct enqueued *by = work_stack.lookup(&work);
    struct enqueued v = {};
    if (by) {
        v.stack_id = by->stack_id;
        v.tid = by->tid;
        v.rs = by->rs;
        work_stack.delete(&work);
    }
    worker_stack.update(&tid, &v);
    return 0;
}

/* Point-to-point. ProcessGroupGloo::send(tensors, dstRank, tag) posts the
 * transfer and returns its work; the caller (dist.send, a pipeline's
 * batch_isend_irecv) then blocks in the work's wait(). One event per
 * transfer: ts when posted, dur_ns until its wait returned, wait_ns the
 * part blocked in wait(). The post is parked like any call; at its return
 * the event moves to p2p_work under the work's address; wait() parks it
 * again (in flight: a pipeline hang shows there) and its return emits it.
 * send and recv return a c10::intrusive_ptr<Work> (a non-trivial class)
 * through a hidden pointer: the first argument on x86_64, x8 on aarch64. */
BPF_HASH(p2p_work, u64, EVENT, 4096);   /* SendWork/RecvWork* -> its posted event */
BPF_HASH(p2p_ret, u32, u64, 4096);      /* tid -> where its post's work pointer goes */
struct p2p_key {
    u64 pg;
    s32 peer;
    s32 tag;
    u32 fn;
    u32 pad;
};
BPF_HASH(p2p_seq, struct p2p_key, u64, 4096);

static __always_inline int p2p_post(struct pt_regs *ctx, u16 fn) {
#if defined(__x86_64__)
    u64 ret = arg(ctx, 1), pg = arg(ctx, 2);
    s32 peer = (s32)arg(ctx, 4), tag = (s32)arg(ctx, 5);
#else
    u64 ret = ctx->regs[8], pg = arg(ctx, 1);
    s32 peer = (s32)arg(ctx, 3), tag = (s32)arg(ctx, 4);
#endif
    EVENT ev = {};
    hdr_init(&ev.hdr, fn);
    ev.context = pg;
    ev.peer = peer;
    ev.tag = tag;
    struct p2p_key key = {.pg = pg, .peer = peer, .tag = tag, .fn = fn};
    u64 zero = 0;
    u64 *seq = p2p_seq.lookup_or_try_init(&key, &zero);
    if (seq)
        ev.seq = __sync_fetch_and_add(seq, 1);
    u32 tid = ev.hdr.tid;
    p2p_ret.update(&tid, &ret);
    park(&ev);
    return 0;
}
static __always_inline int p2p_posted(struct pt_regs *ctx, u16 fn) {
    struct inflight_key key;
    EVENT *ev = unpark(ctx, fn, &key);
    u64 *ret = p2p_ret.lookup(&key.tid);
    if (!ev || !ret)
        return 0;
    u64 work = read_u64(*ret);
    p2p_ret.delete(&key.tid);
    if (work)
        p2p_work.update(&work, ev);
    return 0;
}
/* the size of the posted transfer, from the unbound buffer it posts */
static __always_inline int p2p_size(struct pt_regs *ctx, u16 fn) {
    struct inflight_key key;
    inflight_key_of(&key, fn);
    EVENT *ev = inflight.lookup(&key);
    if (!ev || (ev->hdr.flags & PROBING_HAS_RET))
        return 0; /* a collective's own transfers: no post of ours is open */
    u64 nbytes = arg(ctx, 5);
    if (nbytes == ~0ULL)
        nbytes = read_u64(arg(ctx, 1) + GLOO_UB_SIZE_OFF);
    ev->elements = nbytes;
    ev->elem_size = 1;
    return 0;
}
static __always_inline int p2p_wait(struct pt_regs *ctx) {
    u64 work = arg(ctx, 1);
    EVENT *posted = p2p_work.lookup(&work);
    if (!posted)
        return 0;
    EVENT ev = {};
    __builtin_memcpy(&ev, posted, sizeof(ev));
    p2p_work.delete(&work);
    ev.hdr.tid = (u32)bpf_get_current_pid_tgid();
    ev.hdr.flags &= ~PROBING_HAS_RET;
    ev.hdr.dur_ns = 0;
    ev.wait_ns = bpf_ktime_get_ns(); /* when the wait began, until it returns */
    park(&ev);
    return 0;
}
static __always_inline int p2p_waited(struct pt_regs *ctx, u16 fn) {
    struct inflight_key key;
    inflight_key_of(&key, fn);
    EVENT *ev = inflight.lookup(&key);
    if (!ev || (ev->hdr.flags & PROBING_HAS_RET) || !ev->wait_ns)
        return 0;
    complete(ctx, &ev->hdr);
    ev->wait_ns = bpf_ktime_get_ns() - ev->wait_ns;
    emit(ev);
    return 0;
}
int gloo_send(struct pt_regs *ctx) { return p2p_post(ctx, GLOO_SEND); }
int gloo_recv(struct pt_regs *ctx) { return p2p_post(ctx, GLOO_RECV); }
int gloo_ret_GLOO_SEND(struct pt_regs *ctx) { return p2p_posted(ctx, GLOO_SEND); }
int gloo_ret_GLOO_RECV(struct pt_regs *ctx) { return p2p_posted(ctx, GLOO_RECV); }
int gloo_ubsend(struct pt_regs *ctx) { return p2p_size(ctx, GLOO_SEND); }
int gloo_ubrecv(struct pt_regs *ctx) { return p2p_size(ctx, GLOO_RECV); }
int gloo_sendwait(struct pt_regs *ctx) { return p2p_wait(ctx); }
int gloo_recvwait(struct pt_regs *ctx) { return p2p_wait(ctx); }
int gloo_ret_GLOO_SENDWAIT(struct pt_regs *ctx) { return p2p_waited(ctx, GLOO_SEND); }
int gloo_ret_GLOO_RECVWAIT(struct pt_regs *ctx) { return p2p_waited(ctx, GLOO_RECV); }

/* the k-th collective on its context (since tracing began) */
static __always_inline void next_seq(EVENT *ev) {
    u64 context = ev->context, zero = 0;
    u64 *seq = context ? context_seq.lookup_or_try_init(&context, &zero) : 0;
    if (seq)
        ev->seq = __sync_fetch_and_add(seq, 1);
}

/* An all-reduce that is a part of reduce-scatter `rs`: its size is added
 * to the call's, the first part to start gives the call its start, context
 * and seq, and the part waits in `inflight` as the call (a hang shows a
 * reduce-scatter; without a size, known only at the call's end). */
static __always_inline void rs_part(EVENT *ev, struct rs_call *rs) {
    __sync_fetch_and_add(&rs->ev.elements, ev->elements);
    if (__sync_fetch_and_add(&rs->started, 1) == 0) {
        next_seq(ev);
        rs->ev.hdr.ts = ev->hdr.ts;
        rs->ev.context = ev->context;
        rs->ev.ctx_head[0] = ev->ctx_head[0];
        rs->ev.ctx_head[1] = ev->ctx_head[1];
        rs->ev.elem_size = ev->elem_size;
        rs->ev.seq = ev->seq;
    }
    u32 tid = ev->hdr.tid;
    __builtin_memcpy(ev, &rs->ev, sizeof(*ev));
    ev->hdr.tid = tid;
    ev->elements = 0;
    ev->elem_size = 0;
}

/* every gloo::<collective>(Options&) takes one reference to its options */
static __always_inline int collective(struct pt_regs *ctx, u16 fn) {
    EVENT ev = {};
    hdr_init(&ev.hdr, fn);
    ev.peer = -1;
    u64 call = 0;
    struct enqueued *by = worker_stack.lookup(&ev.hdr.tid);
    if (by) {
        if (!ev.hdr.stack_id)
            ev.hdr.stack_id = by->stack_id;
        ev.caller = by->tid;
        call = by->rs;
    }
    u64 opts = arg(ctx, 1);
    ev.context = read_u64(opts);
    if (ev.context)
        bpf_probe_read_user(ev.ctx_head, sizeof(ev.ctx_head), (void *)ev.context);
    if (fn == GLOO_ALLREDUCE) {
        ev.elements = read_u64(opts + GLOO_ALLREDUCE_ELEMENTS_OFF);
        ev.elem_size = read_u64(opts + GLOO_ALLREDUCE_ELEMSIZE_OFF);
    }
    struct rs_call *rs = (call && fn == GLOO_ALLREDUCE) ? rs_calls.lookup(&call) : 0;
    if (rs)
        rs_part(&ev, rs);
    else
        next_seq(&ev);
    park(&ev);
    return 0;
}

/* An all-reduce returns: its event, or, for a reduce-scatter's part, the
 * part's end (the call's event goes out when its last part ends). */
int gloo_ret_GLOO_ALLREDUCE(struct pt_regs *ctx) {
    u32 tid = (u32)bpf_get_current_pid_tgid();
    struct enqueued *by = worker_stack.lookup(&tid);
    u64 call = by ? by->rs : 0;
    struct rs_call *rs = call ? rs_calls.lookup(&call) : 0;
    struct inflight_key key;
    EVENT *ev = unpark(ctx, rs ? rs->ev.hdr.fn : GLOO_ALLREDUCE, &key);
    if (!rs) {
        if (ev)
            emit(ev);
        return 0;
    }
    by->rs = 0; /* one end per part */
    u64 now = bpf_ktime_get_ns();
    if (now > rs->end)
        rs->end = now;
    rs_release(call);
    return 0;
}

#define GLOO_PROBE(name, fn)                                 \
    int gloo_##name(struct pt_regs *ctx) { return collective(ctx, fn); } \
    RETURN_PROBE(gloo, fn)

int gloo_allreduce(struct pt_regs *ctx) { return collective(ctx, GLOO_ALLREDUCE); }
GLOO_PROBE(allgather, GLOO_ALLGATHER)
GLOO_PROBE(allgatherv, GLOO_ALLGATHERV)
GLOO_PROBE(broadcast, GLOO_BROADCAST)
GLOO_PROBE(reduce, GLOO_REDUCE)
GLOO_PROBE(gather, GLOO_GATHER)
GLOO_PROBE(scatter, GLOO_SCATTER)
GLOO_PROBE(alltoall, GLOO_ALLTOALL)
GLOO_PROBE(alltoallv, GLOO_ALLTOALLV)
GLOO_PROBE(barrier, GLOO_BARRIER)
