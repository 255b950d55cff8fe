"""Stage 1 of the pipeline: supervised fine-tuning (SFT) of the policy language model.

``train_sft(cfg, tokenizer, out_dir)`` reads the ``sft`` config section (``conf/sft/*.yaml``):

  1. data: token tensors ``input_ids [N, L]`` / ``attention_mask [N, L]`` (right-padded), for training
     and validation, from the function ``sft.examples`` names (the task's: the movie reviews' in
     ``rlhf_train/tasks/movie_reviews/hooks.py``, TL;DR ``prompt + label`` texts in :func:`text_sft_examples`);
  2. model: a ``transformers`` causal LM from ``sft.init`` (hub name / local dir, e.g. ``gpt2``) or,
     with ``sft.init=null``, randomly initialised from the ``policy.config`` architecture;
  3. ``sft.max_steps`` AdamW steps on the causal-LM loss (next-token cross-entropy over every real
     token; padding is ignored), linear warm-up then cosine decay to ``min_lr_ratio * lr``;
  4. validation loss (mean per-token cross-entropy, nats) every ``eval_every`` steps and at the end;
  5. ``save_pretrained`` of model and tokenizer into ``out_dir`` (the RL stage loads it from there).

With ``sft.lora.r > 0`` step 2 puts a LoRA adapter on the ``sft.init`` model (peft,
:mod:`rlhf_train.models.lora`) and only the adapter trains; step 5 saves the adapter in
``out_dir/adapter`` and the merged model (:func:`~rlhf_train.models.export.merged_copy`) in ``out_dir``: a plain model for the RL
stage, whose own ``policy.lora`` (if any) is then a fresh adapter on it.

The training-loop helpers here (:func:`make_optimizer`, :func:`batches`) are shared with the reward
model stage (:mod:`rlhf_train.pipeline.reward_training`).
"""
from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Any, Iterator

import torch
from omegaconf import DictConfig

from rlhf_train.infra.errors import ConfigError
from rlhf_train.models.lora import apply_lora, is_peft_model, lora_settings

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------
# Shared helpers (SFT and reward model)
# --------------------------------------------------------------------------------------------
def make_optimizer(params, scfg: DictConfig, total_steps: int):
    """AdamW + linear warm-up + cosine decay to ``min_lr_ratio * lr`` (one scheduler step per update)."""
    from torch.optim.lr_scheduler import LambdaLR

    params = [p for p in params if p.requires_grad]
    fused = all(p.device.type in ("cpu", "cuda") and p.dtype == torch.float32 for p in params)
    opt = torch.optim.AdamW(params, lr=scfg.lr, betas=tuple(scfg.betas), weight_decay=scfg.weight_decay,
                            fused=fused or None)  # fused: one kernel for all parameters (CPU and CUDA)
    warmup, floor = max(int(scfg.warmup_steps), 0), float(scfg.min_lr_ratio)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return opt, LambdaLR(opt, factor)


def batches(n: int, batch_size: int, seed: int) -> Iterator[torch.Tensor]:
    """Row indices ``[batch_size]`` forever: seeded permutations, epoch after epoch (last partial batch dropped,
    unless the data is smaller than one batch)."""
    g = torch.Generator().manual_seed(int(seed))
    batch_size = min(batch_size, n)
    while True:
        perm = torch.randperm(n, generator=g)
        for start in range(0, n - batch_size + 1, batch_size):
            yield perm[start:start + batch_size]


