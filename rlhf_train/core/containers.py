"""Typed containers: token data after torchrl's ``Tokens`` / ``Masks`` / ``LogProbs``, and :class:`Rollout`.

Every rollout carries its tokens once per sequence, never once per timestep:

    prompt   [B, P]      left-padded prompt tokens (generation needs left padding)
    response [B, T]      generated tokens, right-padded with the pad id after EOS
    full     [B, P + T]  ``cat(prompt, response)``: what every model sees in its one forward pass

``Masks`` holds the matching boolean masks (1 = a real token), and ``LogProbs`` holds per-token
log-probabilities of the response tokens ([B, T], zero outside the response mask).

:class:`Rollout` is one batch of scored rollouts with every field declared (name, shape, meaning) in one
place; ``RolloutFromModel`` returns it and the reward-shaping stack rewrites it. :data:`TORCHRL_KEYS` maps its
fields to the keys of torchrl's rollout TensorDict (what :mod:`rlhf_train.compat.torchrl` returns).

Mask helpers beside them: position ids of a left-padded batch, the index of each row's last attended
token (where a reward model reads its score), EOS tests, and re-padding to the left or right.
"""
from __future__ import annotations

import torch
from tensordict import TensorClass, TensorDict, TensorDictBase


class Tokens(TensorClass["nocast"]):
    """Token ids: ``prompt [B, P]`` (left-padded), ``response [B, T]``, ``full [B, P+T]``."""

    prompt: torch.Tensor | None = None
    response: torch.Tensor | None = None
    full: torch.Tensor | None = None


class Masks(TensorClass["nocast"]):
    """Boolean masks aligned with :class:`Tokens`.

    ``prompt [B, P]``: non-pad prompt tokens. ``response [B, T]``: response tokens up to and including
    the first EOS. ``full [B, P+T]``: the attention mask of ``Tokens.full``. ``assistant [B, T]``: in a
    multi-turn episode (:mod:`rlhf_train.rollout.multi_turn`) the tokens the policy sampled, its assistant
    turns with their EOS; ``response`` then covers the whole episode after the first prompt, environment and
    tool tokens included (context, not actions). ``None`` in a single-turn rollout: every response token is
    sampled. :attr:`actions` is the mask log-probs, KL, advantages and losses are taken over.
    """

    prompt: torch.Tensor | None = None
    response: torch.Tensor | None = None
    full: torch.Tensor | None = None
    assistant: torch.Tensor | None = None

    @property
    def actions(self) -> torch.Tensor:
        """``[B, T]``: the tokens the policy sampled, its actions: ``assistant``, or ``response`` when unset."""
        return self.assistant if self.assistant is not None else self.response


class LogProbs(TensorClass["nocast"]):
    """Per-token log-probabilities; rlhf_train fills ``response [B, T]`` (the sampled tokens)."""

    prompt: torch.Tensor | None = None
    response: torch.Tensor | None = None
    full: torch.Tensor | None = None


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids ``[B, L]`` for a left-padded batch: 0 at the first real token.

    ``generate`` derives positions this way for left-padded prompts; the training forward pass must
    use the same positions or its log-probs would not match the sampling distribution.
    """
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def leading_padding(attention_mask: torch.Tensor) -> int:
    """How many leading columns of ``attention_mask [B, L]`` are padding in every row (0 when a row starts with a
    real token, or when no row has one). Dropping them changes no real token's position
    (:func:`position_ids_from_mask`) or what it attends to."""
    return int(attention_mask.bool().any(0).int().argmax())


def last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """``[B]`` index of the last attended token (works for left, right or both-side padding)."""
    L = attention_mask.shape[-1]
    return L - 1 - attention_mask.long().flip(-1).argmax(-1)


def is_eos(tokens: torch.Tensor, eos_token_id: int | list[int] | tuple[int, ...] | torch.Tensor) -> torch.Tensor:
    """``tokens == eos`` for one EOS id, or membership in several (e.g. ``<|im_end|>`` and ``<|endoftext|>``)."""
    if isinstance(eos_token_id, int):
        return tokens == eos_token_id
    ids = torch.as_tensor(eos_token_id, dtype=tokens.dtype, device=tokens.device).reshape(-1)
    return tokens == ids[0] if ids.numel() == 1 else torch.isin(tokens, ids)


def response_mask_from_tokens(response: torch.Tensor, eos_token_id: int | list[int] | tuple[int, ...]) -> torch.Tensor:
    """``[B, T]`` bool: response positions up to and including the first EOS (all if none); with several EOS
    ids, the first of any of them ends the response."""
    is_eos_ = is_eos(response, eos_token_id)
    # number of EOS strictly before each position; a position belongs to the response while it is 0
    eos_before = is_eos_.long().cumsum(-1) - is_eos_.long()
    return eos_before == 0


def _pack(ids: torch.Tensor, mask: torch.Tensor, pad_token_id: int, real_first: bool):
    """Move every row's real tokens to one end, keeping their order (a stable sort on the mask), vectorised."""
    mask = mask.bool()
    order = torch.sort((~mask if real_first else mask).long(), dim=-1, stable=True).indices
    return ids.gather(-1, order).masked_fill(~mask.gather(-1, order), pad_token_id), mask.gather(-1, order)


