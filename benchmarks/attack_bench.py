"""Attacks on a live probe (issue 21); prints JSON.

Each attack gets a fresh host: ``tests/stall_host.py`` with ``PROBING=1``, a
main thread spinning in a tight loop that timestamps every turn. For each
attack: the host's RSS (now and peak) and its longest main-loop stall
(``stall_ms``; ``held_ms``: the part the probe's threads can have caused,
at most their CPU time meanwhile) before the attack (a quiet window of
``BENCH_QUIET_S``) and during it, and
the outcome: whether the host lived, whether the probe still answered, and
what the attack got.

    python benchmarks/attack_bench.py               # every attack
    python benchmarks/attack_bench.py fd_flood ...  # some of them
    BENCH_PROBE_PATH=/tmp/base python benchmarks/attack_bench.py  # the hosts
        import probing from /tmp/base (an older tree: the baseline)

Attacks are plain functions ``attack(host) -> dict`` in ``ATTACKS``, each
with the host it needs (``tcp``, ``nofile``); add one with ``@attack(...)``.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from probing.cli.client import ProbeClient
from tests.stall_host import SCRIPT, StallHost, other_threads_cpu_s

TOKEN = "attack-bench-token"
QUIET_S = float(os.environ.get("BENCH_QUIET_S", 2))


class Host:
    """A stall-measuring host with a probe (and, with ``tcp``, a peer port)."""

    def __init__(self, *, tcp: bool = False, nofile: int | None = None, peers: str = "") -> None:
        self.runtime = tempfile.mkdtemp(prefix="attack-bench-")
        env = {**os.environ, "PROBING": "1", "PROBING_RUNTIME_DIR": self.runtime}
        if os.environ.get("BENCH_PROBE_PATH"):  # another tree's probe (a baseline)
            env["PYTHONPATH"] = os.environ["BENCH_PROBE_PATH"]
        self.port: int | None = None
        if tcp:
            self.port = free_port()
            env["PROBING_PEERS"] = f"127.0.0.1:{self.port}" + (f",{peers}" if peers else "")
            env["PROBING_TOKEN"] = TOKEN
            env["RANK"] = "0"
        if nofile:
            env["STALL_NOFILE"] = str(nofile)
        self.proc = subprocess.Popen(
            [sys.executable, SCRIPT], env=env, stdout=subprocess.PIPE, text=True
        )
        self.pid = self.proc.pid
        self.sock = os.path.join(self.runtime, f"probing-{os.getuid()}", f"{self.pid}.sock")
        self.stalls = StallHost(self.proc)
        wait(lambda: os.path.exists(self.sock), 30)
        if self.port is not None:
            wait(lambda: self.tcp_status() != 0, 30)
        os.environ["PROBING_RUNTIME_DIR"] = self.runtime  # for this process's client

    def client(self, timeout: float = 5.0) -> ProbeClient:
        return ProbeClient.for_pid(self.pid, timeout=timeout)

    def answers(self, timeout: float = 5.0) -> bool:
        try:
            return self.client(timeout).health()["pid"] == self.pid
        except Exception:
            return False

    def tcp_status(self, timeout: float = 5.0) -> int:
        req = f"GET /health HTTP/1.0\r\nAuthorization: Bearer {TOKEN}\r\n\r\n".encode()
        try:
            return status(talk(self.port, req, timeout))  # type: ignore[arg-type]
        except (OSError, ValueError):
            return 0

    def peak_mb(self) -> float:
        with open(f"/proc/{self.pid}/status") as f:
            kb = next(int(x.split()[1]) for x in f if x.startswith("VmHWM:"))
        return round(kb / 1024, 1)

    def threads(self) -> int:
        with open(f"/proc/{self.pid}/status") as f:
            return int(next(x for x in f if x.startswith("Threads:")).split()[1])

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()
        subprocess.run(["rm", "-rf", self.runtime], check=False)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait(cond: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def talk(target: int | str, request: bytes, timeout: float = 5.0) -> bytes:
    """One request on a TCP port (int) or a unix socket (str); what came back."""
    if isinstance(target, int):
        s = socket.create_connection(("127.0.0.1", target), timeout=timeout)
    else:
        s = socket.socket(socket.AF_UNIX)
        s.settimeout(timeout)
        s.connect(target)
    try:
        s.sendall(request)
        s.shutdown(socket.SHUT_WR)
        out = b""
        while chunk := s.recv(1 << 16):
            out += chunk
        return out
    except ConnectionResetError:
        return out
    finally:
        s.close()


def status(answer: bytes) -> int:
    parts = answer.split(b"\r\n", 1)[0].split()
    if len(parts) < 2 or not parts[1].isdigit():
        raise ValueError(f"not an HTTP answer: {answer[:80]!r}")
    return int(parts[1])


Attack = Callable[[Host], dict[str, Any]]
ATTACKS: list[tuple[str, dict[str, Any], Attack]] = []


def attack(**host: Any) -> Callable[[Attack], Attack]:
    """Register an attack; ``host`` says what host it needs (tcp=, nofile=)."""

    def register(fn: Attack) -> Attack:
        ATTACKS.append((fn.__name__, host, fn))
        return fn

    return register


def _hold(port: int, n: int, first: bytes = b"") -> list[socket.socket]:
    held = []
    for _ in range(n):
        try:
            s = socket.create_connection(("127.0.0.1", port), timeout=2)
            if first:
                s.sendall(first)
            held.append(s)
        except OSError:
            break
    return held


@attack(tcp=True, nofile=200)
def fd_flood(host: Host) -> dict[str, Any]:
    """260 idle TCP connections without a token, RLIMIT_NOFILE 200."""
    held = _hold(host.port, 260)  # type: ignore[arg-type]
    t0 = time.monotonic()
    during = host.answers(10)
    latency = time.monotonic() - t0
    open_ok = host.stalls.report()["open_ok"]
    for s in held:
        s.close()
    return {
        "connections": len(held),
        "probe_answered_during": during,
        "answer_s": round(latency, 3),
        "host_open_ok_during": open_ok,
        "answers_after": wait(host.answers, 10),
    }


@attack(tcp=True, nofile=200)
def emfile(host: Host) -> dict[str, Any]:
    """The host takes every descriptor: accept() fails with EMFILE."""
    held = host.stalls.toggle_exhaust()
    got = []
    for _ in range(5):
        try:
            got.append(status(talk(host.sock, b"GET /health HTTP/1.0\r\n\r\n", 3)) or 0)
        except (OSError, ValueError):
            got.append(0)
    host.stalls.toggle_exhaust()
    return {
        "host_held_fds": held,
        "answers_while_out": got,
        "answers_after": wait(host.answers, 10),
    }


@attack(tcp=True)
def slowloris(host: Host) -> dict[str, Any]:
    """500 TCP connections sending a header byte now and then for 3 s."""
    base = host.threads()
    held = _hold(host.port, 500, b"POST /query HTTP/1.0\r\nX-Slow: ")  # type: ignore[arg-type]
    most = host.threads()
    end = time.monotonic() + 3
    latencies = []
    while time.monotonic() < end:
        for s in held:
            try:
                s.send(b"a")
            except OSError:
                pass
        t0 = time.monotonic()
        ok = host.answers(10)
        latencies.append(round(time.monotonic() - t0, 3) if ok else None)
        most = max(most, host.threads())
    for s in held:
        s.close()
    return {
        "connections": len(held),
        "threads_before": base,
        "threads_most": most,
        "unix_answers": len(latencies),
        "unix_unanswered": latencies.count(None),
        "unix_answer_s_max": max((x for x in latencies if x is not None), default=None),
        "tcp_with_token_after": host.tcp_status(10),
        "answers_after": wait(host.answers, 10),
    }


@attack()
def impersonation(host: Host) -> dict[str, Any]:
    """Another process serves ``<victim pid>.sock`` in the user's directory."""
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    path = os.path.join(host.runtime, f"probing-{os.getuid()}", f"{victim.pid}.sock")
    fake = socket.socket(socket.AF_UNIX)
    fake.bind(path)
    fake.listen(4)
    got: list[bytes] = []

    def serve() -> None:
        fake.settimeout(5)
        try:
            c, _ = fake.accept()
            got.append(c.recv(65536))
            c.sendall(b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\n{}")
            c.close()
        except OSError:
            pass

    threading.Thread(target=serve, daemon=True).start()
    try:
        ProbeClient.for_pid(victim.pid).eval("open('/etc/hostname').read()")
        outcome = "sent: the client trusted the impostor"
    except Exception as err:
        outcome = f"refused: {type(err).__name__}: {str(err)[:120]}"
    victim.kill()
    victim.wait()
    fake.close()
    return {"outcome": outcome, "bytes_the_impostor_got": sum(len(g) for g in got)}


@attack(tcp=True)
def header_tricks(host: Host) -> dict[str, Any]:
    """Token smuggling and malformed framing over TCP."""
    auth = f"Authorization: Bearer {TOKEN}".encode()
    body = json.dumps({"sql": "SELECT 1 AS one", "format": "json"}).encode()
    length = b"Content-Length: %d" % len(body)
    cases = {
        "token_after_8185_char_pad": [b"X-Pad: " + b"a" * 8185 + auth, length],
        "duplicate_authorization": [b"Authorization: Bearer wrong", auth, length],
        "content_length_1_9": [auth, b"Content-Length: 1_9"],
        "duplicate_content_length": [auth, length, length],
        "folded_header": [auth, b" folded", length],
        "chunked": [auth, b"Transfer-Encoding: chunked"],
        "100MB_body_no_token": [b"Content-Length: 100000000"],
    }
    out = {}
    for name, headers in cases.items():
        req = b"POST /query HTTP/1.0\r\n" + b"".join(h + b"\r\n" for h in headers) + b"\r\n"
        try:
            out[name] = status(talk(host.port, req + body, 5))  # type: ignore[arg-type]
        except (OSError, ValueError) as err:
            out[name] = str(err)[:60]
    return {"status": out, "answers_after": host.answers()}


def _fake_peer(size: int) -> tuple[socket.socket, list[int]]:
    """A peer that answers every gather with ``size`` bytes of junk."""
    lst = socket.socket()
    lst.bind(("127.0.0.1", 0))
    lst.listen(16)
    sent: list[int] = []

    def serve() -> None:
        chunk = b"x" * (1 << 20)
        while True:
            try:
                c, _ = lst.accept()
            except OSError:
                return
            c.recv(1 << 16)
            n = 0
            c.sendall(b"HTTP/1.0 200 OK\r\n\r\n")
            try:
                while n < size:
                    n += c.send(chunk)
            except OSError:
                pass
            sent.append(n)
            c.close()

    threading.Thread(target=serve, daemon=True).start()
    return lst, sent


def _oversize_host() -> Host:
    global _FAKE
    _FAKE = _fake_peer(600 << 20)
    return Host(tcp=True, peers=f"127.0.0.1:{_FAKE[0].getsockname()[1]}")


_FAKE: tuple[socket.socket, list[int]] | None = None


@attack(factory=_oversize_host)
def oversize_reply(host: Host) -> dict[str, Any]:
    """A peer answers a cluster query with 600 MB."""
    assert _FAKE is not None
    before = host.peak_mb()
    try:
        res = host.client(60).cluster_query("SELECT count(*) AS n FROM process.threads", timeout=30)
        outcome = [f"rank {m.rank}: {m.reason}" for m in res.missing] or "no peer missing"
    except Exception as err:
        outcome = f"{type(err).__name__}: {str(err)[:120]}"
    _FAKE[0].close()
    return {
        "outcome": outcome,
        "bytes_sent_by_peer": sum(_FAKE[1]),
        "peak_rss_mb_before": before,
        "peak_rss_mb_after": host.peak_mb(),
        "answers_after": host.answers(),
    }


@attack(tcp=True)
def gather_redirect(host: Host) -> dict[str, Any]:
    """An authenticated /cluster/gather naming a trap address and 100 members
    pointing back at the probe."""
    trap = socket.socket()
    trap.bind(("127.0.0.1", 0))
    trap.listen(128)
    trap_addr = f"127.0.0.1:{trap.getsockname()[1]}"
    members = [{"rank": 1, "node": "x", "addr": trap_addr}]
    members += [{"rank": 2 + i, "node": "x", "addr": f"127.0.0.1:{host.port}"} for i in range(100)]
    body = json.dumps(
        {"work": {"mode": "scan", "scans": {}}, "members": members, "timeout": 3}
    ).encode()
    req = (
        f"POST /cluster/gather HTTP/1.0\r\nAuthorization: Bearer {TOKEN}\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    base = host.threads()
    try:
        st = status(talk(host.port, req, 30))  # type: ignore[arg-type]
    except (OSError, ValueError) as err:
        st = str(err)[:60]
    trap.setblocking(False)
    connections = 0
    while True:
        try:
            trap.accept()[0].close()
            connections += 1
        except BlockingIOError:
            break
    trap.close()
    return {
        "status": st,
        "connections_to_trap": connections,
        "threads_before": base,
        "threads_after": host.threads(),
        "answers_after": host.answers(),
    }


# -- queries (issue 21 part 1): each over the unix socket, the answer kept open --


def _post_sql(host: Host, sql: str, fmt: str = "json", timeout: float = 120) -> tuple[Any, int]:
    """POST /query; (status or what went wrong, bytes of the answer)."""
    body = json.dumps({"sql": sql, "format": fmt}).encode()
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(timeout)
    try:
        s.connect(host.sock)
        s.sendall(b"POST /query HTTP/1.0\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        out = bytearray()
        while chunk := s.recv(1 << 20):
            out += chunk
        return (status(bytes(out[:64])) if out else "no answer"), len(out)
    except (OSError, ValueError) as err:
        return f"{type(err).__name__}: {err}"[:80], 0
    finally:
        s.close()


def _error_of(host: Host, sql: str) -> str:
    """The probe's error for ``sql`` (its first 100 characters), or its status."""
    body = json.dumps({"sql": sql, "format": "json"}).encode()
    try:
        got = talk_open(
            host.sock, b"POST /query HTTP/1.0\r\nContent-Length: %d\r\n\r\n" % len(body) + body
        )
        payload = got.partition(b"\r\n\r\n")[2]
        return f"{status(got)}: " + json.loads(payload).get("error", "")[:100]
    except (OSError, ValueError, AttributeError) as err:
        return f"{type(err).__name__}: {err}"[:100]


def talk_open(path: str, request: bytes, timeout: float = 120) -> bytes:
    """One request on a unix socket without a half-close (a closed end cancels a query)."""
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(timeout)
    try:
        s.connect(path)
        s.sendall(request)
        out = b""
        while chunk := s.recv(1 << 20):
            out += chunk
        return out
    finally:
        s.close()


def _warm(host: Host) -> None:
    """The engine loads on the first query: not part of the attack."""
    _post_sql(host, "SELECT 1 AS one")
    host.stalls.report()


@attack()
def crash_query(host: Host) -> dict[str, Any]:
    """``SELECT 1+1+...`` with 10,000 and then 100,000 terms."""
    _warm(host)
    out: dict[str, Any] = {}
    for terms in (10_000, 100_000):
        t0 = time.monotonic()
        out[f"terms_{terms}"] = _error_of(host, "SELECT " + "+".join(["1"] * terms))
        out[f"terms_{terms}_s"] = round(time.monotonic() - t0, 3)
        if not host.stalls.alive():
            break
    return {**out, "answers_after": host.answers()}


def _timed_answer(host: Host, sql: str, fmt: str = "json") -> dict[str, Any]:
    """One query after the engine is warm: its status, size and time."""
    _warm(host)
    t0 = time.monotonic()
    got, size = _post_sql(host, sql, fmt=fmt)
    return {
        "status": got,
        "answer_mb": round(size / (1 << 20), 1),
        "answer_s": round(time.monotonic() - t0, 2),
        "answers_after": host.answers(),
    }


@attack()
def cross_join(host: Host) -> dict[str, Any]:
    """100,000 x 1,000 rows, as Arrow."""
    sql = (
        "SELECT a.value, b.value FROM generate_series(1,100000) a "
        "CROSS JOIN generate_series(1,1000) b"
    )
    return _timed_answer(host, sql, fmt="arrow")


@attack()
def json_3m_rows(host: Host) -> dict[str, Any]:
    """``SELECT value FROM generate_series(1,3000000)`` as JSON."""
    return _timed_answer(host, "SELECT value FROM generate_series(1,3000000)")


@attack()
def hang_up(host: Host) -> dict[str, Any]:
    """A client asks for hours of CPU and gives up after 3 s: does the query stop?"""
    _warm(host)
    sql = "SELECT count(*) AS n FROM generate_series(1, 1000000000000)"
    body = json.dumps({"sql": sql, "format": "json"}).encode()
    s = socket.socket(socket.AF_UNIX)
    s.connect(host.sock)
    s.sendall(b"POST /query HTTP/1.0\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    time.sleep(3)
    s.close()
    t0 = time.monotonic()
    cpu0 = other_threads_cpu_s(host.pid)
    time.sleep(1)  # let a cancellation land
    cpu1 = other_threads_cpu_s(host.pid)
    time.sleep(4)
    cpu2 = other_threads_cpu_s(host.pid)
    return {
        "query_cpu_s_in_1s_after": round(cpu1 - cpu0, 2),
        "query_cpu_s_in_next_4s": round(cpu2 - cpu1, 2),
        "watched_s": round(time.monotonic() - t0, 1),
        "answers_after": host.answers(),
    }


def run(name: str, needs: dict[str, Any], fn: Attack) -> dict[str, Any]:
    factory = needs.get("factory")
    host = factory() if factory else Host(**needs)
    try:
        time.sleep(QUIET_S)
        before = host.stalls.report()
        t0 = time.monotonic()
        try:
            outcome = fn(host)
        except Exception as err:
            outcome = {"error": f"{type(err).__name__}: {err}"}
        seconds = time.monotonic() - t0
        alive = host.stalls.alive()
        try:
            during = host.stalls.report() if alive else {}
        except AssertionError:  # it died as we asked (a crash lands a moment later)
            alive, during = False, {}
        return {
            "attack": name,
            "seconds": round(seconds, 2),
            "host_alive": alive,
            "rss_mb_before": before.get("rss_mb"),
            "rss_mb_during": during.get("rss_mb"),
            "peak_rss_mb": host.peak_mb() if alive else None,
            "stall_ms_before": before.get("stall_ms"),
            "stall_ms_during": during.get("stall_ms"),
            "held_ms_before": before.get("held_ms"),
            "held_ms_during": during.get("held_ms"),
            **outcome,
        }
    finally:
        host.stop()


def main(argv: list[str]) -> None:
    chosen = [a for a in ATTACKS if not argv or a[0] in argv]
    results = [run(*a) for a in chosen]
    print(json.dumps({"quiet_s": QUIET_S, "attacks": results}, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
