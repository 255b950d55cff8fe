"""The PPO loop. ``train(cfg)`` reads top to bottom; the math lives in :mod:`rlhf_train.ppo_math`.

Each iteration:
  1. next prompt batch (each process its own shard)
  2. ``RolloutFromModel``: generate, then one forward pass each of policy (log-probs, values),
     reference and reward model; the transform stack shapes the reward
  3. GAE over response tokens, advantages whitened over all processes' tokens
  4. PPO epochs over minibatches (gradient accumulation through Accelerate)
  5. step the KL controller with the mean per-sequence KL of all processes
  6. log metrics reduced over processes (main process only); checkpoint every N iterations
"""
from __future__ import annotations

import contextlib
import math
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from rlhf_train import ppo_math
from rlhf_train.checkpoint import load_checkpoint, resolve_resume, save_checkpoint
from rlhf_train.errors import ConfigError
from rlhf_train.logger import build_logger, redact
from rlhf_train.models import context_length
from rlhf_train.rollout import RolloutFromModel
from rlhf_train.run_dir import check_writable
from rlhf_train.sweep import write_final_metrics
from rlhf_train.transforms import build_transform_stack, check_transform_stack

PREEMPTED_EXIT_CODE = 143  # 128 + SIGTERM: what schedulers (SLURM, k8s) read as "terminated, requeue"


# --------------------------------------------------------------------------------------------
# Building the components from the config
# --------------------------------------------------------------------------------------------
@dataclass
class Components:
    tokenizer: Any
    policy: Any
    ref_model: Any
    reward_model: Any
    kl_controller: Any
    dataset: Any


def validate_config(cfg: DictConfig) -> None:
    """Bad values that Hydra's types cannot catch: one clear error before any work starts."""
    checks = [
        ("rollout.max_new_tokens", cfg.rollout.max_new_tokens),
        ("data.batch_size", cfg.data.batch_size),
        ("ppo.minibatch_size", cfg.ppo.minibatch_size),
        ("ppo.num_epochs", cfg.ppo.num_epochs),
        ("ppo.gradient_accumulation_steps", cfg.ppo.gradient_accumulation_steps),
        ("trainer.num_iterations", cfg.trainer.num_iterations),
        ("trainer.checkpoint_every", cfg.trainer.checkpoint_every),
        ("trainer.samples_every", cfg.trainer.samples_every),
        ("trainer.max_consecutive_faults", cfg.trainer.max_consecutive_faults),
    ]
    if cfg.rollout.get("logprob_batch_size") is not None:
        checks.append(("rollout.logprob_batch_size", cfg.rollout.logprob_batch_size))
    if "target" in cfg.kl_controller:
        checks += [("kl_controller.target", cfg.kl_controller.target), ("kl_controller.horizon", cfg.kl_controller.horizon)]
    for key, value in checks:
        if value is None or value <= 0:
            raise ConfigError(f"{key}={value} must be positive")
    if cfg.ppo.minibatch_size % cfg.ppo.gradient_accumulation_steps:
        raise ConfigError(f"ppo.minibatch_size={cfg.ppo.minibatch_size} must be a multiple of "
                          f"ppo.gradient_accumulation_steps={cfg.ppo.gradient_accumulation_steps}")
    if cfg.rollout.temperature <= 0:
        raise ConfigError(f"rollout.temperature={cfg.rollout.temperature} must be positive")
    if cfg.trainer.keep_checkpoints < 0:
        raise ConfigError(f"trainer.keep_checkpoints={cfg.trainer.keep_checkpoints} must be >= 0 (0 keeps all)")
    # the reward-shaping stack is built after the models: check it now (KL estimator names, then a dry
    # run of every entry on a stand-in rollout, which is cheap: no model is involved)
    for name, entry in (cfg.get("transforms") or {}).items():
        estimator = entry.get("estimator") if hasattr(entry, "get") else None
        if estimator is not None and estimator not in ppo_math.KL_ESTIMATORS:
            raise ConfigError(f"transforms.{name}.estimator='{estimator}' is not valid; choose one of: "
                              f"{', '.join(ppo_math.KL_ESTIMATORS)}")
    check_transform_stack(cfg.get("transforms"))


