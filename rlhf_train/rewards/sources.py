"""The reward-source seam: complete sequences in, one score per sequence out.

The rollout scores each batch with a dict of weighted sources keyed by name (the reward model being
one of them): ``score = Σ_name weight · source(sequences)``, each source's raw score kept as
``reward_sources[name]`` (logged as ``reward/<name>``). A new kind of source (a Python reward function,
a verifier, a remote reward server, ...) goes in ``rlhf_train/rewards/<name>.py`` as a callable with
:meth:`RewardSource.__call__`. Today's implementation: :class:`RewardModelSource`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from tensordict import TensorDict

from rlhf_train.core.containers import right_pad


@dataclass
class Sequences:
    """What a reward source scores: ``B`` sequences of prompt + response in the policy's vocabulary.

    ``full [B, L]`` token ids, ``full_mask [B, L]`` (True on real tokens; any padding on either side).
    ``prompt_len``: ``full[:, :prompt_len]`` is the (left-padded) prompt, or ``None`` when the sequences
    are not split (e.g. a dataset's reference responses). ``columns``: other per-row data from the
    dataset (e.g. a reference answer), each a list of length ``B``.
    """

    full: torch.Tensor
    full_mask: torch.Tensor
    prompt_len: int | None = None
    columns: dict[str, list[Any]] = field(default_factory=dict)


class RewardSource(Protocol):
    """Scores sequences: ``(Sequences) -> [B]`` float tensor (NaN = no reward for that row)."""

    def __call__(self, sequences: Sequences) -> torch.Tensor: ...


class RewardModelSource:
    """A reward model with torchrl's ``GPT2RewardModel`` interface as a :class:`RewardSource`:
    ``model(input_ids, attention_mask) -> (rewards [B, L], end_scores [B])``; the score is ``end_scores``.

    Reward models receive **right-padded** sequences (real tokens first, positions from 0): that
    interface reads the end score at ``mask.sum(-1) - 1``, while the rollout's sequences are left-padded
    prompts followed by right-padded responses. Rows go through in chunks of ``batch_size`` (None = all).
    """

    def __init__(self, model: torch.nn.Module, pad_token_id: int = 0, batch_size: int | None = None):
        self.model, self.pad_token_id, self.batch_size = model, pad_token_id, batch_size

    @torch.no_grad()
    def __call__(self, sequences: Sequences) -> torch.Tensor:
        ids, mask = right_pad(sequences.full, sequences.full_mask, self.pad_token_id)
        width = int(mask.sum(-1).max()) if mask.numel() else 0
        ids, mask = ids[:, :max(width, 1)], mask[:, :max(width, 1)]  # drop all-padding columns
        device = next(self.model.parameters()).device
        step = self.batch_size or ids.shape[0] or 1
        out = []
        for a in range(0, ids.shape[0], step):
            _, end_scores = self.model(input_ids=ids[a:a + step].to(device), attention_mask=mask[a:a + step].to(device))
            out.append(end_scores.reshape(-1).float().to(sequences.full.device))
        return torch.cat(out) if out else torch.zeros(0, device=sequences.full.device)


def weighted_sum(sources: dict[str, tuple[RewardSource, float]], sequences: Sequences) -> tuple[torch.Tensor, TensorDict]:
    """``(Σ_name weight · score_name [B], TensorDict of each source's raw score [B])``."""
    B = sequences.full.shape[0]
    parts = TensorDict({name: source(sequences) for name, (source, _) in sources.items()}, batch_size=[B],
                       device=sequences.full.device)
    total = torch.zeros(B, device=sequences.full.device)
    for name, (_, weight) in sources.items():
        total = total + float(weight) * parts[name]
    return total, parts
