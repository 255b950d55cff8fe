"""CPU attention: ``transformers``' ``sdpa`` against ``rlhf_train/models/attention.py`` (a decode step's two batched
matmuls; masked GQA on the kernel's own ``enable_gqa``), per call and over a whole generation.

Per decode call: one query per row and head (``[rows, heads, 1, d]``, strided as an attention layer's view) against
``[rows, kv_heads, L, d]`` cached keys and values and a ``[rows, 1, 1, L]`` mask, at cache lengths ``L`` of the
shape's prompt + response (``shapes.py``), each way through ``transformers``' attention registry; best of
``--rounds``. Per masked GQA call, forward + backward: ``rows / 2`` rows (a micro-batch) of the shape's
``new_tokens`` queries against prompt + response keys, a causal mask over the cached prompt. Then the decode loop (``sample_with_cache``) on a random-weight model of the shape, ``--prompts`` ×
``--num-samples`` rows and the shape's ``new_tokens``, with and without the grouped attention, alternating, medians
of ``--rounds``. One JSON line.

    python benchmarks/attention.py --shape smollm2
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from rlhf_train.infra.cpu_defaults import set_cpu_defaults  # noqa: E402

set_cpu_defaults()  # as `python -m rlhf_train` runs (before torch is imported)

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from shapes import SHAPES  # noqa: E402


def _sdpa_and_ours_ms(call, rounds: int, n: int) -> tuple[float, float]:
    """Best of ``rounds`` mean times (ms) of ``call(fn)``, ``n`` calls each, with ``fn`` the registry's ``"sdpa"``:
    ``transformers``' own, then under :func:`~rlhf_train.models.attention.cpu_attention`."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from rlhf_train.models.attention import cpu_attention

    def best() -> float:
        fn, out = ALL_ATTENTION_FUNCTIONS["sdpa"], float("inf")
        for _ in range(rounds):
            start = time.perf_counter()
            for _ in range(n):
                call(fn)
            out = min(out, (time.perf_counter() - start) / n * 1e3)
        return out

    sdpa = best()
    with cpu_attention():
        return sdpa, best()


def _layer(heads: int, kv_heads: int) -> torch.nn.Module:
    """What ``transformers``' attention functions read off an attention layer."""
    layer = torch.nn.Module()
    layer.num_key_value_groups, layer.is_causal = heads // kv_heads, True
    return layer


def per_call_ms(rows: int, heads: int, kv_heads: int, d: int, L: int, rounds: int) -> dict:
    layer = _layer(heads, kv_heads)
    q = torch.randn(rows, 1, heads, d).transpose(1, 2)
    k, v = torch.randn(rows, kv_heads, L, d), torch.randn(rows, kv_heads, L, d)
    mask = torch.ones(rows, 1, 1, L, dtype=torch.bool)
    mask[: rows // 2, ..., : L // 4] = False  # left padding in half the rows
    with torch.no_grad():
        sdpa, grouped = _sdpa_and_ours_ms(lambda fn: fn(layer, q, k, v, mask), rounds, n=200)
    return {"L": L, "sdpa_ms": round(sdpa, 4), "grouped_ms": round(grouped, 4), "speedup": round(sdpa / grouped, 2)}


def gqa_fwd_bwd_ms(rows: int, heads: int, kv_heads: int, d: int, Q: int, L: int, rounds: int) -> dict:
    layer = _layer(heads, kv_heads)
    q = torch.randn(rows, Q, heads, d).transpose(1, 2).requires_grad_()
    k, v = (torch.randn(rows, kv_heads, L, d, requires_grad=True) for _ in range(2))
    mask = torch.ones(rows, 1, Q, L, dtype=torch.bool).tril(diagonal=L - Q)
    mask[: rows // 2, ..., : (L - Q) // 4] = False  # left padding in half the rows
    grad = torch.randn(rows, Q, heads, d)
    sdpa, gqa = _sdpa_and_ours_ms(lambda fn: torch.autograd.grad(fn(layer, q, k, v, mask)[0], (q, k, v), grad),
                                  rounds, n=20)
    return {"rows": rows, "Q": Q, "L": L, "sdpa_ms": round(sdpa, 3), "enable_gqa_ms": round(gqa, 3),
            "speedup": round(sdpa / gqa, 2)}


def decode_loop_s(shape: dict, prompts: int, num_samples: int, rounds: int) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlhf_train.generation import decode_loop

    cfg = LlamaConfig(vocab_size=shape["vocab"], hidden_size=shape["width"], intermediate_size=shape["intermediate"],
                      num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
                      num_key_value_heads=shape["kv_heads"], tie_word_embeddings=True, attn_implementation="sdpa")
    torch.manual_seed(0)
    lm = LlamaForCausalLM(cfg).eval()
    P = shape["prompt_len"]
    prompt = torch.randint(2, shape["vocab"], (prompts, P))
    mask = torch.ones(prompts, P, dtype=torch.long)
    mask[: prompts // 2, : P // 2] = 0  # prompts of P/2 … P tokens, left-padded
    grouped = decode_loop.cpu_attention
    times = {"sdpa": [], "grouped": []}
    for r in range(rounds + 1):  # the first round warms up, untimed
        for name in times:
            decode_loop.cpu_attention = grouped if name == "grouped" else contextlib.nullcontext
            start = time.perf_counter()
            decode_loop.sample_with_cache(lm, prompt, mask, max_new_tokens=shape["new_tokens"], eos_token_id=-1,
                                          pad_token_id=0, num_samples=num_samples)
            if r:
                times[name].append(time.perf_counter() - start)
    decode_loop.cpu_attention = grouped
    return {f"decode_loop_{name}_s": round(statistics.median(t), 3) for name, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="smollm2", choices=[k for k, v in SHAPES.items() if v["arch"] == "llama"])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--num-samples", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    s = SHAPES[args.shape]
    rows, d, total = args.prompts * args.num_samples, s["width"] // s["heads"], s["prompt_len"] + s["new_tokens"]
    calls = [per_call_ms(rows, s["heads"], s["kv_heads"], d, L, args.rounds) for L in (s["prompt_len"], total)]
    gqa = gqa_fwd_bwd_ms(rows // 2, s["heads"], s["kv_heads"], d, s["new_tokens"], total, args.rounds)
    print(json.dumps({"shape": args.shape, "rows": rows, "threads": args.threads, "per_call": calls, "gqa_fwd_bwd": gqa,
                      **decode_loop_s(s, args.prompts, args.num_samples, args.rounds)}))


if __name__ == "__main__":
    main()