def instantiate_or_config_error(*args, **kwargs):
    """``hydra.utils.instantiate``, except that a :class:`ConfigError` raised by the target comes out as
    itself (the one line the user sees) rather than wrapped in Hydra's InstantiationException."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    try:
        return instantiate(*args, **kwargs)
    except InstantiationException as err:
        cause = err.__cause__
        while cause is not None and not isinstance(cause, ConfigError):
            cause = cause.__cause__
        if cause is None:
            raise
        raise cause from None


def build_components(cfg: DictConfig, device: torch.device | str = "cpu") -> Components:
    """Instantiate tokenizer, policy, reference, reward model, KL controller and prompt dataset."""
    instantiate = instantiate_or_config_error

    # a model with neither weights nor an architecture would silently be a random full-size GPT-2
    # (e.g. `reward_model=pretrained` without a path: Hydra keeps the schema's null under its `???`)
    for group, what in (("policy", "a local model dir"), ("reward_model", "the dir of a trained reward model")):
        node = cfg.get(group)
        if node is not None and "pretrained" in node and (
                OmegaConf.is_missing(node, "pretrained") or not node.pretrained) and not node.get("config"):
            raise ConfigError(f"{group}.pretrained is not set (and {group}.config is empty): "
                              f"set {group}.pretrained=<{what}>")
    tokenizer = instantiate(cfg.tokenizer)
    policy = instantiate(cfg.policy, tokenizer=tokenizer)
    ref_model = instantiate(cfg.ref_model, policy=policy, tokenizer=tokenizer, device=None, _convert_="all")
    ref_model.to(cfg.ref_model.device or device)
    reward_model = instantiate(cfg.reward_model, tokenizer=tokenizer, device=None)
    reward_model.to(cfg.reward_model.device or device)
    kl_controller = instantiate(cfg.kl_controller)
    data_kwargs = {k: v for k, v in cfg.data.items() if k not in ("batch_size", "num_workers")}
    dataset = instantiate(data_kwargs, tokenizer=tokenizer)
    check_fits(cfg, policy, dataset)
    check_reward_model(reward_model, dataset)
    return Components(tokenizer, policy, ref_model, reward_model, kl_controller, dataset)


def check_fits(cfg: DictConfig, policy, dataset) -> None:
    ctx = context_length(policy.lm)
    need = dataset.prompt_width + cfg.rollout.max_new_tokens
    if ctx is not None and need > ctx:
        raise ConfigError(f"prompts ({dataset.prompt_width} tokens) + rollout.max_new_tokens "
                          f"({cfg.rollout.max_new_tokens}) = {need} exceed the policy's context of {ctx} tokens; "
                          f"lower data.max_prompt_length / data.max_prompt_tokens or rollout.max_new_tokens")
    if len(dataset) < cfg.data.batch_size:
        raise ConfigError(f"the prompt dataset has {len(dataset)} prompts, fewer than data.batch_size="
                          f"{cfg.data.batch_size}")
    if cfg.ppo.minibatch_size > cfg.data.batch_size:
        raise ConfigError(f"ppo.minibatch_size={cfg.ppo.minibatch_size} exceeds data.batch_size={cfg.data.batch_size}")


@torch.no_grad()
def check_reward_model(reward_model, dataset) -> None:
    """Probe the reward model on 2 prompts: it must return ``(rewards [B, L], end_scores [B])``."""
    n = min(2, len(dataset))
    probe = [dataset[i] for i in range(n)]
    device = next(reward_model.parameters(), torch.zeros(())).device
    ids = torch.stack([p["input_ids"] for p in probe]).to(device)
    mask = torch.stack([p["attention_mask"] for p in probe]).to(device)
    try:
        out = reward_model(input_ids=ids, attention_mask=mask)
    except Exception as err:
        raise ConfigError(f"the reward model fails on a probe batch of {n} prompts ({type(err).__name__}: {err}); "
                          f"check reward_model") from None
    shapes = [tuple(o.shape) for o in out] if isinstance(out, (tuple, list)) else None
    if (shapes is None or len(shapes) != 2 or not all(isinstance(o, torch.Tensor) for o in out)
            or shapes[1] not in ((n,), (n, 1)) or len(shapes[0]) != 2 or shapes[0][0] != n):
        got = shapes if shapes is not None else f"{type(out).__name__} {tuple(getattr(out, 'shape', ()))}"
        raise ConfigError(f"the reward model's output has the wrong shape: on {n} prompts of {ids.shape[1]} tokens "
                          f"it returned {got}, expected (rewards [{n}, L], end_scores [{n}]); check reward_model")


def make_lr_scheduler(cfg: DictConfig, optimizer, num_update_steps: int):
    from transformers import get_scheduler

    return get_scheduler(cfg.scheduler.name, optimizer, num_warmup_steps=cfg.scheduler.warmup_steps,
                         num_training_steps=max(num_update_steps, 1))


class PreemptionHandler:
    """First SIGTERM/SIGINT: finish the current iteration, checkpoint, exit 143. Second: exit at once."""

    def __init__(self):
        self.requested = False
        self._old = {}

    def install(self) -> "PreemptionHandler":
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread (e.g. inside some launchers)
                pass
        return self

    def _handle(self, signum, frame):
        if self.requested:
            os._exit(128 + signum)
        self.requested = True
        print(f"[rlhf_train] received {signal.Signals(signum).name}: finishing this iteration, then "
              f"checkpointing and exiting (send it again to exit at once)", flush=True)

    def restore(self) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)


# --------------------------------------------------------------------------------------------
# PPO update
# --------------------------------------------------------------------------------------------
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
    pg_loss, pg_stats = ppo_math.policy_loss(log_probs, mb["sample_log_prob"], mb["advantage"], mask, cfg.ppo.clip_eps)
    vf_loss, vf_stats = ppo_math.value_loss(values, mb["values"], mb["returns"], mask, cfg.ppo.clip_eps_value)
    loss = pg_loss + cfg.ppo.vf_coef * vf_loss
    stats = {
        "loss/policy": pg_loss.detach(), "loss/value": vf_loss.detach(),
        "policy/clipfrac": pg_stats["clipfrac"], "policy/approx_kl": pg_stats["approx_kl"],
        "val/ratio": pg_stats["ratio_mean"], "val/clipfrac": vf_stats["clipfrac"],
    }
    if entropy is not None:
        ent = ppo_math.masked_mean(entropy, mask)
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


# --------------------------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------------------------
def _rollout_metrics(td) -> dict:
    mask = td["masks", "response"]
    nxt = td["next"]
    return {
        "objective/reward_raw": nxt["reward_raw"].sum(-1).mean(),   # shaped score per sequence
        "objective/reward_kl": nxt["reward_kl"].sum(-1).mean(),     # KL penalty per sequence
        "objective/reward_total": nxt["reward"].sum(-1).mean(),     # the sum PPO maximises
        "objective/score": nxt["score_raw"].mean(),                 # raw reward-model score
        "objective/kl": td["kl_per_sequence"].mean(),               # mean per-sequence KL (nats)
        "objective/kl_coef": td["kl_coef"][0],
        "objective/entropy_sampled": -(td["sample_log_prob"].sum(-1)).mean(),
        "response/length": mask.sum(-1).float().mean(),
        "response/eos_rate": nxt["terminated"].any(-1).float().mean(),
        "val/value_mean": ppo_math.masked_mean(td["values"], mask),
        "val/advantage_mean_raw": ppo_math.masked_mean(td["advantage_raw"], mask),
        "val/return_mean": ppo_math.masked_mean(td["returns"], mask),
    }


def _reduce_metrics(metrics: dict, accelerator) -> dict:
    names = sorted(metrics)
    vals = torch.stack([torch.as_tensor(metrics[k], dtype=torch.float32).reshape(()) for k in names]).to(accelerator.device)
    if accelerator.num_processes > 1:
        vals = accelerator.reduce(vals, "mean")
    return {k: float(v) for k, v in zip(names, vals.cpu())}


def _samples(td, tokenizer, n: int = 4) -> list[dict]:
    tok = td["tokens"]
    rows = []
    for i in range(min(n, td.batch_size[0])):
        prompt = tok.prompt[i][td["masks", "prompt"][i]]
        response = tok.response[i][td["masks", "response"][i]]
        rows.append({"prompt": tokenizer.decode(prompt), "response": tokenizer.decode(response),
                     "score": float(td["next", "score_raw"][i]),
                     "reward": float(td["next", "reward"][i].sum())})
    return rows


def infinite_batches(loader, accelerator, start_epoch: int = 0, skip: int = 0):
    """Yield ``(epoch, index_in_epoch, batch)`` forever; resumes mid-epoch by skipping consumed batches."""
    epoch = start_epoch
    while True:
        if hasattr(loader, "set_epoch"):
            loader.set_epoch(epoch)
        it = accelerator.skip_first_batches(loader, skip) if skip else loader
        for i, batch in enumerate(it, start=skip):
            yield epoch, i, batch
        epoch, skip = epoch + 1, 0


def _cpu_only_multiprocess() -> bool:
    """Launched as several processes (``accelerate launch --multi_gpu``/torchrun) on a machine without
    GPUs: Accelerate only forms the process group (gloo) when told ``cpu=True``; otherwise each process
    would silently train alone."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or torch.cuda.is_available():
        return False
    from accelerate.utils import is_mlu_available, is_npu_available, is_xpu_available

    return not (is_xpu_available() or is_npu_available() or is_mlu_available())


