"""Held-out evaluation of the reward sources (rlhf_train/loop/evaluation.py):

1. a hand-worked case: a scripted backend answers three prompts four times each (and once greedily), a reward
   function checks each answer against the prompt's ``answer`` column; accuracy, pass@2, pass@4, mean@4 and the
   completion length are the values worked out below, a reward model gets its mean only;
2. the RL loop's evaluation (``evaluation`` set, ``evaluation.every``) on a tiny model: ``eval/...`` at iteration
   0, every N and the last; the training's metrics and weights are those of a run without it; a preempted and
   resumed run reproduces metrics.csv exactly;
3. bad settings are one line at start: pass@k's k, prompts that are not held out.

Budget: ~25 s on 2 cores (tests 2).
"""
from __future__ import annotations

import csv
import os
import signal

import pytest
import torch
from omegaconf import OmegaConf

from rlhf_train.generation.base import Generation
from rlhf_train.infra.errors import ConfigError
from tests.helpers.reliability import make_cfg

EOS, PAD, A, B, C = 0, 1, 2, 3, 4
LETTERS = {A: "A", B: "B", C: "C"}


class LetterTokenizer:
    """Token ids 2, 3, 4 are the letters A, B, C; 0 (EOS) and 1 (pad) are special."""

    pad_token_id = PAD

    def batch_decode(self, rows, skip_special_tokens=False):
        return ["".join(LETTERS.get(t, "" if skip_special_tokens else "<s>") for t in row) for row in rows]


class ScriptedBackend:
    """Answers prompt ``10 + i`` with the letters ``script[i]`` (one per sample), each followed by EOS."""

    def __init__(self, script):
        self.script = script

    def generate(self, prompt, prompt_mask, num_samples=1):
        rows = []
        for p in prompt[:, -1].tolist():
            letters = self.script[p - 10]
            assert len(letters) == num_samples
            rows += [[letter, EOS] for letter in letters]
        return Generation(torch.tensor(rows))


def exact_answer(prompts, completions, answer, **columns):
    """1 when the completion is the row's answer, 0 when not, None for a row without an answer."""
    return [None if a is None else float(c == a) for c, a in zip(completions, answer)]


class ConstantRewardModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor(0.5))

    def forward(self, input_ids, attention_mask):
        end = self.w.expand(input_ids.shape[0])
        return end[:, None].expand(input_ids.shape), end


def test_held_out_metrics_by_hand():
    from rlhf_train.data.hf_prompts import HFPromptDataset
    from rlhf_train.loop.evaluation import evaluate_held_out
    from rlhf_train.rewards.sources import FunctionRewardSource, RewardModelSource

    # prompts 10, 11, 12 with answers A, B, C; the second batch holds prompt 12 alone (columns cross batches)
    prompts = HFPromptDataset([[10], [11], [12]], {"answer": ["A", "B", "C"]}, PAD, ["p0", "p1", "p2"])
    sources = {"exact": (FunctionRewardSource(exact_answer, LetterTokenizer(), "exact"), 1.0),
               "rm": (RewardModelSource(ConstantRewardModel(), PAD), 0.1)}
    sampled = ScriptedBackend([[A, B, A, C], [C, C, C, C], [C, C, C, C]])  # correct: 2, 0, 4 of 4
    greedy = ScriptedBackend([[A], [A], [C]])                              # correct: 1, 0, 1
    e = OmegaConf.create({"batch_size": 2, "num_samples": 4, "seed": 0, "accuracy_threshold": 1.0, "pass_k": [2, 4]})
    metrics, rows = evaluate_held_out({"sampled": sampled, "greedy": greedy}, sources, prompts, e, (EOS,), PAD)

    assert rows["sampled"]["parts"]["exact"].tolist() == [1, 0, 1, 0, 0, 0, 0, 0, 1, 1, 1, 1]
    # accuracy: 6 of 12 samples; greedy: 2 of 3
    assert metrics["eval/sampled/exact/accuracy"] == pytest.approx(6 / 12)
    assert metrics["eval/greedy/exact/accuracy"] == pytest.approx(2 / 3)
    # pass@2 = 1 - C(n-c, 2)/C(4, 2): c=2 -> 1 - 1/6, c=0 -> 0, c=4 -> 1; averaged over the 3 prompts
    assert metrics["eval/sampled/exact/pass@2"] == pytest.approx((5 / 6 + 0 + 1) / 3)
    # pass@4: any of the 4 samples correct: prompts 10 and 12
    assert metrics["eval/sampled/exact/pass@4"] == pytest.approx(2 / 3)
    # mean@4: per-prompt means 0.5, 0, 1 averaged
    assert metrics["eval/sampled/exact/mean@4"] == pytest.approx(0.5)
    assert metrics["eval/sampled/exact/mean"] == pytest.approx(0.5)
    # every response is a letter + EOS: 2 tokens
    assert metrics["eval/sampled/completion_length"] == 2.0 and metrics["eval/greedy/completion_length"] == 2.0
    # the reward model: its mean, and no "correct" (no accuracy / pass@k for it)
    assert metrics["eval/sampled/rm/mean"] == pytest.approx(0.5) and metrics["eval/greedy/rm/mean"] == pytest.approx(0.5)
    assert not any(k.startswith("eval/sampled/rm/") and not k.endswith("/mean") for k in metrics)
    assert not any("pass@" in k for k in metrics if k.startswith("eval/greedy/"))


