"""``RolloutFromModel``: a drop-in for ``torchrl.data.llm.RolloutFromModel``, without its defects.

Same constructor, methods and output keys as torchrl's; what differs (see ``anchors.md``):

* EOS and pad ids come from the tokenizer / model config, never the constant 50256;
* tokens are stored once per sequence (``Tokens.full [B, P+T]`` + ``Masks.response [B, T]``), never
  once per timestep (``[B, T, L]``); per-token fields are ``[B, T]`` (torchrl's trailing ``1`` dropped);
* ``sample_log_prob`` is the log-prob under the distribution the token was sampled from (temperature,
  top-k, top-p applied: ``process_logits``, which the PPO loss applies too), so the first PPO ratio is 1
  (to float32 rounding when it is read off ``generate``'s steps, see ``logprobs_from_generate``);
* ``kl_coef`` is a property reading the KL controller, so the rollout and the controller never disagree;
* the controller is fed the mean **per-sequence** KL with ``n_steps`` = number of sequences (Ziegler §2.2);
* reward shaping is delegated to the transform stack (:mod:`rlhf_train.rewards.transforms`);
* the EOS token is an action like any other: it gets a log-prob, a KL term and the reward (N+).

Per iteration the cost is one KV-cached ``generate``, whose steps also give the policy's log-probs and
values (:class:`InverseCDFSampler` draws each token and records its log-prob; a forward hook on the
trunk keeps the hidden state the value head reads), plus one batched forward pass over prompt + response
for each of the reference and the reward model. With ``logprobs_from_generate=False`` (the trainer's
choice under mixed precision) the policy gets its own scoring pass as well.
"""
from __future__ import annotations

import contextlib

import torch
from transformers import LogitsProcessor

from rlhf_train.core.sampling import process_logits


class InverseCDFSampler(LogitsProcessor):
    """Draws each next token inside ``generate`` from ``process_logits(scores)`` (temperature, top-k,
    top-p: transformers' warpers) and marks it with score +inf, so ``generate``'s greedy step
    (``do_sample=False``) returns it.

    Why not ``generate(do_sample=True)``: its step is ``torch.multinomial(softmax(scores), 1)``, which on
    CPU draws one exponential variate per vocabulary entry (32 x 50257 per step): 38 ms of CPU per step
    on one core, more than the model's forward pass. Inverse-CDF sampling draws one uniform per row
    (cumulative sum, then a binary search): 5 ms. Same distribution (the cumulative sum is in float64, so
    no token's interval loses mass to rounding; filtered tokens have empty intervals), same seeding
    (torch's global generator). Measured on a 2-layer, width-128 GPT-2, 32 prompts x 50 new tokens, one
    thread: ``generate`` 2.78 s -> 1.15 s of CPU (greedy decoding alone: 0.88 s).
    """

    def __init__(self, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0):
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self.log_probs: list[torch.Tensor] = []  # per step: log π(sampled token) [B], nearly free here

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        # few, whole-row ops: on a shared CPU each multi-threaded op waits for every thread to be scheduled
        probs = torch.softmax(process_logits(scores, self.temperature, self.top_k, self.top_p), -1)  # [B, V]
        cdf_dtype = torch.float32 if scores.device.type == "mps" else torch.float64  # MPS has no float64
        cdf = probs.cumsum(-1, dtype=cdf_dtype)
        u = torch.rand(scores.shape[0], 1, dtype=cdf_dtype, device=scores.device) * cdf[:, -1:]
        tokens = torch.searchsorted(cdf, u, right=True).clamp_(max=scores.shape[-1] - 1)  # first cdf > u
        self.log_probs.append(probs.gather(-1, tokens).squeeze(-1).log())
        return scores.scatter_(-1, tokens, float("inf"))


@contextlib.contextmanager
def last_hidden_per_step(trunk: torch.nn.Module):
    """Collects, for every forward call of ``trunk`` (one per ``generate`` step), the last position's
    final hidden state ``[B, H]``: the state that predicts the token sampled at that step."""
    steps: list[torch.Tensor] = []

    def hook(module, args, output):
        hidden = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]
        steps.append(hidden[:, -1])

    handle = trunk.register_forward_hook(hook)
    try:
        yield steps
    finally:
        handle.remove()


def _stack_steps(steps: list[torch.Tensor], T: int) -> torch.Tensor:
    """Per-step ``[B, ...]`` tensors → ``[B, T, ...]`` (first T steps; zero-padded if generation stopped early)."""
    out = torch.stack(steps[:T], dim=1)
    if out.shape[1] < T:
        out = torch.cat([out, out.new_zeros(out.shape[0], T - out.shape[1], *out.shape[2:])], dim=1)
    return out
