"""The Python that runs inside the target once injected (stdlib only).

The injector sends this file's source with ``ARGS`` bound, executed in a
fresh namespace (nothing lands in the target's ``__main__``) by the boot
thread that holds the GIL. It loads the guest (``probing/guest``) from its
files under one private name, ``_probing_guest`` (never through
``sys.path``: the target imports what it imported before), starts it, has
it hand the process to the node's engine (started by probing's own Python
when none runs, or by the injector: ``spawn``), and reports to a status file the injector waits on.
Every exception is caught and reported; nothing is printed in the target.
"""

import sys

NAME = "__probing_inject__"
LOAD_SWITCH_S = 0.00005  # the switch interval while the guest loads

# First of all, a short GIL switch interval: in a host whose thread spins in
# Python, each file read of an import waits a whole switch interval (5 ms)
# to get the GIL back. The host's own comes back once the guest is loaded.
HOST_SWITCH = sys.getswitchinterval()
if __name__ == NAME:  # run in the target (the injector imports this file too)
    sys.setswitchinterval(min(HOST_SWITCH, LOAD_SWITCH_S))

import os  # noqa: E402

TYPE_CHECKING = False  # no typing import in the target
if TYPE_CHECKING:
    from typing import Any


def load_guest(directory: str) -> "Any":
    """The guest package at ``directory``, as ``_probing_guest``: loaded by
    its own ``hook.load`` (the one loader the ``.pth`` hooks use too)."""
    path = os.path.join(directory, "hook.py")
    ns: dict[str, Any] = {"__name__": "_probing_hook"}
    with open(path) as f:
        exec(compile(f.read(), path, "exec"), ns)  # probing's own file
    return ns["load"](directory)


def _main_thread_fixed(had_threading: bool) -> None:
    """Point ``threading.main_thread()`` at the real main thread again.

    Before 3.13, the first ``import threading`` takes the importing thread
    for the main thread. When that import happens here, in the boot thread,
    the real main thread would be left without a ``Thread`` object and the
    interpreter's exit would fail an assertion on the boot thread's lock.
    The main thread's state is the interpreter's oldest, so it comes last
    in ``sys._current_frames()``; it gets the ``_MainThread`` object back,
    with a held lock standing in for its state lock (released at exit).
    """
    import _thread
    import threading

    main = threading._main_thread  # type: ignore[attr-defined]
    if had_threading or not hasattr(main, "_tstate_lock"):
        return
    real = list(sys._current_frames())[-1]
    if main.ident == real:
        return
    threading._active.pop(main.ident, None)  # type: ignore[attr-defined]
    main._ident = real
    if hasattr(main, "_native_id"):
        main._native_id = os.getpid()
    lock = _thread.allocate_lock()
    lock.acquire()
    main._tstate_lock = lock
    threading._active[real] = main  # type: ignore[attr-defined]


def start(args: "dict[str, Any]") -> "dict[str, Any]":
    had_threading = "threading" in sys.modules
    try:
        guest_pkg = load_guest(args["guest"])
        already = guest_pkg.current() is not None
    finally:  # exact: the interpreter keeps whole microseconds, truncating
        sys.setswitchinterval((round(HOST_SWITCH * 1e6) + 0.25) / 1e6)
        _main_thread_fixed(had_threading)
    # the engine's start is waited for outside the short switch interval
    spawn = args.get("spawn", True)  # False: the injector started the engine (inject.stage)
    answer = guest_pkg.start(args["engine_python"], wait=True, spawn=spawn).engine or {}
    return {
        "ok": True,
        "already": already,
        "socket": answer.get("socket", ""),
        "engine_pid": answer.get("engine_pid"),
        "python": sys.version.split()[0],
    }


def report(path: str, result: "dict[str, Any]") -> None:
    import json

    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, path)


def main(args: "dict[str, Any]") -> None:
    try:
        result = start(args)
    except BaseException as err:  # reported, never raised into the target
        result = {"ok": False, "error": f"{type(err).__name__}: {err}"}
    try:
        report(args["status"], result)
    except OSError:
        pass


if __name__ == NAME:
    main(ARGS)  # type: ignore[name-defined]  # noqa: F821
