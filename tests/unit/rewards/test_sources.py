"""Reward sources you bring (issue 13, item 4): HF reward models with their trained head, Python reward
functions, their weighted sum, and the faults of each (one line before training, skipped batches later).

Budget: ~10 s on 2 quiet cores (tiny models, a few forward passes; one 3-iteration run).
"""
from __future__ import annotations

import json
import math

import pytest
import torch

from tests.helpers.byo import chat_tokenizer, save_seq_classifier


def _texts_to_sequences(tok, texts, prompt_len=None, columns=None):
    from rlhf_train.rewards.sources import Sequences

    tok.padding_side = "left"
    enc = tok(texts, padding=True, return_tensors="pt")
    return Sequences(enc["input_ids"], enc["attention_mask"].bool(), prompt_len, columns or {})


TEXTS = ["w4 w5 w6 answer is 7", "w9 w10", "w11 w12 w13 w14 w15 w16 3"]


# --------------------------------------------------------------------------- HF reward models
def test_hf_reward_model_scores_what_auto_model_for_sequence_classification_gives(tmp_path):
    """Fails on the old code: ``reward_model.pretrained=<HF RM dir>`` loaded the trunk with a random head."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from rlhf_train.models.reward_model import build_reward_model
    from rlhf_train.rewards.sources import RewardModelSource

    tok = chat_tokenizer()
    path = save_seq_classifier(tok, tmp_path / "rm")
    hf = AutoModelForSequenceClassification.from_pretrained(path).eval()
    hf_tok = AutoTokenizer.from_pretrained(path)
    with torch.no_grad():
        expected = torch.cat([hf(**hf_tok(t, return_tensors="pt")).logits[:, 0] for t in TEXTS])  # one row at a time
    rm = build_reward_model(tokenizer=tok, pretrained=str(path))  # what reward_model.pretrained does
    scores = RewardModelSource(rm, tok.pad_token_id)(_texts_to_sequences(tok, TEXTS))
    torch.testing.assert_close(scores, expected, rtol=1e-5, atol=1e-5)


def test_hf_reward_model_with_its_own_tokenizer_re_encodes(tmp_path):
    """A reward model whose tokenizer differs from the policy's (another vocabulary): the policy's tokens are
    decoded and re-encoded with the reward model's tokenizer; the score is AutoModel's on that text."""
    from transformers import AutoModelForSequenceClassification

    from rlhf_train.models.reward_model import build_reward_model
    from rlhf_train.rewards.sources import RewardModelSource

    policy_tok, rm_tok = chat_tokenizer(), chat_tokenizer(extra_words=7)
    ids = [rm_tok.convert_tokens_to_ids(w) for w in ("w4", "x3")]
    path = save_seq_classifier(rm_tok, tmp_path / "rm")
    rm = build_reward_model(tokenizer=policy_tok, pretrained=str(path))
    assert rm.reencodes and ids[1] >= len(policy_tok)  # a vocabulary the policy's ids do not index
    hf = AutoModelForSequenceClassification.from_pretrained(path).eval()
    with torch.no_grad():
        expected = torch.cat([hf(**rm_tok(t, return_tensors="pt")).logits[:, 0] for t in TEXTS])
    scores = RewardModelSource(rm, policy_tok.pad_token_id)(_texts_to_sequences(policy_tok, TEXTS))
    torch.testing.assert_close(scores, expected, rtol=1e-5, atol=1e-5)


def test_hf_reward_model_with_its_own_chat_template(tmp_path):
    """Chat prompts (a ``messages`` column) are rendered with the reward model's own chat template."""
    from transformers import AutoModelForSequenceClassification

    from rlhf_train.models.reward_model import build_reward_model
    from rlhf_train.rewards.sources import RewardModelSource, Sequences

    rm_template = "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
    policy_tok, rm_tok = chat_tokenizer(), chat_tokenizer(chat_template=rm_template, extra_words=3)
    path = save_seq_classifier(rm_tok, tmp_path / "rm")
    rm = build_reward_model(tokenizer=policy_tok, pretrained=str(path))
    messages = [[{"role": "user", "content": "w4 w5"}], [{"role": "user", "content": "w6"}]]
    prompt = policy_tok.apply_chat_template(messages, add_generation_prompt=True, padding=True, return_tensors="pt",
                                            return_dict=True)
    completion = policy_tok(["w7 w8", "3"], padding=True, return_tensors="pt")
    full = torch.cat([prompt["input_ids"], completion["input_ids"]], 1)
    mask = torch.cat([prompt["attention_mask"], completion["attention_mask"]], 1).bool()
    seqs = Sequences(full, mask, prompt["input_ids"].shape[1], {"messages": messages})
    hf = AutoModelForSequenceClassification.from_pretrained(path).eval()
    texts = ["user w4 w5 assistant w7 w8 ", "user w6 assistant 3 "]
    with torch.no_grad():
        expected = torch.cat([hf(**rm_tok(t, return_tensors="pt")).logits[:, 0] for t in texts])
    torch.testing.assert_close(RewardModelSource(rm, policy_tok.pad_token_id)(seqs), expected, rtol=1e-5, atol=1e-5)


