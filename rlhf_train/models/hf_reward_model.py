"""Reward models in Hugging Face's standard format: ``AutoModelForSequenceClassification`` with one label
(what TRL's ``RewardTrainer`` writes, and what hub reward models are), loaded **with their trained head**.

:class:`SequenceClassifierRewardModel` gives such a model :class:`~rlhf_train.models.reward_model.RewardModel`'s
interface, ``(input_ids [B, L], attention_mask [B, L]) -> (rewards [B, L], end_scores [B])``; the score is
the model's own ``logits[:, 0]``, computed by the model's own forward (so it reads the score where
``AutoModelForSequenceClassification`` reads it: the last non-pad token).

Tokenizers: when the reward model's tokenizer is the policy's (same vocabulary), the policy's ids go in as
they are. When it differs, the policy's tokens are decoded to text and re-encoded with the reward model's
tokenizer (as :class:`~rlhf_train.models.reward_model.ReencodingRewardModel` does); :meth:`score_sequences`
(what :class:`~rlhf_train.rewards.sources.RewardModelSource` calls when present) additionally renders
chat prompts (a ``messages`` column) with the **reward model's** chat template, the completion as the
assistant turn, as TRL does for conversational data.
"""
from __future__ import annotations

import json
import os
from typing import Any

import torch
from torch import nn

from rlhf_train.core.containers import last_token_index, position_ids_from_mask
from rlhf_train.infra.errors import ConfigError
from rlhf_train.models.shared_prompt import trunk_hidden


def is_sequence_classifier_dir(path: str) -> bool:
    """True when ``path/config.json`` names a ``...ForSequenceClassification`` architecture."""
    cfg = os.path.join(path, "config.json")
    if not os.path.exists(cfg):
        return False
    with open(cfg) as f:
        archs = json.load(f).get("architectures") or []
    return any(str(a).endswith("ForSequenceClassification") for a in archs)


