"""The SDK's one way to open a channel to a qstreamd: plaintext or TLS
(optionally with a client certificate, for a daemon that requires mTLS),
every call carrying ``authorization: Bearer <token>`` when a token is given.

The token is added by a client interceptor as call metadata rather than as
gRPC call credentials, because gRPC refuses call credentials on insecure
channels and the daemon accepts plaintext on loopback.

    channel = open_channel("daemon:50051", tls_ca="ca.pem", token_file="actor.token")

A `server` names one daemon or the ranks of a data-parallel learner (each
with its own replay shard, all with the same weights): parse_servers() turns
it into the targets to open, one channel each. Every channel balances with
round_robin, so a target that resolves to several addresses (dns:/// of a
headless Service) spreads new calls, and so new streams, over all of them.
"""

from __future__ import annotations

import collections
import json
import operator
import os
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence, Union

import grpc
import grpc.aio

MiB = 1 << 20

# The largest message a channel opened here accepts from the daemon, unless
# the caller passes max_receive_message_length. The largest message the
# daemon sends is a Policy (GetPolicy/WatchPolicy): 4 bytes per network
# parameter plus ~100 bytes, and neither the Policy nor StatusResponse
# carries its size (StatusResponse.config, from which it follows, is only
# sent to admin tokens), so the limit is set before the first policy is
# seen: 256 MiB holds ~67M parameters, far above gRPC's own 4 MiB default
# (~1M parameters), while a broken or hostile peer still cannot make the
# client allocate without bound. -1 lifts the limit.
DEFAULT_MAX_RECEIVE_MESSAGE_LENGTH = 256 * MiB
_MAX_CHANNEL_ARG = (1 << 31) - 1

# Batches of any size go out (the daemon enforces server.max_message_bytes);
# new calls go round-robin over the addresses a target resolves to.
ROUND_ROBIN_SERVICE_CONFIG = json.dumps({"loadBalancingConfig": [{"round_robin": {}}]})
DEFAULT_OPTIONS: tuple[tuple[str, Any], ...] = (
    ("grpc.max_send_message_length", -1),
    ("grpc.service_config", ROUND_ROBIN_SERVICE_CONFIG),
)

# Schemes of the gRPC target URIs that parse_servers() takes as one target.
_TARGET_SCHEMES = ("dns:", "ipv4:", "ipv6:", "unix:", "unix-abstract:")

_TOKEN_REFUSED = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)

PathLike = Union[str, "os.PathLike[str]"]
Servers = Union[str, Sequence[str]]


class QstreamError(Exception):
    """Base class of the SDK's errors."""


class AuthError(QstreamError):
    """The daemon refused the call's token: ``code`` is
    grpc.StatusCode.UNAUTHENTICATED (missing or unknown token) or
    PERMISSION_DENIED (the token's role may not make this call); ``details``
    is the daemon's message. Retrying with the same token cannot help."""

    def __init__(self, call: str, code: grpc.StatusCode, details: str):
        hint = "missing or unknown token" if code == grpc.StatusCode.UNAUTHENTICATED else "wrong role"
        super().__init__(f"{call}: the daemon refused the token ({code.name}, {hint}): {details}")
        self.call = call
        self.code = code
        self.details = details


class ConnectError(QstreamError):
    """The daemon could not be reached within the timeout. ``details`` is
    gRPC's last reason (refused connection, TLS handshake failure, ...)."""

    def __init__(self, server: str, timeout: float, details: str):
        super().__init__(f"could not reach qstreamd at {server} within {timeout:g}s: {details}")
        self.server = server
        self.details = details


class MessageTooLarge(QstreamError):
    """A message from the daemon (a policy) exceeded the channel's receive
    limit. ``details`` is gRPC's message ("Received message larger than max
    (N vs. LIMIT)"). Raise the limit: ``max_receive_message_length=`` of the
    SDK class (bytes, -1: none), or ``grpc.max_receive_message_length`` on a
    channel you open yourself. Retrying cannot help."""

    def __init__(self, call: str, details: str):
        super().__init__(
            f"{call}: {details}; raise the receive limit with max_receive_message_length=BYTES (-1: no limit; "
            f"default {DEFAULT_MAX_RECEIVE_MESSAGE_LENGTH // MiB} MiB), or for a channel you opened yourself with "
            f"the channel option grpc.max_receive_message_length (gRPC's default is 4 MiB)"
        )
        self.call = call
        self.details = details


