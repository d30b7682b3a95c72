/* cuda: one event per CUDA runtime / driver call. Shared by cuda.bpf.c and
 * probing/node/bpf/families.py. */
#ifndef PROBING_CUDA_H
#define PROBING_CUDA_H

enum cuda_fn {
    CUDA_LAUNCHKERNEL = 0,
    CUDA_LAUNCHKERNEL_PTSZ = 1,
    CUDA_LAUNCHKERNELEXC = 2,
    CUDA_MEMCPY = 3,
    CUDA_MEMCPYASYNC = 4,
    CUDA_MALLOC = 5,
    CUDA_FREE = 6,
    CUDA_STREAMSYNCHRONIZE = 7,
    CUDA_DEVICESYNCHRONIZE = 8,
    CUDA_EVENTSYNCHRONIZE = 9,
    CUDA_GRAPHLAUNCH = 10,
    CU_LAUNCHKERNEL = 11,
    CU_MODULEGETFUNCTION = 12,
};

struct cuda_event {
    struct probing_hdr hdr;
    u64 func;   /* kernel: host stub (cudaLaunchKernel) or CUfunction; graph exec */
    u64 bytes;  /* memcpy count, malloc size */
    u64 stream; /* cudaStream_t / CUstream; the event for cudaEventSynchronize */
    u64 ptr;    /* memcpy dst, free'd pointer, malloc'd pointer, kernel name string */
    u32 grid[3];
    u32 block[3];
    u8 kind; /* cudaMemcpyKind, 255 where the call has none */
    u8 pad[7];
};

/* the event struct bpf/preamble.c builds its maps and helpers on */
#define EVENT struct cuda_event

#endif