def test_a_bare_trunk_is_refused_not_given_a_random_head(tmp_path):
    from transformers import AutoModel

    from rlhf_train.infra.errors import ConfigError
    from rlhf_train.models.reward_model import build_reward_model
    from tests.helpers.byo import tiny_config

    tok = chat_tokenizer()
    AutoModel.from_config(tiny_config("gpt2", tok)).save_pretrained(tmp_path / "trunk")
    with pytest.raises(ConfigError, match=r"reward_model.pretrained=.*has no trained reward head"):
        build_reward_model(tokenizer=tok, pretrained=str(tmp_path / "trunk"))
    cfg = json.loads((tmp_path / "trunk" / "config.json").read_text())
    cfg["architectures"], cfg["num_labels"] = ["GPT2ForSequenceClassification"], 3
    cfg["id2label"] = {str(i): f"L{i}" for i in range(3)}
    (tmp_path / "trunk" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="3 labels; a reward model has one"):
        build_reward_model(tokenizer=tok, pretrained=str(tmp_path / "trunk"))


# --------------------------------------------------------------------------- Python functions
def answer_reward(prompts, completions, answer, **_):
    """1 when the completion's last word is the dataset's answer; None when there is no answer."""
    return [None if a is None else float(c.split()[-1:] == [str(a)]) for c, a in zip(completions, answer)]


def test_function_reads_a_dataset_column_and_sources_sum_by_weight():
    from rlhf_train.rewards.sources import (
        FunctionRewardSource,
        Sequences,
        build_reward_sources,
        weighted_sum,
    )

    tok = chat_tokenizer()
    prompt = ["w4 w5", "w6", "w7 w8 w9"]
    completion = ["answer is 7", "w10 3", "w11"]
    P = 3
    tok.padding_side = "left"
    p = tok(prompt, padding=True, return_tensors="pt")
    tok.padding_side = "right"
    c = tok(completion, padding=True, return_tensors="pt")
    seqs = Sequences(torch.cat([p["input_ids"], c["input_ids"]], 1),
                     torch.cat([p["attention_mask"], c["attention_mask"]], 1).bool(), P,
                     {"answer": [7, 4, None]})
    sources = build_reward_sources(None, {
        "answer": {"_target_": "tests.unit.rewards.test_sources.answer_reward", "weight": 2.0},
        "length": {"_target_": "rlhf_train.rewards.functions.length_penalty", "target": 1, "coef": 0.5,
                   "weight": 1.0}}, tok, tok.pad_token_id)
    assert isinstance(sources["answer"][0], FunctionRewardSource)
    prompts, completions = sources["answer"][0].texts(seqs)
    assert completions == completion and prompts == prompt
    total, parts = weighted_sum(sources, seqs)
    # by hand: answer = [1, 0, None]; length penalty = -0.5 * max(0, words - 1) = [-1, -0.5, 0]
    assert parts["answer"][:2].tolist() == [1.0, 0.0] and math.isnan(parts["answer"][2])
    assert parts["length"].tolist() == [-1.0, -0.5, 0.0]
    assert total.tolist() == [2 * 1 - 1.0, 2 * 0 - 0.5, 0.0]  # a source's None is left out of that row's sum


def test_ready_made_functions():
    from rlhf_train.rewards.functions import final_answer_match, regex_match

    comps = ["so the answer is 1/2", "it is \\boxed{0.5}", "I think 3", "no idea", "42"]
    assert final_answer_match(comps, comps, answer=["0.5", "1/2", "4", "2", None]) == [1.0, 1.0, 0.0, 0.0, None]
    assert regex_match([], ["<answer>4</answer>", "4"], pattern=r"<answer>.+</answer>") == [1.0, 0.0]


# --------------------------------------------------------------------------- faults
def raises(prompts, completions, **_):
    raise ValueError("boom")


def wrong_length(prompts, completions, **_):
    return [1.0]


def returns_nan(prompts, completions, **_):
    return [float("nan")] * len(completions)


def returns_str(prompts, completions, **_):
    return "1.0"  # would be read character by character as a list


def returns_huge(prompts, completions, **_):
    return [1e39] * len(completions)  # finite as a Python float, inf in float32


def calls_exit(prompts, completions, **_):
    import sys

    sys.exit(3)


