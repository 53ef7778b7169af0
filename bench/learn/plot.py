#!/usr/bin/env python3
"""Learning curves from the harness's JSON lines (bench/learn/learn.py).

  python3 bench/learn/plot.py OUT          # OUT/runs/*.jsonl -> OUT/<env>.png

One PNG per env: the mean return of the last 20 training episodes (left) and
the greedy evaluation return (right) against env steps; per variant the mean
over seeds as a line and min/max over seeds as a band; the env's targets as
dashed lines.
"""

from __future__ import annotations

import collections
import json
import sys
from pathlib import Path


def load(out: Path) -> dict:
    """{env: {variant: {seed: [points sorted by env steps]}}}"""
    data = collections.defaultdict(lambda: collections.defaultdict(dict))
    for path in sorted((out / "runs").glob("*.jsonl")):
        points = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        if points:
            p = points[0]
            data[p["env"]][p["variant"]][p["seed"]] = sorted(points, key=lambda q: q["env_steps"])
    return data


def band(seeds: dict, key: str):
    """x (evaluation points common to the seeds, by index), mean, min, max."""
    import numpy as np

    n = min(len(v) for v in seeds.values())
    xs = np.array([np.mean([v[i]["env_steps"] for v in seeds.values()]) for i in range(n)])
    ys = np.array([[np.nan if v[i][key] is None else v[i][key] for i in range(n)] for v in seeds.values()])
    return xs, np.nanmean(ys, axis=0), np.nanmin(ys, axis=0), np.nanmax(ys, axis=0)


def plot_all(out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from learn import ENVS

    written = []
    for env_id, variants in sorted(load(Path(out)).items()):
        fig, axes = plt.subplots(1, 2, figsize=(13, 4.8), sharey=True)
        for (variant, seeds), color in zip(sorted(variants.items()), plt.cm.tab10.colors):
            for ax, key in zip(axes, ("mean_return_20", "eval_return")):
                x, mean, lo, hi = band(seeds, key)
                ax.plot(x, mean, color=color, label=f"{variant} ({len(seeds)} seeds)")
                ax.fill_between(x, lo, hi, color=color, alpha=0.2)
        spec = ENVS.get(env_id)
        for ax, title in zip(axes, ("training: mean return of the last 20 episodes",
                                    "greedy evaluation (10 episodes, no replay)")):
            if spec is not None:
                ax.axhline(spec.reach, color="k", ls="--", lw=0.8)
                ax.axvline(spec.reach_within, color="k", ls=":", lw=0.8)
                if spec.floor is not None:
                    ax.axhline(spec.floor, color="r", ls="--", lw=0.8)
            ax.set_title(title, fontsize=10)
            ax.set_xlabel("env steps")
            ax.grid(alpha=0.3)
        axes[0].set_ylabel("return")
        axes[0].legend(fontsize=8, loc="lower right")
        fig.suptitle(f"{env_id}: mean over seeds, band = min/max", fontsize=11)
        fig.tight_layout()
        path = Path(out) / f"{env_id}.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        written.append(path)
    return written


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    for p in plot_all(Path(sys.argv[1])):
        print(p)
