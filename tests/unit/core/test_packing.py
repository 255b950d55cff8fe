"""rlhf_train/core/packing.py: bin packing and the index maps, each against values worked out by hand."""
import pytest
import torch

from rlhf_train.core.packing import first_fit_decreasing, pack_sequences, split_bins, unpack


def test_first_fit_decreasing_by_hand():
    # longest first: 8 (row 1) opens bin 0 (2 left); 7 (row 5) opens bin 1 (3 left); 5 (row 3) opens bin 2
    # (5 left); 4 (row 0) fits only bin 2 (1 left); 3 (row 2) fits bin 1 (0 left); 2 (row 4) fits bin 0
    assert first_fit_decreasing([4, 8, 3, 5, 2, 7], 10) == [[1, 4], [2, 5], [0, 3]]


def test_first_fit_decreasing_puts_a_row_over_the_budget_alone():
    # 12 > 10 alone; then 6 opens a bin, 4 joins it (10), 3 opens a third
    assert first_fit_decreasing([3, 12, 6, 4], 10) == [[1], [2, 3], [0]]
    assert first_fit_decreasing([], 10) == []
    with pytest.raises(ValueError):
        first_fit_decreasing([1], 0)


def test_split_bins_by_hand():
    lengths = [4, 8, 3, 5, 2, 7]
    bins = [[1, 4], [2, 5], [0, 3]]  # tokens 10, 10, 9
    # the first bin with the most tokens (10) among those of >= 2 rows: [1, 4] -> [1] and [4] (appended)
    assert split_bins(bins, lengths, 4) == [[1], [2, 5], [0, 3], [4]]
    # next: [2, 5] (10 tokens) -> [2], [5]
    assert split_bins(bins, lengths, 5) == [[1], [2], [0, 3], [4], [5]]
    assert split_bins(bins, lengths, 3) == bins
    with pytest.raises(ValueError):
        split_bins(bins, lengths, 7)


def test_pack_sequences_by_hand():
    # P = 3, T = 3; row 0: prompt [pad, 5, 6], response [7, 8, pad]; row 1: prompt [9, 10, 11], response [12, pad, pad]
    full = torch.tensor([[1, 5, 6, 7, 8, 1], [9, 10, 11, 12, 1, 1]])
    mask = torch.tensor([[0, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0]], dtype=torch.bool)
    p = pack_sequences(full, mask, 3)
    assert p.input_ids.tolist() == [[5, 6, 7, 8, 9, 10, 11, 12]]
    assert p.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 3]]
    # response tokens 7, 8 (row 0) are predicted by 6, 7 at packed indices 1, 2; 12 (row 1) by 11 at index 6
    assert p.predictor.tolist() == [1, 2, 6]
    assert p.target.tolist() == [0, 1, 3]  # flat [B * T] indices of (0, 0), (0, 1), (1, 0)
    assert p.shape == (2, 3)
    assert unpack(torch.tensor([-1.0, -2.0, -3.0]), p).tolist() == [[-1.0, -2.0, 0.0], [-3.0, 0.0, 0.0]]


def test_unpack_is_differentiable():
    full = torch.tensor([[5, 6, 7, 8]])
    p = pack_sequences(full, torch.ones(1, 4, dtype=torch.bool), 2)
    values = torch.tensor([2.0, 3.0], requires_grad=True)
    (unpack(values, p) * torch.tensor([[10.0, 100.0]])).sum().backward()
    assert values.grad.tolist() == [10.0, 100.0]


def test_pack_sequences_refuses_an_empty_prompt():
    full = torch.tensor([[1, 1, 7, 8]])
    with pytest.raises(ValueError, match="predictor is padding"):
        pack_sequences(full, torch.tensor([[0, 0, 1, 1]], dtype=torch.bool), 2)
