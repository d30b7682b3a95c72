"""The Python that runs inside the target once injected (stdlib only).

The injector sends this file's source with ``ARGS`` bound, executed in a
fresh namespace (nothing lands in the target's ``__main__``) by the boot
thread that holds the GIL. It makes ``probing`` importable without shadowing
the target's own packages (the target's install wins; ours is *appended* to
``sys.path`` only when the Python versions match), starts the probe as
``PROBING=1`` would, and reports to a status file the injector waits on.
Every exception is caught and reported; nothing is printed in the target.
"""

import sys

NAME = "__probing_inject__"
LOAD_SWITCH_S = 0.00005  # probing.probe.imports.LOAD_SWITCH_INTERVAL_S

# First of all, a short GIL switch interval (see
# probing.probe.imports.SwitchInterval): in a host whose thread spins in
# Python, each file read of an import waits a whole switch interval (5 ms)
# to get the GIL back, and even json and typing took 150 ms at the host's.
HOST_SWITCH = sys.getswitchinterval()
if __name__ == NAME:  # run in the target (the injector imports this file too)
    sys.setswitchinterval(min(HOST_SWITCH, LOAD_SWITCH_S))

import os  # noqa: E402

TYPE_CHECKING = False  # no typing import in the target
if TYPE_CHECKING:
    from typing import Any


def _import_probing(args: "dict[str, Any]") -> str:
    try:
        import probing  # noqa: F401  (the target's own install)

        return "target"
    except ImportError:
        pass
    mine = tuple(args["python"])
    if tuple(sys.version_info[:2]) != mine:
        raise ImportError(
            f"probing is not installed for the target's Python "
            f"{sys.version_info[0]}.{sys.version_info[1]} and the injector's install is for "
            f"{mine[0]}.{mine[1]}: pip install probing in the target's environment"
        )
    for path in args["paths"]:
        if path not in sys.path:
            sys.path.append(path)
    import probing  # noqa: F401,F811

    return "appended"


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
    # the short switch interval set above is held in probing's count once
    # probing is importable: the engine's preload, started here, goes on
    # holding it after this thread lets go
    switch = None
    try:
        source = _import_probing(args)
        import probing
        from probing.probe import imports, runtime

        switch = imports.SWITCH
        switch.take(imports.LOAD_SWITCH_INTERVAL_S, host=HOST_SWITCH)
        already = runtime.current() is not None
        probe = probing.enable()
        if not already and args.get("preload"):
            probe.preload()
    finally:
        if switch is None:
            sys.setswitchinterval(HOST_SWITCH)
        else:
            switch.give(imports.LOAD_SWITCH_INTERVAL_S)
        _main_thread_fixed(had_threading)
    return {
        "ok": True,
        "already": already,
        "socket": probe.socket_path,
        "import": source,
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
    except BaseException as err:  # noqa: BLE001 - reported, never raised into the target
        result = {"ok": False, "error": f"{type(err).__name__}: {err}"}
    try:
        report(args["status"], result)
    except OSError:
        pass


if __name__ == NAME:
    main(ARGS)  # type: ignore[name-defined]  # noqa: F821
