"""rlhf_train against TRL, side by side: one RL iteration each, same shapes, same process settings.

TRL runs in its own virtualenvs, created on first use under ``~/.cache/rlhf_train/bench_venvs/``
(``--venv-root``) with this machine's torch version pinned, so the project's own dependencies are
untouched: ``trl==1.12.0`` (the last release with ``trl.experimental.ppo.PPOTrainer``) for PPO and
``trl==1.16.0`` for ``GRPOTrainer``. TRL's side is ``benchmarks/trl_side.py``; rlhf_train's is
``benchmarks/ppo_iteration.py`` (the trainer's own components and update; ``--algorithm grpo`` for GRPO).

Every measurement is a fresh process (so ``peak_rss_mb`` is that process's own peak) that builds its
models, runs ``--warmup`` untimed iterations and times ``--repeats`` more. The processes of one round
run back to back, rlhf_train then TRL (then TRL with rlhf_train's CPU settings, ``THP_MEM_ALLOC_ENABLE=1``
and glibc's ``MALLOC_*`` thresholds), for ``--rounds`` rounds: load from elsewhere hits both sides alike.
TRL runs under its defaults otherwise (those variables removed from its environment), but for its precision:
both sides run float32 (TRL's configs default to ``bf16=True``, which autocasts the update to bfloat16 on a CPU
with bfloat16 instructions; ``--trl-bf16`` keeps that default, ``benchmarks/trl_side.py`` has the measurement).
Both sides: one process, ``--threads`` torch threads, random weights.

Shapes (``--shapes``, comma-separated; ``benchmarks/shapes.py``):
  gpt2_1   2 layers, width 128, GPT-2's 50,257-token vocabulary, prompts ≤ 64, 50 new tokens
  gpt2_2   4 layers, width 256, prompts ≤ 48, 32 new tokens
  smollm2  SmolLM2-135M's shape (Llama, 30 layers, width 576, 9 heads / 3 KV heads, MLP 1536, vocab 49,152),
           prompts ≤ 64, 48 new tokens
PPO: 32 rollouts per iteration, 3 epochs, minibatches of 16. GRPO: 8 prompts × 4 samples, 1 epoch, KL to a
reference (beta 0.04), a reward model. Both sides run the same passes: rlhf_train's side scores no reference
responses (``ppo_iteration.py --no-reference-responses``: TRL's trainers have no reward baseline).

Prints one JSON line per (shape, algorithm): both sides' median iteration time over all rounds, their
peak RSS, and ``speedup`` = TRL / rlhf_train (``speedup_trl_cpu_settings`` likewise).

    python benchmarks/compare_trl.py --shapes gpt2_1,gpt2_2 --algos ppo --rounds 3
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from rlhf_train.infra.cpu_defaults import CPU_DEFAULTS

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from shapes import ALGORITHMS, ROLLOUTS, SHAPES  # noqa: E402  (benchmarks/ is not a package)

TRL_FOR = {"ppo": "1.12.0", "grpo": "1.16.0"}
CPU_SETTINGS = CPU_DEFAULTS  # rlhf_train's (rlhf_train/infra/cpu_defaults.py)


def ensure_venv(root: Path, version: str) -> Path:
    """The python of a virtualenv holding ``trl==version`` and this machine's torch; created if missing."""
    import torch

    venv = root / f"trl-{version}"
    python = venv / "bin" / "python"
    if not python.exists():
        print(f"[compare_trl] creating {venv} (trl=={version}, torch=={torch.__version__.split('+')[0]})",
              file=sys.stderr)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", f"torch=={torch.__version__.split('+')[0]}",
                        f"trl=={version}"], check=True)
    return python


def last_json(stdout: str) -> dict:
    for line in reversed(stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError(f"no JSON line in the output:\n{stdout[-2000:]}")


def run(cmd: list[str], env: dict) -> dict:
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if p.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stderr[-3000:]}")
    return last_json(p.stdout)


