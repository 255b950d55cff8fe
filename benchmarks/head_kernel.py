"""The LM head + log-prob kernel, unfused against fused: forward + backward of one PPO minibatch, and the
no-gradient scoring of a rollout's tokens (the reference pass). Prints one JSON line per shape.

unfused: ``models.scoring.vocab_major_logits`` (``W @ hᵀ``: the whole ``[V, N]`` logits) then
``core.logprob_kernel.logprobs_and_entropy`` (its backward forms the logits' gradient, then autograd's two
matmuls); fused: ``core.logprob_kernel.head_logprobs_and_entropy`` (the head's matmuls inside the blocks,
the logits' gradient never formed when only the log-probs carry one). Without gradients both score blocks
of 512 tokens, as ``models.scoring.response_logprobs`` does. Same inputs, interleaved rounds, medians,
random weights, ``--threads`` threads, the CPU defaults of ``python -m rlhf_train``.

    python benchmarks/head_kernel.py                  # the GPT-2 shapes of benchmarks/compare_trl.py
    python benchmarks/head_kernel.py --shapes 800x128 --block-elements 1048576,2097152,4194304
"""
from __future__ import annotations

# the CPU defaults of `python -m rlhf_train` (why: rlhf_train/infra/cpu_defaults.py), set before torch is imported
from rlhf_train.infra.cpu_defaults import set_cpu_defaults  # noqa: E402

set_cpu_defaults()

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from rlhf_train.core import logprob_kernel  # noqa: E402
from rlhf_train.core.logprob_kernel import (  # noqa: E402
    head_logprobs_and_entropy,
    logprobs_and_entropy,
)
from rlhf_train.models.scoring import vocab_major_logits  # noqa: E402


def unfused(head, hidden, labels, with_entropy):
    return logprobs_and_entropy(vocab_major_logits(head, hidden), labels, 1.0, overwrite_logits=True,
                                with_entropy=with_entropy)


def fused(head, hidden, labels, with_entropy):
    return head_logprobs_and_entropy(hidden, head.weight, head.bias, labels, 1.0, with_entropy)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="800x128,512x256",
                   help="minibatch tokens x width (compare_trl's gpt2_1: 16 x 50 tokens, width 128; "
                        "gpt2_2: 16 x 32, width 256)")
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--block-elements", default=str(logprob_kernel._BLOCK_ELEMENTS),
                   help="comma-separated values of core.logprob_kernel._BLOCK_ELEMENTS for the fused kernel")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    default_blocks = logprob_kernel._BLOCK_ELEMENTS
    for shape in a.shapes.split(","):
        N, H = (int(x) for x in shape.split("x"))
        torch.manual_seed(0)
        head = torch.nn.Linear(H, a.vocab, bias=False)
        hidden = torch.randn(N, H, requires_grad=True)
        labels, grad_out = torch.randint(0, a.vocab, (N,)), torch.randn(N)
        hidden_r, labels_r = torch.randn(2 * N, H), torch.randint(0, a.vocab, (2 * N,))  # a rollout: 2 minibatches

        def train(fn, with_entropy):
            head.weight.grad = hidden.grad = None
            fn(head, hidden, labels, with_entropy)[0].backward(grad_out)

        @torch.no_grad()
        def score(fn):
            return [fn(head, hidden_r[i:i + 512], labels_r[i:i + 512], False) for i in range(0, 2 * N, 512)]

        cases = {"unfused_train": (default_blocks, lambda: train(unfused, False)),
                 "unfused_train_entropy": (default_blocks, lambda: train(unfused, True)),
                 "unfused_no_grad": (default_blocks, lambda: score(unfused))}
        for be in (int(x) for x in a.block_elements.split(",")):
            sfx = "" if be == default_blocks else f"_b{be}"
            cases["fused_train" + sfx] = (be, lambda: train(fused, False))
            cases["fused_train_entropy" + sfx] = (be, lambda: train(fused, True))
            cases["fused_no_grad" + sfx] = (be, lambda: score(fused))
        times = {k: [] for k in cases}
        for r in range(a.rounds + 1):  # round 0 warms up
            for k, (be, fn) in cases.items():
                logprob_kernel._BLOCK_ELEMENTS = be
                t0 = time.perf_counter()
                fn()
                if r:
                    times[k].append(time.perf_counter() - t0)
        logprob_kernel._BLOCK_ELEMENTS = default_blocks
        med = {k: round(sorted(v)[len(v) // 2] * 1e3, 1) for k, v in times.items()}
        print(json.dumps({"tokens": N, "width": H, "vocab": a.vocab, "no_grad_tokens": 2 * N, "threads": a.threads,
                          "rounds": a.rounds, "median_ms": med}), flush=True)


if __name__ == "__main__":
    main()
