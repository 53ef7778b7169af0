"""Child process of test_client.py's kill test: streams KIND_NSTEP batches
forever, printing the transitions it is about to send (SENT) and the ones
the daemon acknowledged (ACKED), each line flushed before going on."""

import sys
import threading
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from qstream import ActorClient, nstep_batch  # noqa: E402

BATCH = 100


def main() -> None:
    server, obs_dim = sys.argv[1], int(sys.argv[2])
    rng = np.random.default_rng(0)
    out = threading.Lock()  # the ack thread and this one write whole lines

    def emit(line: str) -> None:
        with out:
            sys.stdout.write(line + "\n")
            sys.stdout.flush()

    def on_ack(ack, stats):
        emit(f"ACKED {stats.accepted_transitions}")

    client = ActorClient(server, max_in_flight=8, on_ack=on_ack)
    sent = 0
    while True:
        obs = rng.normal(size=(BATCH, obs_dim))
        batch = nstep_batch(obs, rng.integers(0, 2, BATCH), np.ones(BATCH), np.full(BATCH, 0.97), obs)
        sent += BATCH
        emit(f"SENT {sent}")
        client.send(batch)


if __name__ == "__main__":
    main()