def has_tokenizer(path: str) -> bool:
    return any(os.path.exists(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json"))


def same_vocabulary(a: Any, b: Any) -> bool:
    """Two tokenizers map every token to the same id (then ids need no re-encoding)."""
    return a is b or (len(a) == len(b) and a.get_vocab() == b.get_vocab())


class SequenceClassifierRewardModel(nn.Module):
    """An ``AutoModelForSequenceClassification`` (one label) as a reward model; see the module docstring.

    ``rm_tokenizer``: the reward model's own tokenizer when it differs from ``policy_tokenizer`` (None: the
    policy's ids are the reward model's). ``max_length``: re-encoded texts are cut to this many tokens.
    """

    def __init__(self, model: nn.Module, policy_tokenizer: Any = None, rm_tokenizer: Any = None,
                 max_length: int | None = None):
        super().__init__()
        self.model, self.policy_tokenizer, self.rm_tokenizer = model, policy_tokenizer, rm_tokenizer
        self.max_length = max_length
        pad = model.config.pad_token_id
        if pad is None:  # a batch of several rows needs it to find each row's last token
            tok = rm_tokenizer or policy_tokenizer
            pad = tok.pad_token_id if tok is not None and tok.pad_token_id is not None else getattr(tok, "eos_token_id", 0)
            model.config.pad_token_id = pad

    @property
    def reencodes(self) -> bool:
        return self.rm_tokenizer is not None

    def _scores_of_ids(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        # right padding with the model's pad id: the model reads the score at the last non-pad token
        pad = self.model.config.pad_token_id
        ids = ids.masked_fill(~mask.bool(), pad)
        return self.model(input_ids=ids, attention_mask=mask.long()).logits[:, 0].float()

    def score_texts(self, texts: list[str]) -> torch.Tensor:
        """``[B]`` scores of plain texts, tokenized by the reward model's tokenizer (or the policy's)."""
        tok = self.rm_tokenizer or self.policy_tokenizer
        device = next(self.model.parameters()).device
        old, tok.padding_side = tok.padding_side, "right"
        try:
            enc = tok(texts, padding=True, truncation=self.max_length is not None, max_length=self.max_length,
                      return_tensors="pt", add_special_tokens=not _has_chat_markup(tok, texts))
        finally:
            tok.padding_side = old
        return self._scores_of_ids(enc["input_ids"].to(device), enc["attention_mask"].to(device))

    def _decode(self, ids: torch.Tensor, mask: torch.Tensor) -> list[str]:
        rows = [row[m].tolist() for row, m in zip(ids, mask.bool())]
        return self.policy_tokenizer.batch_decode(rows, skip_special_tokens=True)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor):
        if self.reencodes:
            end_scores = self.score_texts(self._decode(input_ids, attention_mask))
        else:
            end_scores = self._scores_of_ids(input_ids, attention_mask)
        end_scores = end_scores.to(input_ids.device)
        rewards = torch.zeros(input_ids.shape, dtype=end_scores.dtype, device=input_ids.device)
        rewards.scatter_(-1, last_token_index(attention_mask)[:, None], end_scores[:, None])
        return rewards, end_scores

    @torch.no_grad()
    def shared_prompt_scores(self, full: torch.Tensor, full_mask: torch.Tensor, prompt_len: int) -> torch.Tensor | None:
        """``[B]`` the scores of ``forward``, from the rollout's own layout (left-padded prompts of ``prompt_len``
        columns, then the responses) with each prompt that several rows share run once
        (:func:`rlhf_train.models.shared_prompt.trunk_hidden`); ``None`` when that does not apply (a re-encoding
        model, a classifier whose head is not a ``score`` linear layer). Positions count from each row's first
        real token and the score is read at its last token whose id is not the pad id: what the model's forward
        does on the right-padded rows ``forward`` receives, to float rounding."""
        trunk = getattr(self.model, getattr(self.model, "base_model_prefix", ""), None)
        head = getattr(self.model, "score", None)
        if self.reencodes or not isinstance(trunk, nn.Module) or not isinstance(head, nn.Linear):
            return None
        mask = full_mask.bool()
        not_pad = mask & (full != self.model.config.pad_token_id)
        columns = torch.arange(full.shape[1], device=full.device)
        last = torch.where(not_pad.any(-1), (columns * not_pad).argmax(-1), mask.long().argmax(-1))
        hidden = trunk_hidden(trunk, full, full_mask, prompt_len, position_ids_from_mask(full_mask))
        return head(hidden[torch.arange(full.shape[0], device=full.device), last]).float()[:, 0]

    def score_sequences(self, sequences) -> torch.Tensor | None:
        """The chat-aware path (re-encoding with a chat template and a ``messages`` column); ``None`` when it
        does not apply (the caller then uses ``forward``)."""
        msgs = sequences.columns.get("messages")
        tok = self.rm_tokenizer
        if tok is None or msgs is None or sequences.prompt_len is None or not getattr(tok, "chat_template", None):
            return None
        P = sequences.prompt_len
        completions = self._decode(sequences.full[:, P:], sequences.full_mask[:, P:])
        texts = [tok.apply_chat_template(list(m) + [{"role": "assistant", "content": c}], tokenize=False)
                 for m, c in zip(msgs, completions)]
        return self.score_texts(texts)


def _has_chat_markup(tok, texts: list[str]) -> bool:
    """A chat template already wrote the BOS (if any): do not add special tokens twice."""
    bos = getattr(tok, "bos_token", None)
    return bool(bos) and all(t.startswith(bos) for t in texts)


def load_sequence_classifier(path: str, policy_tokenizer: Any, trust_remote_code: bool = False,
                             override: str = "reward_model.pretrained") -> SequenceClassifierRewardModel:
    """``AutoModelForSequenceClassification.from_pretrained(path)`` with its trained head; one label required.
    The dir's own tokenizer is used (decode, re-encode) when its vocabulary differs from the policy's."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(path, trust_remote_code=trust_remote_code)
    if model.config.num_labels != 1:
        raise ConfigError(f"{override}={path} is a sequence classifier with {model.config.num_labels} labels; "
                          f"a reward model has one (num_labels=1, as TRL's RewardTrainer writes)")
    rm_tok = None
    if has_tokenizer(path):
        rm_tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        if rm_tok.pad_token is None:
            rm_tok.pad_token = rm_tok.eos_token
        if policy_tokenizer is not None and same_vocabulary(rm_tok, policy_tokenizer):
            rm_tok = None
    elif policy_tokenizer is None:
        raise ConfigError(f"{override}={path} has no tokenizer files and no policy tokenizer was given")
    rm = SequenceClassifierRewardModel(model, policy_tokenizer, rm_tok)
    if rm_tok is None:
        check_vocab(model.config.vocab_size, len(policy_tokenizer), override)
    return rm


def check_vocab(model_vocab: int | None, tokenizer_len: int, override: str) -> None:
    """A model fed the policy tokenizer's ids must have an embedding row for each of them."""
    if model_vocab is not None and model_vocab < tokenizer_len:
        raise ConfigError(f"vocabulary mismatch: the model of {override} has {model_vocab} token embeddings but the "
                          f"tokenizer has {tokenizer_len} tokens; use the model's own tokenizer (tokenizer.pretrained)")
