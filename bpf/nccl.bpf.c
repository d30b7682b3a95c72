/* nccl: uprobes on libnccl's collectives, point-to-point calls, groups and
 * communicator lifecycle. Entry-only for the collectives that only enqueue
 * work (they return at once on a GPU) would lose the return code, so every
 * call is paired with its return: the event carries ret and dur_ns. */
/* The maps and helpers every family shares (ring buffer, drop counter,
 * pairing map, Python stacks, hdr_init/emit/park/unpark) come from
 * bpf/preamble.c, which the loader puts in front of this file. */
#define NO_OP 255

struct comm_info {
    u64 uid;
    s32 rank;
    s32 nranks;
};

BPF_HASH(comm_seq, u64, u64, 4096);
BPF_HASH(comm_info, u64, struct comm_info, 4096);

/* FNV-1a over the 128-byte ncclUniqueId: the same id on every rank of a
 * communicator, so it names the communicator across processes. */
static __always_inline u64 uid_hash(u64 addr) {
    u64 words[16] = {};
    if (bpf_probe_read_user(words, sizeof(words), (void *)addr) != 0)
        return 0;
    u64 h = 0xcbf29ce484222325ULL;
#pragma unroll
    for (int i = 0; i < 16; i++) {
        h ^= words[i];
        h *= 0x100000001b3ULL;
    }
    return h;
}

static __always_inline int call(struct pt_regs *ctx, u16 fn, u64 count, u8 dtype, u8 op,
                                s32 peer, u64 comm, u64 stream) {
    EVENT ev = {};
    hdr_init(&ev.hdr, fn);
    ev.comm = comm;
    ev.stream = stream;
    ev.count = count;
    ev.dtype = dtype;
    ev.op = op;
    ev.peer = peer;
    ev.rank = -1;
    ev.nranks = -1;
    if (comm) {
        /* only collectives and point-to-point calls are numbered */
        u64 zero = 0;
        u64 *seq = fn <= NCCL_ALLTOALL ? comm_seq.lookup_or_try_init(&comm, &zero) : 0;
        if (seq)
            ev.seq = __sync_fetch_and_add(seq, 1);
        struct comm_info *info = comm_info.lookup(&comm);
        if (info) {
            ev.rank = info->rank;
            ev.nranks = info->nranks;
            ev.uid = info->uid;
        }
    }
    park(&ev);
    return 0;
}

/* ncclAllReduce(send, recv, count, datatype, op, comm, stream) */
int nccl_allreduce(struct pt_regs *ctx) {
    return call(ctx, NCCL_ALLREDUCE, arg(ctx, 3), arg(ctx, 4), arg(ctx, 5), -1, arg(ctx, 6),
                arg(ctx, 7));
}
/* ncclReduceScatter(send, recv, recvcount, datatype, op, comm, stream) */
int nccl_reducescatter(struct pt_regs *ctx) {
    return call(ctx, NCCL_REDUCESCATTER, arg(ctx, 3), arg(ctx, 4), arg(ctx, 5), -1, arg(ctx, 6),
                arg(ctx, 7));
}
/* ncclAllGather(send, recv, sendcount, datatype, comm, stream) */
int nccl_allgather(struct pt_regs *ctx) {
    return call(ctx, NCCL_ALLGATHER, arg(ctx, 3), arg(ctx, 4), NO_OP, -1, arg(ctx, 5),
                arg(ctx, 6));
}
/* ncclAlltoAll(send, recv, count, datatype, comm, stream) */
int nccl_alltoall(struct pt_regs *ctx) {
    return call(ctx, NCCL_ALLTOALL, arg(ctx, 3), arg(ctx, 4), NO_OP, -1, arg(ctx, 5),
                arg(ctx, 6));
}
/* ncclBroadcast(send, recv, count, datatype, root, comm, stream) */
int nccl_broadcast(struct pt_regs *ctx) {
    return call(ctx, NCCL_BROADCAST, arg(ctx, 3), arg(ctx, 4), NO_OP, arg(ctx, 5), arg(ctx, 6),
                arg(ctx, 7));
}
/* ncclBcast(buff, count, datatype, root, comm, stream) */
int nccl_bcast(struct pt_regs *ctx) {
    return call(ctx, NCCL_BCAST, arg(ctx, 2), arg(ctx, 3), NO_OP, arg(ctx, 4), arg(ctx, 5),
                arg(ctx, 6));
}
/* ncclReduce(send, recv, count, datatype, op, root, comm, stream) */
int nccl_reduce(struct pt_regs *ctx) {
    return call(ctx, NCCL_REDUCE, arg(ctx, 3), arg(ctx, 4), arg(ctx, 5), arg(ctx, 6), arg(ctx, 7),
                arg(ctx, 8));
}
/* ncclSend(send, count, datatype, peer, comm, stream) */
int nccl_send(struct pt_regs *ctx) {
    return call(ctx, NCCL_SEND, arg(ctx, 2), arg(ctx, 3), NO_OP, arg(ctx, 4), arg(ctx, 5),
                arg(ctx, 6));
}
/* ncclRecv(recv, count, datatype, peer, comm, stream) */
int nccl_recv(struct pt_regs *ctx) {
    return call(ctx, NCCL_RECV, arg(ctx, 2), arg(ctx, 3), NO_OP, arg(ctx, 4), arg(ctx, 5),
                arg(ctx, 6));
}
int nccl_groupstart(struct pt_regs *ctx) {
    return call(ctx, NCCL_GROUPSTART, 0, 0, NO_OP, -1, 0, 0);
}
int nccl_groupend(struct pt_regs *ctx) {
    return call(ctx, NCCL_GROUPEND, 0, 0, NO_OP, -1, 0, 0);
}

