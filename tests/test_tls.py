"""TLS on the peer port (``probing.node.probe.tls``): with a certificate, the
port speaks TLS only and both ends prove themselves; a peer without a
certificate of the fleet's authority is cut off in the handshake, before
anything of its request is read."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from probing.cli.client import TcpTransport
from probing.errors import PeerUnreachable
from probing.node.cluster.exchange import Exchange, PeerFailure, Reply
from probing.node.probe.http import Request, Response, request_bytes
from probing.node.probe.server import UnixHTTPServer
from tests.conftest import require

TOKEN = b"tls-token"


def make_certs(directory: Path, name: str = "fleet") -> dict[str, str]:
    """A CA of its own (``name``) and a peer certificate it signed: the
    ``PROBING_TLS_*`` settings of a peer of that fleet."""
    require(bool(shutil.which("openssl")), "openssl missing (makes the test certificates)")
    d = directory / name
    d.mkdir(parents=True, exist_ok=True)
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=d)

    run("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
        "-subj", f"/CN=probing-{name}-ca")  # fmt: skip
    run("req", *ec, "-keyout", "peer.key", "-out", "peer.csr", "-subj", f"/CN=probing-{name}")
    (d / "ext").write_text(
        "basicConstraints=CA:FALSE\nkeyUsage=digitalSignature\n"
        "extendedKeyUsage=serverAuth,clientAuth\n"
    )
    run("x509", "-req", "-in", "peer.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
        "-out", "peer.pem", "-days", "2", "-extfile", "ext")  # fmt: skip
    return {"PROBING_TLS_CERT": str(d / "peer.pem"), "PROBING_TLS_KEY": str(d / "peer.key"),
            "PROBING_TLS_CA": str(d / "ca.pem")}  # fmt: skip


def _app(req: Request) -> Response:
    return Response.json({"path": req.path, "remote": req.remote is not None})


@pytest.fixture
def port(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """A server whose TCP port speaks TLS (the fleet's certificate)."""
    fleet = make_certs(tmp_path)
    for k, v in fleet.items():
        monkeypatch.setenv(k, v)
    server = UnixHTTPServer(None, _app)
    server.start()
    host, bound = server.listen_tcp("127.0.0.1", 0, TOKEN)
    yield server, host, bound, fleet
    server.stop()


def _ask(host: str, port: int) -> Reply | PeerFailure | None:
    ex = Exchange(time.monotonic() + 5)
    ex.add(host, port, request_bytes("/health", b"{}", TOKEN))
    return ex.run()[0]


def test_peers_of_the_fleet_talk_tls(port) -> None:  # type: ignore[no-untyped-def]
    _, host, bound, _ = port
    got = _ask(host, bound)
    assert isinstance(got, Reply) and got.status == 200, got
    assert json.loads(got.body) == {"path": "/health", "remote": True}
    status, _, body = TcpTransport(f"{host}:{bound}", TOKEN.decode()).request("GET", "/x")
    assert status == 200 and json.loads(body)["path"] == "/x"


def test_a_peer_without_the_fleets_certificate_is_cut_off(port, tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    server, host, bound, _ = port
    for k, v in make_certs(tmp_path, "stranger").items():  # a certificate of another authority
        monkeypatch.setenv(k, v)
    got = _ask(host, bound)
    assert isinstance(got, PeerFailure), got
    for k in ("PROBING_TLS_CERT", "PROBING_TLS_KEY", "PROBING_TLS_CA"):  # no TLS at all
        monkeypatch.delenv(k)
    got = _ask(host, bound)
    assert isinstance(got, PeerFailure), got
    with pytest.raises(PeerUnreachable):
        TcpTransport(f"{host}:{bound}", TOKEN.decode(), timeout=5).request("GET", "/x")
    assert server.stats.get("tls_refused", 0) >= 2
