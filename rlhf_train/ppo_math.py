"""Pure tensor maths for PPO on language models.

Shapes: B = batch (sequences), T = response tokens, V = vocabulary.
``mask`` is a bool or float ``[B, T]`` tensor: 1 on response tokens (a contiguous
prefix of each row, up to and including EOS), 0 after.

References:
  PPO: Schulman et al. 2017, "Proximal Policy Optimization Algorithms".
  GAE: Schulman et al. 2016, "High-Dimensional Continuous Control Using GAE".
  KL estimators: Schulman 2020, "Approximating KL Divergence" (k1, k2, k3).
"""

from __future__ import annotations

import torch
from torch import Tensor

KL_ESTIMATORS = ("k1", "k2", "k3")


# ---------------------------------------------------------------------------
# masked statistics
# ---------------------------------------------------------------------------


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of ``x`` where ``mask`` is 1. x, mask: [B, T] -> scalar, or [B] with dim=1."""
    x = x * mask.to(x.dtype)
    return x.sum() if dim is None else x.sum(dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``x`` over masked entries. [B, T] -> scalar, or per row [B] with dim=1.

    An empty mask (or empty row) gives 0, not NaN.
    """
    m = mask.to(x.dtype)
    return masked_sum(x, m, dim) / masked_sum(torch.ones_like(x), m, dim).clamp(min=1)


