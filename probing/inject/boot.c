/*
 * libprobing_boot: loaded into a running Python process by `probing inject`.
 *
 * The injector borrows one thread for two calls: dlopen() of this library,
 * then probing_boot(args). probing_boot copies its arguments and starts a
 * detached thread, so the borrowed thread is given back at once, whatever
 * it was doing. The new thread takes the GIL itself (PyGILState_Ensure, the
 * API for threads Python did not create), runs the bootstrap source and
 * lets the GIL go. This works while the main thread is busy in Python (it
 * hands the GIL over at the next switch interval) and while it is blocked
 * in C with the GIL released (a hung collective, a socket read).
 *
 * The Python C API is reached through addresses the injector resolved from
 * the target's ELF files, so the library links against no libpython and
 * serves every CPython version and a statically linked python alike.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define PROBING_BOOT_MAGIC 0x31676e69626f7270ULL /* the bytes "probing1", little-endian */

struct probing_boot_args {
    uint64_t magic;
    uint64_t size; /* of the whole block, source included */
    int (*is_initialized)(void);
    int (*gil_ensure)(void);
    void (*gil_release)(int);
    int (*run_string)(const char *source, void *flags);
    char source[]; /* NUL-terminated Python source */
};

static void *boot_main(void *arg)
{
    struct probing_boot_args *a = arg;
    if (a->is_initialized()) {
        int state = a->gil_ensure();
        a->run_string(a->source, NULL);
        a->gil_release(state);
    }
    free(a);
    return NULL;
}

/* Returns 0 when the boot thread started, a positive errno, or -1 for bad args. */
int probing_boot(const struct probing_boot_args *src)
{
    if (src == NULL || src->magic != PROBING_BOOT_MAGIC || src->size < sizeof(*src))
        return -1;
    struct probing_boot_args *a = malloc(src->size);
    if (a == NULL)
        return 12; /* ENOMEM */
    memcpy(a, src, src->size);
    a->source[src->size - sizeof(*src) - 1] = '\0';

    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    /* the boot thread (and the probe threads it starts) take no process signals */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    pthread_t thread;
    int rc = pthread_create(&thread, &attr, boot_main, a);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    pthread_attr_destroy(&attr);
    if (rc != 0) {
        free(a);
        return rc;
    }
    return 0;
}
