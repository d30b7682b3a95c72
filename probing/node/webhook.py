"""Findings leave the node: each one POSTed as JSON to a URL (``PROBING_AGENT_WEBHOOK``).

``Webhook.put`` never blocks its caller (the agent's scan): it appends to a
bounded queue, and when the queue is full the oldest waiting finding is
dropped and counted. One thread POSTs them in order, one at a time. A POST
that fails for a reason that may pass (refused, unreachable, timed out, a
5xx, 408 or 429) is tried again after a backoff that doubles from
``backoff_s`` up to ``max_backoff_s``, as long as it takes, unless newer
findings push it out of the queue; one the server refuses for good (any
other 4xx) is counted and not sent again. ``close`` gives what waits a last
chance to go, for at most ``flush_s``.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from probing.worker import Worker

QUEUE = 1000  # findings waiting at most (a hang on 1000 ranks: 1000 findings at once)
BACKOFF_S = 0.5  # the first wait after a failed POST; doubled each time after
MAX_BACKOFF_S = 30.0  # the longest wait between two tries
TIMEOUT_S = 5.0  # one POST: connecting and the answer
RETRYABLE = frozenset({408, 429})  # 4xx answers that say "later", not "never"


@dataclasses.dataclass
class Counts:
    """What the webhook did since it started (for /metrics and /health)."""

    sent: int = 0  # delivered: a 2xx answer
    dropped: int = 0  # pushed out of a full queue before they were delivered
    rejected: int = 0  # refused for good by the server (a 4xx), not sent again
    retries: int = 0  # POSTs that failed and were tried again
    queued: int = 0  # waiting now (the one being sent included)


class Webhook:
    """A bounded queue of JSON objects and the thread that POSTs them."""

    def __init__(
        self,
        url: str,
        *,
        queue: int = QUEUE,
        backoff_s: float = BACKOFF_S,
        max_backoff_s: float = MAX_BACKOFF_S,
        timeout_s: float = TIMEOUT_S,
    ) -> None:
        if urllib.parse.urlsplit(url).scheme not in ("http", "https"):
            raise ValueError(f"webhook URL {redact(url)!r}: use http:// or https://")
        self.url = url
        self.bound = max(1, queue)
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.timeout_s = timeout_s
        self.created = time.time()  # the counters' _created
        self.last_error = ""
        self._counts = Counts()
        self._queue: collections.deque[dict[str, Any]] = collections.deque()
        self._sending = 0  # 1 while a POST is in flight (taken off the queue)
        self._cond = threading.Condition()
        self._flush_until = 0.0  # after close: the last moment to try
        # the sender: _run until closed, woken from its wait for a finding by close
        self._sender = Worker("probing-webhook", self._run, what="webhook", wake=self._notify)
        self._sender.start()

    # -- the caller's side: never blocks ------------------------------------------------
    def put(self, item: dict[str, Any]) -> None:
        """Queue ``item``; when the queue is full, its oldest is dropped."""
        with self._cond:
            if len(self._queue) >= self.bound:
                self._queue.popleft()
                self._counts.dropped += 1
            self._queue.append(item)
            self._cond.notify()

    def counts(self) -> Counts:
        with self._cond:
            return dataclasses.replace(self._counts, queued=len(self._queue) + self._sending)

    def health(self) -> dict[str, Any]:
        return {
            "url": redact(self.url),
            **dataclasses.asdict(self.counts()),
            "bound": self.bound,
            "last_error": self.last_error,
        }

    def close(self, flush_s: float = 2.0) -> None:
        """Stop; what waits is tried (without backoff) for at most ``flush_s``."""
        with self._cond:
            self._flush_until = time.monotonic() + flush_s
        self._sender.stop(flush_s + self.timeout_s)

    def _notify(self) -> None:
        with self._cond:
            self._cond.notify()

    # -- the sender ---------------------------------------------------------------------
    def _run(self) -> None:
        wait = 0.0
        while True:
            with self._cond:
                while not self._queue and not self._sender.stopping:
                    self._cond.wait()
                if self._sender.stopping and (
                    not self._queue or time.monotonic() >= self._flush_until
                ):
                    return
                item = self._queue.popleft()
                self._sending = 1
            outcome = self._post(item)
            with self._cond:
                self._sending = 0
                if outcome == "sent":
                    self._counts.sent += 1
                elif outcome == "rejected":
                    self._counts.rejected += 1
                elif len(self._queue) >= self.bound:  # newer ones filled it: this is the oldest
                    self._counts.dropped += 1
                else:
                    self._counts.retries += 1
                    self._queue.appendleft(item)
            if outcome != "retry":
                wait = 0.0
            elif self._sender.stopping:
                return  # closing, and the server still fails: what waits stays unsent
            else:
                wait = min(self.max_backoff_s, wait * 2 or self.backoff_s)
                self._sender.wait(wait)  # a close cuts the backoff short: one last try

    def _post(self, item: dict[str, Any]) -> str:
        """One POST: "sent", "rejected" (for good) or "retry"."""
        body = json.dumps(item, default=str).encode()
        request = urllib.request.Request(
            self.url,
            data=body,
            method="POST",
            headers={"Content-Type": "application/json", "User-Agent": "probing-agent"},
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as answer:
                answer.read()
            self.last_error = ""
            return "sent"
        except urllib.error.HTTPError as err:
            self.last_error = f"HTTP {err.code} {err.reason}"
            if 400 <= err.code < 500 and err.code not in RETRYABLE:
                return "rejected"
            return "retry"
        except (OSError, ValueError) as err:  # refused, unreachable, timed out, a bad answer
            reason = getattr(err, "reason", None) or err
            self.last_error = f"{type(err).__name__}: {reason}"
            return "retry"


def redact(url: str) -> str:
    """``url`` without what may be a secret (user, password, path, query): a
    webhook URL often carries its token (Slack's, a bearer in the query)."""
    parts = urllib.parse.urlsplit(url)
    try:
        port = f":{parts.port}" if parts.port else ""
    except ValueError:  # not a port number
        port = ":?"
    base = f"{parts.scheme}://{parts.hostname or ''}{port}"
    return f"{base}/..." if parts.path.strip("/") or parts.query else base
