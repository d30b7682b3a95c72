/* nccl: one event per NCCL call. Shared by nccl.bpf.c and probing/node/bpf/families.py
 * (which checks the enum and the struct size against its own copy). */
#ifndef PROBING_NCCL_H
#define PROBING_NCCL_H

enum nccl_fn {
    NCCL_ALLREDUCE = 0,
    NCCL_ALLGATHER = 1,
    NCCL_REDUCESCATTER = 2,
    NCCL_BROADCAST = 3,
    NCCL_BCAST = 4,
    NCCL_REDUCE = 5,
    NCCL_SEND = 6,
    NCCL_RECV = 7,
    NCCL_ALLTOALL = 8,
    NCCL_GROUPSTART = 9,
    NCCL_GROUPEND = 10,
    NCCL_COMMINITRANK = 11,
    NCCL_COMMINITRANKCONFIG = 12,
    NCCL_COMMINITRANKSCALABLE = 13,
    NCCL_COMMDESTROY = 14,
    NCCL_COMMABORT = 15,
};

struct nccl_event {
    struct probing_hdr hdr;
    u64 comm;   /* ncclComm_t */
    u64 stream; /* cudaStream_t */
    u64 count;  /* elements (the count argument) */
    u64 seq;    /* k-th call on this communicator since tracing began */
    u64 uid;    /* hash of the communicator's ncclUniqueId, 0 if unseen */
    s32 rank;   /* this rank in comm, -1 if its init was not seen */
    s32 nranks;
    s32 peer; /* root (Broadcast/Reduce) or peer (Send/Recv), else -1 */
    u8 dtype; /* ncclDataType_t */
    u8 op;    /* ncclRedOp_t, 255 where the call has none */
    u16 pad;
};

/* the event struct bpf/preamble.c builds its maps and helpers on */
#define EVENT struct nccl_event

#endif
