"""``probing eval``: run Python in the target, return its value and its prints.

An expression is evaluated in a copy of ``__main__``'s namespace (modules it
names are imported, as in ``python.`expr```) and its ``repr`` returned.
Statements run in ``__main__`` itself, so ``x = 1`` stays, as in a shell.
What the code prints is captured; what the target's other threads print
meanwhile still goes where it went before.
"""

from __future__ import annotations

import contextlib
import io
import sys
import threading
import traceback
from collections.abc import Iterator
from typing import Any, TextIO

from probing.errors import EvalError
from probing.tables.python import eval_with_imports

FILENAME = "<probing eval>"


class _ThreadTee(io.TextIOBase):
    """A stream that keeps one thread's writes and passes the rest on."""

    def __init__(self, orig: TextIO, buf: io.StringIO) -> None:
        self._orig = orig
        self._buf = buf
        self._owner = threading.get_ident()

    def write(self, s: str) -> int:
        if threading.get_ident() == self._owner:
            return self._buf.write(s)
        return self._orig.write(s)

    def flush(self) -> None:
        if threading.get_ident() != self._owner:
            self._orig.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._orig, name)


@contextlib.contextmanager
def _captured() -> Iterator[io.StringIO]:
    buf = io.StringIO()
    saved = sys.stdout, sys.stderr
    tees = _ThreadTee(saved[0], buf), _ThreadTee(saved[1], buf)
    sys.stdout, sys.stderr = tees
    try:
        yield buf
    finally:
        if sys.stdout is tees[0]:  # the target may have replaced it meanwhile
            sys.stdout = saved[0]
        if sys.stderr is tees[1]:
            sys.stderr = saved[1]


def run(code: str) -> dict[str, Any]:
    """``{"result": repr or None, "output": printed text}``; raises EvalError."""
    try:
        compile(code, FILENAME, "eval")
        is_expr = True
    except SyntaxError:
        is_expr = False
        try:
            compiled = compile(code, FILENAME, "exec")
        except SyntaxError as err:
            raise EvalError(f"SyntaxError: {err.msg} (line {err.lineno})") from None
    with _captured() as out:
        try:
            if is_expr:
                result: str | None = repr(eval_with_imports(code))
            else:
                main = sys.modules["__main__"]
                exec(compiled, vars(main))  # noqa: S102 - local socket only
                result = None
        except Exception as err:  # noqa: BLE001 - the user's code may raise anything: the answer
            detail = out.getvalue() + _user_traceback(err)
            raise EvalError(f"{type(err).__name__}: {err}", detail=detail) from None
    return {"result": result, "output": out.getvalue()}


def _user_traceback(err: BaseException) -> str:
    """The traceback from the user's code down, without probing's own frames."""
    frames = traceback.extract_tb(err.__traceback__)
    first = next((i for i, f in enumerate(frames) if f.filename == FILENAME), 0)
    lines = ["Traceback (most recent call last):\n"]
    lines += traceback.format_list(frames[first:])
    lines += traceback.format_exception_only(type(err), err)
    return "".join(lines)
