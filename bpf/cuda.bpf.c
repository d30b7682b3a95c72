/* cuda: uprobes on libcudart (launches, copies, allocations, the three
 * synchronising calls, graph launches) and libcuda (cuLaunchKernel, which
 * Triton uses, and cuModuleGetFunction, which names its kernels).
 *
 * Launches and asynchronous copies are entry-only: they run at tens of
 * thousands per second and return at once. Calls that block (memcpy, the
 * synchronise calls, malloc/free) are paired with their return, which gives
 * their duration and return code: that is where a rank waits. */
/* The maps and helpers every family shares (ring buffer, drop counter,
 * pairing map, Python stacks, hdr_init/emit/park/unpark) come from
 * bpf/preamble.c, which the loader puts in front of this file. */
#define NO_KIND 255

static __always_inline void init(EVENT *ev, u16 fn) {
    hdr_init(&ev->hdr, fn);
    ev->kind = NO_KIND;
}
/* a kernel launch or an asynchronous copy: tens of thousands a second. Its
 * event is written in place in the ring buffer (preamble.c: reserve), each
 * field once, and its Python stack is walked only with -DPY_STACKS_HOT
 * (--launch-stacks). NULL when the ring is full. */
static __always_inline EVENT *hot_event(u16 fn) {
#ifdef PY_STACKS_HOT
    u32 stack_id = py_stack_id();
#else
    u32 stack_id = 0;
#endif
    EVENT *ev = reserve();
    if (!ev)
        return 0;
    hdr_fill(&ev->hdr, fn, stack_id);
    ev->ptr = 0;
    ev->kind = NO_KIND;
    __builtin_memset(ev->pad, 0, sizeof(ev->pad));
    return ev;
}

/* cudaLaunchKernel(func, dim3 grid, dim3 block, void **args, size_t shmem, stream):
 * each 12-byte dim3 travels in two registers (x|y<<32, z). */
static __always_inline int launch(struct pt_regs *ctx, u16 fn) {
    EVENT *ev = hot_event(fn);
    if (!ev)
        return 0;
    ev->func = arg(ctx, 1);
    u64 gxy = arg(ctx, 2), bxy = arg(ctx, 4);
    ev->grid[0] = (u32)gxy;
    ev->grid[1] = gxy >> 32;
    ev->grid[2] = (u32)arg(ctx, 3);
    ev->block[0] = (u32)bxy;
    ev->block[1] = bxy >> 32;
    ev->block[2] = (u32)arg(ctx, 5);
    u64 tail[2] = {}; /* dynamic shared memory, stream: on the stack (x86_64) */
    args_from(ctx, 7, tail, 2);
    ev->bytes = tail[0];
    ev->stream = tail[1];
    submit(ev);
    return 0;
}
int cuda_launchkernel(struct pt_regs *ctx) { return launch(ctx, CUDA_LAUNCHKERNEL); }
int cuda_launchkernel_ptsz(struct pt_regs *ctx) { return launch(ctx, CUDA_LAUNCHKERNEL_PTSZ); }

/* cudaLaunchKernelExC(const cudaLaunchConfig_t *config, const void *func, void **args):
 * config = {dim3 grid; dim3 block; size_t dynamicSmemBytes; cudaStream_t stream; ...} */
struct launch_config {
    u32 grid[3];
    u32 block[3];
    u64 smem;
    u64 stream;
};
int cuda_launchkernelexc(struct pt_regs *ctx) {
    struct launch_config cfg = {};
    bpf_probe_read_user(&cfg, sizeof(cfg), (void *)arg(ctx, 1));
    EVENT *ev = hot_event(CUDA_LAUNCHKERNELEXC);
    if (!ev)
        return 0;
    ev->func = arg(ctx, 2);
    __builtin_memcpy(ev->grid, cfg.grid, sizeof(ev->grid));
    __builtin_memcpy(ev->block, cfg.block, sizeof(ev->block));
    ev->bytes = cfg.smem;
    ev->stream = cfg.stream;
    submit(ev);
    return 0;
}

/* Where each loaded libcudart lies (the tracer fills it from /proc/self/maps).
 * The runtime launches through the driver's own cuLaunchKernel: a call from
 * there is a cudaLaunchKernel already recorded, not a second launch. */
#define RUNTIME_RANGES 8 /* RUNTIME_RANGES in probing/node/bpf/tracer.py */
struct text_range {
    u64 start, end;
};
BPF_ARRAY(runtime_text, struct text_range, RUNTIME_RANGES);

static __always_inline int called_from_runtime(struct pt_regs *ctx) {
#if defined(__x86_64__)
    u64 pc = 0; /* the return address, on top of the stack at entry */
    bpf_probe_read_user(&pc, sizeof(pc), (void *)PT_REGS_SP(ctx));
#else
    u64 pc = ctx->regs[30]; /* the link register */
#endif
#pragma unroll
    for (int i = 0; i < RUNTIME_RANGES; i++) {
        int k = i;
        struct text_range *r = runtime_text.lookup(&k);
        if (!r || !r->end)
            break;
        if (pc >= r->start && pc < r->end)
            return 1;
    }
    return 0;
}

