"""Sequence packing: the real tokens of a padded batch concatenated into one row, and back.

Shapes: B = rows, L = P + T columns of ``full [B, L]`` (left-padded prompt of P columns, right-padded
response of T), N = the real tokens (``full_mask.sum()``), M = the real response tokens
(``full_mask[:, P:].sum()``).

Packing (Krell et al. 2021, "Efficient Sequence Packing without Cross-contamination: Accelerating Large
Language Models without Impacting Performance", arXiv:2107.02027, sec. 3): the sequences of a micro-batch
are concatenated without padding into one row ``[1, N]``; position ids restart at 0 with every sequence and
the attention is block-diagonal causal (each token sees only the earlier tokens of its own sequence), so
every token's hidden state is the one the padded batch gives it, and the padding's FLOPs are gone.
:func:`pack_sequences` builds the row and the index maps; :func:`unpack` writes per-token values
``[M]`` back to ``[B, T]``.

Which sequences share a micro-batch: first-fit decreasing (Johnson 1973, "Near-optimal bin packing
algorithms", MIT thesis; at most 11/9 OPT + 6/9 bins, Dósa 2007), :func:`first_fit_decreasing`, into bins
of at most ``budget`` tokens; :func:`split_bins` splits bins until there are as many as another process has
(DDP needs the same number of backward passes on every process).
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

from rlhf_train.core.containers import position_ids_from_mask


def first_fit_decreasing(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Row indices grouped into bins of at most ``budget`` tokens (``lengths[i]``: the tokens of row i).

    Longest first, each row into the first bin it fits in, else into a new bin; a row longer than
    ``budget`` gets a bin of its own. Each bin lists its rows in ascending order; bins in the order they
    were opened. ``lengths`` are B Python ints: the loop is over rows, not tokens (integer bookkeeping,
    microseconds for hundreds of rows), and bin packing is sequential by nature.
    """
    if budget <= 0:
        raise ValueError(f"token budget must be positive, got {budget}")
    order = sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i))
    bins: list[list[int]] = []
    free: list[int] = []
    for i in order:
        n = int(lengths[i])
        j = next((j for j, f in enumerate(free) if f >= n), None)
        if j is None:
            bins.append([i])
            free.append(budget - n)
        else:
            bins[j].append(i)
            free[j] -= n
    return [sorted(b) for b in bins]


def split_bins(bins: list[list[int]], lengths: Sequence[int], count: int) -> list[list[int]]:
    """``bins`` split until there are ``count`` of them: the bin with the most tokens among those with at
    least two rows is cut into two halves of its rows (first half in place, second half appended), again
    and again. ``count`` must be at most the number of rows."""
    rows = sum(len(b) for b in bins)
    if count > rows:
        raise ValueError(f"cannot split {rows} rows into {count} bins")
    out = [list(b) for b in bins]
    while len(out) < count:
        j = max((j for j, b in enumerate(out) if len(b) > 1), key=lambda j: sum(int(lengths[i]) for i in out[j]))
        b = out[j]
        out[j], tail = b[: len(b) // 2], b[len(b) // 2:]
        out.append(tail)
    return out


class PackedSequences(NamedTuple):
    """One packed row and the maps back to the padded batch.

    ``input_ids [1, N]``, ``position_ids [1, N]`` (0 at each sequence's first token); ``predictor [M]``:
    index into the packed row of the hidden state that predicts each response token; ``target [M]``:
    flat index into ``[B * T]`` of that response token; ``shape``: ``(B, T)``."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    predictor: torch.Tensor
    target: torch.Tensor
    shape: tuple[int, int]


def pack_sequences(full: torch.Tensor, full_mask: torch.Tensor, prompt_len: int) -> PackedSequences:
    """The real tokens of ``full [B, L]`` (``full_mask [B, L]``, prompt in the first ``prompt_len`` columns)
    as one row, in row order.

    Position ids are the padded batch's (:func:`~rlhf_train.core.containers.position_ids_from_mask`: 0 at
    each row's first real token), so each sequence sees the positions ``generate`` gave it. Response token
    ``t`` of row ``b`` is predicted by column ``P-1+t`` (the padded path's ``hidden[:, P-1:-1]``), which must
    be a real token: a non-empty prompt, a contiguous response (a ValueError otherwise)."""
    B, L = full.shape
    T = L - prompt_len
    mask = full_mask.bool()
    position_ids = position_ids_from_mask(mask)
    packed_index = (mask.flatten().long().cumsum(0) - 1).view(B, L)  # column -> index in the packed row
    response = mask[:, prompt_len:]
    if not mask[:, prompt_len - 1:L - 1][response].all():
        raise ValueError("pack_sequences: a response token's predictor is padding (empty prompt or a gap "
                         "in the response mask)")
    predictor = packed_index[:, prompt_len - 1:L - 1][response]
    target = torch.arange(B * T, device=full.device).view(B, T)[response]
    return PackedSequences(full[mask][None], position_ids[mask][None], predictor, target, (B, T))


def unpack(values: torch.Tensor, packed: PackedSequences, fill: float = 0.0) -> torch.Tensor:
    """Per-response-token ``values [M]`` (in :attr:`PackedSequences.target` order) as ``[B, T]``, ``fill``
    at padding; differentiable in ``values``."""
    B, T = packed.shape
    return values.new_full((B * T,), fill).index_copy(0, packed.target, values).view(B, T)
