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
};

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
};

/* the event struct bpf/preamble.c builds its maps and helpers on */
#define EVENT struct gloo_event

#endif
