"""How one rlhf_train PPO iteration scales with the response length: 1x, 2x, 4x new tokens.

Each point runs ``benchmarks/ppo_iteration.py`` in a fresh subprocess (so ``peak_rss_mb`` and
``rollout_peak_rss_mb`` are that run's own) with the other shapes fixed, and prints its JSON line;
a last line summarises:

* ``update_s_per_1k_tokens``: update time per 1000 response tokens: flat if the update is linear in
  the number of response tokens (``update_fraction_of_floor``: the same, normalised by the head-matmul
  speed measured in the same run, so that load from other processes cancels out);
* ``rollout_peak_rss_mb``: the process's peak memory when the rollout ended, with the models built:
  the rollout stores tokens once per sequence (``[B, P+T]``) and never the ``[B, T, V]`` logits, so it
  grows by little from 1x to 4x (the torchrl example stores ``[B, T, P+T]`` token prefixes);
* ``peak_rss_mb``: the whole iteration's peak, which includes the PPO update's ``[minibatch·T, V]``
  LM-head logits (bounded with ``update.gradient_accumulation_steps``).

    python benchmarks/scaling.py                       # 50, 100, 200 new tokens
    python benchmarks/scaling.py --new-tokens 50 200   # memory at 50 vs 200
"""
from __future__ import annotations

import os

# the CPU defaults of `python -m rlhf_train` (why: rlhf_train/infra/cpu_defaults.py), set before torch is imported
from rlhf_train.infra.cpu_defaults import set_cpu_defaults  # noqa: E402

set_cpu_defaults()

import argparse
import json
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--new-tokens", type=int, nargs="+", default=[50, 100, 200], help="response lengths T")
    p.add_argument("--repeats", type=int, default=2, help="timed iterations per point (median printed)")
    a, rest = p.parse_known_args(argv)  # anything else goes to ppo_iteration.py (--layers, --threads, ...)
    results = []
    for T in a.new_tokens:
        cmd = [sys.executable, os.path.join(HERE, "ppo_iteration.py"), "--new-tokens", str(T),
               "--repeats", str(a.repeats), *rest]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        r = json.loads(out.strip().splitlines()[-1])
        r["new_tokens"] = T
        print(json.dumps(r), flush=True)
        results.append(r)
    print(json.dumps({
        "new_tokens": [r["new_tokens"] for r in results],
        "gen_tokens": [r["gen_tokens"] for r in results],
        "update_s": [r["update_s"] for r in results],
        "update_s_per_1k_tokens": [round(1000 * r["update_s"] / r["gen_tokens"], 3) for r in results],
        "rollout_s_per_1k_tokens": [round(1000 * r["rollout_s"] / r["gen_tokens"], 3) for r in results],
        # the update's GFLOP/s over the head-matmul floor measured in the same run: flat if linear, and
        # less sensitive than seconds to load from other processes on a shared machine
        "update_fraction_of_floor": [round(r["update_gflop_per_s"] / r["head_matmul_gflop_per_s"], 2) for r in results],
        "rollout_peak_rss_mb": [r["rollout_peak_rss_mb"] for r in results],
        "peak_rss_mb": [r["peak_rss_mb"] for r in results],
    }))


if __name__ == "__main__":
    main()
