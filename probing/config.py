"""Every ``PROBING_*`` environment variable, typed, read in one place.

``load()`` reads them all from the environment into one frozen ``Config``;
each part of the probe calls it when it starts (the store when it is built,
the server when it opens, the engine's limits when it is built). The table
in ``docs/config.md`` is generated from ``SETTINGS`` (``python -c 'from
probing import config; print(config.table())'``) and a test keeps the two, and the code, in step.

A bad value never stops a probe: it is read inside someone else's process.
Numbers that are not positive numbers fall back to their default; only the
cluster's identity (``PROBING_RANK``, ``PROBING_PORT``) refuses a bad value,
and then cluster mode stays off with the reason on stderr.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from probing.errors import ProbingError
from probing.guest.place import RUNTIME_DEFAULT

TRUTHY = frozenset({"1", "true", "yes", "on"})
FALSY = frozenset({"0", "false", "no", "off"})


class ConfigError(ProbingError):
    """A ``PROBING_*`` value that cannot be used."""


def _setting(env: str, default: Any, doc: str, *, strict: bool = False, least: float = 1) -> Any:
    """One variable: ``strict`` refuses a bad value; an integer under
    ``least`` (a number not above 0) takes the default."""
    meta = {"env": env, "doc": doc, "strict": strict, "least": least}
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class Config:
    # start-up
    probing: bool = _setting(
        "PROBING", False, "`1`: the `.pth` hook starts a probe in every Python that starts"
    )
    fork: str = _setting(
        "PROBING_FORK", "none", "`child`: a forked child serves a probe of its own (default: none)"
    )
    runtime_dir: str = _setting(
        "PROBING_RUNTIME_DIR", RUNTIME_DEFAULT, "where `probing-<uid>/<pid>.sock` live"
    )
    keep_dead_s: float = _setting(
        "PROBING_KEEP_DEAD_S",
        600.0,
        "how long the engine answers for a process that died (what it left), seconds",
    )
    engine_env: str = _setting(
        "PROBING_ENGINE_ENV",
        "",
        "more of the job's variables the engine runs with (`LD_LIBRARY_PATH` for an NVML "
        "in a place of its own)",
    )
    engine_idle_s: float = _setting(
        "PROBING_ENGINE_IDLE_S", 60.0, "the engine exits this long after its last process"
    )
    log: str = _setting(
        "PROBING_LOG",
        "info",
        "`debug`, `info`, `warning` or `error`: the least level the engine, the agent and "
        "the commands log (stderr; the engine's `engine-<key>.log`); another value: `info`, "
        "said once",
    )
    version_override: str = _setting(
        "PROBING_VERSION_OVERRIDE",
        "",
        "state this version at the handshakes instead of probing's own (tests of an upgrade)",
    )
    detect_s: float = _setting(
        "PROBING_DETECT_S",
        1.0,
        "seconds between the always-on detector's looks at the pace of a traced job's "
        "collectives (analyze.findings; a full detection every 5-30 s; 0: off)",
        least=0,
    )
    nvml_interval: str = _setting(
        "PROBING_NVML_INTERVAL", "", "sample NVML from start-up at this interval (`100ms`)"
    )
    sample_hz: int = _setting(
        "PROBING_SAMPLE_HZ",
        -1,
        "Python stack sampling rate while tracing (0: off; -1: the built-in rate)",
        least=0,
    )
    bpf_cache: str = _setting(
        "PROBING_BPF_CACHE", "", "where compiled BPF programs are kept (default: the loader's)"
    )
    uprobe_multi: str = _setting(
        "PROBING_UPROBE_MULTI", "", "`0`: single uprobes even where multi-uprobe links exist"
    )
    # the server
    remote_code: bool = _setting(
        "PROBING_REMOTE_CODE", False, "`1`: `python.`expr`` and `/eval` over the peer TCP port too"
    )
    max_connections: int = _setting(
        "PROBING_MAX_CONNECTIONS", 64, "open connections per listening socket"
    )
    workers: int = _setting("PROBING_WORKERS", 8, "threads answering requests; the rest wait")
    header_timeout_s: float = _setting(
        "PROBING_HEADER_TIMEOUT_S", 10.0, "time for a request line and headers"
    )
    idle_timeout_s: float = _setting(
        "PROBING_IDLE_TIMEOUT_S", 10.0, "longest silence while a body arrives"
    )
    # query limits
    sql_max_kb: int = _setting("PROBING_SQL_MAX_KB", 1024, "longest SQL text, KiB")
    sql_max_depth: int = _setting(
        "PROBING_SQL_MAX_DEPTH", 256, "operators and relations nested in one plan"
    )
    sql_max_work: int = _setting(
        "PROBING_SQL_MAX_WORK", 2_000_000, "the planner's work: sum of token depths"
    )
    sql_max_repeat: int = _setting(
        "PROBING_SQL_MAX_REPEAT", 1_000_000, "what one repeat()/lpad()/range() makes"
    )
    query_memory_mb: float = _setting(
        "PROBING_QUERY_MEMORY_MB", 256.0, "DataFusion's memory pool, MiB"
    )
    query_timeout_s: float = _setting(
        "PROBING_QUERY_TIMEOUT_S", 20.0, "one query's time limit, seconds"
    )
    query_max_result_mb: float = _setting(
        "PROBING_QUERY_MAX_RESULT_MB", 128.0, "one result's size, MiB"
    )
    # the store
    store_bytes: float = _setting(
        "PROBING_STORE_BYTES", float(256 << 20), "the store's byte budget"
    )
    store_age_s: float = _setting(
        "PROBING_STORE_AGE_S", 0.0, "retire sealed chunks older than this (0: no age limit)"
    )
    store_codec: str = _setting("PROBING_STORE_CODEC", "", "chunk codec (default: the store's)")
    chunk_dir: str = _setting(
        "PROBING_CHUNK_DIR", "", "where sealed chunks go (default: /dev/shm when it has room)"
    )
    # the cluster
    cluster: str = _setting(
        "PROBING_CLUSTER", "", "`0`/`off`: no cluster mode even in a multi-rank job"
    )
    peers: str = _setting(
        "PROBING_PEERS", "", "`host:port,...`: an explicit peer list (turns cluster mode on)"
    )
    rank: int | None = _setting(
        "PROBING_RANK", None, "this process's rank (default: `RANK`)", strict=True
    )
    port: int | None = _setting(
        "PROBING_PORT",
        None,
        "the engine's peer TCP port (default: the first free of `PROBING_PORT_RANGE`)",
        strict=True,
    )
    port_range: str = _setting(
        "PROBING_PORT_RANGE",
        "9979-10010",
        "`first-last`: the ports an engine takes its peer port from, the first free one "
        "(else any free one); never `PROBING_AGENT_PORT`, which is outside it by default",
    )
    node: str = _setting("PROBING_NODE", "", "this node's name (default: the host name)")
    host: str = _setting("PROBING_HOST", "", "the address peers reach this probe at")
    token: str = _setting("PROBING_TOKEN", "", "the shared secret of the peer TCP port")
    token_file: str = _setting("PROBING_TOKEN_FILE", "", "a file whose first line is the token")
    tls_cert: str = _setting(
        "PROBING_TLS_CERT", "", "a PEM certificate: the peer port speaks TLS only, both ways"
    )
    tls_key: str = _setting("PROBING_TLS_KEY", "", "its private key (when not in the cert file)")
    tls_ca: str = _setting(
        "PROBING_TLS_CA", "", "the CA a peer's certificate must be signed by (default: the cert's)"
    )
    max_reply_mb: float = _setting(
        "PROBING_MAX_REPLY_MB", 256.0, "bytes one peer's answer may take, MiB"
    )
    # the command line
    answer_timeout_s: float = _setting(
        "PROBING_ANSWER_TIMEOUT_S",
        30.0,
        "how long `probing` waits for a probe's answer (more on a slow or emulated machine)",
    )
    mcp_token: str = _setting(
        "PROBING_MCP_TOKEN",
        "",
        "the bearer token `probing mcp --http` requires (needed off the loopback)",
    )
    # probing agent (its options override these; `--config FILE` reads them from a file)
    agent_port: int = _setting(
        "PROBING_AGENT_PORT",
        9978,
        "`probing agent`'s GET /health and /metrics port (outside `PROBING_PORT_RANGE`: "
        "no engine takes it)",
        least=0,
    )
    agent_host: str = _setting(
        "PROBING_AGENT_HOST", "127.0.0.1", "the address `probing agent` serves on"
    )
    agent_every_s: float = _setting(
        "PROBING_AGENT_EVERY_S", 2.0, "seconds between the agent's looks at the node's processes"
    )
    agent_attach: bool = _setting(
        "PROBING_AGENT_ATTACH", True, "`0`: the agent serves and watches, attaches to nothing"
    )
    agent_match: str = _setting(
        "PROBING_AGENT_MATCH", "", "also attach to processes whose command line matches (regex)"
    )
    agent_cgroup: str = _setting(
        "PROBING_AGENT_CGROUP", "", "also attach to processes whose cgroup path holds this"
    )
    agent_families: str = _setting(
        "PROBING_AGENT_FAMILIES", "gloo,nccl", "what the agent traces in what it attaches to"
    )
    agent_webhook: str = _setting(
        "PROBING_AGENT_WEBHOOK",
        "",
        "a URL the agent POSTs each new or cleared finding to, as JSON (retried; off when empty)",
    )

    @property
    def cluster_off(self) -> bool:
        return self.cluster.strip().lower() in FALSY


SETTINGS = {f.metadata["env"]: f for f in dataclasses.fields(Config)}


def _parse(f: dataclasses.Field[Any], raw: str, strict: bool) -> Any:
    kind = f.type if isinstance(f.type, str) else f.type.__name__
    if kind == "bool":
        return raw.strip().lower() in TRUTHY
    if kind == "str":
        return raw.strip().lower() if f.name in ("fork", "cluster", "log") else raw
    if kind in ("int", "int | None"):
        try:
            value = int(raw)
        except ValueError:
            if f.metadata["strict"] and strict:
                raise ConfigError(f"{f.metadata['env']}={raw!r} is not an integer") from None
            return f.default
        return value if (f.metadata["strict"] or value >= f.metadata["least"]) else f.default
    try:
        number = float(raw)
    except ValueError:
        return f.default
    # least 0 (PROBING_DETECT_S): 0 is a value of its own ("off"), not the default
    return number if number > 0 or (number == 0 and f.metadata["least"] == 0) else f.default


def from_env(environ: Mapping[str, str], *, strict: bool = False) -> Config:
    """The settings in ``environ``; unset or empty variables take their default.
    ``strict``: a bad value of a strict setting raises ``ConfigError`` (else
    it takes the default)."""
    values = {}
    for env, f in SETTINGS.items():
        raw = environ.get(env, "")
        if raw.strip():
            values[f.name] = _parse(f, raw, strict)
    return Config(**values)


def load() -> Config:
    """The settings of this process's environment, now."""
    return from_env(os.environ)


_DURATION = re.compile(r"^\s*([\d.]+)\s*(ms|s|us)?\s*$")


def parse_interval(text: str | float) -> float:
    """A duration a user gives (an option, ``PROBING_NVML_INTERVAL``):
    ``"100ms"``, ``"0.5s"``, ``"0.1"`` or a number of seconds → seconds."""
    if isinstance(text, int | float):
        value = float(text)
    else:
        m = _DURATION.match(text)
        if not m:
            raise ValueError(f"not a duration: {text!r} (use e.g. 100ms or 0.5s)")
        value = float(m.group(1)) * {"ms": 1e-3, "us": 1e-6}.get(m.group(2) or "s", 1.0)
    if not 0.001 <= value <= 3600:
        raise ValueError(f"interval {value:g} s is outside 1 ms .. 1 h")
    return value


def table() -> str:
    """The settings as a Markdown table (docs/config.md)."""
    lines = ["| variable | default | what it sets |", "|---|---|---|"]
    for env, f in SETTINGS.items():
        default = f.default if f.default not in ("", None) else "-"
        if env == "PROBING_STORE_BYTES":
            default = "268435456 (256 MiB)"
        lines.append(f"| `{env}` | {default} | {f.metadata['doc']} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(table(), end="")
