"""The minibatch update of one batch of rollouts, for any :class:`~rlhf_train.algorithms.base.Algorithm`:
epochs × minibatches, one forward pass of the policy per micro-batch, gradient accumulation through
Accelerate, gradient clipping, and skipping of non-finite minibatches.

The algorithm supplies the loss (:meth:`Algorithm.loss`); this module owns everything around it.
"""
from __future__ import annotations

import torch

from rlhf_train.algorithms.base import Algorithm, PolicyOutput, finite_rows
from rlhf_train.algorithms.configs import UpdateConfig
from rlhf_train.algorithms.micro_batches import accumulation, micro_batches
from rlhf_train.core.containers import Rollout
from rlhf_train.core.mismatch import mismatch_kl_sums
from rlhf_train.core.prompt_groups import prompt_groups
from rlhf_train.core.sampling import SamplingParams
from rlhf_train.infra.faults import Faults
from rlhf_train.models.scoring import lm_trunk_and_head
from rlhf_train.models.shared_prompt import shares_prompts


def policy_forward(policy, mb: Rollout, sampling: SamplingParams, with_entropy: bool,
                   packed: bool = False) -> PolicyOutput:
    """ONE forward pass over the micro-batch's prompt + response: log-probs of its tokens under the
    sampling temperature alone (never top-k / top-p: :meth:`SamplingParams.for_scoring`), their entropies
    and the values, ``[b, T]`` each (the LM head runs at the response positions only, see
    :func:`rlhf_train.models.scoring.response_logprobs`). ``packed``: the rows as one packed row without
    padding (:mod:`rlhf_train.models.packed`)."""
    full, mask = mb.tokens.full, mb.masks.response
    prompt_len = full.shape[1] - mask.shape[1]
    log_probs, entropy, values = policy(full, mb.masks.full, prompt_len, labels=mb.tokens.response,
                                        temperature=sampling.temperature,  # a sampled token is never at −inf
                                        with_entropy=with_entropy, **({"packed": True} if packed else {}))
    return PolicyOutput(log_probs, entropy, values)


