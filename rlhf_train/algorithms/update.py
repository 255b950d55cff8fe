"""The PPO update over one batch of rollouts: minibatches, the clipped loss from one forward pass,
gradient accumulation through Accelerate, and skipping of non-finite minibatches.

The per-tensor math (GAE, the clipped losses, whitening) lives in :mod:`rlhf_train.core.logprob_kernel`; this module
applies it to a rollout TensorDict ``td`` of batch ``[B]`` with response tensors ``[B, T]``.
"""
from __future__ import annotations

import torch
from omegaconf import DictConfig

from rlhf_train.core.losses import policy_loss, value_loss
from rlhf_train.core.masked import masked_mean


def global_masked_whiten(x: torch.Tensor, mask: torch.Tensor, accelerator) -> torch.Tensor:
    """Whiten ``x [B, T]`` with mean/var over the masked entries of *all* processes.

    Entries outside ``mask`` (padding, and rows of a faulty rollout) take no part, even when non-finite.
    """
    m = mask.float()
    x0 = x.masked_fill(~mask, 0.0)  # not x * m: NaN * 0 is NaN
    stats = torch.stack([x0.sum(), (x0 * x0).sum(), m.sum()]).double()
    stats = accelerator.reduce(stats, "sum") if accelerator.num_processes > 1 else stats
    n = stats[2].clamp(min=1)
    mean = stats[0] / n
    var = (stats[1] / n - mean**2) * n / (n - 1).clamp(min=1)
    return ((x - mean.float()) * torch.rsqrt(var.float() + 1e-8)).masked_fill(~mask, 0.0)


# what must be finite for a minibatch to be used: rewards, rollout log-probs and values, advantages, returns
FAULT_KEYS = (("next", "reward"), "sample_log_prob", "values", "advantage", "returns")


def finite_rows(td) -> torch.Tensor:
    """``[B]``: True where every per-token tensor of :data:`FAULT_KEYS` in ``td`` is finite for that row."""
    B = td.batch_size[0]
    ok = torch.ones(B, dtype=torch.bool, device=td.device)
    present = set(td.keys(include_nested=True))
    for key in FAULT_KEYS:
        if key in present:
            ok &= torch.isfinite(td.get(key).reshape(B, -1)).all(-1)
    return ok


def ppo_loss(policy, mb, cfg: DictConfig, token_scale: float, with_entropy: bool = True):
    """Clipped PPO loss of one micro-batch from ONE forward pass over prompt + response.

    ``token_scale`` turns the local masked sum into this process's share of the mean over all
    processes' tokens (DDP then averages), so N processes × B/N rows give the gradient of 1 × B.
    ``with_entropy=False`` skips the policy entropy (a pass over the vocabulary per token; must be on
    when ``ppo.ent_coef`` is not 0) and its ``policy/entropy`` stat.
    """
    full, full_mask, mask = mb["tokens", "full"], mb["masks", "full"], mb["masks", "response"]
    prompt_len = full.shape[1] - mask.shape[1]
    r = cfg.rollout
    # log π(a_t|s_t) under the sampling distribution and its entropy, [b, T]: the LM head runs at the
    # response positions only, and its [b, T, V] logits are touched once (models.response_logprobs)
    log_probs, entropy, values = policy(full, full_mask, prompt_len, labels=mb["action"], temperature=r.temperature,
                                        top_k=r.top_k, top_p=r.top_p, with_entropy=with_entropy or bool(cfg.ppo.ent_coef))

    n_local = mask.sum().clamp(min=1)
    pg_loss, pg_stats = policy_loss(log_probs, mb["sample_log_prob"], mb["advantage"], mask, cfg.ppo.clip_eps)
    vf_loss, vf_stats = value_loss(values, mb["values"], mb["returns"], mask, cfg.ppo.clip_eps_value)
    loss = pg_loss + cfg.ppo.vf_coef * vf_loss
    stats = {
        "loss/policy": pg_loss.detach(), "loss/value": vf_loss.detach(),
        "policy/clipfrac": pg_stats["clipfrac"], "policy/approx_kl": pg_stats["approx_kl"],
        "val/ratio": pg_stats["ratio_mean"], "val/clipfrac": vf_stats["clipfrac"],
    }
    if entropy is not None:
        ent = masked_mean(entropy, mask)
        if cfg.ppo.ent_coef:  # with no entropy bonus the entropy is only logged: no backward pass through it
            loss = loss - cfg.ppo.ent_coef * ent
        stats["policy/entropy"] = ent.detach()
    loss = loss * n_local * token_scale
    return loss, stats


