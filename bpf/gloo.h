/* gloo: one event per Gloo collective in the torch CPU library. Shared by
 * gloo.bpf.c and probing/node/bpf/families.py. */
#ifndef PROBING_GLOO_H
#define PROBING_GLOO_H

enum gloo_fn {
    GLOO_ALLREDUCE = 0,
    GLOO_ALLGATHER = 1,
    GLOO_ALLGATHERV = 2,
    GLOO_BROADCAST = 3,
    GLOO_REDUCE = 4,
    GLOO_GATHER = 5,
    GLOO_SCATTER = 6,
    GLOO_ALLTOALL = 7,
    GLOO_ALLTOALLV = 8,
    GLOO_BARRIER = 9,
    GLOO_ENQUEUE = 10, /* c10d::ProcessGroupGloo::enqueue: no event (see gloo.bpf.c) */
    GLOO_EXECUTE = 11, /* c10d::ProcessGroupGloo::AsyncWork::execute: no event */
    GLOO_SEND = 12,    /* c10d::ProcessGroupGloo::send: one event when its work is waited */
    GLOO_RECV = 13,    /* c10d::ProcessGroupGloo::recv: the same */
    GLOO_SENDWAIT = 14, /* c10d::ProcessGroupGloo::SendWork::wait: completes GLOO_SEND */
    GLOO_RECVWAIT = 15, /* c10d::ProcessGroupGloo::RecvWork::wait: completes GLOO_RECV */
    GLOO_UBSEND = 16,  /* gloo::transport::tcp::UnboundBuffer::send: the size, no event */
    GLOO_UBRECV = 17,  /* gloo::transport::tcp::UnboundBuffer::recv: the same */
    /* reduce-scatter, which torch runs as all-reduces: one event per call,
     * named by the outermost of these (see gloo.bpf.c) */
    GLOO_REDUCESCATTER = 18,           /* c10d::ProcessGroupGloo::reduce_scatter */
    GLOO_REDUCESCATTER_TENSOR = 19,    /* c10d::ProcessGroupGloo::_reduce_scatter_base */
    GLOO_REDUCESCATTER_COALESCED = 20, /* ...::reduce_scatter_tensor_coalesced */
};

/* Gloo's struct layouts, verified against the Gloo in the libtorch_cpu.so of
 * the torch 2.13.0 wheel (2.13.0+cpu, git cf30153c4c13; an all-reduce's bytes
 * in tests/privileged/test_trace.py). The wheel does not record the Gloo
 * commit torch pins (third_party/gloo); its strings date it to pytorch/gloo
 * 9322e67 (2026-02-09) or later: f834c75's connection-closed message is in
 * it, the SHM allreduce 9322e67 reverted is not. Both layouts below read the
 * same in every pytorch/gloo commit from 46ae6ec (2019-06-19) to 70dc360
 * (2026-04-21, the newest looked at). Another Gloo: override with -D. */

/* gloo::transport::UnboundBuffer {vtable; void* const ptr; const size_t size}
 * (gloo/transport/unbound_buffer.h, unchanged since c2863ec, 2018-09-06, which
 * introduced it): send/recv with nbytes == kUnsetNbytes (~0) move the whole
 * buffer. */
#ifndef GLOO_UB_SIZE_OFF
#define GLOO_UB_SIZE_OFF 16
#endif

/* Where gloo::AllreduceOptions keeps the element count and size: its only
 * member is detail::AllreduceOptionsImpl {shared_ptr<Context> context (0);
 * milliseconds timeout (16); Algorithm algorithm (24); vector in (32), out (56);
 * size_t elements (80); size_t elementSize (88); ...} (gloo/allreduce.h; the
 * algorithm field came with 46ae6ec, "Add bcube allreduce algorithm": before
 * it, elements was at 72). */
#ifndef GLOO_ALLREDUCE_ELEMENTS_OFF
#define GLOO_ALLREDUCE_ELEMENTS_OFF 80
#endif
#ifndef GLOO_ALLREDUCE_ELEMSIZE_OFF
#define GLOO_ALLREDUCE_ELEMSIZE_OFF 88
#endif

struct gloo_event {
    struct probing_hdr hdr;
    u64 context;  /* gloo::Context*: the options' first member, a shared_ptr */
    u64 seq;      /* k-th collective on this context since tracing began */
    u64 elements; /* allreduce: element count; reduce-scatter: its all-reduces' */
    u64 elem_size;
    u64 ctx_head[2]; /* the Context's first 16 bytes: rank and size, decoded by the
                        probe (with or without a vtable pointer in front) */
    s32 peer;        /* send/recv: the other rank (in the group), else -1 */
    s32 tag;         /* send/recv: the tag */
    u64 wait_ns;     /* send/recv: time blocked in the work's wait() (dur_ns: since posted) */
    u32 caller;      /* a collective run on a worker thread: the thread that enqueued it */
    u32 pad;
};

/* the event struct bpf/preamble.c builds its maps and helpers on */
#define EVENT struct gloo_event

#endif