@pytest.mark.parametrize("workers", [0, 1])  # in this process, in a worker process: the same line
@pytest.mark.parametrize("fn, line", [
    ("raises", "on the first batch, reward function 'f' raised ValueError: boom"),
    ("wrong_length", "on the first batch, reward function 'f' returned 1 values for a batch of 3"),
    ("returns_nan", "on the first batch, reward function 'f' returned nan for row 0: NaN or inf in float32 (return "
                    "None for 'no reward')"),
    ("returns_huge", "on the first batch, reward function 'f' returned 1e+39 for row 0: NaN or inf in float32 "
                     "(return None for 'no reward')"),
    ("returns_str", "on the first batch, reward function 'f' must return a list of float | None, got str: 1.0"),
    ("calls_exit", "on the first batch, reward function 'f' raised SystemExit(3) (it must return, not exit)"),
])
def test_probe_gives_one_line_per_fault(fn, line, workers):
    from rlhf_train.infra.errors import ConfigError
    from rlhf_train.rewards.sources import build_reward_sources, probe_reward_sources

    tok = chat_tokenizer()
    entry = {"_target_": f"tests.unit.rewards.test_sources.{fn}", "workers": workers}
    sources = build_reward_sources(None, {"f": entry}, tok, tok.pad_token_id)
    with pytest.raises(ConfigError) as err:
        probe_reward_sources(sources, _texts_to_sequences(tok, TEXTS, prompt_len=2))
    assert str(err.value) == line


def test_probe_with_empty_completions_says_so():
    from rlhf_train.infra.errors import ConfigError
    from rlhf_train.rewards.sources import build_reward_sources, probe_reward_sources

    tok = chat_tokenizer()
    sources = build_reward_sources(None, {"f": {"_target_": "tests.unit.rewards.test_sources.raises"}}, tok, 1)
    seqs = _texts_to_sequences(tok, TEXTS, prompt_len=2)
    seqs.prompt_len = seqs.full.shape[1]  # what the start-up probe passes: the prompts alone
    with pytest.raises(ConfigError, match=r"^on the first batch \(its prompts, with empty completions\), reward "):
        probe_reward_sources(sources, seqs)


@pytest.mark.parametrize("weight", [float("nan"), float("inf"), "abc", None, True])
def test_reward_weights_must_be_finite_numbers(weight):
    from rlhf_train.infra.errors import ConfigError
    from rlhf_train.rewards.sources import build_reward_sources

    tok = chat_tokenizer()
    entry = {"_target_": "tests.unit.rewards.test_sources.raises", "weight": weight}
    with pytest.raises(ConfigError, match=r"^rewards.f.weight=.* is not a finite number"):
        build_reward_sources(None, {"f": entry}, tok, 1)
    with pytest.raises(ConfigError, match=r"^reward_model.weight=.* is not a finite number"):
        build_reward_sources(torch.nn.Linear(1, 1), {}, tok, 1, reward_model_weight=weight)


def test_a_reward_model_returning_nan_fails_at_start():
    from rlhf_train.infra.errors import ConfigError
    from rlhf_train.loop.checks import check_reward_model

    class NaNModel(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(()))

        def forward(self, input_ids, attention_mask):
            return torch.zeros(input_ids.shape), torch.full(input_ids.shape[:1], float("nan"))

    class Data(list):
        def collate(self, rows):
            return {"input_ids": torch.ones(len(rows), 3, dtype=torch.long),
                    "attention_mask": torch.ones(len(rows), 3, dtype=torch.long)}

    with pytest.raises(ConfigError, match="the reward model returned NaN or inf end scores"):
        check_reward_model(NaNModel(), Data([0, 1]))


def test_bad_targets_give_one_line():
    from rlhf_train.infra.errors import ConfigError
    from rlhf_train.rewards.sources import build_reward_sources

    tok = chat_tokenizer()
    with pytest.raises(ConfigError, match=r"rewards.f._target_=nope.missing cannot be imported"):
        build_reward_sources(None, {"f": {"_target_": "nope.missing"}}, tok, 1)
    with pytest.raises(ConfigError, match="no reward source"):
        build_reward_sources(None, {}, tok, 1)
    # a config is code, but Hydra's target policy applies to reward entries as to every other _target_
    with pytest.raises(ConfigError, match=r"^rewards.f._target_=os.system is refused by Hydra's target policy"):
        build_reward_sources(None, {"f": {"_target_": "os.system", "command": "echo pwned"}}, tok, 1)


_CALLS = {"n": 0}


def fails_after_probe(prompts, completions, **_):
    """Fine on the probe (first call), then faults on the 2nd and 3rd calls (a raise, then NaN), fine afterwards."""
    _CALLS["n"] += 1
    if _CALLS["n"] == 2:
        raise RuntimeError("flaky verifier")
    if _CALLS["n"] == 3:
        return [float("nan")] * len(completions)  # a NaN later on is this function's fault too, not a 0
    return [0.5] * len(completions)


