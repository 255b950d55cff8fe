"""Packing (``update.packing=true``): the update's time and peak memory, padded vs packed, on a batch of
very unequal lengths, on the CPU.

The policy is a randomly initialised Llama (4 layers, width 256, 4 heads / 2 KV heads, MLP 688, vocabulary
8192, tied embeddings; 5.0 M parameters), float32, with a value head. The batch: 32 rollouts whose prompt +
response run from 4 to 200 tokens (prompts of 2 to 20 tokens left-padded to 20, responses right-padded to
180): 3,243 real tokens in 6,400 padded positions. The update is the trainer's own
``rlhf_train.algorithms.update.minibatch_update`` (PPO's loss, one epoch, one minibatch of all 32 rows,
AdamW): padded, one micro-batch ``[32, 200]`` (``accumulation`` 1) or four of ``[8, 200]``
(``update.gradient_accumulation_steps=4``: less memory, the same padded FLOPs); packed, micro-batches of at
most ``token_budget`` tokens (one mode per ``--budgets`` value), each one row without padding
(``rlhf_train/models/packed.py``).

Each mode runs in a fresh process (so its peak is its own). Measured: ``update_s``, the median of
``--reps`` updates after one warm-up; ``scoring_s``, the median no-grad log-prob pass over the same batch
(the reference's and the rollout's scoring pass: padded ``[32, 200]``, packed in ``token_budget`` chunks);
``micro_batches``; ``peak_rss_mb``, the process's peak resident memory, and ``update_peak_mb``, that peak
less the resident memory before the first update (the update's activations, gradients and AdamW state).
The fastest budget runs once more with ``update.gradient_checkpointing`` (the layers recompute their
activations in the backward pass). Prints one JSON line per mode and a summary line (``speedup`` = padded /
fastest packed ``update_s``); ``--out FILE`` also writes them as a JSON list.

    python benchmarks/packing.py --reps 3 --out packing.json     # ~4 min on 2 CPU cores at a load average of 5-9
"""
from __future__ import annotations

# the CPU defaults of `python -m rlhf_train` (why: rlhf_train/infra/cpu_defaults.py), set before torch is imported
from rlhf_train.infra.cpu_defaults import set_cpu_defaults  # noqa: E402

set_cpu_defaults()

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
LLAMA = dict(model_type="llama", vocab_size=8192, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True,
             eos_token_id=0, bos_token_id=0, pad_token_id=1)
B, P, T = 32, 20, 180


def lengths() -> list[tuple[int, int]]:
    """(prompt, response) tokens of the 32 rows: totals spread evenly over 4..200, prompts 2..20."""
    out = []
    for i in range(B):
        total = 4 + round(i * 196 / (B - 1))
        prompt = min(2 + (i * 7) % 19, total - 2, P)
        out.append((prompt, total - prompt))
    order = torch.randperm(B, generator=torch.Generator().manual_seed(0)).tolist()
    return [out[i] for i in order]


def rollout():
    from rlhf_train.core.containers import Masks, Rollout, Tokens

    g = torch.Generator().manual_seed(0)
    plen, rlen = (torch.tensor(x) for x in zip(*lengths()))
    prompt_mask = torch.arange(P)[None] >= (P - plen)[:, None]
    response_mask = torch.arange(T)[None] < rlen[:, None]
    full_mask = torch.cat([prompt_mask, response_mask], 1)
    full = torch.randint(2, LLAMA["vocab_size"], (B, P + T), generator=g).masked_fill(~full_mask, 1)
    noise = lambda: torch.randn(B, T, generator=g).masked_fill(~response_mask, 0.0)  # noqa: E731
    return Rollout(
        tokens=Tokens(prompt=full[:, :P], response=full[:, P:], full=full, batch_size=[B]),
        masks=Masks(prompt=prompt_mask, response=response_mask, full=full_mask, batch_size=[B]),
        sample_log_prob=(noise() * 0.1 - 9.0).masked_fill(~response_mask, 0.0), values=noise(),
        advantage=noise(), returns=noise(), reward=noise(), batch_size=[B])


