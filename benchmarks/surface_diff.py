"""The surface a user sees, before and after a refactor: every command's
``--help`` and the answer of every HTTP route of a probe, in the tree of
``--baseline`` and in this checkout, compared item by item (one JSON object).

Each tree runs its own code with this checkout's ``.venv`` Python: the
baseline from a ``git worktree`` of its commit in a temporary folder, put
first on ``PYTHONPATH`` (the working directory too, as ``python -m`` puts it
first on ``sys.path``), and handed on to the node's engine the job starts
(``PROBING_ENGINE_ENV=PYTHONPATH``).

Help: ``probing --help``, then ``probing <cmd> --help`` for every command
the root help lists, and so on down any group's ``Commands:``, with
``COLUMNS=100`` and ``TERM=dumb``. HTTP: an idle job with ``PROBING=1``
in cluster mode on its own (one listed peer, itself, and a token, as
tests/test_cluster.py starts its ranks: no tracing, no root needed) is asked
every route of docs/http.md on its unix socket, and those a peer may reach
over TCP with and without the token; status, content type and body are kept.
What differs by nature (pids, ports, paths, times, the live process's sizes
and counts, the lines of probing's own frames in a traceback) is masked:
the known values by name, the rest by ``MASKS``; the versions need none (one
venv runs both trees).

Per item: ``identical``, or a short unified diff of the masked text. A
difference is either a real change of the surface or a gap in the masks.

    python benchmarks/surface_diff.py [--baseline COMMIT] [--after COMMIT] [--dump DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parents[1]
PYTHON = str(ROOT / ".venv" / "bin" / "python")
# the last commit before issue 44's layout move (df888ae: guest/, node/, cli/)
BASELINE = "92ce8536f94142f81cf8093f0197b69c615b5162"
TOKEN = "surface-token"
HELP_ENV = {"COLUMNS": "100", "TERM": "dumb"}
DIFF_LINES = 40  # a difference is shown this far, then counted

# the fields whose numbers are the live process's (its memory, threads, CPU
# time, its parent) or the moment's (a round trip, a clock offset)
LIVE = ("ppid", "rss_bytes", "vms_bytes", "num_threads", "cpu_user_s", "cpu_system_s",
        "response_ms", "clock_offset_ns")  # fmt: skip
# (pattern, replacement, why): applied after the known values are named
MASKS: list[tuple[str, str, str]] = [
    (rf'"({"|".join(LIVE)})": -?[\d.e+-]+', r'"\1": <n>', "live counts, sizes and times"),
    (r'(File \\"<tree>/[^"]*?\\", line )\d+', r"\1<n>", "lines of probing's own frames"),
    (r"\b\d{10}(\.\d+)?\b", "<epoch-s>", "wall-clock seconds"),
    (r"\b\d{16,20}\b", "<ns>", "wall-clock or monotonic nanoseconds"),
    (r"\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d(\.\d+)?(Z|[+-]\d\d:?\d\d)?", "<time>", "timestamps"),
]


@dataclass(frozen=True)
class Route:
    """One request: its name in the report, how it travels, and what it says."""

    name: str
    method: str
    path: str
    body: bytes = b""
    tcp: bool = False
    token: str | None = TOKEN


def _j(obj: Any) -> bytes:
    return json.dumps(obj).encode()


def _sql(sql: str, fmt: str = "json") -> bytes:
    return _j({"sql": sql, "format": fmt})


ONE = "SELECT 1 AS one, 'x' AS s, CAST(NULL AS INT) AS nothing"
TABLE_LIST = (
    "SELECT table_schema, table_name, table_type FROM information_schema.tables ORDER BY 1, 2"
)
COLUMNS = (
    "SELECT table_schema, table_name, column_name, data_type FROM information_schema.columns "
    "ORDER BY 1, 2, ordinal_position"
)
ROUTES: list[Route] = [
    Route("health", "GET", "/health"),
    Route("tables", "GET", "/tables"),
    Route("query json", "POST", "/query", _sql(ONE)),
    Route("query rows", "POST", "/query", _sql(ONE, "rows")),
    Route("query csv", "POST", "/query", _sql(ONE, "csv")),
    Route("query arrow", "POST", "/query", _sql(ONE, "arrow")),
    Route("query sql body", "POST", "/query?format=json", b"SELECT 2 AS two"),
    Route("query process.info", "POST", "/query", _sql("SELECT * FROM process.info")),
    Route("query table list", "POST", "/query", _sql(TABLE_LIST)),
    Route("query columns", "POST", "/query", _sql(COLUMNS)),
    Route("query python", "POST", "/query", _sql("SELECT * FROM python.`1+1`")),
    Route("query syntax error", "POST", "/query", _sql("SELEC 1")),
    Route("query no table", "POST", "/query", _sql("SELECT * FROM process.nonexistent")),
    Route("query ddl", "POST", "/query", _sql("CREATE TABLE x AS SELECT 1")),
    Route("query bad format", "POST", "/query", _sql("SELECT 1", "xml")),
    Route("query bad json", "POST", "/query", b"{bad"),
    Route("eval", "POST", "/eval", _j({"code": "1 + 1"})),
    Route("eval print", "POST", "/eval", _j({"code": "print('hi')"})),
    Route("eval raises", "POST", "/eval", _j({"code": "1 / 0"})),
    Route("eval bad body", "POST", "/eval", b"x"),
    Route("nvml stop", "POST", "/nvml", _j({"stop": True})),
    Route("nvml bad interval", "POST", "/nvml", _j({"interval": "soon"})),
    Route("trace status", "GET", "/trace/status"),
    Route("trace stop", "POST", "/trace/stop"),
    Route("trace start bad body", "POST", "/trace/start", b"nope"),
    Route("trace thread", "POST", "/trace/thread", _j({"tid": 1, "tstate": 0})),
    Route("trace thread bad", "POST", "/trace/thread", _j({})),
    Route("peers", "GET", "/peers"),
    Route("cluster query", "POST", "/cluster/query", _sql("SELECT pid FROM process.info")),
    Route("cluster query error", "POST", "/cluster/query", _j({"sql": "SELECT 1"})),
    Route("cluster gather bad", "POST", "/cluster/gather", _j({})),
    Route("cluster trace bad", "POST", "/cluster/trace", _j({"action": "dance"})),
    Route("cluster trace stop", "POST", "/cluster/trace", _j({"action": "stop"})),
    Route("metrics", "GET", "/metrics"),
    Route("no such route", "GET", "/nope"),
    Route("wrong method", "POST", "/health"),
    Route("tcp no token", "GET", "/health", tcp=True, token=None),
    Route("tcp wrong token", "GET", "/health", tcp=True, token="not-it"),
    Route("tcp health", "GET", "/health", tcp=True),
    Route("tcp tables", "GET", "/tables", tcp=True),
    Route("tcp peers", "GET", "/peers", tcp=True),
    Route("tcp query", "POST", "/query", _sql(ONE), tcp=True),
    Route("tcp query python", "POST", "/query", _sql("SELECT * FROM python.`1+1`"), tcp=True),
    Route("tcp eval", "POST", "/eval", _j({"code": "1 + 1"}), tcp=True),
    Route("tcp trace status", "GET", "/trace/status", tcp=True),
    Route("tcp trace start output", "POST", "/trace/start", _j({"output": "/tmp/x"}), tcp=True),
    Route("tcp metrics", "GET", "/metrics", tcp=True),
]

JOB = """
import threading, time
def work():
    while True:
        time.sleep(0.05)
