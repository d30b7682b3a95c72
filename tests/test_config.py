"""``probing.config``: every PROBING_* variable typed, documented, in one table."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from probing import config

ROOT = Path(__file__).resolve().parent.parent


def test_every_variable_the_code_names_is_a_setting() -> None:
    named = set()
    for path in (ROOT / "probing").rglob("*.py"):
        named |= set(re.findall(r"\bPROBING_[A-Z][A-Z0-9_]*\b", path.read_text()))
    missing = sorted(named - set(config.SETTINGS))
    assert not missing, f"add these to probing/config.py (and docs/config.md): {missing}"


def test_the_docs_table_is_generated_from_the_settings() -> None:
    doc = (ROOT / "docs" / "config.md").read_text()
    assert config.table() in doc, "regenerate it from probing.config.table()"


def test_values_are_typed_and_bad_ones_fall_back() -> None:
    env = config.from_env(
        {"PROBING_WORKERS": "3", "PROBING_QUERY_TIMEOUT_S": "-1", "PROBING_REMOTE_CODE": "1",
         "PROBING_MAX_CONNECTIONS": "many", "PROBING_FORK": " Child ", "PROBING_SAMPLE_HZ": "0"}
    )  # fmt: skip
    assert env.workers == 3 and env.remote_code is True and env.fork == "child"
    assert env.query_timeout_s == 20.0 and env.max_connections == 64 and env.sample_hz == 0
    assert config.from_env({"PROBING_HEADER_TIMEOUT_S": "0.3"}).header_timeout_s == 0.3
    assert config.from_env({"PROBING_WORKERS": "0"}).workers == 8
    assert config.from_env({"PROBING_RANK": "x"}).rank is None
    with pytest.raises(config.ConfigError, match="PROBING_RANK='x' is not an integer"):
        config.from_env({"PROBING_RANK": "x"}, strict=True)


def test_the_cli_waits_for_a_probe_as_long_as_it_is_told(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PROBING_ANSWER_TIMEOUT_S: a probe that accepts and never answers is
    given up on after that long, and the error says so (a slow or emulated
    machine sets it higher)."""
    import socket
    import time

    from probing.cli.client import UnixTransport
    from probing.errors import NoProbe

    path = str(tmp_path / "mute.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(1)
    try:
        assert UnixTransport(path).timeout == 30.0
        assert UnixTransport(path, timeout=2.0).timeout == 2.0
        monkeypatch.setenv("PROBING_ANSWER_TIMEOUT_S", "0.4")
        transport = UnixTransport(path)
        assert transport.timeout == 0.4
        t0 = time.monotonic()
        with pytest.raises(NoProbe, match="did not answer in 0.4 s"):
            transport.request("GET", "/health")
        assert time.monotonic() - t0 < 10
    finally:
        server.close()