def parse_servers(server: Servers) -> list[str]:
    """The gRPC targets `server` names:

    - a gRPC target URI (dns:, ipv4:, ipv6:, unix:, unix-abstract:) is one
      target, taken as it is: e.g. "dns:///qstream-ranks.ns.svc:50051",
      whose channel spreads new streams over the addresses it resolves to;
    - otherwise "host:port", or several comma-separated ("h1:p1,h2:p2"),
      or a list/tuple of them: one target each (IPv6 hosts in brackets).

    Raises ValueError naming `server` for an empty entry, an entry without a
    port, a URI beside other entries, or an entry listed twice.
    """
    if not server or (isinstance(server, str) and not server.strip()):
        raise ValueError("server is empty")
    if isinstance(server, str):
        value = server.strip()
        if value.lower().startswith(_TARGET_SCHEMES):
            # ipv4: and ipv6: URIs list their addresses with commas themselves.
            if value.lower().startswith("dns:") and "," in value:
                raise ValueError(f"server: {value!r}: a dns: target names one host; list several daemons "
                                 f"as 'host:port,host:port'")
            return [value]
        entries = value.split(",")
    elif isinstance(server, (list, tuple)) and all(isinstance(e, str) for e in server):
        if len(server) == 1:
            return parse_servers(server[0])
        entries = list(server)
    else:
        raise ValueError(f"server: {server!r} is neither a str nor a list of str")
    servers: list[str] = []
    for i, entry in enumerate(e.strip() for e in entries):
        if not entry:
            raise ValueError(f"server: entry {i + 1} of {server!r} is empty")
        if entry.lower().startswith(_TARGET_SCHEMES):
            raise ValueError(f"server: {entry!r} is a target URI, which must be the only one "
                             f"(or list host:port entries)")
        host, _, port = entry.rpartition(":")
        if (not host or not port.isascii() or not port.isdigit() or not 1 <= int(port) <= 65535
                or (":" in host and not (host.startswith("[") and host.endswith("]")))):
            raise ValueError(f"server: {entry!r} is not host:port (a port of 1 to 65535; an IPv6 host in "
                             f"brackets: [::1]:50051)")
        if entry in servers:
            raise ValueError(f"server: {entry!r} is listed twice")
        servers.append(entry)
    return servers


def is_too_large(error: grpc.RpcError) -> bool:
    """Whether `error` is gRPC refusing a received message over the
    channel's max_receive_message_length (a client-side RESOURCE_EXHAUSTED)."""
    return error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in (error.details() or "")


def check_receive_limit(max_receive_message_length: int) -> int:
    """The limit as an int: -1 (none) or 1 to 2**31 - 1 bytes (a gRPC
    channel argument is an int32); ValueError otherwise."""
    try:
        n = -2 if isinstance(max_receive_message_length, bool) else operator.index(max_receive_message_length)
    except TypeError:
        n = -2
    if not (n == -1 or 1 <= n <= _MAX_CHANNEL_ARG):
        raise ValueError(
            f"max_receive_message_length must be -1 (no limit) or 1 to {_MAX_CHANNEL_ARG} bytes, "
            f"got {max_receive_message_length!r}"
        )
    return n


def is_token_refused(error: grpc.RpcError) -> bool:
    """Whether `error` is the daemon refusing the call's token."""
    return error.code() in _TOKEN_REFUSED


def auth_error(call: str, error: grpc.RpcError) -> AuthError:
    """An AuthError for a failed call whose code is_token_refused()."""
    return AuthError(call, error.code(), error.details() or "")


def read_token_file(path: PathLike) -> str:
    """The bearer token in `path`, without trailing whitespace. Raises
    ValueError naming the file when it cannot be read, is empty, or holds
    anything but one line of printable ASCII."""
    try:
        token = Path(path).read_text(encoding="ascii").rstrip()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"token file {path}: cannot read: {e}") from e
    if not token:
        raise ValueError(f"token file {path} is empty")
    _check_token(token, f"token file {path}")
    return token