def trim(*tensors: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Cut right-padded ``[B, L]`` tensors to the batch's longest row (saves compute on short batches)."""
    width = int(mask.sum(-1).max().clamp(min=1))
    return tuple(t[:, :width] for t in tensors)


def check_positive(section: str, scfg: DictConfig, keys: tuple[str, ...]) -> None:
    for key in keys:
        value = scfg.get(key)
        if value is None or value <= 0:
            raise ConfigError(f"{section}.{key}={value} must be positive")


def load_text_dataset(name: str, split: str, key: str):
    """A Hugging Face dataset split (local ``save_to_disk`` dir, local files or a hub name); offline hub
    names fail with one line naming ``key``."""
    from rlhf_train.data.loading import load_hf_dataset

    try:
        return load_hf_dataset(name, split)
    except ConfigError as err:
        raise ConfigError(str(err).replace("data.dataset", key)) from None


def encode_texts(tokenizer, texts: list[str], max_len: int) -> dict[str, torch.Tensor]:
    """``texts + EOS``, truncated **from the left** to ``max_len`` tokens (the end, e.g. a summary, is
    kept), right-padded: ``input_ids [N, max_len]``, ``attention_mask [N, max_len]``."""
    eos = tokenizer.eos_token
    old = tokenizer.truncation_side, tokenizer.padding_side
    tokenizer.truncation_side, tokenizer.padding_side = "left", "right"
    try:
        enc = tokenizer([t + eos for t in texts], max_length=max_len, truncation=True, padding="max_length",
                        add_special_tokens=False, return_tensors="pt")
    finally:
        tokenizer.truncation_side, tokenizer.padding_side = old
    return {"input_ids": enc["input_ids"].long(), "attention_mask": enc["attention_mask"].long()}


def task_hook(cfg: DictConfig, key: str):
    """The function a dotted-path config key names (``sft.examples``, ``rm.pairs``, ``evaluation.judge_fn``,
    ...): how the pipeline reaches a task's code without importing it; ``None`` when the key is null.
    One ConfigError naming ``key`` when the path does not import."""
    from hydra.utils import get_method
    from omegaconf import OmegaConf

    path = OmegaConf.select(cfg, key)
    if not path:
        return None
    try:
        return get_method(str(path))
    except Exception as err:  # ImportError / AttributeError, wrapped by Hydra
        raise ConfigError(f"{key}='{path}' does not name an importable function ({type(err).__name__}); set "
                          f"{key}=<package.module.function>") from None


# --------------------------------------------------------------------------------------------
# 1. data
# --------------------------------------------------------------------------------------------
def text_sft_examples(cfg: DictConfig, tokenizer) -> tuple[dict, dict]:
    """``sft.examples`` of the TL;DR recipe: ``prompt + label`` texts of ``sft.dataset`` (CarperAI/
    openai_summarize_tldr: ``prompt`` is post + "TL;DR:", ``label`` the summary), ``[N, sft.max_len]``."""
    s = cfg.sft
    out = []
    for split, limit in ((s.train_split, s.max_train_examples), (s.val_split, s.max_eval_examples)):
        ds = load_text_dataset(s.dataset, split, "sft.dataset")
        ds = ds.select(range(min(len(ds), limit))) if limit is not None else ds
        out.append(encode_texts(tokenizer, [p + l for p, l in zip(ds["prompt"], ds["label"])], s.max_len))
    return out[0], out[1]


def sft_data(cfg: DictConfig, tokenizer) -> tuple[dict, dict]:
    """(train, validation) token tensors ``{"input_ids", "attention_mask"}``, each ``[N, sft.max_len]``: from
    the function ``sft.examples`` names (the task's own, e.g. the movie reviews' or :func:`text_sft_examples`)."""
    examples = task_hook(cfg, "sft.examples")
    if examples is None:
        raise ConfigError("sft.examples is null: set it to the function that gives the SFT data "
                          "(e.g. rlhf_train.pipeline.sft.text_sft_examples)")
    return examples(cfg, tokenizer)


# --------------------------------------------------------------------------------------------
# 2-5. model, training, validation, save
# --------------------------------------------------------------------------------------------
def build_sft_model(cfg: DictConfig, tokenizer):
    from rlhf_train.models.loading import build_causal_lm

    s = cfg.sft
    config = None if s.init else dict(cfg.policy.config)
    return build_causal_lm(s.init, config, tokenizer, cfg.policy.trust_remote_code, s.dropout, "sft.init")


@torch.no_grad()
def lm_loss(lm, data: dict, batch_size: int) -> float:
    """Mean per-token next-token cross-entropy (nats) of ``lm`` on ``data`` (batched, no grad)."""
    was_training = lm.training
    lm.eval()
    total, count = 0.0, 0
    for start in range(0, data["input_ids"].shape[0], batch_size):
        ids, mask = (data[k][start:start + batch_size] for k in ("input_ids", "attention_mask"))
        ids, mask = trim(ids, mask, mask=mask)
        n = int(mask[:, 1:].sum())
        if n == 0:
            continue
        out = lm(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
        total, count = total + float(out.loss) * n, count + n
    lm.train(was_training)
    return total / max(count, 1)


def train_sft(cfg: DictConfig, tokenizer, out_dir: str | Path) -> dict[str, Any]:
    """Run the SFT stage (module docstring) and save into ``out_dir``; returns its metrics."""
    s = cfg.sft
    check_positive("sft", s, ("max_len", "batch_size", "max_steps", "lr", "eval_every"))
    lora = s.get("lora")
    if lora_settings(lora, "sft.lora") is not None and not s.init:
        raise ConfigError("sft.lora.r>0 trains an adapter on a pretrained model, but sft.init is null (a random "
                          "model): set sft.init=<model dir or hub name>, or sft.lora.r=0")
    torch.manual_seed(s.seed)
    t0 = time.perf_counter()
    # 1. data
    train, val = sft_data(cfg, tokenizer)
    if train["input_ids"].shape[0] == 0:
        raise ConfigError("the SFT training set is empty; check sft.examples / sft.dataset / sft.max_train_examples")
    # 2. model
    lm = build_sft_model(cfg, tokenizer)
    lm = apply_lora(lm, lora, key="sft.lora")  # r = 0: lm itself; the optimizer takes its trainable parameters
    lm.train()
    opt, sched = make_optimizer(lm.parameters(), s, s.max_steps)
    rows = batches(train["input_ids"].shape[0], s.batch_size, s.seed)
    history: list[dict] = []
    val_loss = lm_loss(lm, val, s.eval_batch_size)
    history.append({"step": 0, "val/loss": val_loss})
    log.info("[sft] %d training / %d validation sequences of %d tokens; %d steps; val loss %.3f at step 0",
             train["input_ids"].shape[0], val["input_ids"].shape[0], s.max_len, s.max_steps, val_loss)
    # 3. AdamW steps on the causal-LM loss
    running = None
    for step in range(1, s.max_steps + 1):
        idx = next(rows)
        ids, mask = trim(train["input_ids"][idx], train["attention_mask"][idx], mask=train["attention_mask"][idx])
        loss = lm(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss
        loss.backward()
        if s.grad_clip:
            torch.nn.utils.clip_grad_norm_(lm.parameters(), s.grad_clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        running = loss.item() if running is None else 0.9 * running + 0.1 * loss.item()
        # 4. validation loss
        if step % s.eval_every == 0 or step == s.max_steps:
            val_loss = lm_loss(lm, val, s.eval_batch_size)
            history.append({"step": step, "train/loss": running, "val/loss": val_loss})
            log.info("[sft] step %d/%d: train loss %.3f, val loss %.3f (%.0f s)", step, s.max_steps, running,
                     val_loss, time.perf_counter() - t0)
    # 5. save
    lm.eval()
    if is_peft_model(lm):  # LoRA: the adapter, then the merged plain model the RL stage loads
        from rlhf_train.models.export import merged_copy

        lm.save_pretrained(str(Path(out_dir) / "adapter"))
        lm = merged_copy(lm)  # (unties a tied lm_head that carries an adapter first: the merge is what trained)
    lm.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))
    return {"sft/val_loss": val_loss, "sft/val_perplexity": math.exp(min(val_loss, 50.0)),
            "sft/train_loss": running, "sft/steps": s.max_steps, "history": history}
