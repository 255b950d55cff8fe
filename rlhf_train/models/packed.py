"""The packed forward pass (``update.packing=true``): a micro-batch's sequences as one row without padding.

:func:`packed_forward` is :meth:`~rlhf_train.models.policy.PolicyWithValue.forward` on a packed row: the
real tokens of ``full [b, P+T]`` concatenated (:func:`rlhf_train.core.packing.pack_sequences`), one trunk
pass over ``[1, N]``, the LM head and the value head at the ``M`` response positions only, the results
written back to ``[b, T]`` (0 at padding, which every loss masks out). The loss and its gradient are the
padded path's to float rounding (tests/unit/models/test_packed.py, GPT-2 and Llama, lengths 4 to 200).

Keeping the sequences apart is transformers' own mechanism, reused, not rebuilt: with ``attention_mask=None``
and position ids that restart at 0, ``transformers.masking_utils`` detects the packed format
(``find_packed_sequence_indices``) and builds a block-diagonal causal mask for ``sdpa`` / ``eager``
attention (GPT-2 included: its learned absolute positions are looked up from the same position ids),
while the flash-attention kernels run varlen from the same position ids. A model that does not go through
``masking_utils`` (e.g. remote code) would let the sequences see each other: :func:`check_packing` finds
that before training, with two 3-token sequences.

:func:`packed_sequence_logprobs` is :func:`~rlhf_train.models.scoring.sequence_logprobs` (no grad, the
reference's and the rollout's scoring passes) on a packed row; :func:`token_budget_chunks` groups the rows
of a batch into micro-batches of at most ``update.token_budget`` tokens.
"""
from __future__ import annotations

import torch
from torch import nn

from rlhf_train.core.packing import PackedSequences, first_fit_decreasing, pack_sequences, unpack
from rlhf_train.infra.errors import ConfigError
from rlhf_train.models.scoring import lm_trunk_and_head, response_logprobs


def packed_hidden(trunk: nn.Module, packed: PackedSequences) -> torch.Tensor:
    """Hidden states ``[1, M, H]`` that predict the ``M`` response tokens: one trunk pass over the packed row."""
    out = trunk(input_ids=packed.input_ids, position_ids=packed.position_ids, attention_mask=None, use_cache=False)
    hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    return hidden[:, packed.predictor]


def packed_forward(trunk: nn.Module, head: nn.Module, value_head: nn.Module | None, full: torch.Tensor,
                   full_mask: torch.Tensor, prompt_len: int, labels: torch.Tensor, temperature: float = 1.0,
                   top_k: int = 0, top_p: float = 1.0, with_entropy: bool = True):
    """``(log_probs [b, T], entropy [b, T] or None, values [b, T] or None)`` of ``labels [b, T]`` (the
    response tokens of ``full [b, P+T]``), from one pass over the packed row; 0 at padding."""
    packed = pack_sequences(full, full_mask, prompt_len)
    hidden = packed_hidden(trunk, packed)
    log_probs, entropy = response_logprobs(hidden, head, labels.reshape(-1)[packed.target][None], temperature,
                                           top_k, top_p, with_entropy)
    values = value_head(hidden)[0] if value_head is not None else None
    return (unpack(log_probs[0], packed), unpack(entropy[0], packed) if entropy is not None else None,
            unpack(values, packed) if values is not None else None)


@torch.no_grad()
def packed_sequence_logprobs(lm: nn.Module, full: torch.Tensor, full_mask: torch.Tensor, prompt_len: int,
                             temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Log-probs ``[b, T]`` of the response tokens of ``full`` under ``lm``: one packed pass, no grad."""
    trunk, head = lm_trunk_and_head(lm)
    return packed_forward(trunk, head, None, full, full_mask, prompt_len, full[:, prompt_len:], temperature,
                          top_k, top_p, with_entropy=False)[0]


def token_budget_chunks(full_mask: torch.Tensor, token_budget: int) -> list[torch.Tensor]:
    """Row indices ``[b]`` of each micro-batch: the rows of ``full_mask [B, L]`` packed first-fit decreasing
    into micro-batches of at most ``token_budget`` real tokens (a longer row alone)."""
    bins = first_fit_decreasing(full_mask.sum(-1).tolist(), token_budget)
    return [torch.tensor(b, dtype=torch.long, device=full_mask.device) for b in bins]


@torch.no_grad()
def check_packing(lm: nn.Module, what: str = "the policy") -> None:
    """A :class:`ConfigError` unless ``lm`` keeps packed sequences apart: the hidden states of a 3-token
    sequence packed after another must equal those of the sequence alone (a mixing model differs by O(1))."""
    trunk, _ = lm_trunk_and_head(lm)
    device = next(lm.parameters()).device
    vocab = int(lm.get_input_embeddings().weight.shape[0])
    ids = torch.tensor([[3, 5, 7, 11, 13, 17]], device=device) % vocab
    positions = torch.tensor([[0, 1, 2, 0, 1, 2]], device=device)
    name = f"{what} ({type(lm).__name__})"
    try:
        packed = trunk(input_ids=ids, position_ids=positions, attention_mask=None, use_cache=False)[0][:, 3:]
        alone = trunk(input_ids=ids[:, 3:], position_ids=positions[:, 3:], attention_mask=None, use_cache=False)[0]
    except (TypeError, ValueError, RuntimeError) as err:
        raise ConfigError(f"update.packing=true: {name} cannot run packed sequences ({str(err).splitlines()[0]}); "
                          f"set update.packing=false") from None
    error = (packed.float() - alone.float()).abs().max() / alone.float().abs().max().clamp(min=1e-6)
    if not error <= 1e-2:  # float32: ~1e-7; bfloat16: ~1e-3
        raise ConfigError(f"update.packing=true: {name} lets packed sequences attend to each other (its attention "
                          f"is not built by transformers' masking_utils); set update.packing=false")