def test_unscored_rows_are_wrong_and_left_out_of_the_means():
    from rlhf_train.loop.evaluation import held_out_metrics

    nan = float("nan")
    # 2 prompts x 4 samples; the last sample of prompt 2 was not scored (None)
    parts = {"exact": torch.tensor([1.0, 0, 0, 0, 1, 1, 0, nan])}
    m = held_out_metrics("sampled", parts, torch.tensor([3, 5, 4, 4, 4, 4, 4, 4]), 4, {"exact"}, 1.0, [1, 2])
    assert m["eval/sampled/exact/accuracy"] == pytest.approx(3 / 8)         # the unscored row counts as wrong
    assert m["eval/sampled/exact/mean"] == pytest.approx(3 / 7)             # ... and is left out of the mean
    assert m["eval/sampled/exact/mean@4"] == pytest.approx((1 / 4 + 2 / 3) / 2)
    assert m["eval/sampled/exact/pass@1"] == pytest.approx((1 / 4 + 2 / 4) / 2)
    assert m["eval/sampled/exact/pass@2"] == pytest.approx(((1 - 3 / 6) + (1 - 1 / 6)) / 2)
    assert m["eval/sampled/completion_length"] == pytest.approx(32 / 8)


# --------------------------------------------------------------------------------------------
# the RL loop's held-out evaluation, on a tiny model
# --------------------------------------------------------------------------------------------
def vowel_start(prompts, completions, **columns):
    """A rule the tiny random model meets now and then: the completion starts with a vowel."""
    return [1.0 if c.strip()[:1].lower() in "aeiou" else 0.0 for c in completions]


RL = ["algorithm=grpo", "rollout.num_samples=2", "trainer.num_iterations=4", "trainer.checkpoint_every=2",
      "reward_model=none", "+rewards.vowel._target_=tests.unit.loop.test_evaluation.vowel_start"]
EVAL = ["evaluation=verifiable", "evaluation.split=validation", "evaluation.num_prompts=6", "evaluation.batch_size=3",
        "evaluation.num_samples=4", "evaluation.pass_k=[1,4]", "evaluation.every=2"]


def _rows(path):
    return list(csv.DictReader(open(path)))


def _training(history):
    return [{k: v for k, v in h.items() if not k.startswith(("eval/", "time/"))} for h in history]


@pytest.fixture(scope="module")
def with_and_without(tmp_path_factory):
    from rlhf_train.loop.trainer import train

    runs = {}
    for name, extra in (("plain", []), ("evaluated", EVAL)):
        run_dir = tmp_path_factory.mktemp(name)
        out = train(make_cfg(*RL, *extra), run_dir)
        runs[name] = run_dir, out
    return runs