threading.Thread(target=work, name="loader-0", daemon=True).start()
while True:
    time.sleep(0.05)
"""


# -- the trees ------------------------------------------------------------


@contextlib.contextmanager
def worktree(commit: str) -> Iterator[Path]:
    """``commit``'s tree in a temporary folder (a ``git worktree``), removed after."""
    where = Path(tempfile.mkdtemp(prefix="surface-diff-")) / "tree"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(where), commit],
                   check=True, capture_output=True)  # fmt: skip
    try:
        yield where
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(where)],
                       check=False, capture_output=True)  # fmt: skip
        shutil.rmtree(where.parent, ignore_errors=True)


def tree_env(tree: Path, **extra: str) -> dict[str, str]:
    """The environment that runs ``tree``'s probing: no setting of ours
    inherited, the tree first on the path."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PROBING", "RANK"))}
    return dict(base, PYTHONPATH=str(tree), **extra)


# -- help -----------------------------------------------------------------


def probing(tree: Path, *args: str) -> str:
    """``python -m probing ARGS`` of ``tree``: its exit status, stdout and stderr."""
    r = subprocess.run([PYTHON, "-m", "probing", *args], cwd=tree, capture_output=True,
                       text=True, timeout=120, env=tree_env(tree, **HELP_ENV))  # fmt: skip
    return f"exit {r.returncode}\n{r.stdout}" + (f"-- stderr\n{r.stderr}" if r.stderr else "")


def commands(help_text: str) -> list[str]:
    """The commands a help lists: the first word of each line of its
    ``Commands:`` section (two spaces in; a wrapped description is further in)."""
    names: list[str] = []
    inside = False
    for line in help_text.splitlines():
        if line.strip() == "Commands:":
            inside = True
        elif inside and not line.strip():
            break
        elif inside and re.match(r"  \S", line):
            names.append(line.split()[0])
    return names


def helps(tree: Path) -> dict[str, str]:
    """``--help`` of the root and of every command and subcommand, by command line."""
    out: dict[str, str] = {}
    todo: list[list[str]] = [[]]
    while todo:
        words = todo.pop(0)
        text = probing(tree, *words, "--help")
        out[" ".join(["probing", *words, "--help"])] = text
        todo += [[*words, name] for name in commands(text)]
    return out


# -- HTTP -----------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def exchange(sock: socket.socket, request: bytes) -> bytes:
    """One HTTP/1.0 request, the whole answer (the probe closes after it)."""
    with sock:
        sock.settimeout(30)
        sock.sendall(request)
        out = b""
        while chunk := sock.recv(65536):
            out += chunk
    return out


class Job:
    """An idle ``PROBING=1`` job run by ``tree``'s probing, in cluster mode on
    its own (``PROBING_PEERS`` lists itself), its sockets in a runtime folder
    of its own; ``close`` stops it and the engine it started."""

    def __init__(self, tree: Path) -> None:
        self.runtime = tempfile.mkdtemp(prefix="surface-rt-")
        self.port = free_port()
        env = tree_env(tree, PROBING="1", PROBING_RUNTIME_DIR=self.runtime, RANK="0",
                       PROBING_PEERS=f"127.0.0.1:{self.port}", PROBING_TOKEN=TOKEN,
                       PROBING_ENGINE_ENV="PYTHONPATH", PROBING_ENGINE_IDLE_S="2",
                       PROBING_KEEP_DEAD_S="1")  # fmt: skip
        self.proc = subprocess.Popen([PYTHON, "-c", JOB], cwd=tree, env=env,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)  # fmt: skip
        self.sock = Path(self.runtime) / f"probing-{os.getuid()}" / f"{self.proc.pid}.sock"

    def ready(self, timeout: float = 60.0) -> None:
        """Until its probe answers with its cluster side up (the address bound
        and published), and its database has loaded."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"the job exited: {self.proc.communicate()[1].decode()}")
            with contextlib.suppress(OSError, ValueError):
                cluster = json.loads(self.ask(Route("", "GET", "/health")).body).get("cluster")
                if cluster and cluster.get("addr") and cluster.get("published"):
                    self.ask(Route("", "POST", "/query", _sql("SELECT 1")))
                    return
            time.sleep(0.1)
        raise SystemExit(f"the job's probe never came up in cluster mode ({self.sock})")

    def ask(self, route: Route) -> Answer:
        head = f"{route.method} {route.path} HTTP/1.0\r\nContent-Length: {len(route.body)}\r\n"
        if route.tcp and route.token is not None:
            head += f"Authorization: Bearer {route.token}\r\n"
        request = head.encode() + b"\r\n" + route.body
        if route.tcp:
            sock = socket.create_connection(("127.0.0.1", self.port), timeout=30)
        else:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(str(self.sock))
        return Answer.parse(exchange(sock, request))

    def engines(self) -> list[psutil.Process]:
        """The engines serving this job's runtime folder (the job started them)."""
        found = []
        for p in psutil.process_iter(["cmdline", "environ"]):
            with contextlib.suppress(psutil.Error):
                cmd = " ".join(p.info["cmdline"] or [])
                env = p.info["environ"] or {}
                if "service" in cmd and env.get("PROBING_RUNTIME_DIR") == self.runtime:
                    found.append(p)
        return found

    def close(self) -> None:
        engines = self.engines()
        self.proc.kill()
        self.proc.communicate()
        for p in engines:
            with contextlib.suppress(psutil.Error):
                p.terminate()
                p.wait(10)
        shutil.rmtree(self.runtime, ignore_errors=True)


