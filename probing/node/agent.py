"""``probing agent``: the node's watcher, run as a service in the foreground.

Every ``every_s`` it looks at the node's Python processes and attaches to
the training processes its policy matches, with no ``PROBING=1`` and no
``probing inject`` typed: the same probe as ``inject`` (each process's
guest hands it to its user's engine), traced as the policy says (the
collectives by default), which turns the job's always-on watch on. A
process whose environment says ``PROBING=0`` is never touched, nor one the
policy does not match.

The policy (``Policy``): a process whose environment carries a launcher's
variables (torchrun's ``TORCHELASTIC_RUN_ID``, ``MASTER_PORT`` with
``RANK``, Slurm's ``SLURM_PROCID``, Open MPI's ``OMPI_COMM_WORLD_RANK``,
PMIx's ``PMIX_RANK``, MPICH's ``PMI_RANK``); or which has formed a torch
process group, whatever started it (its backend's threads,
``probing.node.torchgroup``: ``mp.spawn``'s ranks, Lightning's own
launcher's, a framework's that sets the rank in code), looked at again each
scan until it has; or whose command line matches a pattern, or which runs
in a cgroup whose path holds a given text; never a launcher itself
(torchrun's agent, ``deepspeed``, ``accelerate``; ``mp.spawn``'s parent,
which forms no group). A process no launcher named gets its ``job`` from
its probe once attached: the rendezvous its process group's store is on.

It serves ``GET /health`` (what it attached, what failed and why) and
``GET /metrics`` on ``127.0.0.1:<port>``, read-only: one scrape target per node.
No engine takes that port (theirs come from ``PROBING_PORT_RANGE``, which it
is outside of); where another process holds it all the same, the agent says
who in one line and exits ``EX_CONFIG``. At start it compiles and load-tests
the BPF programs it traces (``probing.node.service.warm``), so the first job
it attaches to waits for no compile. ``/metrics`` is OpenMetrics (every
counter with its ``_created``; Prometheus' text format 0.0.4 to a scraper
that does not ask for OpenMetrics, ``curl``, ``promtool``): the agent's
own counters; every live probe of the node's metrics (asked over its unix
socket at each scrape), each sample labelled with its process's ``pid``,
``job`` (``identity.job_label``: one a job, the same on every node of it),
``rank`` and ``node`` where it names none of its own
(``probing_rank_lateness_seconds`` names the rank it measures); and
``probing_finding_active``, one series for each finding active now
(``kind``, the ``rank`` it blames, ``node``, ``comm``, ``job``), read from
the findings logs the jobs' detectors write (``probing.node.findings``),
a finding whose detector's process is gone cleared there ("job gone"),
never served. Each new or cleared finding also goes to the webhook, when
one is set (``probing.node.webhook``). It logs to stderr, one
line an event. SIGTERM stops it; the engines and their probes go on.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import re
import signal
import socket
import threading
import time
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import psutil

from probing import paths, proc
from probing.guest import place, wire
from probing.node import openmetrics
from probing.node.findings import JOB_GONE, Feed
from probing.node.openmetrics import Exposition
from probing.node.service import warm
from probing.node.webhook import Webhook
from probing.worker import Worker, stop_on_signals

DEFAULT_PORT = 9978  # outside the ephemeral range, away from torchrun's 29500
LAUNCHER_RANKS = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID")
LAUNCHERS = re.compile(
    r"(^|/)(torchrun|deepspeed|accelerate|srun|mpirun|mpiexec)$|torch\.distributed\.(run|launch)"
    r"|deepspeed\.launcher"
)
SAY_EACH = 3  # more findings than this cleared at one look are said in one line
GONE_KEEP_S = 600.0  # how long a gone process's job names the findings about it
# a job being stopped loses its ranks one by one: how long the rest of the
# job is given to go too before a gone detector's finding says "the job goes on"
ENDING_S = 5.0
# the exit status of an agent that cannot start as set up (its port held, a bad
# setting): sysexits' EX_CONFIG, which the systemd unit does not restart on
# (RestartPreventExitStatus): a restart every 2 s would meet the same holder
EX_CONFIG = 78
RETRIES = 3  # attempts at a process before it is left alone (each said in /health)
# a trace's start: its uprobes attached, beside a busy job; a BPF compile it
# meets is waited for on top (warm.wait_out), however long it takes
TRACE_START_S = 120.0
# the request's own timeout: warm.wait_out gives up first; no compile takes an hour,
# and a thread left waiting on a probe that never answered ends then
LONGEST_ANSWER_S = 3600.0

_log = logging.getLogger("probing.agent")


@dataclasses.dataclass(frozen=True)
class Policy:
    """Which processes the agent attaches to, and what it traces in them."""

    launchers: bool = True  # a launcher's variables in the environment
    groups: bool = True  # a torch process group formed (torchgroup.formed)
    pattern: str = ""  # a regular expression the command line matches
    cgroup: str = ""  # a text the process's cgroup path holds
    families: tuple[str, ...] = ("gloo", "nccl")  # traced once attached
    attach: bool = True  # False: watch and serve, attach nothing
    require: tuple[tuple[str, str], ...] = ()  # variables a process must carry, with these values

    def why(
        self,
        environ: Mapping[str, str],
        argv: list[str],
        cgroup: str,
        formed: Callable[[], str] = lambda: "",
    ) -> str:
        """Why a process matches ("" where it does not, or opts out).
        ``formed``: what shows it formed a torch process group ("" nothing),
        asked only where its environment names no launcher."""
        if environ.get("PROBING", "").strip().lower() in ("0", "false", "no", "off"):
            return ""
        if any(environ.get(name) != value for name, value in self.require):
            return ""
        if any(LAUNCHERS.search(a) for a in argv[:3]):
            return ""  # the launcher: its ranks are the job
        if self.launchers:
            if environ.get("TORCHELASTIC_RUN_ID"):
                return "TORCHELASTIC_RUN_ID"
            if environ.get("MASTER_PORT") and environ.get("RANK"):
                return "MASTER_PORT and RANK"
            for name in LAUNCHER_RANKS:
                if environ.get(name):
                    return name
        if self.groups and (group := formed()):
            return group
        if self.pattern and re.search(self.pattern, " ".join(argv)):
            return f"command line ~ {self.pattern}"
        if self.cgroup and self.cgroup in cgroup:
            return f"cgroup ~ {self.cgroup}"
        return ""


@dataclasses.dataclass
class SeenProcess:
    """A process the agent picked (``why``) and tried to trace: tracing, or
    why not (``state``)."""

    pid: int
    why: str
    job: str  # what its launcher names the job by (run id, Slurm job, master port)
    started_s: float  # the process's age when the agent saw it
    attached_s: float  # seconds from seeing it to tracing
    state: str  # "tracing", or "failed: <reason>"
    tries: int = 1


class Agent:
    """The watcher: scan, attach, serve its health and the node's metrics."""

    def __init__(
        self, policy: Policy, every_s: float = 2.0, webhook: Webhook | None = None
    ) -> None:
        self.policy = policy
        self.every_s = every_s
        self.webhook = webhook
        self.seen: dict[int, SeenProcess] = {}
        self.scans = 0
        self.failures = 0
        self.created = time.time()  # its counters' _created
        self.feed = Feed()
        self._probes: dict[int, ProbeLabels] = {}  # what a probe says of itself, for its labels
        self._jobs: dict[int, str] = {}  # pid -> job, for the processes it did not attach
        # pid -> (job, when it went): a gone process's findings (rank gone) still name its job
        self._gone: dict[int, tuple[str, float]] = {}
        self._ending: dict[Any, float] = {}  # a gone detector's pid: when its job still ran
        self._lock = threading.Lock()
        self._feed_lock = threading.Lock()
        # the loop, on the caller's thread (run): a look at once, then every every_s
        self._loop = Worker("probing-agent", self._look, every_s, at_once=True)

    # -- the loop ---------------------------------------------------------------------
    def run(self) -> None:
        """Look at the node every ``every_s`` until stopped (SIGTERM)."""
        self._loop.every_s = self.every_s
        self._loop.run()

    def _look(self) -> None:
        """A scan, and the findings logged since the last: each said where it
        fails, and the other done all the same."""
        try:
            self.scan()
        except Exception as err:  # a service's loop: said, and on
            _log.warning(f"scan failed: {type(err).__name__}: {err}")
        try:
            self.follow()
        except Exception as err:  # as above
            _log.warning(f"reading the findings failed: {type(err).__name__}: {err}")

    def stop(self) -> None:
        self._loop.stop()

    def scan(self) -> list[SeenProcess]:
        """One look at the node: attach to what matches and is new; what was attached."""
        from probing.node import torchgroup

        self.scans += 1
        new = []
        for found in psutil.process_iter(["pid", "cmdline", "create_time"]):
            pid = found.info["pid"]
            with self._lock:
                known = self.seen.get(pid)
            if pid == os.getpid() or (known is not None and not _retry(known)):
                continue
            argv = found.info.get("cmdline") or []
            if not argv or "python" not in os.path.basename(argv[0]):
                continue
            environ = proc.environ(pid)
            formed = functools.partial(torchgroup.formed, pid)
            why = self.policy.why(environ, argv, _cgroup(pid), formed) if environ else ""
            if not why or not self.policy.attach:
                continue
            age = max(0.0, time.time() - (found.info.get("create_time") or time.time()))
            got = self._attach(pid, why, _job(environ), age)
            if known is not None:
                got.tries = known.tries + 1
            with self._lock:
                self.seen[pid] = got
            new.append(got)
        self._name_jobs()
        with self._lock:  # processes gone: forgotten, their job kept for the findings they raise
            now = time.monotonic()
            for pid in [p for p in self.seen if not psutil.pid_exists(p)]:
                self._gone[pid] = (self.seen.pop(pid).job, now)
            for pid in [p for p, (_, t) in self._gone.items() if now - t > GONE_KEEP_S]:
                del self._gone[pid]
            for known_pids in (self._probes, self._jobs):
                for pid in [p for p in known_pids if not psutil.pid_exists(p)]:
                    del known_pids[pid]
        return new

    def follow(self) -> list[dict[str, Any]]:
        """The findings the node's detectors logged since the last look, each
        with its job, and those it cleared, their detector's process gone
        (``Feed.poll``); queued for the webhook, never waited for."""
        with self._feed_lock:
            rows = self.feed.poll(self._gone_reason)
        ended = [r for r in rows if r["state"] == "cleared" and r.get("reason")]
        many = len(ended) > SAY_EACH  # a node's old findings, cleared at once: one line
        for row in rows:
            row["job"] = self._job_of(row.get("pid"))
            why = f": {row['reason']}" if row.get("reason") else ""
            if not (many and row in ended):
                _log.info(f"finding {row['state']}{why}: {row.get('kind')} rank {row.get('rank')} "
                          f"(pid {row.get('pid')}, job {row['job']})")  # fmt: skip
            if self.webhook is not None:
                self.webhook.put(row)
        if many:
            _log.info(
                f"{len(ended)} findings cleared, their processes gone (findings.jsonl has each)"
            )
        return rows

    def _gone_reason(self, row: dict[str, Any]) -> str | None:
        """Why a finding whose detector's process is gone is cleared: its job
        is gone, unless a live process the agent knows is of that job for
        ``ENDING_S`` (None meanwhile: asked again at the next look)."""
        job = self._job_of(row.get("pid"))
        with self._lock:
            known = [(a.pid, a.job) for a in self.seen.values()] + list(self._jobs.items())
        others = [p for p, j in known if j == job and p != row.get("pid")]
        if job == "?" or not any(proc.running(p) for p in others):
            self._ending.pop(row.get("pid"), None)
            return JOB_GONE
        since = self._ending.setdefault(row.get("pid"), time.monotonic())
        if time.monotonic() - since < ENDING_S:
            return None
        del self._ending[row.get("pid")]
        return "its detector's process is gone (the job goes on)"

    def _name_jobs(self) -> None:
        """The job of each process traced that no launcher named ("?"): the
        rendezvous its probe learned from its process group, once it has."""
        with self._lock:
            unnamed = [a for a in self.seen.values() if a.job == "?" and a.state == "tracing"]
        for known in unnamed:
            try:
                about = json.loads(_get(_socket(known.pid), "/health"))
            except (OSError, ValueError, wire.WireError):
                continue  # gone meanwhile: forgotten below
            job = _rendezvous_job(about.get("cluster"))
            if job is not None:
                with self._lock:
                    known.job = job
                _log.info(f"pid {known.pid}: job {job} (its process group's store)")

    def _job_of(self, pid: Any) -> str:
        if not isinstance(pid, int):
            return "?"
        with self._lock:
            known = self.seen.get(pid)
            job = known.job if known is not None else self._jobs.get(pid)
            if job is None and pid in self._gone:
                job = self._gone[pid][0]
        if job is None:
            job = _job(proc.environ(pid))
            if job != "?":  # a process not exec'd yet has its parent's variables: read again
                with self._lock:
                    self._jobs[pid] = job
        return job

    def _attach(self, pid: int, why: str, job: str, age: float) -> SeenProcess:
        from probing.errors import ProbingError
        from probing.inject.injector import inject

        t0 = time.monotonic()
        _log.debug("pid %d (%s; job %s): injecting, then tracing %s", pid, why, job,
                   ",".join(self.policy.families))  # fmt: skip
        try:
            result = inject(pid)
            traced = {"families": list(self.policy.families)}
            sock = result.socket or _socket(pid)
            start = functools.partial(
                wire.request, sock, "POST", "/trace/start", traced, timeout=LONGEST_ANSWER_S
            )
            answer = warm.wait_out(
                start, _engine_of(sock), TRACE_START_S,
                lambda msg: _log.info(f"pid {pid}: {msg.removeprefix('probing: ')}"),
            )  # fmt: skip
            state = str(answer.get("state", "tracing"))
        except TimeoutError:
            self.failures += 1
            state = f"failed: its probe did not answer /trace/start in {TRACE_START_S:g} s"
        except wire.WireError as err:
            if err.kind == "AlreadyTracing":  # its engine resumed the trace (the engine of a
                state = "tracing"  # container replaced, from the probe's .trace), or a user's
            else:
                self.failures += 1
                state = f"failed: {err}"
        except (ProbingError, OSError) as err:
            self.failures += 1
            state = f"failed: {err}"
        took = time.monotonic() - t0
        level = logging.WARNING if state.startswith("failed") else logging.INFO
        _log.log(level, f"pid {pid} ({why}; job {job}): {state} in {took:.1f} s")
        return SeenProcess(pid, why, job, round(age, 2), round(took, 2), state)

    # -- what it serves -----------------------------------------------------------------
    def health(self) -> dict[str, Any]:
        with self._lock:
            seen = [dataclasses.asdict(a) for a in self.seen.values()]
        return {
            "ok": True,
            "pid": os.getpid(),
            "install": place.install(),
            "policy": dataclasses.asdict(self.policy),
            "scans": self.scans,
            "failures": self.failures,
            "processes": seen,
            "findings_active": len(self._active()),
            "webhook": self.webhook.health() if self.webhook is not None else None,
        }

    def _active(self) -> list[dict[str, Any]]:
        with self._feed_lock:
            return self.feed.active()

    def metrics(self) -> str:
        """OpenMetrics: the agent's counters, the findings active on the node,
        then every live probe's metrics, each sample labelled with its
        process (``pid``), ``job``, ``rank`` and ``node`` where it names none."""
        with self._lock:
            tracing = sum(1 for a in self.seen.values() if a.state == "tracing")
        out = Exposition()
        out.gauge(
            "probing_agent_attached", "processes this agent attached to and traces", [({}, tracing)]
        )
        out.counter(
            "probing_agent_attach_failures", "attaches that failed (GET /health says why)",
            [({}, self.failures)], self.created,
        )  # fmt: skip
        if self.webhook is not None:
            n = self.webhook.counts()
            out.gauge("probing_agent_webhook_queued", "findings waiting for the webhook",
                      [({}, n.queued)])  # fmt: skip
            for name, value, what in (
                ("sent", n.sent, "findings the webhook delivered"),
                ("dropped", n.dropped, "findings dropped from the webhook's full queue"),
                ("rejected", n.rejected, "findings the webhook refused for good (a 4xx)"),
                ("retries", n.retries, "webhook POSTs that failed and were tried again"),
            ):
                out.counter(f"probing_agent_webhook_{name}", what, [({}, value)],
                            self.webhook.created)  # fmt: skip
        active: dict[tuple[tuple[str, str], ...], int] = {}
        for row in self._active():
            labels = {"job": self._job_of(row.get("pid")), "kind": str(row.get("kind") or "")}
            for name in ("rank", "node", "comm"):
                if row.get(name) is not None:
                    labels[name] = str(row[name])
            key = tuple(sorted(labels.items()))
            active[key] = active.get(key, 0) + 1
        out.gauge(
            "probing_finding_active",
            "findings active now, by kind and the rank they blame (analyze.findings)",
            [(dict(key), count) for key, count in sorted(active.items())],
        )
        for pid, sock in sorted(paths.all_sockets().items()):
            if pid == os.getpid() or not psutil.pid_exists(pid):
                continue  # a dead process's probe: its figures stopped when it died
            try:
                text = _get(sock, "/metrics")
                probe = self._probe(pid, sock)
            except (OSError, ValueError, wire.WireError):
                continue  # gone meanwhile, or no detector (not a rank of a job)
            out.merge(text, probe.labels(pid), probe.created)
        return out.text()

    def _probe(self, pid: int, sock: str) -> ProbeLabels:
        """What ``pid``'s probe says of itself, asked until it knows its rank in a job."""
        with self._lock:
            known = self._probes.get(pid)
        if known is not None and known.final:
            return known
        about = json.loads(_get(sock, "/health"))
        cluster = about.get("cluster") or {}
        rank = cluster.get("rank")
        rank = rank if isinstance(rank, int) and rank >= 0 else None  # -1: still learning it
        job = self._job_of(pid)
        probe = ProbeLabels(
            job=_rendezvous_job(cluster) or job if job == "?" else job,
            rank=rank,
            node=str(cluster.get("node") or socket.gethostname()),
            created=float(about.get("started_ns") or 0) / 1e9 or self.created,
            # a rank of a job: it stays (Lightning's ranks name their size before their rank)
            final=rank is not None and int(cluster.get("world_size") or 1) > 1,
        )
        with self._lock:
            self._probes[pid] = probe
        return probe


