"""``probing.log``: one format, the level from ``PROBING_LOG``, a bad value said once."""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterator
from typing import Any

import pytest

from probing import config, errors, log

ENGINE = logging.getLogger("probing.engine")


@pytest.fixture(autouse=True)
def as_imported(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test starts and ends with the lines of a process no entry point set up."""
    monkeypatch.setattr(log, "_said_bad", set())
    log.setup(None)
    yield
    log.setup(None)


def test_debug_lines_show_with_probing_log_debug_and_not_by_default(capsys: Any) -> None:
    log.setup("engine", config.from_env({}).log)
    ENGINE.debug("pid 1: retired in 0.01 s")
    ENGINE.info("attach pid 1 (x)")
    err = capsys.readouterr().err
    assert "retired" not in err and "attach pid 1 (x)" in err
    log.setup("engine", config.from_env({"PROBING_LOG": " DEBUG "}).log)
    ENGINE.debug("pid 1: retired in 0.01 s")
    assert "pid 1: retired in 0.01 s" in capsys.readouterr().err


def test_a_bad_level_is_info_and_said_once(capsys: Any) -> None:
    for _ in range(2):
        log.setup("agent", config.from_env({"PROBING_LOG": "loud"}).log)
    ENGINE.debug("not shown")
    ENGINE.info("shown")
    lines = capsys.readouterr().err.splitlines()
    said = [line for line in lines if "PROBING_LOG='loud' is no level" in line]
    assert len(said) == 1 and "debug, info, warning, error): info it is" in said[0], lines
    assert lines[-1].endswith(" shown") and not any("not shown" in line for line in lines)


def test_a_line_names_its_process_pid_and_time(capsys: Any) -> None:
    log.setup("engine")
    ENGINE.info("attach pid 12860 (/tmp/probing-0/12860.guest)")
    line = capsys.readouterr().err
    found = re.fullmatch(r"probing engine (\d+): \d\d:\d\d:\d\d attach pid 12860 \(\S+\)\n", line)
    assert found and int(found.group(1)) == os.getpid(), line


def test_a_commands_lines_are_probing_colon_message(capsys: Any) -> None:
    log.setup(None, "info")
    errors.tell("cluster mode off: no token")
    assert capsys.readouterr().err == "probing: cluster mode off: no token\n"


def test_a_level_above_a_warning_silences_tell(capsys: Any) -> None:
    log.setup("engine", "error")
    errors.tell("NVML sampling not started: no driver")
    errors.log_unexpected("a loop failed", ValueError("boom"))
    err = capsys.readouterr().err
    assert "NVML" not in err and "a loop failed: ValueError: boom" in err


def test_a_bug_is_logged_once_with_its_traceback(capsys: Any) -> None:
    log.setup("engine")
    seen: set[str] = set()
    for _ in range(3):
        try:
            raise ValueError("boom")
        except ValueError as bug:
            errors.log_unexpected("the drain failed", bug, seen)
    said = capsys.readouterr().err
    first = said.splitlines()[0]
    assert re.fullmatch(r"probing engine \d+: \S+ the drain failed: ValueError: boom", first), said
    assert said.count("Traceback (most recent call last)") == 1
    assert 'raise ValueError("boom")' in said
