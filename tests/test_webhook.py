"""``probing.node.webhook``: findings POSTed as JSON to a local HTTP server;
one that is down, then comes up, gets them after retries; the queue's bound
holds (the oldest dropped, and counted); a 4xx is not tried again."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from probing.node.webhook import Webhook, redact


class Receiver:
    """A local HTTP server that keeps what is POSTed to it, answering
    ``codes`` in turn (then 200)."""

    def __init__(self, port: int = 0, codes: tuple[int, ...] = ()) -> None:
        self.got: list[dict] = []  # type: ignore[type-arg]
        self.codes = list(codes)
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # http.server's name
                body = self.rfile.read(int(self.headers["Content-Length"]))
                code = outer.codes.pop(0) if outer.codes else 200
                if code == 200:
                    assert self.headers["Content-Type"] == "application/json"
                    outer.got.append(json.loads(body))
                self.send_response(code)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hooks/probing?key=secret"
        threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        ).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver() -> Iterator[Callable[..., Receiver]]:
    started: list[Receiver] = []

    def start(port: int = 0, codes: tuple[int, ...] = ()) -> Receiver:
        started.append(Receiver(port, codes))
        return started[-1]

    yield start
    for r in started:
        r.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "not in time"
        time.sleep(0.01)


def test_a_finding_is_posted_as_json(receiver) -> None:  # type: ignore[no-untyped-def]
    server = receiver()
    hook = Webhook(server.url)
    try:
        hook.put({"kind": "straggler", "rank": 2, "state": "new"})
        _until(lambda: hook.counts().sent == 1)
        assert server.got == [{"kind": "straggler", "rank": 2, "state": "new"}]
        assert hook.counts().queued == 0 and hook.counts().retries == 0
    finally:
        hook.close(0)


def test_a_server_that_is_down_then_comes_up_gets_it_after_retries(receiver) -> None:  # type: ignore[no-untyped-def]
    port = _free_port()  # nothing listens there yet: refused
    hook = Webhook(f"http://127.0.0.1:{port}/", backoff_s=0.05, max_backoff_s=0.2)
    try:
        hook.put({"n": 1})
        _until(lambda: hook.counts().retries >= 3)
        assert hook.counts().sent == 0 and hook.counts().queued == 1
        assert "refused" in hook.health()["last_error"].lower()
        server = receiver(port)
        _until(lambda: hook.counts().sent == 1)
        assert server.got == [{"n": 1}] and hook.health()["last_error"] == ""
    finally:
        hook.close(0)


def test_a_5xx_is_tried_again_and_a_4xx_is_not(receiver) -> None:  # type: ignore[no-untyped-def]
    server = receiver(codes=(503, 429))
    hook = Webhook(server.url, backoff_s=0.01)
    try:
        hook.put({"n": 1})  # 503, then 429: tried again; then 200
        _until(lambda: hook.counts().sent == 1)
        assert hook.counts().retries == 2
        server.codes = [400]
        hook.put({"n": 2})  # 400: refused for good
        _until(lambda: hook.counts().rejected == 1)
        hook.put({"n": 3})
        _until(lambda: hook.counts().sent == 2)
        n = hook.counts()
        assert (n.retries, n.rejected, n.queued) == (2, 1, 0)
        assert server.got == [{"n": 1}, {"n": 3}]
    finally:
        hook.close(0)


def test_the_queue_bound_holds_the_oldest_dropped_and_counted(receiver) -> None:  # type: ignore[no-untyped-def]
    port = _free_port()
    hook = Webhook(f"http://127.0.0.1:{port}/", queue=3, backoff_s=60)
    hook.put({"n": 0})
    _until(lambda: hook.counts().retries == 1)  # refused: waiting 60 s to try again
    t0 = time.monotonic()
    for i in range(1, 10):
        hook.put({"n": i})
    assert time.monotonic() - t0 < 0.5  # never waits on the server
    n = hook.counts()
    assert (n.queued, n.dropped, n.sent) == (3, 7, 0)
    assert hook.health()["dropped"] == 7
    server = receiver(port)
    hook.close(flush_s=5)  # cuts the backoff short: what waits goes, in order
    assert [x["n"] for x in server.got] == [7, 8, 9]
    assert hook.counts().sent == 3 and hook.counts().queued == 0


def test_the_url_is_said_without_its_secrets() -> None:
    assert redact("https://user:pw@hooks.example:8443/services/T0/B0/xyz?token=t") == (
        "https://hooks.example:8443/..."
    )
    assert redact("http://10.0.0.1:9000") == "http://10.0.0.1:9000"
    with pytest.raises(ValueError, match="http:// or https://"):
        Webhook("ftp://example/")
