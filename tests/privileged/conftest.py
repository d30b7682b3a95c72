"""Fixtures of the privileged tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.jobs.launch import Launch


@pytest.fixture
def launch(tmp_path: Path) -> Iterator:
    started: list[Launch] = []

    def start(how: str, *job_args: str, **kw) -> Launch:  # type: ignore[no-untyped-def]
        job = Launch(how, tmp_path, *job_args, **kw)
        started.append(job)
        return job

    yield start
    for job in started:
        job.stop()
