"""AdminClient: the daemon's AdminService (Status, Checkpoint, Pause,
Resume) and its gRPC health check.

Roles with --auth_tokens: Status needs an observer token (the config is
then left out, StatusResponse.config_redacted) or an admin token;
Checkpoint, Pause and Resume need admin; health needs none.

    with AdminClient("daemon:50051", tls_ca="ca.pem", token_file="observer.token") as admin:
        print(admin.status().learner_steps)
"""

from __future__ import annotations

import grpc

from qstream.channel import PathLike, auth_error, channel_for, is_token_refused
from qstream.proto import admin_pb2, admin_pb2_grpc

# grpc.health.v1.HealthCheckResponse.ServingStatus
HEALTH_STATUS = {0: "UNKNOWN", 1: "SERVING", 2: "NOT_SERVING", 3: "SERVICE_UNKNOWN"}


def _decode_health(data: bytes) -> str:
    """HealthCheckResponse{status = 1 (varint)} without the grpc-health
    package; an empty message is status 0."""
    if len(data) >= 2 and data[0] == 0x08:
        return HEALTH_STATUS.get(data[1], f"status {data[1]}")
    return HEALTH_STATUS[0]


class AdminClient:
    """Unary admin calls with a per-call `timeout` (seconds). A refused
    token raises AuthError; other failures raise grpc.RpcError."""

    def __init__(
        self,
        server: str | grpc.Channel,
        *,
        tls_ca: PathLike | None = None,
        tls_cert: PathLike | None = None,
        tls_key: PathLike | None = None,
        tls_server_name: str | None = None,
        token: str | None = None,
        token_file: PathLike | None = None,
        timeout: float = 10.0,
        max_receive_message_length: int | None = None,
    ) -> None:
        """`server` is an address (TLS, token and receive-limit parameters as
        in qstream.channel.open_channel) or a ready channel."""
        self._channel, self._own_channel = channel_for(
            server, tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key, tls_server_name=tls_server_name,
            token=token, token_file=token_file, max_receive_message_length=max_receive_message_length,
        )
        self._stub = admin_pb2_grpc.AdminServiceStub(self._channel)
        self._health = self._channel.unary_unary(
            "/grpc.health.v1.Health/Check",
            request_serializer=lambda service: service,
            response_deserializer=_decode_health,
        )
        self.timeout = timeout

    def _call(self, name: str, method, request, timeout: float | None):
        try:
            return method(request, timeout=self.timeout if timeout is None else timeout, wait_for_ready=True)
        except grpc.RpcError as e:
            if is_token_refused(e):
                raise auth_error(name, e) from None
            raise

    def status(self, timeout: float | None = None) -> admin_pb2.StatusResponse:
        """Learner steps, replay fill, ingest counters, policy version, ...
        (admin_pb2.StatusResponse)."""
        return self._call("AdminService.Status", self._stub.Status, admin_pb2.StatusRequest(), timeout)

    def checkpoint(self, name: str = "", timeout: float | None = None) -> admin_pb2.CheckpointResponse:
        """Writes a checkpoint under the daemon's --checkpoint_dir and returns
        once it is on disk (an empty name: the automatic ckpt-<step>)."""
        return self._call("AdminService.Checkpoint", self._stub.Checkpoint, admin_pb2.CheckpointRequest(name=name),
                          timeout)

    def pause(self, timeout: float | None = None) -> None:
        self._call("AdminService.Pause", self._stub.Pause, admin_pb2.PauseRequest(), timeout)

    def resume(self, timeout: float | None = None) -> None:
        self._call("AdminService.Resume", self._stub.Resume, admin_pb2.ResumeRequest(), timeout)

    def health(self, timeout: float | None = None) -> str:
        """grpc.health.v1 Check of the whole server: "SERVING",
        "NOT_SERVING", ..."""
        return self._call("Health.Check", self._health, b"", timeout)

    def close(self) -> None:
        if self._own_channel:
            self._channel.close()

    def __enter__(self) -> "AdminClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
