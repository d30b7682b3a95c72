/* gloo: one event per Gloo collective in the torch CPU library. Shared by
 * gloo.bpf.c and probing/bpf/families.py. */
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
};

/* gloo::transport::UnboundBuffer {vtable; void* const ptr; const size_t size}
 * (gloo/transport/unbound_buffer.h, unchanged from gloo's 2018 introduction of
 * unbound buffers through the revision torch 2.13 vendors): send/recv with
 * nbytes == kUnsetNbytes (~0) move the whole buffer. */
#ifndef GLOO_UB_SIZE_OFF
#define GLOO_UB_SIZE_OFF 16
#endif

/* Where gloo::AllreduceOptions keeps the element count and size: its only
 * member is detail::AllreduceOptionsImpl {shared_ptr<Context> context;
 * milliseconds timeout; Algorithm algorithm; vector in, out; size_t elements;
 * size_t elementSize; ...}. Overridable with -D for another gloo. */
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
    u64 elements; /* allreduce: element count, else 0 */
    u64 elem_size;
    u64 ctx_head[2]; /* the Context's first 16 bytes: rank and size, decoded by the
                        probe (with or without a vtable pointer in front) */
    s32 peer;        /* send/recv: the other rank (in the group), else -1 */
    s32 tag;         /* send/recv: the tag */
    u64 wait_ns;     /* send/recv: time blocked in the work's wait() (dur_ns: since posted) */
};

/* the event struct bpf/preamble.c builds its maps and helpers on */
#define EVENT struct gloo_event

#endif
