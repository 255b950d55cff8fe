"""What Python reward functions cost, and what running them beside the reward model saves.

rlhf_train calls each reward function once per batch in a worker thread, started before the reward models
score the same batch on the calling thread (``rlhf_train/rewards/sources.py``: ``weighted_sum``); torch
releases the GIL in its kernels, so a slow function (a verifier, a sandbox, a remote call) overlaps with the
reward-model passes instead of adding to them. Measured here, one JSON line each:

* ``final_answer_match_ms_per_row``: the ready-made math-verify answer check, per completion;
* ``overlap``: a reward model pass (GPT-2 trunk, ``--layers`` x ``--width``, ``--batch`` rows of
  ``--tokens`` tokens) and a function that sleeps ``--sleep`` s (stands for I/O-bound work), scored
  one after the other (``sequential_s``: RM time + function time) and through ``weighted_sum``
  (``overlapped_s``); ``saved_s`` is the difference;
* ``rollout_scoring``: ``RolloutFromModel.create_rollout_td`` (reward sources, then the transform stack
  with the reference pass: a GPT-2 of the same shape) with the sleeping function as the only source, in
  order (``in_order_s``: the function's thread disabled) and with the reference pass running while the
  function scores (``function_beside_reference_s``);
* ``pool``: ``--batch`` rows scored by a CPU-bound function that burns ``--row_cpu_s`` of CPU per row
  (:func:`cpu_bound`), in the trainer's process (``rewards.<name>.workers=0``: ``in_process_s``) and in
  ``--workers`` worker processes (``pool_s``, the first call's worker start-up not included:
  ``first_pool_call_s`` has it), and whether both gave the same rewards. ``cpu_count``: the cores this
  process may use (the speed-up is at most that many; on a loaded machine less).

    python benchmarks/reward_functions.py
    python benchmarks/reward_functions.py --only pool --workers 4 --row_cpu_s 0.5
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import time

import torch


def sleeper(seconds: float):
    def fn(prompts, completions, **_):
        time.sleep(seconds)
        return [0.0] * len(completions)
    return fn


def cpu_bound(prompts, completions, row_cpu_s: float = 0.5, **_):
    """A CPU-bound reward (a verifier's stand-in): burns ``row_cpu_s`` seconds of this thread's CPU per row
    (not wall time: on a loaded machine each row still costs the same CPU), returns a value per row."""
    out = []
    for c in completions:
        t0, x = time.thread_time(), 0
        while time.thread_time() - t0 < row_cpu_s:  # (the clock is a system call: read it every 10k steps)
            for _ in range(10_000):
                x = (x * 31 + len(c)) % 1000003
        out.append(float(len(c)))
    return out


def pool(args) -> dict:
    """``--batch`` rows of :func:`cpu_bound`: in this process, then in ``--workers`` worker processes."""
    from rlhf_train.rewards.executor import start_method
    from rlhf_train.rewards.sources import FunctionRewardSource, Sequences

    class Tok:
        def batch_decode(self, rows, skip_special_tokens=False):
            return [" ".join(map(str, r)) for r in rows]

    ids = torch.randint(2, 1000, (args.batch, 16))
    seqs = Sequences(ids, torch.ones_like(ids, dtype=torch.bool), 8)
    fn = functools.partial(cpu_bound, row_cpu_s=args.row_cpu_s)
    inline = FunctionRewardSource(fn, Tok(), "cpu", workers=0, timeout_s=None)
    workers = FunctionRewardSource(fn, Tok(), "cpu", workers=args.workers, timeout_s=None)
    t0 = time.perf_counter()
    expected = inline(seqs)
    in_process = time.perf_counter() - t0
    t0 = time.perf_counter()
    got = workers(seqs)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    again = workers(seqs)
    pooled = time.perf_counter() - t0
    workers.close()
    return {"pool": {"rows": args.batch, "row_cpu_s": args.row_cpu_s, "workers": args.workers,
                     "start_method": start_method(), "cpu_count": len(os.sched_getaffinity(0)),
                     "in_process_s": round(in_process, 3), "first_pool_call_s": round(first, 3),
                     "pool_s": round(pooled, 3), "speedup": round(in_process / pooled, 2),
                     "same_rewards": bool(torch.equal(expected, got) and torch.equal(expected, again))}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--sleep", type=float, default=0.5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--row_cpu_s", type=float, default=0.5)
    ap.add_argument("--only", choices=["pool"], default=None, help="run only this measurement")
    args = ap.parse_args()
    if args.only == "pool":
        print(json.dumps(pool(args)))
        return

    from transformers import GPT2Config, GPT2Model

    from rlhf_train.models.reward_model import RewardModel
    from rlhf_train.rewards.functions import final_answer_match
    from rlhf_train.rewards.sources import (
        FunctionRewardSource,
        RewardModelSource,
        Sequences,
        weighted_sum,
    )

    completions = [f"so the answer is {i}/{i + 1}" if i % 2 else f"\\boxed{{{i * 3}}}" for i in range(64)]
    answers = [f"{i}/{i + 1}" if i % 3 else str(i * 3) for i in range(64)]
    final_answer_match([], completions[:2], answer=answers[:2])  # imports and sympy warm-up
    t0 = time.perf_counter()
    final_answer_match([], completions, answer=answers)
    print(json.dumps({"final_answer_match_ms_per_row": round(1000 * (time.perf_counter() - t0) / 64, 2),
                      "rows": 64}))

    torch.manual_seed(0)
    trunk = GPT2Model(GPT2Config(n_layer=args.layers, n_embd=args.width, n_head=4, vocab_size=1000,
                                 n_positions=max(args.tokens, 128), bos_token_id=0, eos_token_id=0))
    rm = RewardModel(trunk, args.width).eval()

    class Tok:  # the function source decodes tokens; a stand-in keeps this about timing
        def batch_decode(self, rows, skip_special_tokens=False):
            return [" ".join(map(str, r)) for r in rows]

    ids = torch.randint(2, 1000, (args.batch, args.tokens))
    seqs = Sequences(ids, torch.ones_like(ids, dtype=torch.bool), args.tokens // 2)
    rm_source, fn_source = RewardModelSource(rm, 0), FunctionRewardSource(sleeper(args.sleep), Tok(), "slow")
    sources = {"reward_model": (rm_source, 1.0), "slow": (fn_source, 1.0)}
    weighted_sum(sources, seqs)  # warm-up (thread pool, allocator)
    seq_t, ovl_t, rm_t = [], [], []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        rm_source(seqs)
        rm_t.append(time.perf_counter() - t0)
        fn_source(seqs)
        seq_t.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        weighted_sum(sources, seqs)
        ovl_t.append(time.perf_counter() - t0)
    print(json.dumps({"overlap": {
        "batch": args.batch, "tokens": args.tokens, "rm_layers": args.layers, "rm_width": args.width,
        "function_sleep_s": args.sleep, "threads": torch.get_num_threads(),
        "rm_s": round(min(rm_t), 3), "sequential_s": round(min(seq_t), 3), "overlapped_s": round(min(ovl_t), 3),
        "saved_s": round(min(seq_t) - min(ovl_t), 3)}}))
    # the rollout: with a function source, the reference pass runs while the function scores
    from rlhf_train.models.policy import build_policy
    from rlhf_train.rollout.rollout_from_model import RolloutFromModel

    class FullTok(Tok):
        eos_token_id, pad_token_id, bos_token_id = 0, 0, 0

        def __len__(self):
            return 1000

    cfg = {"n_layer": args.layers, "n_embd": args.width, "n_head": 4, "n_positions": max(args.tokens, 128)}
    policy, ref = build_policy(FullTok(), config=cfg), build_policy(FullTok(), config=cfg).lm
    T = args.tokens // 2
    times = {}
    for threaded in (False, True):
        fn = FunctionRewardSource(sleeper(args.sleep), Tok(), "slow")
        fn.overlap = threaded
        rollout = RolloutFromModel(policy, ref, None, tokenizer=FullTok(), max_new_tokens=T,
                                   reward_sources={"slow": (fn, 1.0)})
        lp = torch.zeros(args.batch, T)
        rollout.create_rollout_td(None, ids, lp, prompt_len=args.tokens - T, values=lp)  # warm-up
        best = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            rollout.create_rollout_td(None, ids, lp, prompt_len=args.tokens - T, values=lp)
            best.append(time.perf_counter() - t0)
        times[threaded] = min(best)
    print(json.dumps({"rollout_scoring": {
        "batch": args.batch, "tokens": args.tokens, "ref_layers": args.layers, "ref_width": args.width,
        "function_sleep_s": args.sleep, "in_order_s": round(times[False], 3),
        "function_beside_reference_s": round(times[True], 3), "saved_s": round(times[False] - times[True], 3)}}))
    print(json.dumps(pool(args)))


if __name__ == "__main__":
    main()