def masked_var(x: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance of ``x`` over masked entries (scalar). Bessel-corrected if ``unbiased``."""
    m = mask.to(x.dtype)
    var = masked_mean((x - masked_mean(x, m)) ** 2, m)
    if unbiased:
        n = m.sum()
        var = var * n / (n - 1).clamp(min=1)
    return var


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """(x - mean) / std with mean/var over masked entries only. [B, T] -> [B, T], 0 where mask is 0.

    ``shift_mean=False`` keeps the original mean (only rescales), as in TRL.
    """
    m = mask.to(x.dtype)
    mean, var = masked_mean(x, m), masked_var(x, m)
    whitened = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return whitened * m


# ---------------------------------------------------------------------------
# advantages
# ---------------------------------------------------------------------------


def gae(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over response tokens.

    rewards, values, mask: [B, T] -> (advantages [B, T], returns [B, T]).

        delta_t = r_t + gamma * V_{t+1} * m_{t+1} - V_t
        A_t     = sum_{k >= t} (gamma * lam)^(k - t) * delta_k * m_k
        R_t     = A_t + V_t

    The value after the last response token is 0: the episode ends (EOS) or is
    truncated there, and like TRL / "N+ implementation details" we treat it as terminal.
    Advantages and returns are 0 outside the mask.
    """
    m = mask.to(values.dtype)
    T = values.shape[-1]
    next_values = torch.cat([values[:, 1:] * m[:, 1:], torch.zeros_like(values[:, :1])], dim=1)
    deltas = (rewards + gamma * next_values - values) * m  # [B, T]
    # The backward recursion A_t = delta_t + gamma*lam*A_{t+1} is a Python loop over T
    # (T tiny kernel launches per batch, slow on GPU). Instead unroll it as one matmul with
    # an upper-triangular discount matrix W[t, k] = (gamma*lam)^(k-t) for k >= t, else 0:
    # A = deltas @ W^T. T is at most a few hundred, so the [T, T] matrix is cheap.
    t = torch.arange(T, device=values.device)
    lag = t[None, :] - t[:, None]  # lag[t, k] = k - t
    W = torch.where(lag >= 0, (gamma * lam) ** lag.clamp(min=0).to(values.dtype), 0.0)
    advantages = (deltas @ W.T) * m
    returns = (advantages + values) * m
    return advantages, returns


# ---------------------------------------------------------------------------
# losses
# ---------------------------------------------------------------------------


def policy_loss(
    log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, mask: Tensor, clip_eps: float
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate. All inputs [B, T] -> (scalar loss, stats of detached scalars).

        ratio = exp(log pi - log pi_old)
        loss  = masked_mean(max(-A * ratio, -A * clip(ratio, 1 - eps, 1 + eps)))

    stats: clipfrac (fraction of tokens where the clipped term is the larger one),
    approx_kl (masked mean of (ratio - 1) - log ratio, the k3 estimator), ratio_mean.
    """
    log_ratio = log_probs - old_log_probs
    ratio = torch.exp(log_ratio)
    pg_loss1 = -advantages * ratio
    pg_loss2 = -advantages * torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps)
    loss = masked_mean(torch.max(pg_loss1, pg_loss2), mask)
    with torch.no_grad():
        stats = {
            "clipfrac": masked_mean((pg_loss2 > pg_loss1).to(ratio.dtype), mask),
            "approx_kl": masked_mean((ratio - 1) - log_ratio, mask),
            "ratio_mean": masked_mean(ratio, mask),
        }
    return loss, stats


def value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, clip_eps_value: float
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped value loss. All inputs [B, T] -> (scalar loss, {"clipfrac"}).

        v_clip = old_v + clip(v - old_v, -eps, eps)
        loss   = 0.5 * masked_mean(max((v - R)^2, (v_clip - R)^2))
    """
    values_clipped = old_values + torch.clamp(values - old_values, -clip_eps_value, clip_eps_value)
    vf_loss1 = (values - returns) ** 2
    vf_loss2 = (values_clipped - returns) ** 2
    loss = 0.5 * masked_mean(torch.max(vf_loss1, vf_loss2), mask)
    with torch.no_grad():
        stats = {"clipfrac": masked_mean((vf_loss2 > vf_loss1).to(values.dtype), mask)}
    return loss, stats


# ---------------------------------------------------------------------------
# per-token quantities from logits
# ---------------------------------------------------------------------------


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of softmax(logits) over the last dim. [B, T, V] -> [B, T], float32.

    H = logsumexp(z) - sum_v softmax(z)_v * z_v  (stable: no log of a tiny probability).
    """
    logits = logits.float()
    return torch.logsumexp(logits, dim=-1) - (torch.softmax(logits, dim=-1) * logits).sum(-1)


def kl_estimate(log_p: Tensor, log_q: Tensor, estimator: str) -> Tensor:
    """Per-token estimate of KL(p || q), p = policy, q = reference, sampled from p. [B, T] -> [B, T].

    k1 = log p - log q                   (unbiased, can be negative)
    k2 = 0.5 * (log p - log q)^2         (biased, >= 0, low variance)
    k3 = (r - 1) - log r, r = q / p      (unbiased, >= 0)
    """
    log_ratio = log_p - log_q
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    if estimator == "k3":
        return torch.expm1(-log_ratio) + log_ratio  # (r - 1) - log r with log r = -log_ratio
    raise ValueError(f"unknown KL estimator {estimator!r}; expected one of {', '.join(KL_ESTIMATORS)}")


def logprobs_of_labels(logits: Tensor, labels: Tensor) -> Tensor:
    """log softmax(logits)[label], computed in float32. logits [B, T, V], labels [B, T] -> [B, T]."""
    logits = logits.float()
    picked = torch.gather(logits, -1, labels.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


# Vocabulary rows of [V, N] logits handled per block by logprobs_and_entropy: ~2^21 floats (8 MB) per
# block keeps its temporaries in the CPU's last-level cache.
_BLOCK_ELEMENTS = 1 << 21


def _vocab_blocks(V: int, N: int):
    step = max(1, _BLOCK_ELEMENTS // max(N, 1))
    return [(a, min(a + step, V)) for a in range(0, V, step)]


class _LogProbsAndEntropy(torch.autograd.Function):
    """``(log softmax(z)[label], H(softmax(z)))`` per token, with ``z = logits_t / temperature`` given
    vocabulary-major (``[V, N]``), in blocks of vocabulary rows that stay in cache.

    Why not ``logprobs_of_labels`` + ``entropy_from_logits``: with a 50k vocabulary the logits of a PPO
    minibatch are hundreds of MB, and that pair (logsumexp twice, softmax, product, their autograd nodes,
    gather's zero-filled gradient) makes ~15 passes over them and allocates ~8 more tensors of their
    size, each page-faulted in afresh: on a 2-core CPU that cost 3-4x the LM-head matmuls themselves.
    Here: one pass for the max, one cache-blocked pass for ``e = exp(z - max)`` and its sums (log-sum-exp,
    entropy ``H = lse - Σ p z``); with ``overwrite_logits`` the logits' memory keeps ``e``, and the
    backward pass turns it into the gradient in place, ``dlogp/dz = onehot(label) - e / Σe`` (no second
    exp) and ``dH/dz = -p (log p + H)``. Vocabulary-major because the head matmul ``W·hᵀ`` writes that
    layout 1.5x faster than ``h·Wᵀ`` on CPU (85 vs 57 GFLOP/s per core for 800 tokens x 50257). Measured
    on one core, one PPO minibatch (800 tokens x 50257), forward + backward of LM head + log-probs +
    entropy: 2.92 s -> 0.54 s of CPU, where the three head matmuls alone take 0.41 s.
    """

    @staticmethod
    def forward(ctx, logits_t: Tensor, labels: Tensor, temperature: float, overwrite_logits: bool,
                with_entropy: bool):
        V, N = logits_t.shape
        dtype = torch.promote_types(logits_t.dtype, torch.float32)  # at least float32
        in_place = overwrite_logits and logits_t.dtype == dtype    # blocks may be computed in the logits
        keep_exp = in_place and ctx.needs_input_grad[0]              # ... and keep e = exp(z - max) there
        picked = logits_t.gather(0, labels[None]).squeeze(0).to(dtype) / temperature
        m = logits_t.amax(0).to(dtype) / temperature                # max_v z, [N]
        s = torch.zeros_like(m)                                     # Σ_v e,  e = exp(z - m)
        sy = torch.zeros_like(m)                                    # Σ_v e (z - m)
        for a, b in _vocab_blocks(V, N):
            x = logits_t[a:b]
            z = x.to(dtype) / temperature if temperature != 1.0 else x.to(dtype)
            y = torch.sub(z, m, out=x) if in_place else z - m
            e = y.exp() if with_entropy else y.exp_()  # in place (in the logits, when allowed) if it can be
            if with_entropy:
                sy += torch.linalg.vecdot(e, y, dim=0)
                if keep_exp:
                    x.copy_(e)
            s += e.sum(0)
        lse = m + s.log()
        # H = lse - Σ p z = log Σe - Σ e (z - m) / Σe
        entropy = s.log() - sy / s if with_entropy else torch.full_like(lse, float("nan"))
        if not with_entropy:
            ctx.mark_non_differentiable(entropy)
        ctx.save_for_backward(logits_t, labels, lse, entropy, s)
        ctx.temperature, ctx.overwrite_logits, ctx.keep_exp = temperature, overwrite_logits, keep_exp
        ctx.set_materialize_grads(False)  # an unused entropy gets no gradient pass
        return picked - lse, entropy

    @staticmethod
    def backward(ctx, grad_logp: Tensor | None, grad_entropy: Tensor | None):
        if grad_logp is None and grad_entropy is None:
            return None, None, None, None, None
        saved, labels, lse, entropy, s = ctx.saved_tensors  # saved: exp(z - max) if keep_exp, else logits
        t = ctx.temperature
        grad = saved if ctx.overwrite_logits else torch.empty_like(saved)
        in_place = grad.dtype == lse.dtype  # else each block is computed in float32, then cast into grad
        gl = grad_logp.to(lse.dtype) if grad_logp is not None else None
        ge = grad_entropy.to(lse.dtype) if grad_entropy is not None else None
        for a, b in _vocab_blocks(*saved.shape):
            x = saved[a:b].to(lse.dtype)
            g = grad[a:b] if in_place else torch.empty_like(x)
            if ctx.keep_exp:
                p = torch.mul(x, 1.0 / s, out=g)                  # p = e / Σe (g may be x itself)
                p_log_p = torch.special.xlogy(p, p) if ge is not None else None  # 0 where p underflowed
            else:
                log_p = torch.sub(x / t if t != 1.0 else x, lse, out=g)  # log p (g may be x itself)
                p_log_p = log_p.clone() if ge is not None else None
                p = log_p.exp_()
                if p_log_p is not None:
                    p_log_p.mul_(p)
            # dH/dz = -p (log p + H)
            ent_grad = p_log_p.add_(p * entropy).mul_(-ge) if ge is not None else None
            g = p.mul_(-gl) if gl is not None else p.zero_()      # d log p_label / dz = onehot(label) - p
            if ent_grad is not None:
                g.add_(ent_grad)
            if t != 1.0:
                g.div_(t)
            if not in_place:
                grad[a:b] = g
        if gl is not None:  # the onehot(label) part
            cols = torch.arange(labels.shape[0], device=labels.device)
            grad.index_put_((labels, cols), (gl / t).to(grad.dtype), accumulate=True)
        return grad, None, None, None, None


def logprobs_and_entropy(logits_t: Tensor, labels: Tensor, temperature: float = 1.0,
                         overwrite_logits: bool = False, with_entropy: bool = True) -> tuple[Tensor, Tensor]:
    """Per token, ``log softmax(z)[label]`` and the entropy of ``softmax(z)``, ``z = logits / temperature``.

    ``logits_t [V, N]`` is **vocabulary-major** (the transpose of the usual ``[N, V]``: what ``W @ hᵀ``
    writes), ``labels [N]`` -> ``(log_probs [N], entropy [N])``, at least float32. The same values as
    ``logprobs_of_labels(logits / temperature, labels)`` and ``entropy_from_logits(logits / temperature)``
    (to float32 rounding), in one blockwise pass (see :class:`_LogProbsAndEntropy`).
    ``overwrite_logits=True``: the backward pass writes the gradient into the logits' memory (no second
    [V, N] buffer); only for logits nothing else reads afterwards (autograd raises if a graph node does).
    ``with_entropy=False`` skips the entropy (returned as NaN; it then takes no gradient).
    """
    return _LogProbsAndEntropy.apply(logits_t, labels, float(temperature), bool(overwrite_logits), bool(with_entropy))
