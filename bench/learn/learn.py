#!/usr/bin/env python3
"""Learning harness: real qstreamd + gymnasium actors through the Python SDK.

For every (env, variant, seed) it starts a `qstreamd` on free loopback ports
with the env's TrainerConfig (plus the variant's overrides and the seed), one
training actor process (a vector env acting epsilon-greedily, streaming
through qstream.Writer) and one evaluation process that does not feed the
replay. Every `eval_every` env steps the training actor hands the policy it
is acting with (version and weights) to the evaluation process, which plays
`eval_episodes` greedy episodes with it and writes one JSON line:

  {"env", "variant", "seed", "env_steps", "wall_s", "mean_return_20",
   "episodes", "policy_version", "acks", "throttled_acks", "eval_return",
   "eval_min", "eval_max"}

into OUT/runs/<env>__<variant>__s<seed>.jsonl. When all runs are over it
writes OUT/summary.json (each run checked against its env's targets) and, with
matplotlib installed, OUT/<env>.png (mean and min/max over seeds per variant;
bench/learn/plot.py redraws them).

  python3 bench/learn/learn.py --qstreamd build/qstreamd --out /tmp/learn
  python3 bench/learn/learn.py --envs CartPole-v1 --seeds 1,2,3 --jobs 3 \
      --variant base: --variant lr3e-4:optimizer.lr=0.0003 --steps 200000

A variant is NAME:key=value,key=value; keys are TrainerConfig fields by
dotted path (optimizer.lr, replay.alpha, network.v_max, ...) or actor knobs
(actor.eps_end, actor.eps_decay, actor.num_envs). `make learn` runs the
default set (three envs, seeds 1-3) into bench/learn/out.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import json
import math
import multiprocessing as mp
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "clients" / "python"))

import numpy as np  # noqa: E402


@dataclass
class EnvSpec:
    """One environment of the harness: its config, budget and targets."""

    env_id: str
    config: str  # TrainerConfig file, relative to the repo root
    steps: int  # env steps per run
    eval_every: int  # env steps between evaluation points
    eps_end: float = 0.01
    eps_decay: int = 10_000
    num_envs: int = 8
    # Targets (issue 14): reach `reach` (mean of the last 20 episodes) within
    # `reach_within` env steps; with `floor`, never fall below it afterwards;
    # with `final_eval`, the last greedy evaluation scores at least that.
    reach: float = 0.0
    reach_within: int = 0
    floor: float | None = None
    final_eval: float | None = None


ENVS = {
    "CartPole-v1": EnvSpec("CartPole-v1", "deploy/demo.pbtxt", steps=350_000, eval_every=10_000,
                           reach=475, reach_within=100_000, floor=400, final_eval=500),
    "Acrobot-v1": EnvSpec("Acrobot-v1", "bench/learn/acrobot.pbtxt", steps=150_000, eval_every=5_000,
                          reach=-80, reach_within=100_000),
    "MountainCar-v0": EnvSpec("MountainCar-v0", "bench/learn/mountaincar.pbtxt", steps=300_000,
                              eval_every=10_000, eps_decay=50_000, reach=-120, reach_within=300_000),
}


@dataclass
class Run:
    env: EnvSpec
    variant: str
    overrides: dict
    seed: int
    out: Path
    qstreamd: str
    backend: str
    eval_episodes: int

    @property
    def name(self) -> str:
        return f"{self.env.env_id}__{self.variant}__s{self.seed}"


# ---------------------------------------------------------------- config ----

def parse_variant(text: str) -> tuple[str, dict]:
    name, _, rest = text.partition(":")
    if not re.fullmatch(r"[A-Za-z0-9_.+-]+", name or ""):
        raise SystemExit(f"--variant {text!r}: NAME must be [A-Za-z0-9_.+-]+ (NAME:key=value,...)")
    overrides = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq:
            raise SystemExit(f"--variant {text!r}: {item!r} is not key=value")
        overrides[key.strip()] = value.strip()
    return name, overrides


def write_config(base: Path, overrides: dict, seed: int, dest: Path) -> None:
    """The env's TrainerConfig with the variant's overrides and the seed."""
    from google.protobuf import text_format

    from qstream.proto import config_pb2

    config = config_pb2.TrainerConfig()
    text_format.Parse(base.read_text(), config)
    for key, value in overrides.items():
        if key.startswith("actor."):
            continue
        *path, leaf = key.split(".")
        msg = config
        for part in path:
            msg = getattr(msg, part)
        fd = msg.DESCRIPTOR.fields_by_name.get(leaf)
        if fd is None:
            raise SystemExit(f"override {key}: {msg.DESCRIPTOR.full_name} has no field {leaf!r}")
        repeated = fd.is_repeated if hasattr(fd, "is_repeated") else fd.label == fd.LABEL_REPEATED
        if repeated:
            del getattr(msg, leaf)[:]
            getattr(msg, leaf).extend(int(v) if fd.cpp_type in (fd.CPPTYPE_INT32, fd.CPPTYPE_INT64) else float(v)
                                      for v in value.split("/"))
        elif fd.cpp_type in (fd.CPPTYPE_FLOAT, fd.CPPTYPE_DOUBLE):
            setattr(msg, leaf, float(value))
        elif fd.cpp_type == fd.CPPTYPE_BOOL:
            setattr(msg, leaf, value.lower() in ("1", "true", "yes"))
        elif fd.cpp_type == fd.CPPTYPE_ENUM:
            setattr(msg, leaf, fd.enum_type.values_by_name[value].number)
        else:
            setattr(msg, leaf, int(value))
    config.seed = seed
    dest.write_text(text_format.MessageToString(config))


def actor_knobs(env: EnvSpec, overrides: dict) -> dict:
    knobs = dict(eps_end=env.eps_end, eps_decay=env.eps_decay, num_envs=env.num_envs)
    for key, value in overrides.items():
        if key.startswith("actor."):
            name = key[len("actor."):]
            if name not in knobs:
                raise SystemExit(f"override {key}: actor knobs are {sorted(knobs)}")
            knobs[name] = type(knobs[name])(float(value)) if name != "eps_end" else float(value)
    return knobs


# ---------------------------------------------------------------- daemon ----

def start_daemon(run: Run, config: Path, log: Path) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [run.qstreamd, f"--config={config}", "--listen=127.0.0.1:0", "--metrics_listen=127.0.0.1:0",
         f"--backend={run.backend}"],
        stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True,
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        m = re.search(r"listening grpc=(\S+)", log.read_text(errors="replace"))
        if m:
            return proc, m.group(1)
        if proc.poll() is not None:
            raise RuntimeError(f"qstreamd exited with {proc.returncode}: {log.read_text()[-2000:]}")
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"qstreamd did not start within 120 s: {log}")


def stop(proc: subprocess.Popen | mp.Process, grace: float = 15) -> None:
    if isinstance(proc, subprocess.Popen):
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(grace)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        return
    if proc.is_alive():
        proc.terminate()
        proc.join(grace)
        if proc.is_alive():
            proc.kill()
            proc.join()


# ---------------------------------------------------------------- actors ----

def train_actor(run: Run, server: str, queue, knobs: dict) -> None:
    """Acts for run.env.steps env steps; at every evaluation point puts
    (point, policy) on `queue`; None at the end."""
    from qstream.actor import EpsilonSchedule, TransitionRecorder, _autoreset_mode, make_vector_env
    from qstream.policy import PolicyWatcher
    from qstream.writer import Writer

    env = run.env
    epsilon = EpsilonSchedule(1.0, knobs["eps_end"], knobs["eps_decay"])
    envs = make_vector_env(env.env_id, knobs["num_envs"])
    n = envs.num_envs
    rng = np.random.default_rng(run.seed)
    returns = collections.deque(maxlen=20)
    episodes = 0
    steps = 0
    start = time.monotonic()
    next_eval = env.eval_every
    with PolicyWatcher(server, timeout=60) as watcher, Writer(
        server, max_batch=256, max_delay=0.02, max_in_flight=8, env=env.env_id
    ) as writer:
        obs, _ = envs.reset(seed=run.seed)
        obs = np.asarray(obs, dtype=np.float32).reshape(n, -1)
        recorder = TransitionRecorder(n, _autoreset_mode(envs))
        while steps < env.steps:
            policy = watcher.policy
            actions = policy.act(obs, epsilon(steps), rng)
            env_actions = actions[:, 0] if policy.num_branches == 1 else actions
            next_obs, rewards, terminated, truncated, infos = envs.step(env_actions)
            t, finished = recorder.record(obs, actions, rewards, next_obs, terminated, truncated, infos)
            ids = t["env_ids"]
            if ids.size:
                writer.append(t["obs"], t["actions"], t["rewards"], t["done"], t["truncated"],
                              next_obs=t["next_obs"], env_ids=ids, policy_version=policy.version)
                steps += ids.size
            for e in finished:  # into the daemon's qstream_episode_return{env}
                writer.report_episode(e.episode_return, e.length, policy.version)
            returns.extend(e.episode_return for e in finished)
            episodes += len(finished)
            obs = np.asarray(next_obs, dtype=np.float32).reshape(n, -1)
            if steps >= next_eval:
                st = writer.stats
                point = dict(env_steps=steps, wall_s=round(time.monotonic() - start, 2),
                             mean_return_20=float(np.mean(returns)) if returns else None,
                             episodes=episodes, policy_version=policy.version, acks=st.acked_batches,
                             throttled_acks=st.throttled_acks)
                queue.put((point, policy))
                next_eval += env.eval_every
        writer.flush()
    envs.close()
    queue.put(None)


def greedy_returns(env_id: str, policy, episodes: int, seed: int) -> list[float]:
    """`episodes` greedy episodes, one per sub-env of a vector env."""
    import gymnasium as gym

    envs = gym.vector.SyncVectorEnv([lambda: gym.make(env_id) for _ in range(episodes)])
    obs, _ = envs.reset(seed=seed)
    rng = np.random.default_rng(seed)
    total = np.zeros(episodes)
    done = np.zeros(episodes, dtype=bool)
    while not done.all():
        actions = policy.act(np.asarray(obs, dtype=np.float32).reshape(episodes, -1), 0.0, rng)
        env_actions = actions[:, 0] if policy.num_branches == 1 else actions
        obs, rewards, terminated, truncated, _ = envs.step(env_actions)
        total[~done] += np.asarray(rewards)[~done]
        done |= np.asarray(terminated) | np.asarray(truncated)
    envs.close()
    return total.tolist()


def eval_actor(run: Run, queue, path: str) -> None:
    """Evaluates every policy the training actor hands over; one JSON line each."""
    base = dict(env=run.env.env_id, variant=run.variant, seed=run.seed)
    with open(path, "a") as out:
        k = 0
        while True:
            item = queue.get()
            if item is None:
                return
            point, policy = item
            scores = greedy_returns(run.env.env_id, policy, run.eval_episodes, seed=10_000 * run.seed + k)
            k += 1
            line = dict(base, **point, eval_return=float(np.mean(scores)), eval_min=float(np.min(scores)),
                        eval_max=float(np.max(scores)))
            out.write(json.dumps(line) + "\n")
            out.flush()


def run_one(run: Run) -> dict:
    """One (env, variant, seed): daemon, training actor, evaluation; returns
    its summary."""
    runs_dir = run.out / "runs"
    runs_dir.mkdir(parents=True, exist_ok=True)
    jsonl = runs_dir / f"{run.name}.jsonl"
    jsonl.unlink(missing_ok=True)
    log_dir = run.out / "logs"
    log_dir.mkdir(exist_ok=True)
    config = log_dir / f"{run.name}.pbtxt"
    write_config(ROOT / run.env.config, run.overrides, run.seed, config)
    knobs = actor_knobs(run.env, run.overrides)
    start = time.monotonic()
    daemon, server = start_daemon(run, config, log_dir / f"{run.name}.qstreamd.log")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    evaluator = ctx.Process(target=eval_actor, args=(run, queue, str(jsonl)), daemon=True)
    actor = ctx.Process(target=train_actor, args=(run, server, queue, knobs), daemon=True)
    error = None
    try:
        evaluator.start()
        actor.start()
        actor.join()
        if actor.exitcode != 0:
            error = f"training actor exited with {actor.exitcode}"
            queue.put(None)
        evaluator.join(600)
        if evaluator.exitcode != 0:
            error = error or f"evaluation exited with {evaluator.exitcode}"
    finally:
        stop(actor)
        stop(evaluator)
        stop(daemon)
    summary = summarize(run.env, load_points(jsonl))
    summary.update(env=run.env.env_id, variant=run.variant, seed=run.seed, overrides=run.overrides,
                   wall_s=round(time.monotonic() - start, 1))
    if error:
        summary["error"] = error
    return summary


# --------------------------------------------------------------- results ----

def load_points(path: Path) -> list[dict]:
    if not path.exists():
        return []
    points = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return sorted(points, key=lambda p: p["env_steps"])


def summarize(env: EnvSpec, points: list[dict]) -> dict:
    """Checks one run's points against the env's targets."""
    out = dict(points=len(points))
    if not points:
        out["met"] = False
        return out
    reached_at = next((p for p in points if p["mean_return_20"] is not None and p["mean_return_20"] >= env.reach),
                      None)
    out["reached_at_env_steps"] = reached_at["env_steps"] if reached_at else None
    out["reached_at_wall_s"] = reached_at["wall_s"] if reached_at else None
    met = reached_at is not None and reached_at["env_steps"] <= env.reach_within
    if reached_at is not None:
        after = [p["mean_return_20"] for p in points if p["env_steps"] >= reached_at["env_steps"]]
        out["min_mean_return_after_reach"] = min(after)
        if env.floor is not None:
            met = met and min(after) >= env.floor
    last = points[-1]
    out.update(final_env_steps=last["env_steps"], final_wall_s=last["wall_s"],
               final_mean_return_20=last["mean_return_20"], final_eval_return=last["eval_return"],
               best_eval_return=max(p["eval_return"] for p in points))
    if last.get("acks"):
        out["throttled_ack_fraction"] = round(last["throttled_acks"] / last["acks"], 4)
    if env.final_eval is not None:
        met = met and last["eval_return"] >= env.final_eval
    out["met"] = bool(met)
    return out


def target_text(env: EnvSpec) -> str:
    text = f"mean-20 >= {env.reach:g} within {env.reach_within} env steps"
    if env.floor is not None:
        text += f", never below {env.floor:g} afterwards"
    if env.final_eval is not None:
        text += f", final greedy eval >= {env.final_eval:g}"
    return text


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--qstreamd", default=str(ROOT / "build" / "qstreamd"))
    ap.add_argument("--backend", default="cpu", help="qstreamd --backend (cpu|cuda|auto)")
    ap.add_argument("--envs", default=",".join(ENVS), help=f"comma-separated, of {sorted(ENVS)}")
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--variant", action="append", default=[],
                    help="NAME:key=value,... (repeatable); default: base: (the env's config as is)")
    ap.add_argument("--steps", type=int, default=0, help="env steps per run (default: the env's budget)")
    ap.add_argument("--eval_every", type=int, default=0, help="env steps between evaluation points")
    ap.add_argument("--eval_episodes", type=int, default=10)
    ap.add_argument("--jobs", type=int, default=1, help="runs at once (each takes ~2 cores)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "learn" / "out"))
    args = ap.parse_args()

    if not os.access(args.qstreamd, os.X_OK):
        print(f"learn: {args.qstreamd} is not an executable qstreamd (build it: make build)", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    variants = [parse_variant(v) for v in (args.variant or ["base:"])]
    seeds = [int(s) for s in args.seeds.split(",") if s]
    runs = []
    for env_id in filter(None, args.envs.split(",")):
        if env_id not in ENVS:
            print(f"learn: unknown env {env_id!r}; known: {sorted(ENVS)}", file=sys.stderr)
            return 2
        env = ENVS[env_id]
        if args.steps:
            env = EnvSpec(**dict(asdict(env), steps=args.steps))
        if args.eval_every:
            env = EnvSpec(**dict(asdict(env), eval_every=args.eval_every))
        for name, overrides in variants:
            for seed in seeds:
                runs.append(Run(env, name, overrides, seed, out, args.qstreamd, args.backend, args.eval_episodes))
    print(f"learn: {len(runs)} runs, {args.jobs} at once, into {out}", flush=True)
    for env_id in dict.fromkeys(r.env.env_id for r in runs):
        env = next(r.env for r in runs if r.env.env_id == env_id)
        print(f"learn: {env_id}: {env.steps} env steps per run, eval every {env.eval_every}; "
              f"target: {target_text(env)}", flush=True)

    start = time.monotonic()
    summaries = []
    # Threads only wait on each run's processes (daemon, actor, evaluator).
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        by_name = {r.name: r for r in runs}
        results = {r.name: pool.submit(run_one, r) for r in runs}
        last_report = 0.0
        while results:
            for name in list(results):
                if results[name].done():
                    try:
                        s = results.pop(name).result()
                    except Exception as e:  # a run that broke is reported, the others go on
                        r = by_name[name]
                        s = dict(env=r.env.env_id, variant=r.variant, seed=r.seed, error=repr(e), met=False)
                    summaries.append(s)
                    print(f"learn: done {name}: " + json.dumps({k: s.get(k) for k in (
                        "met", "reached_at_env_steps", "min_mean_return_after_reach", "final_mean_return_20",
                        "final_eval_return", "throttled_ack_fraction", "wall_s", "error") if k in s}), flush=True)
            if time.monotonic() - last_report >= 30:
                last_report = time.monotonic()
                progress = []
                for r in runs:
                    pts = load_points(out / "runs" / f"{r.name}.jsonl")
                    if pts and r.name in results:
                        p = pts[-1]
                        progress.append(f"{r.name} {p['env_steps']} steps mean20={p['mean_return_20']} "
                                        f"eval={p['eval_return']:.1f}")
                if progress:
                    print(f"learn: {time.monotonic() - start:.0f}s: " + "; ".join(progress), flush=True)
            time.sleep(1)
    summary_path = out / "summary.json"
    summary_path.write_text(json.dumps(summaries, indent=1) + "\n")
    print(f"learn: all runs in {time.monotonic() - start:.0f} s; summary {summary_path}", flush=True)
    try:
        import plot

        for png in plot.plot_all(out):
            print(f"learn: wrote {png}", flush=True)
    except ImportError as e:
        print(f"learn: no plots ({e}); pip install -r bench/learn/requirements.txt", flush=True)
    by_env = collections.defaultdict(list)
    for s in summaries:
        by_env[(s.get("env"), s.get("variant"))].append(s)
    failed = False
    for (env_id, variant), ss in sorted(by_env.items(), key=str):
        met = sum(1 for s in ss if s.get("met"))
        failed |= met < len(ss)
        print(f"learn: {env_id} {variant}: targets met on {met} of {len(ss)} seeds", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main())