@contextlib.contextmanager
def full_weights(policy, accelerator):
    """Rollouts call the unwrapped policy (``generate`` + one scoring pass), which needs whole weights.

    FSDP gathers them with ``summon_full_params`` and DeepSpeed ZeRO-3 with ``GatheredParameters``
    (every process then holds the full weights for the rollout); DDP and ZeRO-1/2 already do.
    Collective under FSDP / ZeRO-3: every process enters it.
    """
    from accelerate.utils import DistributedType

    kind = accelerator.distributed_type
    if kind == DistributedType.FSDP:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        with FSDP.summon_full_params(policy, writeback=False, recurse=True):
            yield
    elif kind == DistributedType.DEEPSPEED and accelerator.state.deepspeed_plugin.zero_stage == 3:
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(policy.parameters()), modifier_rank=None):
            yield
    else:
        yield


def _in_policy_precision(ref_log_prob_fn, accelerator):
    """Run the reference under the policy's autocast (bf16/fp16), as the policy's own pass is: π_ref is a
    copy of the initial policy, so the first iteration's KL is then exactly 0. Log-probs stay fp32."""

    def ref_log_probs(full, full_mask, prompt_len):
        with accelerator.autocast():
            return ref_log_prob_fn(full, full_mask, prompt_len)

    return ref_log_probs


