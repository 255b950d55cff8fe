"""Held-out metrics of verifiable rewards: accuracy, pass@k and mean@k from reward scores.

Shapes: ``N`` = scored rows, ``P`` = prompts, ``n`` = samples per prompt (a prompt's samples in one row of a
``[P, n]`` tensor: ``scores.view(P, n)`` of the rollout's order, where the samples of a prompt are adjacent).
A score of NaN is a row its reward source did not score (a reward function returned ``None``): it is never
correct, and :func:`nan_mean` / :func:`mean_at_k` leave it out.

References:
  pass@k: Chen et al. 2021, "Evaluating Large Language Models Trained on Code", eq. 1 (the unbiased
  estimator 1 − C(n−c, k) / C(n, k) from n ≥ k samples of which c are correct) and its numerically stable
  product form (their Figure 3).
  mean@k: the per-prompt mean over k samples, averaged over prompts: DeepSeek-AI 2025, "DeepSeek-R1:
  Incentivizing Reasoning Capability in LLMs via Reinforcement Learning", §3.1 (pass@1 = (1/k) Σ_i p_i, here of
  the source's score p_i), as verl's validation metric ``mean@N``.
"""
from __future__ import annotations

import torch
from torch import Tensor


def is_correct(scores: Tensor, threshold: float = 1.0) -> Tensor:
    """Whether each row counts as solved: ``score >= threshold`` (NaN: not scored, never correct). [...] → bool [...]."""
    return scores >= threshold  # (NaN compares False)


def accuracy(scores: Tensor, threshold: float = 1.0) -> Tensor:
    """The share of rows scored at least ``threshold``, over all rows (unscored NaN rows count as wrong).
    ``scores [N]`` → scalar (NaN for ``N = 0``)."""
    return is_correct(scores, threshold).double().mean()


def nan_mean(scores: Tensor) -> Tensor:
    """The mean score over the rows that were scored (NaN rows left out; NaN when none was). ``[N]`` → scalar."""
    return scores.double().nanmean()


def pass_at_k(correct: Tensor, k: int) -> Tensor:
    """The unbiased pass@k per prompt (Chen et al. 2021, eq. 1): the probability that at least one of ``k``
    samples drawn without replacement from the prompt's ``n`` is correct,

        pass@k = 1 − C(n−c, k) / C(n, k) = 1 − ∏_{i=n−c+1}^{n} (1 − k / i)     (1 when n − c < k),

    with ``c`` the prompt's correct samples (the product form is their Figure 3's: no large binomials).
    ``correct [P, n]`` bool → ``[P]`` float64; average over prompts for the data set's pass@k."""
    n = correct.shape[-1]
    if not 1 <= k <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n samples per prompt, got k={k}, n={n}")
    c = correct.sum(-1)                                                  # [P]
    i = torch.arange(1, n + 1, dtype=torch.float64, device=correct.device)  # [n]
    in_product = i > (n - c)[:, None]                                    # [P, n]: i = n−c+1 .. n
    # only rows with n − c ≥ k use their terms, and there every i in the product exceeds k: log1p(−k/i) is finite
    log_terms = torch.where(in_product, torch.log1p(-k / i), torch.zeros((), dtype=torch.float64))
    return torch.where(n - c < k, torch.ones((), dtype=torch.float64), -torch.expm1(log_terms.sum(-1)))


def mean_at_k(scores: Tensor) -> Tensor:
    """mean@k: the mean score of each prompt's ``k`` samples, averaged over prompts (DeepSeek-R1 §3.1's pass@1 of
    ``k`` samples, of the score). A prompt's unscored (NaN) samples are left out of its mean, a prompt with none
    scored out of the average. ``scores [P, k]`` → scalar float64 (NaN when nothing was scored)."""
    per_prompt = scores.double().nanmean(-1)  # [P]
    return per_prompt.nanmean()