def shape_args(shape: dict, algo: str, a, ours: bool) -> list[str]:
    """The command-line flags of one side (``ppo_iteration.py`` for ours, ``trl_side.py`` for TRL's)."""
    args = []
    for k, v in shape.items():
        args += [f"--{k.replace('_', '-')}", str(v)]
    args += ["--rollouts", str(ROLLOUTS), "--threads", str(a.threads), "--warmup", str(a.warmup),
             "--repeats", str(a.repeats)]
    s = ALGORITHMS[algo]
    args += ["--epochs", str(s["epochs"]), "--minibatch", str(s["minibatch"])]
    if ours:
        args += ["--no-reference-responses"]  # TRL's trainers score no reference responses
    if algo == "ppo":
        return args
    # GRPO: 8 prompts x 4 samples, 1 epoch (one optimizer step over the 32), KL to a reference (beta 0.04)
    args += ["--num-samples", str(s["num_samples"])]
    return args + (["--algorithm", algo, "--grpo-beta", str(s["beta"])] if ours else ["--beta", str(s["beta"])])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="gpt2_1,gpt2_2,smollm2")
    p.add_argument("--algos", default="ppo,grpo")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--trl-bf16", action="store_true", help="TRL's default precision: bfloat16 autocast")
    p.add_argument("--no-trl-cpu-settings", action="store_true",
                   help="skip the third run of each round (TRL with rlhf_train's CPU settings)")
    p.add_argument("--venv-root", default=os.environ.get("RLHF_TRAIN_BENCH_VENVS",
                                                          str(Path.home() / ".cache/rlhf_train/bench_venvs")))
    a = p.parse_args(argv)
    shapes, algos = a.shapes.split(","), a.algos.split(",")
    pythons = {algo: ensure_venv(Path(a.venv_root), TRL_FOR[algo]) for algo in algos}
    base_env = {k: v for k, v in os.environ.items() if k not in CPU_SETTINGS}
    results: dict = {}
    for r in range(a.rounds):
        for shape in shapes:
            for algo in algos:
                res = results.setdefault((shape, algo), {"ours": [], "trl": [], "trl_cpu": []})
                ours_cmd = [sys.executable, str(HERE / "ppo_iteration.py"), *shape_args(SHAPES[shape], algo, a, True)]
                res["ours"].append(run(ours_cmd, {**base_env, **CPU_SETTINGS}))
                trl_cmd = [str(pythons[algo]), str(HERE / "trl_side.py"), "--algo", algo,
                           *shape_args(SHAPES[shape], algo, a, False), *(["--bf16"] if a.trl_bf16 else [])]
                res["trl"].append(run(trl_cmd, base_env))
                if not a.no_trl_cpu_settings:
                    res["trl_cpu"].append(run(trl_cmd, {**base_env, **CPU_SETTINGS}))
                print(f"[compare_trl] round {r + 1}/{a.rounds} {shape} {algo}: ours {res['ours'][-1]['total_s']} s, "
                      f"trl {res['trl'][-1]['total_s']} s", file=sys.stderr)
    for (shape, algo), res in results.items():
        med = {k: statistics.median([t for x in v for t in x.get("total_s_all", [x["total_s"]])])
               for k, v in res.items() if v}
        line = {"shape": shape, "algorithm": algo, **SHAPES[shape],
                "rlhf_train_s": round(med["ours"], 3), "trl_s": round(med["trl"], 3),
                "speedup": round(med["trl"] / med["ours"], 2),
                "rlhf_train_peak_rss_mb": max(x["peak_rss_mb"] for x in res["ours"]),
                "trl_peak_rss_mb": max(x["peak_rss_mb"] for x in res["trl"]),
                "trl_version": res["trl"][0]["trl_version"], "trl_precision": "bf16" if a.trl_bf16 else "fp32",
                "rounds": a.rounds, "threads": a.threads}
        if "trl_cpu" in med:
            line.update(trl_cpu_settings_s=round(med["trl_cpu"], 3),
                        speedup_trl_cpu_settings=round(med["trl_cpu"] / med["ours"], 2))
        for key in ("rollout_s", "update_s", "rollout_floor_ratio", "update_floor_ratio", "iteration_floor_ratio"):
            vals = [x[key] for x in res["ours"] if key in x]
            if vals:
                line[f"rlhf_train_{key}"] = round(statistics.median(vals), 3)
        print(json.dumps(line))


if __name__ == "__main__":
    main()
