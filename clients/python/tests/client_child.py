"""Child process of test_client.py's kill test: streams KIND_NSTEP batches
forever, printing the transitions it is about to send (SENT) and the ones
the daemon acknowledged (ACKED), each line flushed before going on."""

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from qstream import ActorClient, nstep_batch  # noqa: E402

BATCH = 100


def main() -> None:
    server, obs_dim = sys.argv[1], int(sys.argv[2])
    rng = np.random.default_rng(0)

    def on_ack(ack, stats):
        print(f"ACKED {stats.accepted_transitions}", flush=True)

    client = ActorClient(server, max_in_flight=8, on_ack=on_ack)
    sent = 0
    while True:
        obs = rng.normal(size=(BATCH, obs_dim))
        batch = nstep_batch(obs, rng.integers(0, 2, BATCH), np.ones(BATCH), np.full(BATCH, 0.97), obs)
        sent += BATCH
        print(f"SENT {sent}", flush=True)
        client.send(batch)


if __name__ == "__main__":
    main()