@dataclass(frozen=True)
class Answer:
    """What a route answered: the status line, the content type and the body."""

    status: str
    content_type: str
    body: bytes

    @classmethod
    def parse(cls, raw: bytes) -> Answer:
        head, _, body = raw.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        kind = next((ln.split(":", 1)[1].strip() for ln in lines[1:]
                     if ln.lower().startswith("content-type:")), "")  # fmt: skip
        return cls(lines[0], kind, body)

    def texts(self) -> tuple[str, str]:
        """The answer as text to compare, exactly as it came, and as shown
        in a diff: JSON indented (its keys in their order), Arrow as its
        schema and rows."""
        out = f"{self.status}\ncontent-type: {self.content_type}\n"
        if "arrow" in self.content_type:
            digest = hashlib.sha256(self.body).hexdigest()
            return out + f"sha256 {digest}", out + arrow_text(self.body)
        raw = self.body.decode("utf-8", "replace")
        try:
            return out + raw, out + json.dumps(json.loads(raw), indent=1)
        except ValueError:
            return out + raw, out + raw


def arrow_text(body: bytes) -> str:
    import pyarrow as pa
    import pyarrow.ipc as ipc

    table = ipc.open_stream(pa.py_buffer(body)).read_all()
    return f"{len(body)} bytes\n{table.schema}\n{json.dumps(table.to_pylist())}"