def _retry(known: SeenProcess) -> bool:
    return known.state.startswith("failed") and known.tries < RETRIES


def _cgroup(pid: int) -> str:
    try:
        return proc.read(pid, "cgroup")
    except OSError:
        return ""


def _job(environ: Mapping[str, str]) -> str:
    """A process's ``job`` label (``identity.job_label``: never torchrun's
    default run id, which every plain torchrun job of a node has)."""
    from probing.node.cluster.identity import job_label

    return job_label(environ)


def _rendezvous_job(cluster: Any) -> str | None:
    """The ``job`` label of a probe's process from its process group's store
    (its ``GET /health``'s ``cluster.store``, ``host:port``): the
    rendezvous label ``identity.job_label`` gives ``MASTER_ADDR`` and
    ``MASTER_PORT``; None where the probe knows no store yet."""
    from probing.node.cluster.identity import job_label

    store = cluster.get("store") if isinstance(cluster, dict) else None
    if not isinstance(store, str) or ":" not in store:
        return None
    host, _, port = store.rpartition(":")
    return job_label({"MASTER_ADDR": host, "MASTER_PORT": port})


def _engine_of(sock: str) -> int | None:
    """The pid of the engine that serves the probe socket ``sock`` (its peer)."""
    import struct

    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.settimeout(5.0)
        conn.connect(sock)
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        return int(struct.unpack("3i", creds)[0])
    except OSError:
        return None
    finally:
        conn.close()


