"""rlhf_train's KV-cached decode loop against ``transformers``' ``generate`` (``generation=hf_generate``),
and the two samplers, in one process with the runs interleaved (so machine noise hits both alike).

Builds the policy of ``benchmarks/ppo_iteration.py``'s shapes (a random GPT-2 from the trainer's config,
``--algorithm``/``--num-samples`` as there), then times ``RolloutFromModel.backend.generate`` on the same
prompts ``--rounds`` times per variant, alternating, and one decode step's sampling over ``[rows, V]``
logits: ``InverseCDFSampler`` (softmax + a float64 cumulative sum, what runs inside ``generate``) against
``core.sampling.sample_vocab_major`` (two-level, in the logits' memory; both timings include a copy of the
logits, as ``generate`` makes one). Prints one JSON line of medians.

    python benchmarks/decode_loop.py --layers 2 --width 128 --prompt-len 64 --new-tokens 50
    python benchmarks/decode_loop.py --layers 4 --width 256 --prompt-len 48 --new-tokens 32 --num-samples 4
"""
from __future__ import annotations

import os

# the CPU defaults of `python -m rlhf_train` (why: rlhf_train/infra/cpu_defaults.py), set before torch is imported
from rlhf_train.infra.cpu_defaults import set_cpu_defaults  # noqa: E402

set_cpu_defaults()

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ppo_iteration  # noqa: E402  (benchmarks/ is not a package)
from flops import median_seconds  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag, default in (("--layers", 2), ("--width", 128), ("--heads", 4), ("--vocab", 50257), ("--prompt-len", 64),
                          ("--new-tokens", 50), ("--rollouts", 32), ("--num-samples", 1), ("--threads", 2),
                          ("--rounds", 6)):
        p.add_argument(flag, type=int, default=default)
    p.add_argument("--algorithm", default="ppo")
    a = p.parse_args(argv)
    from rlhf_train.core.sampling import sample_vocab_major
    from rlhf_train.data.prompts import collate
    from rlhf_train.generation.hf_generate import InverseCDFSampler

    bench = ppo_iteration.RLHFTrainBenchmark(
        layers=a.layers, width=a.width, heads=a.heads, vocab=a.vocab, prompt_len=a.prompt_len,
        new_tokens=a.new_tokens, rollouts=a.rollouts, threads=a.threads, algorithm=a.algorithm,
        num_samples=a.num_samples, max_iterations=1)
    prompts = collate([bench.run_.dataset[int(i)] for i in bench.order[:a.rollouts // a.num_samples]])
    loop = bench.run_.rollout.backend  # generation=decode_loop, the default; its fallback is generation=hf_generate
    backends = {"decode_loop": loop, "hf_generate": loop.fallback}
    ids, mask = prompts["input_ids"], prompts["attention_mask"].bool()
    times: dict[str, list[float]] = {"decode_loop": [], "hf_generate": []}
    for _ in range(a.rounds + 1):  # the first round warms up both
        for name in times:
            t = time.perf_counter()
            backends[name].generate(ids, mask, a.num_samples)
            times[name].append(time.perf_counter() - t)
    loop_s, hf_s = (statistics.median(times[k][1:]) for k in ("decode_loop", "hf_generate"))
    logits = torch.randn(a.rollouts, a.vocab) * 3
    logits_t, buffer = logits.T.contiguous(), torch.empty(a.vocab, a.rollouts)
    sampler = InverseCDFSampler()

    def old_step():
        sampler(None, logits.clone())
        sampler.log_probs.clear()

    print(json.dumps({
        "shape": {k: getattr(a, k) for k in ("layers", "width", "vocab", "prompt_len", "new_tokens", "rollouts",
                                             "num_samples", "threads")},
        "generate_s_decode_loop": round(loop_s, 3), "generate_s_hf_generate": round(hf_s, 3),
        "speedup": round(hf_s / loop_s, 2), "rounds": a.rounds,
        "sampler_ms_inverse_cdf_in_generate": round(median_seconds(old_step, 30) * 1e3, 2),
        "sampler_ms_vocab_major": round(median_seconds(lambda: sample_vocab_major(buffer.copy_(logits_t)), 30) * 1e3, 2),
    }))


if __name__ == "__main__":
    main()