def ppo_update(policy, optimizer, lr_scheduler, accelerator, td, cfg: DictConfig, generator: torch.Generator,
               fault_state: dict):
    """``num_epochs`` passes of minibatch PPO over the rollouts in ``td`` (batch ``[B]``).

    A minibatch whose rewards, log-probs, values, advantages or returns (:func:`finite_rows`), loss or
    gradient norm is not finite is skipped: no optimizer step, counted in ``fault_state["skipped"]``
    (logged as ``faults/skipped_updates``), its stats left out of the means. ``trainer.max_consecutive_faults``
    skips in a row raise ``FloatingPointError`` (the caller checkpoints the last good state).
    """
    B = td.batch_size[0]
    mbs, accum = cfg.ppo.minibatch_size, cfg.ppo.gradient_accumulation_steps
    micro = mbs // accum
    all_stats: list[dict] = []
    good_stats: list[dict] = []
    first_ratio = None
    for epoch in range(cfg.ppo.num_epochs):
        perm = torch.randperm(B, generator=generator)
        for start in range(0, B - mbs + 1, mbs):
            idx = perm[start:start + mbs]
            # global token count of this minibatch, so the loss is a mean over all processes' tokens:
            # DDP averages over processes (× num_processes undoes it) and accelerator.backward divides
            # by the accumulation steps (× accum undoes it; the micro-batch sums already add up)
            n_tokens = td["masks", "response"][idx].sum().float().to(accelerator.device)
            n_global = accelerator.reduce(n_tokens, "sum") if accelerator.num_processes > 1 else n_tokens
            token_scale = accelerator.num_processes * accum / n_global.clamp(min=1).item()
            mb_stats = []
            skipped = False
            for k in range(accum):
                mb = td[idx[k * micro:(k + 1) * micro]]
                with accelerator.accumulate(policy):
                    # the entropy is logged from the first epoch (later epochs need it only as a bonus)
                    loss, stats = ppo_loss(policy, mb, cfg, token_scale, with_entropy=epoch == 0)
                    finite = (torch.isfinite(loss) & finite_rows(mb).all()).float()
                    if accelerator.num_processes > 1:  # 1 only if finite everywhere (reduce has no "min")
                        finite = accelerator.reduce(finite, "mean")
                    if finite.item() < 1:
                        skipped = True
                        loss = loss.nan_to_num(0.0) * 0.0  # keep collectives in step; no update below
                    accelerator.backward(loss)
                    if accelerator.sync_gradients:
                        if skipped:
                            optimizer.zero_grad(set_to_none=True)
                            fault_state["skipped"] += 1
                            fault_state["consecutive"] += 1
                        else:
                            grad_norm = None
                            if cfg.ppo.max_grad_norm is not None:
                                grad_norm = accelerator.clip_grad_norm_(policy.parameters(), cfg.ppo.max_grad_norm)
                            if grad_norm is not None and not torch.isfinite(torch.as_tensor(grad_norm)):
                                optimizer.zero_grad(set_to_none=True)
                                fault_state["skipped"] += 1
                                fault_state["consecutive"] += 1
                            else:
                                optimizer.step()
                                lr_scheduler.step()
                                fault_state["consecutive"] = 0
                            if grad_norm is not None:
                                stats["policy/grad_norm"] = torch.as_tensor(grad_norm).float()
                        optimizer.zero_grad(set_to_none=True)
                if first_ratio is None:
                    first_ratio = stats["val/ratio"]
                mb_stats.append(stats)
            if fault_state["consecutive"] >= cfg.trainer.max_consecutive_faults:
                raise FloatingPointError(
                    f"{fault_state['consecutive']} PPO updates in a row were skipped for non-finite rewards, "
                    f"log-probs, advantages, loss or gradients (trainer.max_consecutive_faults="
                    f"{cfg.trainer.max_consecutive_faults})")
            all_stats += mb_stats
            good_stats += [] if skipped or fault_state["consecutive"] else mb_stats
    used = good_stats or all_stats  # all skipped: the (non-finite) stats show it
    keys = {k for s in used for k in s}
    out = {k: torch.stack([s[k].float().cpu() for s in used if k in s]).mean() for k in keys}
    out["val/first_ratio"] = first_ratio
    return out
