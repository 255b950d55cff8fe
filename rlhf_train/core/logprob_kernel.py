"""Log-probs of the sampled tokens and the policy's entropy, from logits; and a fused kernel for both.

Shapes: B = batch (sequences), T = response tokens, V = vocabulary, N = tokens of a flattened batch.
``logprobs_of_labels`` and ``entropy_from_logits`` take the usual ``[B, T, V]`` logits and return
``[B, T]`` float32: ``log softmax(z)[label] = z_label - logsumexp(z)`` and
``H(softmax(z)) = logsumexp(z) - Σ_v softmax(z)_v z_v`` (no log of a tiny probability).

Why a fused kernel (:func:`logprobs_and_entropy`): in a PPO update the LM head's logits are the
largest tensors (hundreds of MB for a 50k vocabulary), and computing log-probs and entropy with the
two plain functions above walks over them ~15 times and allocates ~8 more tensors of their size. The
kernel takes the logits vocabulary-major (``[V, N]``, the layout ``W @ hᵀ`` writes 1.5x faster on CPU),
makes one cache-blocked pass over them (each block's max, exp and sums while it is in cache), and its
backward pass computes the gradient
(``d log p_label / dz = onehot(label) - p``, ``dH/dz = -p (log p + H)``) in the logits' own memory
when ``overwrite_logits=True``.
Measured on one CPU core for one PPO minibatch (800 tokens x 50257), forward + backward of LM head,
log-probs and entropy: 2.92 s -> 0.54 s (the head matmuls alone take 0.41 s); details in
:class:`_LogProbsAndEntropy`. :func:`rlhf_train.models.scoring.response_logprobs` is its caller.
"""
from __future__ import annotations

