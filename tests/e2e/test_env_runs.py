"""An environment recipe (``+recipe=guess_number``, at a tiny size: a 1-layer Llama with a ChatML template) across
processes and kills:

1. 2 processes (gloo, ``accelerate launch``) x 2 games x 2 episodes give the first update of 1 process x 4 games x
   2 episodes (2 accumulation micro-batches): the same games played greedily (so the two processes play what the
   one process plays), PPO's GAE over the policy's tokens, its advantages whitened over both processes, the value
   head (initialised at random: a gradient even where every game scores the same);
2. SIGKILL in the middle of iteration 3, then ``trainer.resume=auto``: ``metrics.csv`` is that of an uninterrupted run
   (``rlhf_train.tools.resume_check``), the held-out evaluation of episodes included.

Budget: ~2-3 min on 2 idle cores (marked slow: subprocesses).
"""
from __future__ import annotations

import re
import sys

import pytest
import torch

from tests.e2e.test_distributed import LAUNCH_2, WORKER, run
from tests.helpers.envs import chatml_tokenizer, save_eos_llama


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_eos_llama(tmp_path_factory.mktemp("model") / "policy", chatml_tokenizer(), favour=("1", "2", "3", "4", "5"))


def tiny_recipe(model) -> list[str]:
    """``+recipe=guess_number`` with the tiny model: games of 4 numbers (1-4 or 2-5, digits the model favours)."""
    return ["+recipe=guess_number", "policy=pretrained", f"policy.pretrained={model}", "policy.lora.r=0",
            "data.size=4", "data.offset=1", "data.max_prompts=16", "rollout.num_samples=2", "rollout.max_new_tokens=6",
            "evaluation.num_prompts=4", "evaluation.batch_size=4", "trainer.progress_bar=false"]


@pytest.mark.slow
def test_two_processes_play_the_games_of_one_and_give_its_update(tiny, tmp_path):
    common = [*tiny_recipe(tiny), "logger=csv", "rollout.do_sample=false", "update.num_epochs=1",
              "algorithm=ppo", "algorithm.beta=0", "policy.value_head_init_std=0.1", "evaluation.enabled=false",
              "trainer.num_iterations=1"]
    two, one = tmp_path / "two", tmp_path / "one"
    two.mkdir(), one.mkdir()
    run([*LAUNCH_2, WORKER, *common, "data.batch_size=2", "update.minibatch_size=4"], two, two / "dump",
        tmp_path / "cache")
    run([sys.executable, WORKER, *common, "data.batch_size=4", "update.minibatch_size=8",
         "update.gradient_accumulation_steps=2", f"hydra.run.dir={one / 'run'}"], one, one / "dump", tmp_path / "cache")
    ranks = [torch.load(two / "dump" / f"rank{r}.pt", weights_only=False) for r in range(2)]
    single = torch.load(one / "dump" / "rank0.pt", weights_only=False)
    assert [r["num_processes"] for r in ranks] == [2, 2]
    assert sorted(single["prompts"][0].tolist()) == sorted(torch.cat([r["prompts"][0] for r in ranks]).tolist())
    for key in ("env/turns", "objective/score"):  # the processes played different games; together, the one's
        local = [r["local_metrics"][0][key] for r in ranks]
        assert ranks[0]["reduced_metrics"][0][key] == pytest.approx(sum(local) / 2, rel=1e-5, abs=1e-6)
        assert ranks[0]["reduced_metrics"][0][key] == pytest.approx(single["reduced_metrics"][0][key], rel=1e-5,
                                                                    abs=1e-6)
    g2 = torch.cat([g.reshape(-1) for g in ranks[0]["first_grad"]])
    g1 = torch.cat([g.reshape(-1) for g in single["first_grad"]])
    assert g1.abs().max() > 0 and len(ranks[0]["first_grad"]) == len(single["first_grad"])
    for a, b in zip(ranks[1]["first_grad"], ranks[0]["first_grad"]):  # DDP left the same gradient on both
        assert torch.equal(a, b)
    # episodes are padded to each batch's longest (other widths in the two runs): float32 summation order, ~3e-5
    # of the largest gradient here (measured); a process-local statistic would be off by O(1)
    assert float((g2 - g1).norm() / g1.norm()) < 1e-4
    torch.testing.assert_close(g2, g1, rtol=1e-3, atol=1e-4 * float(g1.abs().max()))


@pytest.mark.slow
def test_sigkill_then_resume_auto_reproduces_an_environment_runs_metrics(tiny, tmp_path):
    from rlhf_train.tools.resume_check import run_check

    overrides = [o for o in tiny_recipe(tiny) if not o.startswith(("+recipe", "trainer.progress_bar"))]
    out = run_check(tmp_path, iterations=4, kill_after=2, recipe="guess_number", timeout=500,
                    overrides=[*overrides, "data.batch_size=2", "update.minibatch_size=4", "evaluation.every=2"])
    assert out["resumed_from"] and re.search(r"iter_00000[23]", out["resumed_from"]), out
    assert out["diffs"] == [], out["diffs"]
    text = (tmp_path / "reference" / "metrics.csv").read_text()
    assert (tmp_path / "resumed" / "metrics.csv").read_text() == text
    header = text.splitlines()[0].split(",")
    assert "env/turns" in header and "eval/greedy/env/accuracy" in header
