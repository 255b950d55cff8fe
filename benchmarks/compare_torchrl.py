"""rlhf_train vs the torchrl ``examples/rlhf`` way: one PPO iteration each, same shapes, one process.

The torchrl side is ``benchmarks/torchrl_example.py`` (torchrl's own ``RolloutFromModel``,
``LMHeadActorValueOperator``, ``GAE``, ``ClipPPOLoss`` and replay buffers, as the example wires them);
the rlhf_train side is ``benchmarks/ppo_iteration.py`` (the trainer's own components and update).
Default shape = the example's: 4 prompts per collection step, 32 rollouts per iteration, 50 new tokens,
3 PPO epochs, minibatches of 16, a 2-layer width-128 GPT-2 with GPT-2's 50257-token vocabulary, on
2 CPU threads.

The machine may be shared, so rlhf_train's iteration (a few seconds) is timed ``--repeats`` times
before *and* as many times after the torchrl iteration (about a minute), and the median is compared:
a burst of load from elsewhere cannot decide the ratio. Prints three JSON lines: rlhf_train,
torchrl_example, and the ratios (torchrl / rlhf_train) of ``total_s``, ``rollout_s``, ``update_s``.
``peak_rss_mb`` is the process's peak: rlhf_train runs first, so its value is its own; the torchrl
line's is the peak of both (``benchmarks/scaling.py`` measures memory in fresh processes).

    python benchmarks/compare_torchrl.py
"""
from __future__ import annotations

import os

# the CPU defaults of `python -m rlhf_train` (why: rlhf_train/infra/cpu_defaults.py), set before torch is imported
from rlhf_train.infra.cpu_defaults import set_cpu_defaults  # noqa: E402

set_cpu_defaults()

import json
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ppo_iteration  # noqa: E402  (benchmarks/ is not a package)
from torchrl_example import run_torchrl_example_iteration  # noqa: E402


def main(argv=None):
    p = ppo_iteration.parser()
    p.description = __doc__.splitlines()[0]
    p.set_defaults(repeats=2)
    p.add_argument("--skip-torchrl", action="store_true", help="time rlhf_train only")
    a = p.parse_args(argv)
    shape = dict(layers=a.layers, width=a.width, heads=a.heads, vocab=a.vocab, prompt_len=a.prompt_len,
                 new_tokens=a.new_tokens, rollouts=a.rollouts, epochs=a.epochs, minibatch=a.minibatch,
                 threads=a.threads, seed=a.seed)
    load_before = os.getloadavg()[0]

    ours = ppo_iteration.RLHFTrainBenchmark(**shape, max_iterations=a.warmup + 2 * a.repeats)
    for _ in range(a.warmup):
        ours.run()
    runs = [ours.run() for _ in range(a.repeats)]
    own_peak_rss = max(r["peak_rss_mb"] for r in runs)  # before torchrl's iteration raises the process's peak
    theirs = None
    if not a.skip_torchrl:
        t = time.perf_counter()
        theirs = run_torchrl_example_iteration(**shape, batch=a.batch)
        theirs["wall_s_incl_setup"] = round(time.perf_counter() - t, 1)
    runs += [ours.run() for _ in range(a.repeats)]
    ours_line = {**ppo_iteration.median_run(runs), "peak_rss_mb": own_peak_rss}

    print(json.dumps(ours_line))
    if theirs is not None:
        print(json.dumps(theirs))
        ratio = {f"ratio_{k}": round(theirs[k] / max(ours_line[k], 1e-9), 1) for k in ("total_s", "rollout_s", "update_s")}
        print(json.dumps({**ratio, "threads": a.threads, "load_avg_1min": [load_before, os.getloadavg()[0]]}))


if __name__ == "__main__":
    main()