def run_mode(budget: int | None, reps: int, accum: int = 1, checkpointing: bool = False) -> dict:
    """One mode in this process: ``budget`` None = padded, in ``accum`` micro-batches."""
    from accelerate import Accelerator

    from rlhf_train.algorithms.configs import AlgorithmConfig, UpdateConfig
    from rlhf_train.algorithms.micro_batches import micro_batches
    from rlhf_train.algorithms.registry import build_algorithm
    from rlhf_train.algorithms.update import minibatch_update
    from rlhf_train.core.sampling import SamplingParams
    from rlhf_train.infra.faults import Faults
    from rlhf_train.models.packed import packed_sequence_logprobs, token_budget_chunks
    from rlhf_train.models.policy import build_policy
    from rlhf_train.models.scoring import sequence_logprobs

    torch.manual_seed(0)
    policy = build_policy(config=dict(LLAMA), gradient_checkpointing=checkpointing).eval()
    ro = rollout()
    update = UpdateConfig(num_epochs=1, minibatch_size=B, gradient_accumulation_steps=accum, max_grad_norm=1.0,
                          packing=budget is not None, token_budget=budget or 4096)
    algorithm = build_algorithm(AlgorithmConfig(), update, 1, T)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-6)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=accum)
    full, mask = ro.tokens.full, ro.masks.full

    def score():
        if budget is None:
            return sequence_logprobs(policy.lm, full, mask, P)
        for rows in token_budget_chunks(mask, budget):
            packed_sequence_logprobs(policy.lm, full[rows], mask[rows], P)

    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    times, scoring = [], []
    for rep in range(reps + 1):  # the first: warm-up
        t0 = time.perf_counter()
        minibatch_update(policy, optimizer, scheduler, accelerator, ro, algorithm, SamplingParams(), update,
                         torch.Generator().manual_seed(rep), Faults(3))
        t1 = time.perf_counter()
        score()
        t2 = time.perf_counter()
        if rep:
            times.append(t1 - t0)
            scoring.append(t2 - t1)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    n_micro = len(micro_batches(mask, torch.arange(B), update, accelerator))
    return {"mode": "padded" if budget is None else "packed", "token_budget": budget, "accumulation": accum,
            "gradient_checkpointing": checkpointing, "micro_batches": n_micro,
            "real_tokens": int(mask.sum()), "padded_positions": B * (P + T),
            "update_s": round(statistics.median(times), 3), "scoring_s": round(statistics.median(scoring), 3),
            "peak_rss_mb": round(peak), "update_peak_mb": round(peak - rss_before),
            "params_m": round(sum(p.numel() for p in policy.parameters()) / 1e6, 2),
            "threads": torch.get_num_threads(), "reps": reps}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budgets", type=int, nargs="+", default=[256, 512, 1024])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--child", nargs=3, default=None, help=argparse.SUPPRESS)  # budget (0: padded), accum, ckpt
    a = ap.parse_args(argv)
    if a.child is not None:
        budget, accum, ckpt = (int(x) for x in a.child)
        print(json.dumps(run_mode(budget or None, a.reps, accum, bool(ckpt))))
        return

    def child(budget: int, accum: int = 1, ckpt: int = 0) -> dict:
        res = subprocess.run([sys.executable, __file__, "--reps", str(a.reps), "--child", str(budget), str(accum),
                              str(ckpt)], cwd=REPO, capture_output=True, text=True, check=True)
        lines.append(json.loads(res.stdout.strip().splitlines()[-1]))
        print(json.dumps(lines[-1]), flush=True)
        return lines[-1]

    lines: list[dict] = []
    padded, padded4 = child(0), child(0, 4)
    best = min((child(b) for b in a.budgets), key=lambda r: r["update_s"])
    ckpt = child(best["token_budget"], 1, 1)  # the fastest budget again, with update.gradient_checkpointing
    summary = {"summary": "packing", "padded_update_s": padded["update_s"], "best_token_budget": best["token_budget"],
               "packed_update_s": best["update_s"], "speedup": round(padded["update_s"] / best["update_s"], 2),
               "scoring_speedup": round(padded["scoring_s"] / best["scoring_s"], 2),
               "update_peak_mb_padded": padded["update_peak_mb"], "update_peak_mb_padded_accum4": padded4["update_peak_mb"],
               "update_peak_mb_packed": best["update_peak_mb"],
               "checkpointing_update_s": ckpt["update_s"], "checkpointing_update_peak_mb": ckpt["update_peak_mb"]}
    lines.append(summary)
    print(json.dumps(summary))
    if a.out:
        a.out.write_text(json.dumps(lines, indent=1) + "\n")


if __name__ == "__main__":
    main()
