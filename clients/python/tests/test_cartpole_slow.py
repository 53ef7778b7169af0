"""gymnasium CartPole-v1 through the SDK learns to a mean return of 475 over
20 episodes on the CPU backend, with the demo's config."""

import os
from pathlib import Path

import pytest

from qstream import EpsilonSchedule, run_actor

DEMO_CONFIG = Path(__file__).resolve().parents[3] / "deploy" / "demo.pbtxt"
TARGET = 475.0
# Environment steps allowed before the run counts as failed to learn.
STEP_CAP = int(os.environ.get("QSTREAM_PY_CARTPOLE_STEP_CAP", "400000"))


@pytest.mark.slow
def test_gymnasium_cartpole_reaches_475(start_daemon, capsys):
    d = start_daemon(DEMO_CONFIG.read_text())
    lines = []

    def log(line):
        lines.append(line)
        with capsys.disabled():
            print(line, flush=True)

    result = run_actor(
        "CartPole-v1",
        d.grpc,
        num_envs=8,
        total_steps=STEP_CAP,
        epsilon=EpsilonSchedule(1.0, 0.01, 20_000),
        seed=3,
        stop_at_return=TARGET,
        report_every_s=10,
        log=log,
    )
    st = d.status()
    with capsys.disabled():
        print(
            f"\nCartPole-v1 via SDK: reached={result.reached_target} env_steps={result.env_steps} "
            f"episodes={result.episodes} mean_return_20={result.mean_return:.1f} wall_s={result.wall_seconds:.1f} "
            f"learner_steps={st.learner_steps} policy_version={result.policy_version}",
            flush=True,
        )
    assert result.reached_target, "\n".join(lines[-5:])
    assert result.mean_return >= TARGET
    assert st.learner_steps > 0
