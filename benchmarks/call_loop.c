/* Calls a CUDA runtime entry point n times from C, so a benchmark measures
 * the uprobe and not the Python call around it. Built by trace_bench.py. */
#include <stddef.h>
#include <time.h>

typedef struct { unsigned x, y, z; } dim3;
typedef int (*launch_fn)(const void *, dim3, dim3, void **, size_t, void *);
typedef int (*sync_fn)(void *);

static long long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* this thread's CPU time: a uprobe's BPF program runs in the probed thread
 * and is charged to it, while the time other work on a busy machine took
 * the CPU away is not */
static long long cpu_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* ns per call of cudaLaunchKernel(func, {1,1,1}, {32,1,1}, 0, 0, 0) */
double launch_loop(void *fn, void *func, long n) {
    dim3 g = {1, 1, 1}, b = {32, 1, 1};
    long long t0 = now_ns();
    for (long i = 0; i < n; i++)
        ((launch_fn)fn)(func, g, b, NULL, 0, NULL);
    return (double)(now_ns() - t0) / n;
}

/* ns per call of cudaStreamSynchronize(NULL) (probed at entry and return) */
double sync_loop(void *fn, long n) {
    long long t0 = now_ns();
    for (long i = 0; i < n; i++)
        ((sync_fn)fn)(NULL);
    return (double)(now_ns() - t0) / n;
}

/* the same two loops, in CPU ns of the calling thread per call */
double launch_loop_cpu(void *fn, void *func, long n) {
    long long t0 = cpu_ns();
    launch_loop(fn, func, n);
    return (double)(cpu_ns() - t0) / n;
}

double sync_loop_cpu(void *fn, long n) {
    long long t0 = cpu_ns();
    sync_loop(fn, n);
    return (double)(cpu_ns() - t0) / n;
}