/* cuLaunchKernel(f, gx, gy, gz, bx, by, bz, shmem, stream, params, extra) */
int cu_launchkernel(struct pt_regs *ctx) {
    if (called_from_runtime(ctx))
        return 0;
    u64 tail[3] = {}; /* block z, shared memory, stream: on the stack (x86_64) */
    args_from(ctx, 7, tail, 3);
    EVENT *ev = hot_event(CU_LAUNCHKERNEL);
    if (!ev)
        return 0;
    ev->func = arg(ctx, 1);
    ev->grid[0] = arg(ctx, 2);
    ev->grid[1] = arg(ctx, 3);
    ev->grid[2] = arg(ctx, 4);
    ev->block[0] = arg(ctx, 5);
    ev->block[1] = arg(ctx, 6);
    ev->block[2] = tail[0];
    ev->bytes = tail[1];
    ev->stream = tail[2];
    submit(ev);
    return 0;
}

/* cudaMemcpy(dst, src, count, kind): blocks; cudaMemcpyAsync(..., stream) */
int cuda_memcpy(struct pt_regs *ctx) {
    EVENT ev = {};
    init(&ev, CUDA_MEMCPY);
    ev.ptr = arg(ctx, 1);
    ev.bytes = arg(ctx, 3);
    ev.kind = arg(ctx, 4);
    park(&ev);
    return 0;
}
int cuda_memcpyasync(struct pt_regs *ctx) {
    EVENT *ev = hot_event(CUDA_MEMCPYASYNC);
    if (!ev)
        return 0;
    ev->func = 0;
    ev->ptr = arg(ctx, 1);
    ev->bytes = arg(ctx, 3);
    ev->kind = arg(ctx, 4);
    ev->stream = arg(ctx, 5);
    __builtin_memset(ev->grid, 0, sizeof(ev->grid));
    __builtin_memset(ev->block, 0, sizeof(ev->block));
    submit(ev);
    return 0;
}

/* cudaMalloc(void **devPtr, size): the pointer is read back at return. */
int cuda_malloc(struct pt_regs *ctx) {
    EVENT ev = {};
    init(&ev, CUDA_MALLOC);
    ev.ptr = arg(ctx, 1);
    ev.bytes = arg(ctx, 2);
    park(&ev);
    return 0;
}
int cuda_ret_CUDA_MALLOC(struct pt_regs *ctx) {
    struct inflight_key key;
    EVENT *ev = unpark(ctx, CUDA_MALLOC, &key);
    if (ev) {
        ev->ptr = ev->hdr.ret == 0 ? read_u64(ev->ptr) : 0;
        emit(ev);
    }
    return 0;
}

/* Calls with one interesting pointer argument, paired with their return. */
static __always_inline int one_arg(struct pt_regs *ctx, u16 fn, int into_stream) {
    EVENT ev = {};
    init(&ev, fn);
    if (into_stream)
        ev.stream = arg(ctx, 1);
    else
        ev.ptr = arg(ctx, 1);
    park(&ev);
    return 0;
}
int cuda_free(struct pt_regs *ctx) { return one_arg(ctx, CUDA_FREE, 0); }
int cuda_streamsynchronize(struct pt_regs *ctx) { return one_arg(ctx, CUDA_STREAMSYNCHRONIZE, 1); }
int cuda_devicesynchronize(struct pt_regs *ctx) {
    EVENT ev = {};
    init(&ev, CUDA_DEVICESYNCHRONIZE);
    park(&ev);
    return 0;
}
int cuda_eventsynchronize(struct pt_regs *ctx) { return one_arg(ctx, CUDA_EVENTSYNCHRONIZE, 1); }

/* cudaGraphLaunch(graphExec, stream) */
int cuda_graphlaunch(struct pt_regs *ctx) {
    EVENT ev = {};
    init(&ev, CUDA_GRAPHLAUNCH);
    ev.func = arg(ctx, 1);
    ev.stream = arg(ctx, 2);
    emit(&ev);
    return 0;
}

/* cuModuleGetFunction(CUfunction *hfunc, CUmodule hmod, const char *name): at
 * return, func = the new CUfunction and ptr = the name, which the probe reads
 * from its own memory to name the kernels cuLaunchKernel starts. */
int cu_modulegetfunction(struct pt_regs *ctx) {
    EVENT ev = {};
    init(&ev, CU_MODULEGETFUNCTION);
    ev.func = arg(ctx, 1);
    ev.ptr = arg(ctx, 3);
    park(&ev);
    return 0;
}
int cuda_ret_CU_MODULEGETFUNCTION(struct pt_regs *ctx) {
    struct inflight_key key;
    EVENT *ev = unpark(ctx, CU_MODULEGETFUNCTION, &key);
    if (ev) {
        ev->func = ev->hdr.ret == 0 ? read_u64(ev->func) : 0;
        emit(ev);
    }
    return 0;
}

RETURN_PROBE(cuda, CUDA_MEMCPY)
RETURN_PROBE(cuda, CUDA_FREE)
RETURN_PROBE(cuda, CUDA_STREAMSYNCHRONIZE)
RETURN_PROBE(cuda, CUDA_DEVICESYNCHRONIZE)
RETURN_PROBE(cuda, CUDA_EVENTSYNCHRONIZE)
