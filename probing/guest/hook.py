"""Start the guest from outside the package (stdlib only, run from its file).

A ``.pth`` line (``PROBING=1`` at start-up) and the injector's bootstrap run
this file by path, then ``load`` the guest package from its directory under
one private name, ``_probing_guest``: nothing is added to ``sys.path``, and
the job can import exactly what it could before. ``probing hook install``
writes such a ``.pth`` into a job's environment (``pth_line``).
"""

import os
import sys

GUEST = "_probing_guest"  # the one name the guest's modules live under in a job
TRUE = ("1", "true", "yes", "on")

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any


def load(directory: str) -> "Any":
    """The guest package at ``directory``, as ``_probing_guest`` (loaded once)."""
    loaded = sys.modules.get(GUEST)
    if loaded is not None:
        return loaded
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        GUEST, os.path.join(directory, "__init__.py"), submodule_search_locations=[directory]
    )
    if spec is None or spec.loader is None:
        raise ImportError(f"no guest at {directory}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[GUEST] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        for name in [n for n in sys.modules if n == GUEST or n.startswith(GUEST + ".")]:
            del sys.modules[name]
        raise
    return module


def boot(directory: str, engine_python: str) -> None:
    """``PROBING=1``: the guest serves, and registers with the engine from a
    thread of its own (the host's start-up never waits). Never raises."""
    if os.environ.get("PROBING", "").strip().lower() not in TRUE:
        return
    try:
        load(directory).start(engine_python, wait=False)
    except Exception as err:  # never break the host's start-up
        try:
            print(f"probing: probe not started: {type(err).__name__}: {err}", file=sys.stderr)
        except (OSError, ValueError, AttributeError):
            pass


def pth_line(directory: str, engine_python: str) -> str:
    """The ``.pth`` line that runs ``boot`` when ``PROBING`` is set (and
    nothing else otherwise: one ``os.environ`` look-up per interpreter)."""
    hook = os.path.join(directory, "hook.py")
    run = (
        f"ns = {{'__name__': '_probing_hook'}}; "
        f"exec(compile(open({hook!r}).read(), {hook!r}, 'exec'), ns); "
        f"ns['boot']({directory!r}, {engine_python!r})"
    )
    return (
        f"import os; os.environ.get('PROBING', '').strip().lower() in {TRUE!r} and exec({run!r})\n"
    )