def _socket(pid: int) -> str:
    from probing import paths

    found = paths.find_socket(pid)
    if found is None:
        raise wire.WireError(0, f"pid {pid} has no probe socket after its injection")
    return found


@dataclasses.dataclass(frozen=True)
class ProbeLabels:
    """A probe's labels, from its own ``GET /health``."""

    job: str
    rank: int | None  # None: not known yet (a rank learns it from its process group)
    node: str
    created: float  # the probe's start (unix s): its counters' _created
    final: bool  # its rank is known: not asked again

    def labels(self, pid: int) -> dict[str, str]:
        out = {"pid": str(pid), "job": self.job, "node": self.node}
        if self.rank is not None:
            out["rank"] = str(self.rank)
        return out


def _get(sock_path: str, path: str) -> str:
    """One probe's ``GET path`` over its unix socket, the body as text."""
    from probing.node.probe import http

    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(5.0)
    try:
        sock.connect(sock_path)
        answer = http.exchange(sock, http.request_bytes(path, b"", None, "GET"))
    finally:
        sock.close()
    if answer.status != 200:
        raise wire.WireError(answer.status, f"{sock_path}: {path} answered {answer.status}")
    return answer.body.decode()


def serve(agent: Agent, host: str, port: int) -> ThreadingHTTPServer:
    """``GET /health`` and ``GET /metrics`` (OpenMetrics to a scraper that
    asks for it, as Prometheus does; Prometheus' text format 0.0.4 to one
    that does not, ``curl`` or ``promtool``), read-only, in a thread of its own.
    A port another process holds is a ``PortHeld`` naming it (the command
    line's one line and ``EX_CONFIG``), never a traceback."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # http.server's name
            if self.path == "/health":
                body, ctype = json.dumps(agent.health()).encode(), "application/json"
            elif self.path == "/metrics":  # OpenMetrics where asked (Prometheus), else text 0.0.4
                text, ctype = agent.metrics(), openmetrics.OPENMETRICS
                if not openmetrics.wants_openmetrics(self.headers.get("Accept")):
                    text, ctype = openmetrics.text_format(text), openmetrics.TEXT_FORMAT
                body = text.encode()
            else:
                self.send_error(404, "GET /health or GET /metrics")
                return
            self.send_response(200)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:  # scrapes are not events
            pass

    from probing.node.cluster.port import cannot_bind

    try:
        server = ThreadingHTTPServer((host, port), Handler)
    except OSError as err:
        hint = "stop it, or give the agent another port: --port or PROBING_AGENT_PORT"
        raise cannot_bind("the agent", host, port, err, hint) from None
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="probing-agent-http", daemon=True).start()
    return server


def main(
    policy: Policy, *, every_s: float, host: str, port: int, webhook: str | None = None
) -> None:
    """Run the agent until SIGTERM or SIGINT. ``webhook``: the URL findings
    are POSTed to (None: ``PROBING_AGENT_WEBHOOK``; "": none)."""
    from probing import config

    url = config.load().agent_webhook if webhook is None else webhook
    try:
        hook = Webhook(url.strip()) if url.strip() else None
    except ValueError as err:
        raise config.ConfigError(f"PROBING_AGENT_WEBHOOK: {err}") from err
    agent = Agent(policy, every_s, webhook=hook)
    server = serve(agent, host, port)
    what = f"{'on' if policy.attach else 'off'} ({', '.join(policy.families)})"
    _log.info(
        f"serving GET /health and /metrics on {host}:{server.server_address[1]}; attaching: {what}"
    )
    # compiled now, not at the first job's trace (which would wait for it)
    warming = warm.warm_up(policy.families, _log.info) if policy.attach else None
    if hook is not None:
        _log.info(f"findings go to the webhook {hook.health()['url']} too")
    stop_on_signals(agent.stop, (signal.SIGTERM, signal.SIGINT))  # no lock in a handler
    try:
        agent.run()
    finally:
        if warming is not None:
            warming.stop()
        server.shutdown()
        if hook is not None:
            agent.follow()  # what was logged since the last look goes too
            hook.close()
            left = hook.counts().queued
            if left:
                _log.warning(f"{left} finding(s) not delivered to the webhook: {hook.last_error}")
        _log.info("stopped")
