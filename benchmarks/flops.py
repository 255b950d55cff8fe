"""Matmul FLOP accounting of one RL iteration, and the GEMM rate that makes it a time floor.

An iteration's floor is its matmul FLOPs divided by the rate this machine does one large GEMM at (measured
in the same process, same threads: :func:`gemm_gflop_per_s`). FLOPs count 2 per multiply-add:

* a forward pass of a transformer over ``L`` tokens: ``2 · P_mm · L`` for the weight matmuls (``P_mm``: the
  trunk's Linear / Conv1D weights) + ``4 · n_layer · L² · d`` for attention (``QKᵀ`` and ``AV``, full
  square: what the SDPA kernels compute) + ``2 · d · V`` per position that goes through the LM head;
* generation: the prompt's prefill, then one position per new token (its KV-cached attention over the
  ``t`` tokens before it: ``4 · n_layer · t · d``), the LM head at each new token;
* backward = 2 × forward, so a training pass is 3 × its forward.

What each benchmark's iteration runs is counted by :func:`rollout_flops` / :func:`update_flops`.
"""
from __future__ import annotations

import time

import torch
from torch import nn


def matmul_params(model: nn.Module, exclude: tuple[nn.Module, ...] = ()) -> int:
    """Weights of ``model``'s Linear / Conv1D layers (the matmuls), without the modules in ``exclude``."""
    from transformers.pytorch_utils import Conv1D

    skip = {id(m) for m in exclude}
    return sum(m.weight.numel() for m in model.modules()
               if isinstance(m, (nn.Linear, Conv1D)) and id(m) not in skip)


def shape_of(lm: nn.Module) -> dict:
    """``n_layer``, ``d`` (width), ``V`` (vocabulary) and ``P_mm`` (trunk matmul weights) of a causal LM or
    a sequence classifier (its score head counted as a matmul of width × labels)."""
    lm = getattr(lm, "model", lm) if not hasattr(lm, "config") else lm  # an HF reward model's wrapper
    c = getattr(lm, "config", None) or lm.trunk.config  # rlhf_train's RewardModel: a trunk + a scalar head
    n_layer = getattr(c, "n_layer", None) or c.num_hidden_layers
    d = getattr(c, "n_embd", None) or c.hidden_size
    head = lm.get_output_embeddings() if hasattr(lm, "get_output_embeddings") else None
    return {"n_layer": n_layer, "d": d, "V": c.vocab_size,
            "P_mm": matmul_params(lm, (head,) if head is not None else ())}


def forward_flops(s: dict, L: int, head_positions: int) -> float:
    """One forward pass over ``L`` tokens of one sequence, the LM head at ``head_positions`` of them."""
    return 2 * s["P_mm"] * L + 4 * s["n_layer"] * L * L * s["d"] + 2 * s["d"] * s["V"] * head_positions


def shared_forward_flops(s: dict, P: int, T: int, head_positions: int, share: int) -> float:
    """One sequence's part of a forward pass whose ``P``-token prompt ``share`` sequences share
    (``trainer.shared_prompt``: the prompt once per group, ``1 / share`` of it here), then its ``T`` response
    tokens against the prompt's cache (their attention over ``P + T`` keys); ``share = 1``: :func:`forward_flops`."""
    if share <= 1:
        return forward_flops(s, P + T, head_positions)
    prompt = 2 * s["P_mm"] * P + 4 * s["n_layer"] * P * P * s["d"]
    response = 2 * s["P_mm"] * T + 4 * s["n_layer"] * T * (P + T) * s["d"]
    return prompt / share + response + 2 * s["d"] * s["V"] * head_positions


def generate_flops(s: dict, P: int, T: int, prefill_share: float = 1.0) -> float:
    """KV-cached generation of ``T`` tokens after a ``P``-token prompt, one sequence (``prefill_share``: the
    fraction of the prompt's prefill this sequence pays, ``1 / num_samples`` when samples share it)."""
    prefill = 2 * s["P_mm"] * P + 4 * s["n_layer"] * P * P * s["d"]
    steps = 2 * s["P_mm"] * T + 4 * s["n_layer"] * s["d"] * (T * P + T * (T - 1) / 2)
    return prefill_share * prefill + steps + 2 * s["d"] * s["V"] * T


def rollout_flops(policy_lm, ref_lm, reward_model, td, policy_pass: bool, num_samples: int = 1,
                  shared_prompt: int = 1) -> float:
    """The rollout of batch ``td``: generate (one prefill per prompt, shared by its ``num_samples`` samples);
    the policy's scoring pass (``policy_pass``: when log-probs do not come from the generation's own steps);
    one reference pass; the reward model over prompt + response (and over the batch's reference responses,
    the reward baseline, when it has them). ``shared_prompt``: how many rows share each prompt in the
    scoring passes (``trainer.shared_prompt``; 1: every row whole)."""
    B, L = td["tokens", "full"].shape
    T = td["masks", "response"].shape[1]
    pol = shape_of(policy_lm)
    total = B * generate_flops(pol, L - T, T, prefill_share=1.0 / num_samples)
    if policy_pass:
        total += B * shared_forward_flops(pol, L - T, T, T, shared_prompt)
    if ref_lm is not None:
        total += B * shared_forward_flops(shape_of(ref_lm), L - T, T, T, shared_prompt)
    if reward_model is not None:
        rm = shape_of(reward_model)
        rm["V"] = 1  # a scalar head
        total += B * shared_forward_flops(rm, L - T, T, 1, shared_prompt)
        if ("next", "score_ref") in td.keys(True):
            total += B * forward_flops(rm, L, 1)  # the reference responses, about as long
    return float(total)


def update_flops(policy_lm, td, rows: int, shared_prompt: int = 1) -> float:
    """``rows`` sequences of ``td``'s width through forward + backward (3 × a forward, the LM head at the
    response positions only, as the update computes it; ``shared_prompt`` rows sharing each prompt)."""
    L = td["tokens", "full"].shape[1]
    T = td["masks", "response"].shape[1]
    return float(rows * 3 * shared_forward_flops(shape_of(policy_lm), L - T, T, T, shared_prompt))


def gemm_gflop_per_s(width: int, vocab: int, tokens: int, repeats: int = 5) -> float:
    """GFLOP/s of the LM head's three matmuls (forward ``W·hᵀ`` and the two of its backward) for
    ``tokens`` tokens: the largest GEMMs of the iteration, so the best rate it can hope for. Median of
    ``repeats``, this process's threads."""
    h, w = torch.randn(tokens, width), torch.randn(vocab, width)
    g_t = torch.randn(vocab, tokens)
    out = torch.empty(vocab, tokens)

    def three():
        torch.mm(w, h.T, out=out)
        g_t.T @ w
        g_t @ h

    return 3 * 2 * tokens * width * vocab / 1e9 / median_seconds(three, repeats)


def median_seconds(fn, repeats: int) -> float:
    """Median wall time of ``repeats`` calls of ``fn`` (after one untimed call)."""
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return sorted(times)[repeats // 2]