def test_a_faulty_function_later_skips_its_batch_which_is_redrawn_and_a_streak_stops_the_run(tmp_path):
    import json

    from rlhf_train.loop.trainer import train
    from tests.e2e.test_train import compose

    base = ["+recipe=smoke", "logger=csv", "trainer.progress_bar=false", "trainer.num_threads=1",
            f"cache_dir={tmp_path / 'cache'}", "trainer.checkpoint_every=100", "reward_model=none",
            "+rewards.flaky._target_=tests.unit.rewards.test_sources.fails_after_probe",
            "+rewards.flaky.workers=0"]  # in this process, so that _CALLS counts its calls
    _CALLS["n"] = 0
    out = train(compose([*base, "trainer.num_iterations=4", "trainer.max_consecutive_faults=3"]), run_dir=tmp_path / "a")
    assert out["metrics"]["faults/reward_errors"] == 2  # two batches skipped and redrawn ...
    assert [h["iteration"] for h in out["history"]] == [1, 2, 3, 4]  # ... so the run never ends short
    assert (tmp_path / "a" / "checkpoints" / "iter_000004").is_dir()
    assert _CALLS["n"] == 1 + 2 + 4
    _CALLS["n"] = 0
    with pytest.raises(FloatingPointError, match="2 batches in a row were skipped because a reward function failed"):
        train(compose([*base, "trainer.num_iterations=4", "trainer.max_consecutive_faults=2"]), run_dir=tmp_path / "b")
    # the fault stop's checkpoint gives whoever resumes a fresh budget (the totals are kept)
    state = json.loads((tmp_path / "b" / "checkpoints" / "iter_000000" / "trainer_state.json").read_text())
    assert state["faults"]["reward_errors"] == 2 and state["faults"]["reward_consecutive"] == 0


def test_reference_pass_overlapping_a_function_gives_the_same_rollout():
    """With a Python reward function the reference pass runs while the function scores (in its thread); the
    rollout must be exactly the one computed in order (function, then the stack's reference pass)."""
    from rlhf_train.models.loading import build_causal_lm
    from rlhf_train.models.policy import build_policy
    from rlhf_train.core.sampling import SamplingParams
    from rlhf_train.models.reference import frozen_copy
    from rlhf_train.rewards.shaping import KLDivergence, RewardAdjustment
    from rlhf_train.rewards.sources import FunctionRewardSource
    from rlhf_train.rollout.rollout_from_model import RolloutFromModel

    tok = chat_tokenizer()
    torch.manual_seed(0)
    policy = build_policy(tok, config={"n_layer": 1, "n_embd": 32, "n_head": 2, "n_positions": 64})
    ref = build_causal_lm(None, {"n_layer": 1, "n_embd": 32, "n_head": 2, "n_positions": 64}, tok)
    generated = torch.randint(4, len(tok), (3, 7))
    outs, calls = [], []
    for threaded in (True, False):
        fn = FunctionRewardSource(lambda prompts, completions, **_: calls.append(1) or [1.0] * len(completions), tok)
        fn.overlap = threaded
        rollout = RolloutFromModel(policy, None, frozen_copy(ref, SamplingParams()), {"f": (fn, 1.0)},
                                   {"kl": KLDivergence(), "reward": RewardAdjustment()},
                                   eos_token_ids=(tok.eos_token_id,), pad_token_id=tok.pad_token_id, max_new_tokens=4)
        outs.append(rollout.score(None, generated, torch.ones(3, 3, dtype=torch.bool), kl_coef=0.1))
    assert len(calls) == 2
    for name in ("ref_log_prob", "kl", "reward", "score"):
        torch.testing.assert_close(getattr(outs[0], name), getattr(outs[1], name), rtol=0, atol=0)


def test_a_function_returning_none_never_makes_a_row_a_fault():
    """None from a Python function = no reward from it: with it as the only source the row's score is 0
    (TRL's nansum), not NaN (which the update would skip and count as a fault); a reward model's NaN stays a
    fault."""
    from rlhf_train.rewards.sources import Sequences, score_sources

    class Fn:
        overlap = True

        def __call__(self, seqs):
            return torch.tensor([1.0, float("nan"), 0.5])

    class Model:
        def __call__(self, seqs):
            return torch.tensor([0.5, 0.5, float("nan")])

    seqs = Sequences(torch.zeros(3, 4, dtype=torch.long), torch.ones(3, 4, dtype=torch.bool), 2)
    total, _, _ = score_sources({"f": (Fn(), 2.0)}, seqs)
    assert total.tolist() == [2.0, 0.0, 1.0]
    total, _, _ = score_sources({"f": (Fn(), 1.0), "rm": (Model(), 1.0)}, seqs)
    assert total[:2].tolist() == [1.5, 0.5] and math.isnan(total[2])