import torch
from torch import Tensor


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of softmax(logits) over the last dim. [B, T, V] -> [B, T], float32.

    H = logsumexp(z) - sum_v softmax(z)_v * z_v  (stable: no log of a tiny probability).
    """
    logits = logits.float()
    return torch.logsumexp(logits, dim=-1) - (torch.softmax(logits, dim=-1) * logits).sum(-1)


def logprobs_of_labels(logits: Tensor, labels: Tensor) -> Tensor:
    """log softmax(logits)[label], computed in float32. logits [B, T, V], labels [B, T] -> [B, T]."""
    logits = logits.float()
    picked = torch.gather(logits, -1, labels.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


# Vocabulary rows of [V, N] logits handled per block: ~2^21 floats (8 MB) per block keeps its temporaries
# in the CPU's last-level cache. On an accelerator (CUDA, MPS, ...) the blocks only bound the memory of
# the gradient-free pass (there is no cache to fit them in) and each block costs a dozen kernel launches,
# so they are 32x larger there (256 MB of float32 logits).
_BLOCK_ELEMENTS = 1 << 21
_ACCELERATOR_BLOCK_FACTOR = 32


def _vocab_blocks(V: int, N: int, device: torch.device | None = None):
    elements = _BLOCK_ELEMENTS * (_ACCELERATOR_BLOCK_FACTOR if device is not None and device.type != "cpu" else 1)
    step = max(1, elements // max(N, 1))
    return [(a, min(a + step, V)) for a in range(0, V, step)]


def _block_forward(z: Tensor, temperature: float, with_entropy: bool, keep_exp: bool, scratch: list):
    """Statistics of one vocabulary block ``z [Vb, N]`` of float logits, computed in ``z``'s memory:
    ``(m_b, s_b, sy_b)`` = (its max, ``Σ e``, ``Σ e (z/t - m_b)`` or None) with ``e = exp(z/t - m_b)``.
    With ``keep_exp`` ``z`` holds ``e`` afterwards (the backward pass turns it into the gradient)."""
    if temperature != 1.0:
        z.mul_(1.0 / temperature)
    m_b = z.amax(0)
    y = z.sub_(m_b)                                                     # z/t - m_b, in place
    if not with_entropy:
        e = y.exp_()
        return m_b, e.sum(0), None
    if not scratch or scratch[0].shape != y.shape:
        scratch[:] = [torch.empty_like(y), torch.empty_like(y)]
    e = torch.exp(y, out=scratch[0])
    sy_b = torch.mul(e, y, out=scratch[1]).sum(0)
    if keep_exp:
        z.copy_(e)
    return m_b, e.sum(0), sy_b


def _combine(maxes, sums, ysums, with_entropy: bool):
    """Per token, from the blocks' statistics: ``(lse, entropy or NaN, scale / s)`` where ``lse`` is
    ``logsumexp(z/t)``, ``scale_b = exp(m_b - m)`` relates block b's ``e`` to the global max ``m`` and
    ``p = e_b · scale_b / s`` is the softmax."""
    m_blocks = torch.stack(maxes)                                       # [n_blocks, N]
    m = m_blocks.amax(0)                                                # max_v z/t
    scale = torch.exp(m_blocks - m)
    s = (torch.stack(sums) * scale).sum(0)                              # Σ_v exp(z/t - m)
    lse = m + s.log()
    if with_entropy:  # Σ exp(z/t - m)(z/t - m) = Σ_b scale_b (sy_b + (m_b - m) s_b);  H = log s - that / s
        sy = (scale * (torch.stack(ysums) + (m_blocks - m) * torch.stack(sums))).sum(0)
        entropy = s.log() - sy / s
    else:
        entropy = torch.full_like(lse, float("nan"))
    return lse, entropy, scale / s


def _block_grad(x: Tensor, g: Tensor, p_scale_b: Tensor, lse, entropy, gl, ge, t: float, keep_exp: bool) -> Tensor:
    """The gradient of one block WITHOUT the onehot(label) part, written into ``g`` (which may be ``x``):
    ``-gl · p / t`` (``d log p_label / dz`` less its onehot) ``- ge · p (log p + H) / t`` (``dH/dz``).
    ``x`` holds ``e_b`` (``keep_exp``) or the raw logits."""
    if keep_exp and ge is None:                                         # one pass: p = e_b · scale_b / s
        return torch.mul(x, p_scale_b * (-gl / t), out=g)
    if keep_exp:
        p = torch.mul(x, p_scale_b, out=g)                              # p (g may be x itself)
        p_log_p = torch.special.xlogy(p, p) if ge is not None else None  # 0 where p underflowed
    else:
        log_p = torch.sub(x / t if t != 1.0 else x, lse, out=g)        # log p (g may be x itself)
        p_log_p = log_p.clone() if ge is not None else None
        p = log_p.exp_()
        if p_log_p is not None:
            p_log_p.mul_(p)
    ent_grad = p_log_p.add_(p * entropy).mul_(-ge) if ge is not None else None  # dH/dz = -p (log p + H)
    g = p.mul_(-gl) if gl is not None else p.zero_()
    if ent_grad is not None:
        g.add_(ent_grad)
    return g.div_(t) if t != 1.0 else g


class _LogProbsAndEntropy(torch.autograd.Function):
    """``(log softmax(z)[label], H(softmax(z)))`` per token, with ``z = logits_t / temperature`` given
    vocabulary-major (``[V, N]``), in blocks of vocabulary rows that stay in cache.

    Why not ``logprobs_of_labels`` + ``entropy_from_logits``: with a 50k vocabulary the logits of a PPO
    minibatch are hundreds of MB, and that pair (logsumexp twice, softmax, product, their autograd nodes,
    gather's zero-filled gradient) makes ~15 passes over them and allocates ~8 more tensors of their
    size, each page-faulted in afresh: on a 2-core CPU that cost 3-4x the LM-head matmuls themselves.
    Here: one cache-blocked pass: per block of vocabulary rows its own max ``m_b``, ``e = exp(z - m_b)``
    and its sums, combined across blocks afterwards (log-sum-exp, entropy ``H = lse - Σ p z``); with
    ``overwrite_logits`` the logits' memory keeps ``e``, and the backward pass turns it into the gradient
    in place, ``dlogp/dz = onehot(label) - e · exp(m_b - m) / Σ`` in one multiply per element (no second
    exp) and ``dH/dz = -p (log p + H)``. (The per-block max replaced a separate max pass over the whole
    logits, and the one-multiply gradient a two-pass one: 212 -> 205 ms for one minibatch of 800 tokens,
    forward + backward with the head matmuls, 2 threads.) Vocabulary-major because the head matmul ``W·hᵀ`` writes that
    layout 1.5x faster than ``h·Wᵀ`` on CPU (85 vs 57 GFLOP/s per core for 800 tokens x 50257). Measured
    on one core, one PPO minibatch (800 tokens x 50257), forward + backward of LM head + log-probs +
    entropy: 2.92 s -> 0.54 s of CPU, where the three head matmuls alone take 0.41 s.
    :class:`_HeadLogProbsAndEntropy` is the same with the head's matmuls inside (what training uses).
    """

    @staticmethod
    def forward(ctx, logits_t: Tensor, labels: Tensor, temperature: float, overwrite_logits: bool,
                with_entropy: bool):
        V, N = logits_t.shape
        dtype = torch.promote_types(logits_t.dtype, torch.float32)  # at least float32
        in_place = overwrite_logits and logits_t.dtype == dtype    # blocks may be computed in the logits
        keep_exp = in_place and ctx.needs_input_grad[0]              # ... and keep e = exp(z - block max) there
        picked = logits_t.gather(0, labels[None]).squeeze(0).to(dtype) / temperature
        stats, scratch = [], []
        for a, b in _vocab_blocks(V, N, logits_t.device):
            z = logits_t[a:b] if in_place else logits_t[a:b].to(dtype, copy=True)
            stats.append(_block_forward(z, temperature, with_entropy, keep_exp, scratch))
        lse, entropy, p_scale = _combine(*zip(*stats), with_entropy)
        if not with_entropy:
            ctx.mark_non_differentiable(entropy)
        ctx.save_for_backward(logits_t, labels, lse, entropy, p_scale)
        ctx.temperature, ctx.overwrite_logits, ctx.keep_exp = temperature, overwrite_logits, keep_exp
        ctx.set_materialize_grads(False)  # an unused entropy gets no gradient pass
        return picked - lse, entropy

    @staticmethod
    def backward(ctx, grad_logp: Tensor | None, grad_entropy: Tensor | None):
        if grad_logp is None and grad_entropy is None:
            return None, None, None, None, None
        saved, labels, lse, entropy, p_scale = ctx.saved_tensors  # saved: the e_b if keep_exp, else logits
        t = ctx.temperature
        grad = saved if ctx.overwrite_logits else torch.empty_like(saved)
        in_place = grad.dtype == lse.dtype  # else each block is computed in float32, then cast into grad
        gl = grad_logp.to(lse.dtype) if grad_logp is not None else None
        ge = grad_entropy.to(lse.dtype) if grad_entropy is not None else None
        for i, (a, b) in enumerate(_vocab_blocks(*saved.shape, saved.device)):
            x = saved[a:b].to(lse.dtype)
            g = _block_grad(x, grad[a:b] if in_place else torch.empty_like(x), p_scale[i], lse, entropy, gl, ge,
                            t, ctx.keep_exp)
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


class _HeadLogProbsAndEntropy(torch.autograd.Function):
    """:class:`_LogProbsAndEntropy` with the LM head's matmuls inside: the forward pass computes
    ``z = W_b·hᵀ (+ b_b)`` block by block of vocabulary rows straight into the ``[V, N]`` buffer that keeps
    ``e``, and the backward pass never forms the gradient of the logits when only the log-probs carry
    one (the trainer's case, ``ent_coef = 0``).

    Why: the gradient of block b is ``g_b = onehot·c - e_b·diag(σ_b)`` with ``c = gl/t`` and ``σ_b`` the
    per-token ``scale_b·gl/(s·t)``. Forming it is one more trip of the ``[V, N]`` logits through main
    memory (a read and a write of 160 MB for 800 tokens x 50257) before the two matmuls read it again. The
    per-token factor can go on the small side instead: ``dW_b = -e_b (σ_b ⊙ h)`` and ``dh -= σ_b ⊙ (e_bᵀ
    W_b)``, and the onehot part is ``dh += c ⊙ W[label]``, ``dW[label] += c ⊙ h`` (``[N, H]`` work).
    With an entropy gradient each block's gradient is formed in one block-sized buffer that stays in cache.
    Measured (``benchmarks/head_kernel.py``, 2 threads, medians of 9 interleaved rounds; forward + backward
    of one minibatch, head matmuls included): 800 tokens x width 128, 187-194 -> 180-183 ms; 512 x 256,
    217 ms either way; one PPO iteration of ``benchmarks/ppo_iteration.py`` 2.17 -> 2.12 s (2 layers, width
    128). Without gradients the logits of only one block exist (8 MB instead of 100 MB per 512 tokens).
    """

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, bias: Tensor | None, labels: Tensor, temperature: float,
                with_entropy: bool):
        with torch.autocast(hidden.device.type, enabled=False):  # its matmuls write float buffers of its own
            return _HeadLogProbsAndEntropy._forward(ctx, hidden, weight, bias, labels, temperature, with_entropy)

    @staticmethod
    def backward(ctx, grad_logp: Tensor | None, grad_entropy: Tensor | None):
        if grad_logp is None and grad_entropy is None:
            return None, None, None, None, None, None
        with torch.autocast(ctx.saved_tensors[0].device.type, enabled=False):
            return _HeadLogProbsAndEntropy._backward(ctx, grad_logp, grad_entropy)

    @staticmethod
    def _forward(ctx, hidden: Tensor, weight: Tensor, bias: Tensor | None, labels: Tensor, temperature: float,
                 with_entropy: bool):
        (V, _), N = weight.shape, hidden.shape[0]
        keep_exp = any(ctx.needs_input_grad[:3])
        store = hidden.new_empty(V, N) if keep_exp else None            # e of every block, for the backward
        blocks = _vocab_blocks(V, N, hidden.device)
        f = hidden.dtype  # the compute dtype; a weight stored in less (bf16) is cast up one block at a time
        # the tokens whose label lies in each block: their logit is read while the block is fresh
        order = torch.argsort(labels)
        starts = torch.tensor([a for a, _ in blocks], device=labels.device)
        bounds = torch.searchsorted(labels[order], starts).tolist() + [N]
        picked, hidden_t = hidden.new_empty(N), hidden.T
        stats, scratch, buf = [], [], None
        for i, (a, b) in enumerate(blocks):
            if store is not None:
                z = store[a:b]
            else:                                                       # no gradient: one block at a time
                buf = hidden.new_empty(b - a, N) if buf is None else buf
                z = buf[: b - a]
            if bias is not None:
                torch.addmm(bias[a:b, None].to(f), weight[a:b].to(f), hidden_t, out=z)
            else:
                torch.mm(weight[a:b].to(f), hidden_t, out=z)
            cols = order[bounds[i]:bounds[i + 1]]
            picked[cols] = z[labels[cols] - a, cols]
            stats.append(_block_forward(z, temperature, with_entropy, keep_exp, scratch))
        lse, entropy, p_scale = _combine(*zip(*stats), with_entropy)
        if not with_entropy:
            ctx.mark_non_differentiable(entropy)
        ctx.save_for_backward(hidden, weight, bias, labels, store, lse, entropy, p_scale)
        ctx.temperature, ctx.blocks = temperature, blocks
        ctx.set_materialize_grads(False)  # an unused entropy gets no gradient pass
        return picked / temperature - lse, entropy

    @staticmethod
    def _backward(ctx, grad_logp: Tensor | None, grad_entropy: Tensor | None):
        hidden, weight, bias, labels, store, lse, entropy, p_scale = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        t, gl, ge, f = ctx.temperature, grad_logp, grad_entropy, hidden.dtype
        # the gradients are computed in the compute dtype f, then cast to the parameters' own (bf16 weights)
        grad_h = torch.zeros_like(hidden) if need_h else None
        grad_w = torch.empty(weight.shape, dtype=f, device=weight.device) if need_w else None
        grad_b = torch.empty(bias.shape, dtype=f, device=bias.device) if need_b else None
        buf = None
        for i, (a, b) in enumerate(ctx.blocks):
            e_b = store[a:b]                                            # [Vb, N], left as it is
            if ge is None:                                              # g_b = -e_b · diag(σ_b), never formed
                sigma = p_scale[i] * (gl / t)                           # [N]
                if need_h:
                    grad_h.addcmul_(e_b.T @ weight[a:b].to(f), sigma[:, None], value=-1.0)
                if need_w:
                    torch.mm(e_b, hidden * -sigma[:, None], out=grad_w[a:b])
                if need_b:
                    torch.mv(e_b, -sigma, out=grad_b[a:b])
                continue
            buf = torch.empty_like(e_b) if buf is None else buf
            g = _block_grad(e_b, buf[: b - a], p_scale[i], lse, entropy, gl, ge, t, True)
            if need_h:
                grad_h.addmm_(g.T, weight[a:b].to(f))
            if need_w:
                torch.mm(g, hidden, out=grad_w[a:b])
            if need_b:
                torch.sum(g, 1, out=grad_b[a:b])
        if gl is not None:  # the onehot(label) part of d log p_label / dz: c = gl / t at (label, token)
            c = gl / t
            if need_h:
                grad_h.addcmul_(weight[labels].to(f), c[:, None])
            if need_w:
                grad_w.index_add_(0, labels, hidden * c[:, None])
            if need_b:
                grad_b.index_add_(0, labels, c)
        grad_w = grad_w.to(weight.dtype) if grad_w is not None else None
        grad_b = grad_b.to(bias.dtype) if grad_b is not None else None
        return grad_h, grad_w, grad_b, None, None, None


def head_logprobs_and_entropy(hidden: Tensor, weight: Tensor, bias: Tensor | None, labels: Tensor,
                              temperature: float = 1.0, with_entropy: bool = True) -> tuple[Tensor, Tensor]:
    """:func:`logprobs_and_entropy` of the logits ``hidden @ weightᵀ + bias``, with the head's matmuls inside
    the blockwise pass: ``hidden [N, H]``, ``weight [V, H]`` and ``bias [V]`` (or None) of an LM head,
    ``labels [N]`` -> ``(log_probs [N], entropy [N])`` (entropy NaN and gradient-free unless
    ``with_entropy``). Gradients flow to ``hidden``, ``weight`` and ``bias`` (:class:`_HeadLogProbsAndEntropy`);
    without gradients only one block of logits exists at a time.

    Everything is computed in ``hidden``'s dtype (float32, or float64 in gradient checks): a ``weight`` /
    ``bias`` stored in less (bfloat16 weights) is cast up one vocabulary block at a time and gets its
    gradient in its own dtype. Any device: on CPU the blocks fit the cache, on an accelerator they are
    larger (:data:`_ACCELERATOR_BLOCK_FACTOR`). Under autocast the caller turns it off around this
    function (its matmuls write into float buffers of their own)."""
    if not torch.is_grad_enabled():  # a scoring pass: inputs that require grad (a policy's weights) keep no [V, N]
        hidden, weight = hidden.detach(), weight.detach()
        bias = bias.detach() if bias is not None else None
    return _HeadLogProbsAndEntropy.apply(hidden, weight, bias, labels, float(temperature), bool(with_entropy))
