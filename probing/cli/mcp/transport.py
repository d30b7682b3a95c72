"""How ``probing mcp`` is reached: stdio (what a desktop or CLI agent spawns)
or streamable HTTP on one address, where a bearer token, when given, is
checked on every request. HTTP off the loopback requires one."""

from __future__ import annotations

import hmac
import ipaddress
import socket
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from probing.errors import ProbingError

if TYPE_CHECKING:
    from mcp.server.mcpserver import MCPServer
    from mcp.server.transport_security import TransportSecuritySettings

PATH = "/mcp"
TOKEN_ENV = "PROBING_MCP_TOKEN"


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address, or ``localhost``) is reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name: whatever it resolves to, it is not known to be local


def check_binding(host: str, token: str | None) -> None:
    """A ProbingError unless ``host`` is the loopback or a token guards it."""
    if token or is_loopback(host):
        return
    raise ProbingError(
        f"refusing to serve MCP on {host} without a bearer token: anyone who reaches it "
        "could read every process's stacks and tables",
        hint=f"set {TOKEN_ENV} (or pass --token) and give it to the agent as "
        "'Authorization: Bearer <token>', or keep the default --host 127.0.0.1",
    )


class BearerAuth:
    """ASGI middleware: every HTTP request carries ``Authorization: Bearer
    <token>`` (compared in constant time), or is answered 401."""

    def __init__(self, app: Any, token: str) -> None:
        self.app = app
        self.expected = f"Bearer {token}".encode()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            got = b""
            for name, value in scope.get("headers", []):
                if name.lower() == b"authorization":
                    got = value
            if not hmac.compare_digest(got, self.expected):
                from starlette.responses import JSONResponse

                reply = JSONResponse(
                    {"error": "missing or wrong bearer token: send 'Authorization: Bearer "
                     f"<token>' with the token the server was started with (${TOKEN_ENV})"},
                    status_code=401,
                    headers={"WWW-Authenticate": 'Bearer realm="probing-mcp"'},
                )  # fmt: skip
                await reply(scope, receive, send)
                return
        await self.app(scope, receive, send)


def rebinding_guard(host: str) -> TransportSecuritySettings | None:
    """On the loopback, requests must name a loopback host (``Host``,
    ``Origin``): a web page whose name was rebound to 127.0.0.1 is refused.
    Off it, none: the token guards the door."""
    from mcp.server.transport_security import TransportSecuritySettings

    if not is_loopback(host):
        return None
    bare = host.strip("[]")
    names = [f"[{bare}]" if ":" in bare else bare, "127.0.0.1", "localhost", "[::1]"]
    return TransportSecuritySettings(
        enable_dns_rebinding_protection=True,
        allowed_hosts=[f"{n}:*" for n in names],
        allowed_origins=[f"http://{n}:*" for n in names],
    )


def serve_stdio(server: MCPServer) -> None:
    """Serve over this process's stdin and stdout until the client closes them."""
    server.run("stdio")


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on ``host``:``port`` (0: a free one), or a clear error."""
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host.strip("[]"), port))
    except OSError as err:
        sock.close()
        raise ProbingError(
            f"cannot listen on {host}:{port}: {err.strerror or err}",
            hint="choose another --port (0: any free one) or --host",
        ) from None
    sock.listen(128)
    return sock


def serve_http(
    server: MCPServer, host: str, port: int, token: str | None, said: Callable[[str], None]
) -> None:
    """Serve streamable HTTP on ``host``:``port`` at ``/mcp`` until interrupted;
    ``said`` is told the URL once it listens."""
    import uvicorn

    check_binding(host, token)
    app: Any = server.streamable_http_app(
        streamable_http_path=PATH, host=host, transport_security=rebinding_guard(host)
    )
    if token:
        app = BearerAuth(app, token)
    sock = bind(host, port)
    where = sock.getsockname()
    shown = f"[{where[0]}]" if sock.family == socket.AF_INET6 else where[0]
    said(f"serving MCP on http://{shown}:{where[1]}{PATH}" + (" (bearer token)" if token else ""))
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on")
    uvicorn.Server(config).run(sockets=[sock])
