"""TLS for the peer port: who may talk to a node's engine over the network.

With ``PROBING_TLS_CERT`` (and its key, ``PROBING_TLS_KEY``, unless the
certificate file holds it) the peer port speaks TLS only, both ways, and
both ends prove themselves: a peer must present a certificate signed by
``PROBING_TLS_CA`` (the fleet's or the job's own authority; the
certificate's own issuer when unset), or its connection is cut during the
handshake, before anything of its request is read. The job's token is
still checked inside. Peers are addressed by IP, so the certificate
vouches for membership of the fleet, not for a host name.

Without a certificate nothing here is loaded (``ssl`` brings OpenSSL, 4 MB
of every engine's memory) and the port speaks plain HTTP, as before.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from probing import config
from probing.errors import ProbingError

if TYPE_CHECKING:
    import ssl


def enabled() -> bool:
    return bool(config.load().tls_cert)


@functools.lru_cache(maxsize=4)
def _context(server: bool, cert: str, key: str, ca: str) -> ssl.SSLContext:
    import ssl

    purpose = ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT
    ctx = ssl.SSLContext(purpose)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(cert, key or None)
        ctx.load_verify_locations(ca or cert)
    except (OSError, ssl.SSLError) as err:
        raise ProbingError(
            f"the peer port's TLS certificate does not load: {err}",
            hint="check PROBING_TLS_CERT, PROBING_TLS_KEY and PROBING_TLS_CA (PEM files)",
        ) from err
    ctx.verify_mode = ssl.CERT_REQUIRED  # both ways: a peer without one is cut off
    ctx.check_hostname = False  # peers are reached by address; the CA vouches for them
    return ctx


def server_context() -> ssl.SSLContext | None:
    """The peer port's side, or None when TLS is off."""
    env = config.load()
    return _context(True, env.tls_cert, env.tls_key, env.tls_ca) if env.tls_cert else None


def client_context() -> ssl.SSLContext | None:
    """The asking side, or None when TLS is off."""
    env = config.load()
    return _context(False, env.tls_cert, env.tls_key, env.tls_ca) if env.tls_cert else None


def wants_io(err: BaseException) -> int:
    """What a non-blocking TLS socket waits for before it can go on: 1 to
    read, 2 to write, 0 when ``err`` is a real failure."""
    import ssl

    if isinstance(err, ssl.SSLWantReadError):
        return 1
    if isinstance(err, ssl.SSLWantWriteError):
        return 2
    return 0


def wrap(ctx: Any, sock: Any, *, server: bool) -> Any:
    """``sock`` (non-blocking) as a TLS socket whose handshake is still to do."""
    return ctx.wrap_socket(sock, server_side=server, do_handshake_on_connect=False)
