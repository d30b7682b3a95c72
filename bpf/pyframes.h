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

/* Walk tstate's frames into st; the stack's hash (never 0), 0 when empty.
 * One read per frame and no branch but the end of the chain, so the
 * verifier keeps few states. A frame a C caller owns (3.12+ shim
 * frames) or the interpreter's entry frame (3.14) is recorded with code 0,
 * and userspace leaves it out. 3.14's f_executable is a tagged pointer
 * (_PyStackRef): its low PY_FRAME_CODE_TAG_BITS are cleared. */
static __always_inline u32 py_walk(u64 tstate, struct py_stack *st) {
    u64 buf[PY_FRAME_READ / 8];
    u64 frame = py_top_frame(tstate);
    u64 h = 0xcbf29ce484222325ULL;
    u32 n = 0;
    for (int i = 0; i < PY_MAX_FRAMES; i++) {
        if (!frame || bpf_probe_read_user(buf, sizeof(buf), (void *)frame) != 0)
            break;
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
