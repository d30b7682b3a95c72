/* Python stacks for the probe families: the calling thread's CPython frame
 * chain, walked at the moment of the probed call.
 *
 * A thread blocked in NCCL, CUDA or Gloo does not hold the GIL, so its
 * PyThreadState comes from py_threads (native tid -> PyThreadState*), which
 * the probe fills when tracing starts and keeps current as threads come and
 * go. The walk records up to PY_MAX_FRAMES (code object, instruction offset)
 * pairs; their hash is the stack id, and each distinct stack is stored once
 * in py_stacks for the probe to resolve to file/function/line.
 *
 * Offsets come from probing/pyframes (Offsets.cflags) as -D PY_*; -1 marks a
 * field the running CPython lacks. Without -DPY_STACKS every stack id is 0
 * and nothing here runs. The maps and py_stack_id() live in bpf/preamble.c
 * ("Python stacks" block there), as count_drop and emit do: BCC did not
 * rewrite map calls made from this header.
 */
#ifndef PROBING_PYFRAMES_H
#define PROBING_PYFRAMES_H

#define PY_MAX_FRAMES 32
#define PY_FRAME_READ 104 /* bytes of a frame read at once: every field we use */

struct py_stack {
    u32 depth;
    u32 pad;
    u64 code[PY_MAX_FRAMES];  /* PyCodeObject* */
    s32 offset[PY_MAX_FRAMES]; /* byte offset of the current instruction, -1 unknown */
};

#ifdef PY_STACKS
#ifndef PY_STACKS_MAX
#define PY_STACKS_MAX 8192
#endif
#define PY_FIELD(buf, off, type) (*(type *)((char *)(buf) + ((off) & 127)))

static __always_inline u64 py_top_frame(u64 tstate) {
#if PY_TSTATE_CFRAME >= 0
    u64 cframe = read_u64(tstate + PY_TSTATE_CFRAME);
    return cframe ? read_u64(cframe + PY_CFRAME_CURRENT_FRAME) : 0;
#else
    return read_u64(tstate + PY_TSTATE_FRAME);
#endif
}

/* 3.11+ keeps a thread's frames in its data stack: chunks of contiguous
 * memory, each frame just above its caller. So a walk reads a window of the
 * data stack ending at a frame's PY_FRAME_READ once, and finds that frame's
 * callers in it, where a read a frame costs ~125 ns. A window begins no lower
 * than the frame's page, which is mapped: below it may not be (a chunk's
 * first page), and a read that faults costs more than it saves. The first
 * window is at most PY_WINDOW_FIRST long (most of a read's cost on a short
 * stack is its bytes), the next ones up to a page. A frame outside the
 * window is one below the last frame read and near it (the data stack going
 * on: a window is read again, ending there) or elsewhere (3.12+'s entry
 * frames on the C stack, a generator's frame in its object: read alone, the
 * window kept, since their callers are back in it). 3.10's frames are heap
 * objects: each is read alone. */
#if PY_FRAME_INSTR >= 0
#define PY_WINDOW 4096
#define PY_WINDOW_FIRST 1024
#else
#define PY_WINDOW 0
#endif
#define PY_PAGE 4096ULL
#define PY_NEAR 65536 /* a frame this far below the last one read: the data stack going on */
/* The window's bounds live in the map, not in the program's registers: the
 * verifier reads them as unknown, so it takes one iteration's state for
 * another's, where constants (no window yet, a first one, a long one) would
 * each be explored on. */
struct py_window {
    u64 lo, span; /* the window: [lo, lo + span) */
    u8 b[PY_WINDOW + 256]; /* the window, then one frame read alone at b[PY_WINDOW] */
};

/* The bytes of `frame` (PY_FRAME_READ of them) in `w`, reading what is
 * needed (see above); NULL where it cannot be read. */
static __always_inline u8 *py_frame_bytes(u64 frame, u64 last, struct py_window *w) {
#if PY_WINDOW
    u64 lo = w->lo, span = w->span;
    if (frame >= lo && frame + PY_FRAME_READ <= lo + span)
        return w->b + ((frame - lo) & (PY_WINDOW - 1));
    if (frame < last && last - frame < PY_NEAR) {
        u64 size = (frame & (PY_PAGE - 1)) + PY_FRAME_READ; /* from the frame's page */
        u64 most = span ? PY_WINDOW : PY_WINDOW_FIRST;
        if (size > most)
            size = most;
        u64 start = frame + PY_FRAME_READ - size;
        if (size <= PY_WINDOW && bpf_probe_read_user(w->b, size, (void *)start) == 0) {
            w->lo = start;
            w->span = size;
            return w->b + ((frame - start) & (PY_WINDOW - 1));
        }
    }
#endif
    if (bpf_probe_read_user(w->b + PY_WINDOW, PY_FRAME_READ, (void *)frame) != 0)
        return 0;
    return w->b + PY_WINDOW;
}

/* Walk tstate's frames into st; the stack's hash (never 0), 0 when empty.
 * A frame a C caller owns (3.12+ shim frames) or the interpreter's entry
 * frame (3.14) is recorded with code 0, and userspace leaves it out. 3.14's
 * f_executable is a tagged pointer (_PyStackRef): its low
 * PY_FRAME_CODE_TAG_BITS are cleared. */
static __always_inline u32 py_walk(u64 tstate, struct py_stack *st, struct py_window *w) {
    u64 frame = py_top_frame(tstate);
    u64 last = frame + 1;
    w->lo = w->span = 0;
    u64 h = 0xcbf29ce484222325ULL;
    u32 n = 0;
    for (int i = 0; i < PY_MAX_FRAMES; i++) {
        u8 *buf = frame ? py_frame_bytes(frame, last, w) : 0;
        if (!buf)
            break;
        last = frame;
        u64 code = PY_FIELD(buf, PY_FRAME_CODE, u64) & ~(u64)PY_FRAME_CODE_TAG_BITS;
#if PY_FRAME_INSTR >= 0
        s32 off = (s32)(PY_FIELD(buf, PY_FRAME_INSTR, u64) - code - PY_CODE_ADAPTIVE);
#else
        s32 off = 2 * PY_FIELD(buf, PY_FRAME_LASTI, s32);
#endif
#if PY_FRAME_OWNER >= 0 && PY_FRAME_OWNED_BY_CSTACK >= 0
        if (PY_FIELD(buf, PY_FRAME_OWNER, u8) >= PY_FRAME_OWNED_BY_CSTACK)
            code = 0;
#endif
        st->code[i] = code;
        st->offset[i] = off;
        h = (h ^ code) * 0x100000001b3ULL;
        h = (h ^ (u32)off) * 0x100000001b3ULL;
        n = i + 1;
        frame = PY_FIELD(buf, PY_FRAME_PREVIOUS, u64);
    }
    st->depth = n;
    if (!n)
        return 0;
    u32 id = (u32)(h ^ (h >> 32));
    return id ? id : 1;
}
#endif

#endif