def _check_token(token: str, source: str) -> None:
    if not all("!" <= c <= "~" for c in token):
        raise ValueError(f"{source}: a token is one line of printable ASCII without spaces")


def _read_pem(path: PathLike, what: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"{what} {path}: cannot read: {e}") from e
    if b"-----BEGIN " not in data:
        raise ValueError(f"{what} {path} holds no PEM block")
    return data


class _Details(
    collections.namedtuple(
        "_Details", ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression")
    ),
    grpc.ClientCallDetails,
):
    pass


class _BearerToken(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds the authorization header to every call of the channel."""

    def __init__(self, token: str):
        (self._header,) = bearer_metadata(token)

    def _details(self, d: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        metadata = [m for m in (d.metadata or ()) if m[0] != "authorization"]
        metadata.append(self._header)
        return _Details(
            d.method, d.timeout, metadata, d.credentials,
            getattr(d, "wait_for_ready", None), getattr(d, "compression", None),
        )

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)


def bearer_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """The call metadata that carries `token` (none without one)."""
    return (("authorization", f"Bearer {token}"),) if token is not None else ()


def open_channel(
    server: str,
    *,
    tls_ca: PathLike | None = None,
    tls_cert: PathLike | None = None,
    tls_key: PathLike | None = None,
    tls_server_name: str | None = None,
    token: str | None = None,
    token_file: PathLike | None = None,
    max_receive_message_length: int = DEFAULT_MAX_RECEIVE_MESSAGE_LENGTH,
    options: Iterable[tuple[str, Any]] = (),
) -> grpc.Channel:
    """A channel to the daemon at `server`: host:port or a gRPC target URI
    such as dns:///name:port (one target of parse_servers(); a list of
    several is a ValueError: Writer, ActorClient and run_actor spread over
    several, one channel each). Calls go round_robin over the addresses the
    target resolves to (ROUND_ROBIN_SERVICE_CONFIG in DEFAULT_OPTIONS).

    Args:
        tls_ca: PEM file of the CA that signed the daemon's certificate. TLS
            is used when this or `tls_cert` is given (without it gRPC's
            default roots verify the daemon).
        tls_cert, tls_key: PEM client certificate and its key (both or
            neither), for a daemon started with --tls_client_ca (mTLS).
        tls_server_name: the name the daemon's certificate is checked
            against instead of the host of `server` (TLS only).
        token, token_file: the bearer token (role actor, observer or admin)
            sent with every call, or a file holding it (trailing newline
            stripped); at most one of the two.
        max_receive_message_length: the largest message (a policy: 4
            bytes per network parameter, ~100 more) the channel accepts, in
            bytes; -1: no limit. Default DEFAULT_MAX_RECEIVE_MESSAGE_LENGTH
            (256 MiB). A policy over it raises MessageTooLarge.
        options: extra gRPC channel options, after DEFAULT_OPTIONS and the
            receive limit (an option given here replaces either).

    Raises ValueError naming the file or parameter when a file cannot be
    read or the parameters do not fit together. Connecting happens on the
    first call.
    """
    credentials, channel_options, token = _channel_parts(
        server, tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key, tls_server_name=tls_server_name, token=token,
        token_file=token_file, max_receive_message_length=max_receive_message_length, options=options)
    if credentials is not None:
        channel = grpc.secure_channel(server, credentials, options=channel_options)
    else:
        channel = grpc.insecure_channel(server, options=channel_options)
    if token is not None:
        channel = grpc.intercept_channel(channel, _BearerToken(token))
    return channel


def aio_channel_factory(
    server: str, *, options: Iterable[tuple[str, Any]] = (), **security: Any
) -> tuple[Callable[[], "grpc.aio.Channel"], tuple[tuple[str, str], ...]]:
    """(open, metadata) for a grpc.aio channel to `server` with the
    parameters of open_channel (those that are not None), checked here:
    open() makes the channel (call it on the event loop that will use it),
    and `metadata` (the bearer token, if any) goes with each call."""
    given = {k: v for k, v in security.items() if v is not None}
    credentials, channel_options, token = _channel_parts(server, options=options, **given)
    metadata = bearer_metadata(token)

    def open_aio() -> "grpc.aio.Channel":
        if credentials is not None:
            return grpc.aio.secure_channel(server, credentials, options=channel_options)
        return grpc.aio.insecure_channel(server, options=channel_options)

    return open_aio, metadata


# open_channel's security parameters (all default None).
_SECURITY_PARAMS = ("tls_ca", "tls_cert", "tls_key", "tls_server_name", "token", "token_file")


def channel_pem_parts(
    server: str,
    *,
    max_receive_message_length: int = DEFAULT_MAX_RECEIVE_MESSAGE_LENGTH,
    options: Iterable[tuple[str, Any]] = (),
    **security: Any,
) -> tuple[tuple[bytes | None, bytes | None, bytes | None] | None, list[tuple[str, Any]], str | None]:
    """open_channel's checks over its parameters (`security`: those of
    _SECURITY_PARAMS, None ones ignored): (the TLS files' PEM bytes as (CA,
    key, certificate), each None when not given, or None for plaintext; the
    channel options; the bearer token or None)."""
    unknown = set(security) - set(_SECURITY_PARAMS)
    if unknown:
        raise TypeError(f"unexpected channel parameter(s): {', '.join(sorted(unknown))}")
    tls_ca, tls_cert, tls_key, tls_server_name, token, token_file = (security.get(k) for k in _SECURITY_PARAMS)
    if not isinstance(server, str) or ("," in server and not server.lower().startswith(_TARGET_SCHEMES)):
        raise ValueError(f"server: {server!r} names several daemons; a channel goes to one (Writer, "
                         f"ActorClient and run_actor take several)")
    if (tls_cert is None) != (tls_key is None):
        raise ValueError("tls_cert and tls_key go together")
    if token is not None and token_file is not None:
        raise ValueError("give token or token_file, not both")
    tls = tls_ca is not None or tls_cert is not None
    if tls_server_name and not tls:
        raise ValueError("tls_server_name needs TLS (tls_ca)")
    if token_file is not None:
        token = read_token_file(token_file)
    elif token is not None:
        token = token.strip()
        if not token:
            raise ValueError("token is empty")
        _check_token(token, "token")

    merged = dict(DEFAULT_OPTIONS)
    merged["grpc.max_receive_message_length"] = check_receive_limit(max_receive_message_length)
    merged.update(options)  # the caller's options win (gRPC takes one value per key)
    channel_options: list[tuple[str, Any]] = list(merged.items())
    pems = None
    if tls:
        pems = (_read_pem(tls_ca, "tls_ca") if tls_ca is not None else None,
                _read_pem(tls_key, "tls_key") if tls_key is not None else None,
                _read_pem(tls_cert, "tls_cert") if tls_cert is not None else None)
        if tls_server_name:
            channel_options.append(("grpc.ssl_target_name_override", tls_server_name))
    return pems, channel_options, token


def _channel_parts(server: str, **kwargs: Any) -> tuple[grpc.ChannelCredentials | None, list[tuple[str, Any]],
                                                        str | None]:
    """channel_pem_parts() with the TLS files as grpc credentials."""
    pems, channel_options, token = channel_pem_parts(server, **kwargs)
    credentials = None
    if pems is not None:
        ca, key, cert = pems
        credentials = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)
    return credentials, channel_options, token


def channel_for(
    server: str | grpc.Channel, *, options: Iterable[tuple[str, Any]] = (), **security: Any
) -> tuple[grpc.Channel, bool]:
    """(channel, owned): `server` itself when it is a channel (then no
    security parameter or max_receive_message_length may be given: the
    channel has its own), else open_channel(server, **security) with the
    parameters that are not None, which the caller owns and closes."""
    given = {k: v for k, v in security.items() if v is not None}
    if isinstance(server, grpc.Channel):
        if given:
            raise ValueError(f"{', '.join(given)}: not used with a ready channel; pass the address instead "
                             f"(or set it on the channel)")
        return server, False
    return open_channel(server, options=options, **given), True