def minibatch_update(policy, optimizer, lr_scheduler, accelerator, rollout: Rollout, algorithm: Algorithm,
                     sampling: SamplingParams, cfg: UpdateConfig, generator: torch.Generator, faults: Faults) -> dict:
    """``cfg.num_epochs`` passes over the rollouts (batch ``[B]``) in minibatches of ``cfg.minibatch_size``.

    The loss of each micro-batch is the algorithm's mean over its units (tokens or sequences,
    :meth:`Algorithm.loss_units`), rescaled to this process's share of the mean over all processes' units
    of the minibatch (DDP averages over processes), so N processes ×
    B/N rows give the gradient of 1 × B. A minibatch whose rollout fields (:func:`finite_rows`), loss or
    gradient norm is not finite is skipped: no optimizer step, counted in ``faults.skipped``
    (logged as ``faults/skipped_updates``), its stats left out of the means. ``faults.max_consecutive``
    skips in a row raise ``FloatingPointError`` (the caller checkpoints the last good state).

    The first minibatch's passes come before any optimizer step: where the rollout has the sampler's own
    log-probs they are compared with these (``objective/sample_train_kl``: the mean of sampler − trainer
    log-prob over its response tokens, k1 of KL(sampler || trainer); ``objective/sample_train_kl_k2``: the
    mean of ½ (sampler − trainer)², k2; :func:`rlhf_train.core.mismatch.mismatch_kl_sums`).
    """
    B = rollout.batch_size[0]
    prompt_len = rollout.tokens.full.shape[1] - rollout.masks.response.shape[1]
    shares = shares_prompts(lm_trunk_and_head(accelerator.unwrap_model(policy).lm)[0])  # trainer.shared_prompt
    mbs, accum = cfg.minibatch_size, cfg.gradient_accumulation_steps
    all_stats: list[dict] = []
    good_stats: list[dict] = []
    first_ratio = None
    mismatch = []  # (Σ d, Σ ½ d², n) of the first minibatch's micro-batches: before any optimizer step
    for epoch in range(cfg.num_epochs):
        perm = torch.randperm(B, generator=generator)
        for start in range(0, B - mbs + 1, mbs):
            idx = perm[start:start + mbs]
            # global unit (token / sequence) count of this minibatch: DDP averages over processes
            # (× num_processes undoes it) and accelerator.backward divides by the accumulation steps (× accum)
            n_tokens = algorithm.loss_units(rollout.masks.actions[idx]).float().to(accelerator.device)
            n_global = accelerator.reduce(n_tokens, "sum") if accelerator.num_processes > 1 else n_tokens
            token_scale = accelerator.num_processes * accum / n_global.clamp(min=1).item()
            mb_stats = []
            skipped = False
            groups = None if cfg.packing or not shares else prompt_groups(rollout.tokens.full[idx],
                                                                          rollout.masks.full[idx], prompt_len)
            if groups is not None:  # a prompt's samples adjacent, so a micro-batch runs their shared prompt once
                idx = idx[groups[1].argsort(stable=True)]
            if not cfg.packing:  # shortest prompts first (groups stay whole): a micro-batch's pass drops the
                # prompt columns that all its rows pad (models.scoring.response_hidden); the summed gradient is the same
                idx = idx[rollout.masks.full[idx, :prompt_len].sum(-1).argsort(stable=True)]
            rows = micro_batches(rollout.masks.full[idx], idx, cfg, accelerator,  # packing: by token budget
                                 None if groups is None else (len(groups[0]), prompt_len))
            for k, mb_rows in enumerate(rows):
                mb = rollout[mb_rows]
                with accumulation(accelerator, policy, cfg, last=k == len(rows) - 1):
                    # the entropy is logged from the first epoch (later epochs need it only as a bonus)
                    out = policy_forward(policy, mb, sampling, with_entropy=epoch == 0 or algorithm.needs_entropy,
                                         packed=cfg.packing)
                    if epoch == 0 and start == 0 and mb.sampler_log_prob is not None:
                        mismatch.append(mismatch_kl_sums(mb.sampler_log_prob, out.log_probs.detach(),
                                                         mb.masks.actions))
                    loss, stats = algorithm.loss(out, mb)
                    loss = loss * algorithm.loss_units(mb.masks.actions).clamp(min=1) * token_scale
                    finite = (torch.isfinite(loss) & finite_rows(mb).all()).float()
                    if accelerator.num_processes > 1:  # 1 only if finite everywhere (reduce has no "min")
                        finite = accelerator.reduce(finite, "mean")
                    if finite.item() < 1:
                        skipped = True
                        loss = loss.nan_to_num(0.0) * 0.0  # keep collectives in step; no update below
                    accelerator.backward(loss)
                    if accelerator.sync_gradients:
                        _step(policy, optimizer, lr_scheduler, accelerator, cfg, skipped, faults, stats)
                if first_ratio is None:
                    first_ratio = stats["val/ratio"]
                mb_stats.append(stats)
            if faults.too_many_skipped():
                raise FloatingPointError(
                    f"{faults.consecutive} updates in a row were skipped for non-finite rewards, "
                    f"log-probs, advantages, loss or gradients (trainer.max_consecutive_faults="
                    f"{faults.max_consecutive})")
            all_stats += mb_stats
            good_stats += [] if skipped or faults.consecutive else mb_stats
    used = good_stats or all_stats  # all skipped: the (non-finite) stats show it
    keys = {k for s in used for k in s}
    out = {k: torch.stack([s[k].float().cpu() for s in used if k in s]).mean() for k in keys}
    out["val/first_ratio"] = first_ratio
    if mismatch:
        k1, k2, n = (torch.stack(x).sum().float().cpu().item() for x in zip(*mismatch))
        out["objective/sample_train_kl"] = torch.tensor(k1 / max(n, 1.0))
        out["objective/sample_train_kl_k2"] = torch.tensor(k2 / max(n, 1.0))
    return out


def _step(policy, optimizer, lr_scheduler, accelerator, cfg: UpdateConfig, skipped: bool, faults: Faults,
          stats: dict) -> None:
    """The optimizer step at the end of a minibatch, unless it is skipped or its gradient is not finite.

    fp16 (``trainer.precision=fp16``: Accelerate's gradient scaler): a gradient that overflowed is the scaler's
    to handle, not a fault: its step skips the update and lowers the loss scale (no LR step, no grad norm)."""
    if skipped:
        optimizer.zero_grad(set_to_none=True)
        faults.skip_update()
        return
    grad_norm = None
    if cfg.max_grad_norm is not None:
        grad_norm = accelerator.clip_grad_norm_(policy.parameters(), cfg.max_grad_norm)
    finite_norm = grad_norm is None or bool(torch.isfinite(torch.as_tensor(grad_norm)))
    scaler = getattr(accelerator, "scaler", None)
    if not finite_norm and scaler is None:
        optimizer.zero_grad(set_to_none=True)
        faults.skip_update()
    else:
        optimizer.step()
        if not (scaler is not None and accelerator.optimizer_step_was_skipped):
            lr_scheduler.step()
            faults.good_update()
    if grad_norm is not None and (finite_norm or scaler is None):
        stats["policy/grad_norm"] = torch.as_tensor(grad_norm).float()
    optimizer.zero_grad(set_to_none=True)