def _main_process_run_dir(run_dir: Path, accelerator) -> Path:
    """Rank 0's run dir, on every process (Hydra's timestamped default could differ by a second)."""
    if accelerator.num_processes == 1:
        return run_dir
    from accelerate.utils import broadcast_object_list

    return Path(broadcast_object_list([str(run_dir)], from_process=0)[0])


def train(cfg: DictConfig, run_dir: str | Path | None = None) -> dict:
    """Run PPO as configured; returns the last iteration's metrics. See the module docstring."""
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration, set_seed
    from torch.utils.data import DataLoader

    from rlhf_train.data.prompts import collate

    # 0. set-up: validate, seed, build components, let Accelerate prepare model/optimizer/data
    validate_config(cfg)
    run_dir = Path(run_dir or os.getcwd())
    if cfg.trainer.num_threads:
        torch.set_num_threads(cfg.trainer.num_threads)
    accelerator = Accelerator(
        cpu=cfg.trainer.cpu or _cpu_only_multiprocess(), mixed_precision=cfg.trainer.mixed_precision,
        gradient_accumulation_steps=cfg.ppo.gradient_accumulation_steps,
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
    )
    run_dir = _main_process_run_dir(run_dir, accelerator)  # every process uses rank 0's run dir
    if getattr(accelerator, "is_fsdp2", False):
        raise ConfigError("FSDP2 (fsdp_version: 2 in the accelerate config) is not supported: rollouts need the "
                          "full weights; use fsdp_version: 1 (conf/accelerate/fsdp.yaml)")
    if accelerator.is_main_process:
        check_writable(run_dir, "hydra.run.dir")  # probes with a temp file (os.access lies for root)
        run_dir.mkdir(parents=True, exist_ok=True)
    set_seed(cfg.trainer.seed)  # same initial weights on every process
    resume_path = resolve_resume(cfg.trainer.resume, run_dir)
    comps = build_components(cfg, accelerator.device)
    optimizer_cfg = OmegaConf.to_container(cfg.optimizer, resolve=True)
    from hydra.utils import instantiate

    optimizer = instantiate(optimizer_cfg, params=comps.policy.parameters())
    updates_per_iter = cfg.ppo.num_epochs * (cfg.data.batch_size // cfg.ppo.minibatch_size)
    lr_scheduler = make_lr_scheduler(cfg, optimizer, updates_per_iter * cfg.trainer.num_iterations)
    loader = DataLoader(comps.dataset, batch_size=cfg.data.batch_size, shuffle=True, drop_last=True,
                        collate_fn=collate, num_workers=cfg.data.num_workers,
                        generator=torch.Generator().manual_seed(cfg.data.seed))
    # the LR scheduler is not prepared: Accelerate's wrapper steps it num_processes times per update
    # (it assumes the schedule counts single-process batches); ours counts optimizer updates
    policy, optimizer, loader = accelerator.prepare(comps.policy, optimizer, loader)
    # each process samples differently; the loop below re-seeds per process
    set_seed(cfg.trainer.seed + accelerator.process_index)

    gather = (lambda t: accelerator.gather(t.to(accelerator.device)).cpu()) if accelerator.num_processes > 1 else None
    ref_fn = None
    if cfg.transforms.get("ref_logprob") and cfg.transforms.ref_logprob.get("use_ray_service"):
        from rlhf_train.ray_service import ray_ref_log_prob_fn

        ref_fn = ray_ref_log_prob_fn(cfg, comps.ref_model, run_dir)
        comps.ref_model.to("cpu")  # the actor holds the reference now; free the accelerator's memory
    rollout = RolloutFromModel(
        policy, comps.ref_model, comps.reward_model, max_new_tokens=cfg.rollout.max_new_tokens,
        score_clip=cfg.rollout.score_clip, kl_scheduler=comps.kl_controller, tokenizer=comps.tokenizer,
        temperature=cfg.rollout.temperature, top_k=cfg.rollout.top_k, top_p=cfg.rollout.top_p,
        do_sample=cfg.rollout.do_sample, gather_fn=gather, logprob_batch_size=cfg.rollout.logprob_batch_size,
        unwrap_fn=accelerator.unwrap_model, ref_log_prob_fn=ref_fn,
        # log-probs and values straight from generate's steps (no second policy pass), unless the loss's
        # forward runs under autocast while generate does not: then one scoring pass keeps ratio 1 exact
        logprobs_from_generate=accelerator.mixed_precision == "no",
    )
    if ref_fn is None and accelerator.mixed_precision != "no":
        rollout.ref_log_prob_fn = _in_policy_precision(rollout.ref_log_prob_fn, accelerator)
    rollout.transforms = build_transform_stack(
        cfg.transforms, ref_log_prob_fn=rollout.ref_log_prob_fn, eos_token_id=rollout.eos_token_id)

    start_iteration, epoch, batch_in_epoch, wandb_id = 0, 0, 0, None
    fault_state = {"skipped": 0, "consecutive": 0}
    if resume_path is not None:
        state = load_checkpoint(resume_path, accelerator=accelerator, policy=policy, optimizer=optimizer,
                                scheduler=lr_scheduler)
        comps.kl_controller.load_state_dict(state["kl_controller"])
        rollout._kl_queue.extend(torch.tensor(v) for v in state.get("kl_queue", []))
        start_iteration, wandb_id = state["iteration"], state.get("wandb_id")
        epoch, batch_in_epoch = state["data_epoch"], state["data_batch"]
        fault_state = state.get("faults", fault_state)
        if accelerator.is_main_process:
            print(f"[rlhf_train] resumed from {resume_path} at iteration {start_iteration}", flush=True)
    gen = torch.Generator().manual_seed(cfg.trainer.seed * 1000 + accelerator.process_index + start_iteration)
    if resume_path is not None and "ppo_generator" in state:
        gen.set_state(torch.tensor(state["ppo_generator"], dtype=torch.uint8))

    config_yaml = OmegaConf.to_yaml(OmegaConf.create(redact(OmegaConf.to_container(cfg, resolve=True))))
    logger = None
    if accelerator.is_main_process:
        logger = build_logger(cfg.logger, run_dir, OmegaConf.to_container(cfg, resolve=True),
                              resume_iteration=start_iteration if resume_path else None, resume_id=wandb_id)
    preempt = PreemptionHandler().install()
    batches = infinite_batches(loader, accelerator, epoch, batch_in_epoch)
    progress = None
    if accelerator.is_main_process and cfg.trainer.progress_bar:
        from tqdm.auto import tqdm

        progress = tqdm(total=cfg.trainer.num_iterations, initial=start_iteration, desc="PPO", dynamic_ncols=True)

    def checkpoint(iteration: int):
        st = {"kl_controller": comps.kl_controller.state_dict(),
              "kl_queue": [float(x) for q in rollout._kl_queue for x in q.reshape(-1)],
              "data_epoch": epoch, "data_batch": batch_in_epoch + 1, "faults": fault_state,
              "wandb_id": getattr(logger, "run_id", None) if logger else None,
              "ppo_generator": gen.get_state().tolist()}
        return save_checkpoint(run_dir, iteration, accelerator=accelerator, policy=policy, optimizer=optimizer,
                               scheduler=lr_scheduler, trainer_state=st, config_yaml=config_yaml,
                               tokenizer=comps.tokenizer, keep=cfg.trainer.keep_checkpoints)

    metrics: dict = {}
    history: list[dict] = []
    iteration = start_iteration
    try:
        for iteration in range(start_iteration + 1, cfg.trainer.num_iterations + 1):
            t0 = time.perf_counter()
            # 1. next prompt batch (this process's shard)
            epoch, batch_in_epoch, batch = next(batches)
            # 2. rollout: generate + one pass each of policy, reference, reward model; reward shaping
            policy.eval()
            with full_weights(policy, accelerator):  # FSDP / ZeRO-3: gather the shards for generate
                td = rollout.rollout_from_data(batch)
            t_rollout = time.perf_counter() - t0
            # 3. GAE over response tokens; advantages whitened over all processes' response tokens
            mask = td["masks", "response"]
            advantage, returns = ppo_math.gae(td["next", "reward"], td["values"], mask, cfg.ppo.gamma, cfg.ppo.lam)
            td.set("advantage_raw", advantage)
            td.set("returns", returns)
            if cfg.ppo.whiten_advantages:  # a faulty (non-finite) row must not poison the others' statistics
                advantage = global_masked_whiten(advantage, mask & finite_rows(td)[:, None], accelerator)
            td.set("advantage", advantage)
            # 4. PPO epochs over minibatches (policy stays in eval mode: dropout is off by design)
            t1 = time.perf_counter()
            ppo_stats = ppo_update(policy, optimizer, lr_scheduler, accelerator, td, cfg, gen, fault_state)
            t_update = time.perf_counter() - t1
            # 5. the KL controller steps with the mean per-sequence KL of all processes
            kl_coef_used = rollout.kl_coef
            rollout.step_scheduler()
            # 6. metrics reduced over processes, logged by the main process; checkpoints
            metrics = {**_rollout_metrics(td), **ppo_stats, "objective/kl_coef": kl_coef_used,
                       "objective/kl_coef_next": rollout.kl_coef,
                       "faults/skipped_updates": fault_state["skipped"],
                       "time/rollout_s": t_rollout, "time/update_s": t_update,
                       "time/iteration_s": time.perf_counter() - t0, "lr": lr_scheduler.get_last_lr()[0]}
            metrics = _reduce_metrics(metrics, accelerator)
            samples = _samples(td, comps.tokenizer) if iteration % cfg.trainer.samples_every == 0 else None
            if accelerator.is_main_process:
                logger.log(metrics, iteration)
                if samples:
                    logger.log_samples(samples, iteration)
                if progress is not None:
                    progress.update(1)
                    progress.set_postfix(score=f"{metrics['objective/score']:.3f}", kl=f"{metrics['objective/kl']:.2f}")
            history.append({"iteration": iteration, **metrics})
            stop = preempt.requested
            if accelerator.num_processes > 1:
                flag = accelerator.reduce(torch.tensor(float(stop), device=accelerator.device), "sum")
                stop = bool(flag.item() > 0)  # any process signalled: all stop together
            if iteration % cfg.trainer.checkpoint_every == 0 or iteration == cfg.trainer.num_iterations or stop:
                checkpoint(iteration)
            if stop and iteration < cfg.trainer.num_iterations:  # (a signal during the last iteration: done anyway)
                if accelerator.is_main_process:
                    print(f"[rlhf_train] preempted: checkpoint written at iteration {iteration} in "
                          f"{run_dir}/checkpoints; resume with trainer.resume=auto", flush=True)
                raise SystemExit(PREEMPTED_EXIT_CODE)
    except FloatingPointError as err:
        # skipped updates never touch the weights: the current ones are the last good state. Checkpoint
        # them (with a fresh fault budget for whoever resumes) unless they are somehow non-finite too.
        weights_ok = all(torch.isfinite(p).all() for p in accelerator.unwrap_model(policy).parameters())
        if weights_ok:
            fault_state["consecutive"] = 0
            where = f"the last good state is checkpointed in {checkpoint(iteration)}"
        else:
            where = f"the weights are not finite; the newest checkpoint in {run_dir}/checkpoints is the last good state"
        raise FloatingPointError(f"stopped at iteration {iteration}: {err}; {where}") from None
    finally:
        preempt.restore()
        if progress is not None:
            progress.close()
        if logger is not None:
            logger.finish()
    if accelerator.is_main_process:  # final_metrics.json: what a sweep report reads (rlhf_train/sweep.py)
        write_final_metrics(run_dir, metrics, history)
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return {"metrics": metrics, "history": history, "policy": accelerator.unwrap_model(policy),
            "components": comps, "rollout": rollout}