/* Communicator creation: the entry knows rank, nranks and the unique id;
 * the return knows the communicator (written through the first argument). */
static __always_inline int init_enter(struct pt_regs *ctx, u16 fn, u64 newcomm, s32 nranks,
                                      s32 rank, u64 uid_addr) {
    EVENT ev = {};
    hdr_init(&ev.hdr, fn);
    ev.comm = newcomm; /* ncclComm_t*, replaced by the communicator at return */
    ev.rank = rank;
    ev.nranks = nranks;
    ev.uid = uid_hash(uid_addr);
    ev.op = NO_OP;
    ev.peer = -1;
    park(&ev);
    return 0;
}

/* Where the by-value ncclUniqueId (128 bytes) argument lies: in memory on the
 * stack on x86_64 (it takes no register), by reference on aarch64. */
#if defined(__x86_64__)
#define UID_ARG(ctx, n) (PT_REGS_SP(ctx) + 8)
#define AFTER_UID(n) (n)
#else
#define UID_ARG(ctx, n) arg(ctx, n)
#define AFTER_UID(n) ((n) + 1)
#endif

/* ncclCommInitRank(comm*, nranks, ncclUniqueId, rank) (and ...Config(..., config)) */
int nccl_comminitrank(struct pt_regs *ctx) {
    return init_enter(ctx, NCCL_COMMINITRANK, arg(ctx, 1), arg(ctx, 2), arg(ctx, AFTER_UID(3)),
                      UID_ARG(ctx, 3));
}
int nccl_comminitrankconfig(struct pt_regs *ctx) {
    return init_enter(ctx, NCCL_COMMINITRANKCONFIG, arg(ctx, 1), arg(ctx, 2),
                      arg(ctx, AFTER_UID(3)), UID_ARG(ctx, 3));
}
/* ncclCommInitRankScalable(comm*, nranks, rank, nId, ncclUniqueId* ids, config) */
int nccl_comminitrankscalable(struct pt_regs *ctx) {
    return init_enter(ctx, NCCL_COMMINITRANKSCALABLE, arg(ctx, 1), arg(ctx, 2), arg(ctx, 3),
                      arg(ctx, 5));
}

static __always_inline int init_return(struct pt_regs *ctx, u16 fn) {
    struct inflight_key key;
    EVENT *ev = unpark(ctx, fn, &key);
    if (!ev)
        return 0;
    u64 comm = read_u64(ev->comm);
    ev->comm = comm;
    if (comm && ev->hdr.ret == 0) {
        struct comm_info info = {.uid = ev->uid, .rank = ev->rank, .nranks = ev->nranks};
        comm_info.update(&comm, &info);
        u64 zero = 0;
        comm_seq.update(&comm, &zero);
    }
    emit(ev);
    return 0;
}
int nccl_ret_init(struct pt_regs *ctx) { return init_return(ctx, NCCL_COMMINITRANK); }
int nccl_ret_initconfig(struct pt_regs *ctx) { return init_return(ctx, NCCL_COMMINITRANKCONFIG); }
int nccl_ret_initscalable(struct pt_regs *ctx) {
    return init_return(ctx, NCCL_COMMINITRANKSCALABLE);
}

/* ncclCommDestroy(comm), ncclCommAbort(comm): forget the communicator. */
static __always_inline int comm_end(struct pt_regs *ctx, u16 fn) {
    u64 comm = arg(ctx, 1);
    call(ctx, fn, 0, 0, NO_OP, -1, comm, 0);
    comm_seq.delete(&comm);
    comm_info.delete(&comm);
    return 0;
}
int nccl_commdestroy(struct pt_regs *ctx) { return comm_end(ctx, NCCL_COMMDESTROY); }
int nccl_commabort(struct pt_regs *ctx) { return comm_end(ctx, NCCL_COMMABORT); }

RETURN_PROBE(nccl, NCCL_ALLREDUCE)
RETURN_PROBE(nccl, NCCL_ALLGATHER)
RETURN_PROBE(nccl, NCCL_REDUCESCATTER)
RETURN_PROBE(nccl, NCCL_BROADCAST)
RETURN_PROBE(nccl, NCCL_BCAST)
RETURN_PROBE(nccl, NCCL_REDUCE)
RETURN_PROBE(nccl, NCCL_SEND)
RETURN_PROBE(nccl, NCCL_RECV)
RETURN_PROBE(nccl, NCCL_ALLTOALL)
RETURN_PROBE(nccl, NCCL_GROUPSTART)
RETURN_PROBE(nccl, NCCL_GROUPEND)
RETURN_PROBE(nccl, NCCL_COMMDESTROY)
RETURN_PROBE(nccl, NCCL_COMMABORT)