Texts = dict[str, tuple[str, str]]  # item -> (exact, shown)


def answers(tree: Path) -> tuple[Texts, dict[str, str]]:
    """Every route's answer from a job run by ``tree``, and the values to
    mask in them by name (the job's pid, its engine's, its port, its folder)."""
    job = Job(tree)
    try:
        job.ready()
        out = {f"{r.method} {r.path} ({r.name})": job.ask(r).texts() for r in ROUTES}
        known = {str(job.proc.pid): "<pid>", str(job.port): "<port>", job.runtime: "<runtime>"}
        for e in job.engines():
            known[str(e.pid)] = "<engine-pid>"
        return out, known
    finally:
        job.close()


# -- comparing ------------------------------------------------------------


def mask(text: str, known: dict[str, str]) -> str:
    """``text`` with the known values named (longest first, a number only
    where it stands alone), then ``MASKS``."""
    for value in sorted(known, key=len, reverse=True):
        pattern = rf"(?<![\w.]){value}(?!\w)" if value.isdigit() else re.escape(value)
        text = re.sub(pattern, known[value], text)
    for pattern, repl, _why in MASKS:
        text = re.sub(pattern, repl, text)
    return text


def surface(tree: Path) -> dict[str, Texts]:
    """One tree's help texts and HTTP answers, masked: the tree's folder,
    this checkout's Python and ``.venv`` (where the install names itself),
    and what ``answers`` knows."""
    texts = {k: (v, v) for k, v in helps(tree).items()}
    http, known = answers(tree)
    known.update({str(tree): "<tree>", PYTHON: "<python>", str(ROOT / ".venv"): "<venv>"})
    return {
        part: {k: (mask(a, known), mask(b, known)) for k, (a, b) in items.items()}
        for part, items in (("help", texts), ("http", http))
    }


def compare(before: tuple[str, str] | None, after: tuple[str, str] | None) -> str:
    """``identical``, or a unified diff of what is shown, cut at ``DIFF_LINES``."""
    if before is not None and after is not None and before[0] == after[0]:
        return "identical"
    a, b = (t[1] if t else "(absent)" for t in (before, after))
    if a == b:  # the same once indented: only the JSON's spacing differs
        a, b = (t[0] if t else "(absent)" for t in (before, after))
    lines = list(difflib.unified_diff(a.splitlines(), b.splitlines(),
                                      "baseline", "after", n=1, lineterm=""))  # fmt: skip
    cut = lines[:DIFF_LINES]
    if len(lines) > DIFF_LINES:
        cut.append(f"... {len(lines) - DIFF_LINES} more diff lines")
    return "\n".join(cut)


def report(before: Texts, after: Texts) -> dict[str, str]:
    keys = list(before) + [k for k in after if k not in before]
    return {k: compare(before.get(k), after.get(k)) for k in keys}


def dump(folder: Path, side: str, texts: dict[str, Texts]) -> None:
    """Every masked text shown, one file per item under ``folder/side``."""
    for part, items in texts.items():
        for name, (_exact, shown) in items.items():
            path = folder / side / part / (re.sub(r"[^\w.-]+", "_", name).strip("_") + ".txt")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(shown + "\n")


@contextlib.contextmanager
def after_tree(commit: str | None) -> Iterator[Path]:
    """This checkout as it stands, or ``commit``'s tree."""
    if commit is None:
        yield ROOT
    else:
        with worktree(commit) as where:
            yield where


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", default=BASELINE, help="the commit before (default: %(default)s)")
    ap.add_argument("--after", default=None, help="a commit after (default: this checkout)")
    ap.add_argument("--dump", type=Path, help="write every masked text here too")
    args = ap.parse_args()
    with worktree(args.baseline) as base, after_tree(args.after) as new:
        before, after = surface(base), surface(new)
    if args.dump:
        dump(args.dump, "baseline", before)
        dump(args.dump, "after", after)
    diffs = {part: report(before[part], after[part]) for part in ("help", "http")}
    every = {**diffs["help"], **diffs["http"]}
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True).stdout.strip()  # fmt: skip
    out = {
        "baseline": args.baseline,
        "after": args.after or f"this checkout at {head}, with its uncommitted changes",
        "masks": [{"pattern": p, "as": r, "why": w} for p, r, w in MASKS],
        "identical": sum(v == "identical" for v in every.values()),
        "different": sorted(k for k, v in every.items() if v != "identical"),
        **diffs,
    }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
