"""qstream-actor-py: a gymnasium environment acting on a qstreamd policy."""

from __future__ import annotations

import argparse
import sys

from qstream.actor import EpsilonSchedule, run_actor
from qstream.channel import QstreamError


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="qstream-actor-py", description=__doc__)
    p.add_argument("--env", default="CartPole-v1", help="gymnasium environment id")
    p.add_argument("--server", default="127.0.0.1:50051",
                   help="qstreamd gRPC address host:port; several ranks: host1:port1,host2:port2 (the envs split "
                        "over them, the policy from the first) or a target URI such as dns:///name:port")
    p.add_argument("--num_envs", type=int, default=8)
    p.add_argument("--steps", type=int, default=0, help="stop after this many env steps; 0: no cap")
    p.add_argument("--epsilon_start", type=float, default=1.0)
    p.add_argument("--epsilon_end", type=float, default=0.01)
    p.add_argument("--epsilon_decay_steps", type=int, default=10_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stop_at_return", type=float, default=None, help="exit 0 once the mean return reaches this")
    p.add_argument("--return_window", type=int, default=20)
    p.add_argument("--batch_size", type=int, default=256, help="transitions per TransitionBatch")
    p.add_argument("--max_in_flight", type=int, default=32)
    p.add_argument("--report_every_s", type=float, default=5.0)
    p.add_argument("--tls_ca", help="PEM CA certificate the daemon's certificate is verified against; enables TLS")
    p.add_argument("--tls_cert", help="PEM client certificate, for a daemon that requires them (mTLS); with --tls_key")
    p.add_argument("--tls_key", help="PEM private key of --tls_cert")
    p.add_argument("--tls_server_name", help="name the daemon's certificate is checked against instead of the host")
    p.add_argument("--token_file", help="file holding the bearer token (role actor); never pass a token itself")
    p.add_argument("--max_receive_message_length", type=int, default=None,
                   help="largest policy message accepted, bytes (4 per network parameter); -1: no limit; "
                        "default 256 MiB")
    p.add_argument("--transport", choices=["auto", "native", "aio"], default="auto",
                   help="the stream's transport: native (gRPC C++, libqstream_native), aio (grpc.aio), or auto: "
                        "native where the library loads")
    a = p.parse_args(argv)
    if (a.tls_cert is None) != (a.tls_key is None):
        p.error("--tls_cert and --tls_key go together")
    try:
        result = run_actor(
            a.env,
            a.server,
            num_envs=a.num_envs,
            total_steps=a.steps or None,
            epsilon=EpsilonSchedule(a.epsilon_start, a.epsilon_end, a.epsilon_decay_steps),
            seed=a.seed,
            stop_at_return=a.stop_at_return,
            return_window=a.return_window,
            batch_size=a.batch_size,
            max_in_flight=a.max_in_flight,
            report_every_s=a.report_every_s,
            log=lambda line: print(line, flush=True),
            tls_ca=a.tls_ca,
            tls_cert=a.tls_cert,
            tls_key=a.tls_key,
            tls_server_name=a.tls_server_name,
            token_file=a.token_file,
            max_receive_message_length=a.max_receive_message_length,
            transport=a.transport,
        )
    except KeyboardInterrupt:
        return 0
    except (QstreamError, ValueError, ImportError) as e:
        print(f"qstream-actor-py: {e}", file=sys.stderr)
        return 1
    if a.stop_at_return is not None and not result.reached_target:
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
