"""An in-process ExperienceService on a loopback port that records every
batch it reads and acknowledges it (accepted = count), so Writer tests can
look at the exact batches sent without a qstreamd. `hold()` stops acking
(like a daemon whose learner holds inserts back) until `release()`; `reject`
makes the batches with the given sequences get an error ack instead;
`throttle` lists the sequences whose ack has Ack.throttle set."""

from __future__ import annotations

import threading
from concurrent import futures

import grpc

from qstream.proto import experience_pb2

TransitionBatch = experience_pb2.TransitionBatch


class FakeDaemon:
    def __init__(self):
        self.batches: list[TransitionBatch] = []
        self.reject: dict[int, tuple[str, str]] = {}  # sequence -> (field, message)
        self.throttle: set[int] = set()
        self._cv = threading.Condition()
        self._open = threading.Event()
        self._open.set()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        handler = grpc.stream_stream_rpc_method_handler(
            self._stream, request_deserializer=TransitionBatch.FromString,
            response_serializer=experience_pb2.Ack.SerializeToString,
        )
        self._server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("qstream.v1.ExperienceService", {"Stream": handler}),))
        port = self._server.add_insecure_port("127.0.0.1:0")
        self.address = f"127.0.0.1:{port}"
        self._server.start()

    def _stream(self, requests, context):
        for batch in requests:
            with self._cv:
                self.batches.append(batch)
                self._cv.notify_all()
            self._open.wait()
            if batch.sequence in self.reject:
                field, message = self.reject[batch.sequence]
                yield experience_pb2.Ack(sequence=batch.sequence, error=experience_pb2.Error(
                    code=experience_pb2.Error.INVALID_FIELD, field=field, message=message))
            else:
                yield experience_pb2.Ack(sequence=batch.sequence, accepted=batch.count,
                                         throttle=batch.sequence in self.throttle)

    def hold(self) -> None:
        self._open.clear()

    def release(self) -> None:
        self._open.set()

    def wait_batches(self, n: int, timeout: float = 10.0) -> list[TransitionBatch]:
        """The first n batches read, once they are there."""
        with self._cv:
            if not self._cv.wait_for(lambda: len(self.batches) >= n, timeout):
                raise TimeoutError(f"{len(self.batches)} of {n} batches arrived")
            return list(self.batches[:n])

    def stop(self) -> None:
        self._open.set()
        self._server.stop(grace=None)
