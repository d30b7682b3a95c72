"""Generate ``offsets_table.py``: CPython struct offsets per version.

Run ``python -m probing.pyframes.gen_offsets`` after editing a layout below.
Each layout is the prefix of a CPython struct up to the last field probing
reads, transcribed from that version's headers (``Include/cpython/pystate.h``,
``Include/internal/pycore_frame.h``, ``pycore_interp.h``, ``pycore_runtime.h``,
``Include/cpython/code.h``, ``unicodeobject.h``); ctypes lays them out with
the platform C rules (LP64: x86_64 and aarch64 agree). Fields a version does
not have are -1. On 3.13+ the running interpreter's ``_Py_DebugOffsets``
overrides the thread, frame and code offsets (see ``debug.py``).
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

P = ctypes.c_void_p
I = ctypes.c_int  # noqa: E741
L = ctypes.c_ulong
U64 = ctypes.c_uint64
HEAD = [("ob_refcnt", ctypes.c_ssize_t), ("ob_type", P)]
VARHEAD = [*HEAD, ("ob_size", ctypes.c_ssize_t)]
Fields = list[tuple[str, Any]]  # a struct's ``_fields_``: (name, ctypes type)


def _ints(*names: str) -> Fields:
    return [(n, I) for n in names]


def _ptrs(*names: str) -> Fields:
    return [(n, P) for n in names]


# -- the layouts (prefixes) ------------------------------------------------------------

RUNTIME: dict[tuple[int, int], Fields | None] = {  # _PyRuntimeState up to interpreters.head
    (3, 10): _ints("_initialized", "preinit", "preinited", "core_init", "init")
    + _ptrs("_finalizing", "interp_mutex", "interpreters_head"),
    (3, 11): _ints("_initialized", "preinit", "preinited", "core_init", "init")
    + _ptrs("_finalizing", "interp_mutex", "interpreters_head"),
    (3, 12): _ints("_initialized", "preinit", "preinited", "core_init", "init")
    + [("_finalizing", P), ("_finalizing_id", L)]
    + _ptrs("interp_mutex", "interpreters_head"),
}
INTERP: dict[tuple[int, int], Fields | None] = {  # PyInterpreterState up to threads.head
    (3, 10): _ptrs("next", "threads_head"),
    (3, 11): [("next", P), ("next_unique_id", U64), ("threads_head", P)],
    (3, 12): [("next", P), ("id", ctypes.c_int64), ("id_refcount", ctypes.c_int64)]
    + [("requires_idref", I), ("id_mutex", P), ("_initialized", I), ("finalizing", I)]
    + [("monitoring_version", U64), ("last_restart_version", U64)]
    + [("next_unique_id", U64), ("threads_head", P)],
}
_EXC = _ptrs("curexc_type", "curexc_value", "curexc_traceback")
TSTATE = {  # PyThreadState up to native_thread_id
    (3, 10): _ptrs("prev", "next", "interp", "frame")
    + _ints("recursion_depth", "recursion_headroom", "stackcheck_counter", "tracing")
    + _ints("use_tracing")
    + _ptrs("c_profilefunc", "c_tracefunc", "c_profileobj", "c_traceobj", *[n for n, _ in _EXC])
    + _ptrs("exc_type", "exc_value", "exc_tb", "exc_previous", "exc_info", "dict")
    + [("gilstate_counter", I), ("async_exc", P), ("thread_id", L)],
    (3, 11): _ptrs("prev", "next", "interp")
    + _ints("_initialized", "_static", "recursion_remaining", "recursion_limit")
    + _ints("recursion_headroom", "tracing", "tracing_what")
    + _ptrs("cframe", "c_profilefunc", "c_tracefunc", "c_profileobj", "c_traceobj")
    + _ptrs(*[n for n, _ in _EXC], "exc_info", "dict")
    + [("gilstate_counter", I), ("async_exc", P), ("thread_id", L), ("native_thread_id", L)],
    (3, 12): _ptrs("prev", "next", "interp")
    + _ints("_status", "py_recursion_remaining", "py_recursion_limit")
    + _ints("c_recursion_remaining", "recursion_headroom", "tracing", "what_event")
    + _ptrs("cframe", "c_profilefunc", "c_tracefunc", "c_profileobj", "c_traceobj")
    + _ptrs("current_exception", "exc_info", "dict")
    + [("gilstate_counter", I), ("async_exc", P), ("thread_id", L), ("native_thread_id", L)],
    (3, 13): _ptrs("prev", "next", "interp")
    + [("eval_breaker", ctypes.c_uint64)]
    + _ints("_status", "_whence", "state", "py_recursion_remaining", "py_recursion_limit")
    + _ints("c_recursion_remaining", "recursion_headroom", "tracing", "what_event")
    + _ptrs("current_frame", "c_profilefunc", "c_tracefunc", "c_profileobj", "c_traceobj")
    + _ptrs("current_exception", "exc_info", "dict")
    + [("gilstate_counter", I), ("async_exc", P), ("thread_id", L), ("native_thread_id", L)],
    (3, 14): _ptrs("prev", "next", "interp")
    + [("eval_breaker", ctypes.c_uint64)]
    + _ints("_status", "holds_gil", "_whence", "state", "py_recursion_remaining")
    + _ints("py_recursion_limit", "recursion_headroom", "tracing", "what_event")
    + _ptrs("current_frame", "c_profilefunc", "c_tracefunc", "c_profileobj", "c_traceobj")
    + _ptrs("current_exception", "exc_info", "dict")
    + [("gilstate_counter", I), ("async_exc", P), ("thread_id", L), ("native_thread_id", L)],
}
CFRAME = {  # _PyCFrame
    (3, 11): [("use_tracing", ctypes.c_uint8), ("current_frame", P)],
    (3, 12): _ptrs("current_frame", "previous"),
}
FRAME = {  # 3.10: PyFrameObject; 3.11+: _PyInterpreterFrame
    (3, 10): VARHEAD
    + _ptrs("previous", "code", "f_builtins", "f_globals", "f_locals", "f_valuestack")
    + [("f_trace", P), ("f_stackdepth", I), ("f_trace_lines", ctypes.c_char)]
    + [("f_trace_opcodes", ctypes.c_char), ("f_gen", P), ("lasti", I)],
    (3, 11): _ptrs("f_func", "f_globals", "f_builtins", "f_locals", "code", "frame_obj")
    + _ptrs("previous", "instr")
    + [("stacktop", I), ("is_entry", ctypes.c_bool), ("owner", ctypes.c_char)],
    (3, 12): _ptrs("code", "previous", "f_funcobj", "f_globals", "f_builtins", "f_locals")
    + _ptrs("frame_obj", "instr")
    + [("stacktop", I), ("return_offset", ctypes.c_uint16), ("owner", ctypes.c_char)],
}
FRAME[(3, 13)] = FRAME[(3, 12)]  # f_executable and instr_ptr took their places
# 3.14: f_executable is a _PyStackRef (a tagged pointer: FRAME_CODE_TAG_BITS),
# and stackpointer (a pointer) takes stacktop's place
FRAME[(3, 14)] = _ptrs("code", "previous", "f_funcobj", "f_globals", "f_builtins", "f_locals") + [
    *_ptrs("frame_obj", "instr", "stackpointer"),
    ("return_offset", ctypes.c_uint16),
    ("owner", ctypes.c_char),
]
_CO_PTRS = ("co_localsplusnames", "co_localspluskinds", "filename", "name", "qualname")
# 3.13 keeps 3.12's code object up to co_extra and adds co_executors
_CODE_312 = (
    VARHEAD
    + _ptrs("co_consts", "co_names", "co_exceptiontable")
    + _ints("co_flags", "co_argcount", "co_posonly", "co_kwonly", "co_stacksize")
    + _ints("firstlineno", "co_nlocalsplus", "co_framesize", "co_nlocals", "co_ncellvars")
    + _ints("co_nfreevars", "co_version")
    + _ptrs(*_CO_PTRS, "linetable", "co_weakreflist", "_co_cached")
    + [("_co_instrumentation_version", U64), ("_co_monitoring", P)]
    + [("_co_firsttraceable", I), ("co_extra", P)]
)
CODE = {
    (3, 10): HEAD
    + _ints("co_argcount", "co_posonly", "co_kwonly", "co_nlocals", "co_stacksize")
    + _ints("co_flags", "firstlineno")
    + _ptrs("co_code", "co_consts", "co_names", "co_varnames", "co_freevars")
    + _ptrs("co_cellvars", "co_cell2arg", "filename", "name", "linetable"),
    (3, 11): VARHEAD
    + _ptrs("co_consts", "co_names", "co_exceptiontable")
    + [("co_flags", I), ("co_warmup", ctypes.c_short), ("_linearray_size", ctypes.c_short)]
    + _ints("co_argcount", "co_posonly", "co_kwonly", "co_stacksize", "firstlineno")
    + _ints("co_nlocalsplus", "co_nlocals", "co_nplaincellvars", "co_ncellvars", "co_nfree")
    + _ptrs(*_CO_PTRS, "linetable", "co_weakreflist", "_co_code", "_co_linearray")
    + [("_co_firsttraceable", I), ("co_extra", P), ("adaptive", ctypes.c_char)],
    (3, 12): _CODE_312 + [("adaptive", ctypes.c_char)],
    (3, 13): _CODE_312 + [("co_executors", P), ("adaptive", ctypes.c_char)],
    # 3.14: co_executors moves up, _co_unique_id is new (and free-threaded
    # builds add co_tlbc before co_code_adaptive: refused, see debug.py)
    (3, 14): VARHEAD
    + _ptrs("co_consts", "co_names", "co_exceptiontable")
    + _ints("co_flags", "co_argcount", "co_posonly", "co_kwonly", "co_stacksize")
    + _ints("firstlineno", "co_nlocalsplus", "co_framesize", "co_nlocals", "co_ncellvars")
    + _ints("co_nfreevars", "co_version")
    + _ptrs(*_CO_PTRS, "linetable", "co_weakreflist", "co_executors", "_co_cached")
    + [("_co_instrumentation_version", U64), ("_co_monitoring", P)]
    + [("_co_unique_id", ctypes.c_ssize_t), ("_co_firsttraceable", I), ("co_extra", P)]
    + [("adaptive", ctypes.c_char)],
}
_ASCII = [*HEAD, ("length", ctypes.c_ssize_t), ("hash", ctypes.c_ssize_t), ("state", I)]
_WSTR = [("wstr", P)]
_COMPACT = [("utf8_length", ctypes.c_ssize_t), ("utf8", P)]
UNICODE = {  # PyASCIIObject; PyCompactUnicodeObject adds utf8 (and wstr_length < 3.12)
    (3, 10): (_ASCII + _WSTR, _ASCII + _WSTR + _COMPACT + [("wstr_length", ctypes.c_ssize_t)]),
    (3, 12): (_ASCII, _ASCII + _COMPACT),
}
BYTES = [*VARHEAD, ("ob_shash", ctypes.c_ssize_t), ("data", ctypes.c_char)]
# 3.13+: _PyRuntime starts with _Py_DebugOffsets, which says where these are
RUNTIME[(3, 13)] = None
INTERP[(3, 13)] = None
# the first value of _frameowner whose frames run no Python code (a C
# caller's shim frame; 3.14: FRAME_OWNED_BY_INTERPRETER (3), the entry frame
# whose f_executable is None, and FRAME_OWNED_BY_CSTACK (4)): such frames
# are left out
FRAME_OWNED_BY_CSTACK = {(3, 12): 3, (3, 13): 3, (3, 14): 3}
# the low bits of f_executable that tag a _PyStackRef (3.14: Py_TAG_BITS, 1
# with the GIL; 3 clears the free-threaded build's tags too)
FRAME_CODE_TAG_BITS = {(3, 14): 3}
LINETABLE = {(3, 10): "lnotab310", (3, 11): "locations"}
DEBUG_OFFSETS = {(3, 13): 0, (3, 14): 0}  # _Py_DebugOffsets at the start of _PyRuntime
# u64 words of _Py_DebugOffsets' interpreter_frame section (its size first):
# 3.14 adds stackpointer and tlbc_index
DEBUG_FRAME_WORDS = {(3, 13): 6, (3, 14): 8}
VERSIONS = [(3, 10), (3, 11), (3, 12), (3, 13), (3, 14)]


def _pick(table: Mapping[tuple[int, int], Any], v: tuple[int, int]) -> Any:
    """The newest entry at or below ``v`` (a layout lasts until it changes)."""
    keys = [k for k in table if k <= v]
    return table[max(keys)] if keys else None


def _layout(fields: Sequence[tuple[str, Any]] | None) -> dict[str, int]:
    if fields is None:
        return {}
    S = type("S", (ctypes.Structure,), {"_fields_": fields})
    return {name: getattr(S, name).offset for name, _ in fields}


def offsets(v: tuple[int, int]) -> dict[str, int]:
    rt, it = _layout(_pick(RUNTIME, v)), _layout(_pick(INTERP, v))
    ts, cf = _layout(_pick(TSTATE, v)), _layout(CFRAME.get(v))
    fr, co = _layout(_pick(FRAME, v)), _layout(_pick(CODE, v))
    ascii_, compact = (_layout(x) for x in _pick(UNICODE, v))
    ascii_size = ctypes.sizeof(type("A", (ctypes.Structure,), {"_fields_": _pick(UNICODE, v)[0]}))
    compact_size = ctypes.sizeof(type("C", (ctypes.Structure,), {"_fields_": _pick(UNICODE, v)[1]}))
    by = _layout(BYTES)
    del compact
    return {
        "runtime_interpreters_head": rt.get("interpreters_head", -1),
        "interp_threads_head": it.get("threads_head", -1),
        "tstate_next": ts["next"],
        "tstate_cframe": ts.get("cframe", -1),
        "cframe_current_frame": cf.get("current_frame", -1),
        "tstate_frame": ts.get("current_frame", ts.get("frame", -1)),
        "tstate_thread_id": ts["thread_id"],
        "tstate_native_thread_id": ts.get("native_thread_id", -1),
        "frame_previous": fr["previous"],
        "frame_code": fr["code"],
        "frame_instr": fr.get("instr", -1),
        "frame_lasti": fr.get("lasti", -1),
        "frame_owner": fr.get("owner", -1),
        "frame_owned_by_cstack": _pick(FRAME_OWNED_BY_CSTACK, v) or -1,
        "frame_code_tag_bits": FRAME_CODE_TAG_BITS.get(v, 0),
        "code_filename": co["filename"],
        "code_name": co["name"],
        "code_qualname": co.get("qualname", -1),
        "code_firstlineno": co["firstlineno"],
        "code_linetable": co["linetable"],
        "code_adaptive": co.get("adaptive", -1),
        "unicode_length": ascii_["length"],
        "unicode_state": ascii_["state"],
        "unicode_ascii_data": ascii_size,
        "unicode_compact_data": compact_size,
        "bytes_size": by["ob_size"],
        "bytes_data": by["data"],
        "debug_offsets": DEBUG_OFFSETS.get(v, -1),
        "debug_frame_words": DEBUG_FRAME_WORDS.get(v, -1),
    }


def render() -> str:
    """The table module's text (formatted as ruff formats it)."""
    lines = [
        '"""GENERATED by probing/pyframes/gen_offsets.py: do not edit; run',
        '``python -m probing.pyframes.gen_offsets`` instead."""',
        "",
        "OFFSETS: dict[str, dict[str, int]] = {",
    ]
    for a, b in VERSIONS:
        lines.append(f'    "{a}.{b}": {{')
        lines += [f'        "{k}": {v},' for k, v in offsets((a, b)).items()]
        lines.append("    },")
    lines.append("}")
    return "\n".join(lines) + "\n"


def main() -> int:
    out = Path(__file__).with_name("offsets_table.py")
    out.write_text(render())
    sys.stdout.write(f"wrote {out}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