def left_pad(ids: torch.Tensor, mask: torch.Tensor, pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Move every row's real tokens to the right end (left padding, as ``generate`` needs). ``[B, L]`` → ``[B, L]``."""
    return _pack(ids, mask, pad_token_id, real_first=False)



def right_pad(ids: torch.Tensor, mask: torch.Tensor, pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Move every row's real tokens to the left end (right padding), vectorised. ``[B, L]`` → ``[B, L]``.

    What reward models with torchrl's ``GPT2RewardModel`` interface expect: they read the end score at
    position ``mask.sum(-1) - 1`` and number positions from 0 at the first column."""
    return _pack(ids, mask, pad_token_id, real_first=True)


class Rollout(TensorClass["nocast", "shadow"]):
    """One batch of scored rollouts, batch size ``[B]``; ``T`` response tokens, ``P`` prompt tokens.

    ===================  ===========  ==================================  =======================================
    field                shape        torchrl key (:data:`TORCHRL_KEYS`)  meaning
    ===================  ===========  ==================================  =======================================
    ``tokens``           Tokens [B]   ``tokens``                          prompt [B, P] / response [B, T] / full ids
    ``masks``            Masks [B]    ``masks``                           their masks; response: up to and incl. EOS
                                                                          (``masks.actions``: the sampled tokens)
    ``sample_log_prob``  [B, T]       ``sample_log_prob``                 log π_old(a_t|s_t) at the sampling temperature
    ``sampler_log_prob`` [B, T]       (none)                              log μ(a_t|s_t) the sampler recorded (None: not)
    ``values``           [B, T]       ``values``                          V(s_t) of the critic (None: no critic)
    ``ref_log_prob``     [B, T]       ``("ref_log_probs", "response")``   log π_ref(a_t|s_t) (None: no reference)
    ``kl``               [B, T]       ``("next", "kl")``                  per-token KL estimate, 0 outside response
    ``kl_per_sequence``  [B]          ``kl_per_sequence``                 Σ_t kl (nats): what the KL controller sees
    ``kl_coef``          [B]          ``kl_coef``                         β the reward was shaped with
    ``score_raw``        [B]          ``("next", "score_raw")``           weighted sum of the reward sources
    ``score``            [B]          ``("next", "score")``               after score shaping (baseline, EOS penalty, clip)
    ``score_ref``        [B]          ``("next", "score_ref")``           score of the reference response (or None)
    ``reward_sources``   TensorDict   ``reward_sources``                  each source's raw score [B], keyed by name
    ``unscored``         [B] bool     (none)                              no source scored the row (all None)
    ``reward_raw``       [B, T]       ``("next", "reward_raw")``          score at the done step, 0 elsewhere
    ``reward_kl``        [B, T]       ``("next", "reward_kl")``           −β · kl (0 when the KL goes in the loss)
    ``reward``           [B, T]       ``("next", "reward")``              per-token reward: reward_raw + reward_kl
    ``done``             [B, T] bool  ``("next", "done")``                last response token (EOS or cut at T)
    ``terminated``       [B, T] bool  ``("next", "terminated")``          done with an EOS
    ``truncated``        [B, T] bool  ``("next", "truncated")``           done without an EOS
    ``advantage``        [B, T]       ``advantage``                       the estimator's (whitened) advantage
    ``advantage_raw``    [B, T]       ``advantage_raw``                   before whitening
    ``returns``          [B, T]       ``returns``                         value targets (None: no critic)
    ===================  ===========  ==================================  =======================================

    Indexing (``rollout[idx]``) selects rows, so minibatches are rollouts too. Fields an algorithm does
    not use stay ``None``. ``sample_log_prob`` is the trainer's π_old: the sampler's own log-probs when the
    rollout takes them as they are (then ``sampler_log_prob`` holds the same values), else the policy's
    no-grad pass; the two are compared by ``objective/sample_train_kl`` and weighed against each other by
    ``algorithm.is_correction`` (:mod:`rlhf_train.core.mismatch`). An ``unscored`` row (every reward function
    returned None; its score is 0) takes no part in the critic-free estimators' statistics and gets
    advantage 0 (:mod:`rlhf_train.core.advantages`).
    """

    tokens: Tokens | None = None
    masks: Masks | None = None
    sample_log_prob: torch.Tensor | None = None
    sampler_log_prob: torch.Tensor | None = None
    values: torch.Tensor | None = None
    ref_log_prob: torch.Tensor | None = None
    kl: torch.Tensor | None = None
    kl_per_sequence: torch.Tensor | None = None
    kl_coef: torch.Tensor | None = None
    score_raw: torch.Tensor | None = None
    score: torch.Tensor | None = None
    score_ref: torch.Tensor | None = None
    reward_sources: TensorDict | None = None
    unscored: torch.Tensor | None = None
    reward_raw: torch.Tensor | None = None
    reward_kl: torch.Tensor | None = None
    reward: torch.Tensor | None = None
    done: torch.Tensor | None = None
    terminated: torch.Tensor | None = None
    truncated: torch.Tensor | None = None
    advantage: torch.Tensor | None = None
    advantage_raw: torch.Tensor | None = None
    returns: torch.Tensor | None = None

    @classmethod
    def from_torchrl(cls, td: TensorDictBase) -> "Rollout":
        """The typed view of a torchrl-style rollout TensorDict (shares its tensors, copies nothing)."""
        present = set(td.keys(include_nested=True))
        fields = {name: td.get(key) for name, key in TORCHRL_KEYS.items() if key in present}
        for name, typed in (("tokens", Tokens), ("masks", Masks)):  # a plain nested TensorDict: its typed view
            if name in fields and not isinstance(fields[name], typed):
                fields[name] = typed.from_tensordict(fields[name])
        return cls(**fields, batch_size=td.batch_size[:1], device=td.device)


# Rollout field -> key of the torchrl-style rollout TensorDict (RolloutFromModel's output, the transforms' input)
TORCHRL_KEYS: dict[str, str | tuple[str, ...]] = {
    "tokens": "tokens", "masks": "masks", "sample_log_prob": "sample_log_prob", "values": "values",
    "ref_log_prob": ("ref_log_probs", "response"), "kl": ("next", "kl"), "kl_per_sequence": "kl_per_sequence",
    "kl_coef": "kl_coef", "score_raw": ("next", "score_raw"), "score": ("next", "score"),
    "score_ref": ("next", "score_ref"), "reward_sources": "reward_sources", "reward_raw": ("next", "reward_raw"),
    "reward_kl": ("next", "reward_kl"), "reward": ("next", "reward"), "done": ("next", "done"),
    "terminated": ("next", "terminated"), "truncated": ("next", "truncated"), "advantage": "advantage",
    "advantage_raw": "advantage_raw", "returns": "returns",
}
