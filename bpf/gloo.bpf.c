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