def test_rl_loop_evaluates_at_start_every_n_and_last(with_and_without):
    run_dir, out = with_and_without["evaluated"]
    rows = _rows(run_dir / "metrics.csv")
    assert [r["iteration"] for r in rows] == ["0", "1", "2", "3", "4"]
    keys = {"eval/sampled/vowel/accuracy", "eval/sampled/vowel/pass@1", "eval/sampled/vowel/pass@4",
            "eval/sampled/vowel/mean@4", "eval/sampled/vowel/mean", "eval/sampled/completion_length",
            "eval/greedy/vowel/accuracy", "eval/greedy/vowel/mean", "eval/greedy/completion_length"}
    for r in rows:
        evaluated = r["iteration"] in ("0", "2", "4")
        assert all(bool(r[k]) == evaluated for k in keys), r
        if evaluated:
            acc, p1, p4 = (float(r[f"eval/sampled/vowel/{m}"]) for m in ("accuracy", "pass@1", "pass@4"))
            assert p1 == pytest.approx(acc) and acc <= p4 <= 1  # pass@1 is the accuracy; pass@4 at least that
            assert 0 < float(r["eval/sampled/completion_length"]) <= 8  # rollout.max_new_tokens
    # the tiny model meets the rule now and then: neither always nor never
    assert 0 < float(rows[0]["eval/sampled/vowel/accuracy"]) < 1
    assert "time/eval_s" in _rows(run_dir / "timings.csv")[0]
    assert keys <= set(out["metrics"])  # the last iteration's metrics hold the final evaluation
    assert "eval/sampled/vowel/accuracy" in out["history"][1] and "eval/sampled/vowel/accuracy" not in out["history"][0]


def test_rl_loop_evaluation_leaves_the_training_unchanged(with_and_without):
    (_, plain), (_, evaluated) = with_and_without["plain"], with_and_without["evaluated"]
    assert _training(evaluated["history"]) == _training(plain["history"])  # every metric, bit for bit
    for (name, a), b in zip(plain["policy"].state_dict().items(), evaluated["policy"].state_dict().values()):
        assert torch.equal(a, b), name


def test_rl_loop_evaluation_resumes_exactly(tmp_path, monkeypatch, with_and_without):
    from rlhf_train.loop import trainer

    reference, _ = with_and_without["evaluated"]
    real_build = trainer.build_logger

    def preempted_at_3(cfg, run_dir, config, resume_iteration=None, resume_id=None):
        logger = real_build(cfg, run_dir, config, resume_iteration=resume_iteration, resume_id=resume_id)
        real_log = logger.log

        def log(metrics, step):
            real_log(metrics, step)
            if step == 3 and resume_iteration is None:
                os.kill(os.getpid(), signal.SIGTERM)  # checkpoint at 3, exit 143

        logger.log = log
        return logger

    monkeypatch.setattr(trainer, "build_logger", preempted_at_3)
    with pytest.raises(SystemExit):
        trainer.train(make_cfg(*RL, *EVAL), tmp_path)
    trainer.train(make_cfg(*RL, *EVAL, "trainer.resume=auto"), tmp_path)
    assert (tmp_path / "metrics.csv").read_text() == (reference / "metrics.csv").read_text()


# --------------------------------------------------------------------------------------------
# bad settings: one line at start
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides, message", [
    (["evaluation.pass_k=[8]"], r"^evaluation.pass_k=\[8\]: each k must be in 1..4 \(num_samples\)$"),
    (["evaluation.num_samples=0", "evaluation.pass_k=[]"], r"^evaluation.num_samples=0 must be positive"),
    (["evaluation.split=test"], r"^evaluation.split=test: .*movie_review_prompts trains on these prompts"),
    (["data=synthetic"], r"^evaluation.split=validation: rlhf_train.data.prompts.synthetic_prompts trains on these"),
])
def test_bad_evaluation_settings_are_one_line(overrides, message):
    from rlhf_train.loop.checks import check_config

    with pytest.raises(ConfigError, match=message):
        check_config(make_cfg(*RL, *EVAL, *overrides))


def test_greedy_backend_decodes_greedily():
    from rlhf_train.loop.evaluation import build_backends
    from tests.helpers.reliability import tiny_policy

    cfg = make_cfg(*EVAL)
    policy = tiny_policy()
    backends = build_backends(cfg, policy, (0,), 1, None, None)
    assert set(backends) == {"sampled", "greedy"}
    prompt, mask = torch.tensor([[5, 6, 7]]), torch.ones(1, 3, dtype=torch.bool)
    runs = [backends["greedy"].generate(prompt, mask).response for _ in range(2)]
    logits = policy.lm(input_ids=prompt).logits[0, -1]
    assert torch.equal(runs[0], runs[1]) and runs[0][0, 0] == logits.argmax()  # the most likely token, every time
