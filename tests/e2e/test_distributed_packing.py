"""``update.packing=true`` on 2 processes (gloo on CPU, ``accelerate launch``): each process packs its own rows
into its own number of micro-batches, every process runs as many as the process with the most, and the
gradients all-reduce once per minibatch: the first update equals one process's over the same 16 prompts.

Budget: ~1-1.5 min on 2 idle cores (one 2-process run, one 1-process run, smoke-sized).
"""
from __future__ import annotations

import sys

import pytest
import torch

from tests.e2e.test_distributed import COMMON, LAUNCH_2, WORKER, run

# 8-16-token prompts + 8 new tokens: 40 tokens hold one or two sequences, so the processes' micro-batch counts
# differ (measured: 6 and 5 for the first minibatch; the second process's bins are split to 6)
PACKED = ["update.packing=true", "update.token_budget=40", "trainer.num_iterations=1"]


@pytest.mark.slow
def test_two_packed_processes_give_the_gradient_of_one(tmp_path):
    two, one = tmp_path / "two", tmp_path / "one"
    two.mkdir(), one.mkdir()
    run([*LAUNCH_2, WORKER, *COMMON, *PACKED, "data.batch_size=8", "update.minibatch_size=8"],
        two, two / "dump", tmp_path / "cache")
    run([sys.executable, WORKER, *COMMON, *PACKED, "data.batch_size=16", "update.minibatch_size=16",
         f"hydra.run.dir={one / 'run'}"], one, one / "dump", tmp_path / "cache")
    ranks = [torch.load(two / "dump" / f"rank{r}.pt", weights_only=False) for r in range(2)]
    single = torch.load(one / "dump" / "rank0.pt", weights_only=False)
    assert sorted(single["prompts"][0].tolist()) == sorted(ranks[0]["prompts"][0].tolist()
                                                           + ranks[1]["prompts"][0].tolist())
    for a, b in zip(ranks[0]["first_grad"], ranks[1]["first_grad"]):  # DDP left the same gradient on both
        assert torch.equal(a, b)
    flat2 = torch.cat([g.reshape(-1) for g in ranks[0]["first_grad"]])
    flat1 = torch.cat([g.reshape(-1) for g in single["first_grad"]])
    assert flat1.abs().max() > 0
    torch.testing.assert_close(flat2, flat1, rtol=1e-4, atol=1e-6 * float(flat1.abs().max()))
