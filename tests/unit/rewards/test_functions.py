"""The ready-made reward functions (rlhf_train/rewards/functions.py), each rule checked on completions whose
score is worked out by hand in the test: the final-answer match (``\\boxed{}`` > ``<answer>`` > last number,
math-verify for math answers, normalised strings for word answers), the ``<think>/<answer>`` format reward that
pays only for a readable answer, and DAPO's soft overlong punishment (arXiv 2503.14476 eq. 13).

Budget: ~3 s on 2 quiet cores (math-verify + sympy; no model).
"""
from __future__ import annotations

import pytest
import torch

from tests.helpers.byo import chat_tokenizer


def match(completions, answers):
    from rlhf_train.rewards.functions import final_answer_match

    return final_answer_match([""] * len(completions), completions, answer=answers)


# --------------------------------------------------------------------------- final_answer_match
def test_answer_tags_are_read():
    """Fails on the old code: math-verify's parser finds nothing in ``<answer>11</answer>`` (scored 0)."""
    assert match(["<answer>11</answer>", "<answer> 11 </answer>\n"], ["11", "11"]) == [1.0, 1.0]


def test_precedence_boxed_then_answer_tag_then_last_number():
    from rlhf_train.rewards.functions import extract_answer

    # the old code took math-verify's last number: 5 here, so "<answer>11</answer> is larger than 5" scored 0
    assert extract_answer("<answer>11</answer> is larger than 5") == "11"
    assert extract_answer("\\boxed{4}, or <answer>3</answer>, or 9") == "4"   # \boxed{} first
    assert extract_answer("<answer>3</answer> then 9") == "3"                  # then the <answer> tag
    assert extract_answer("first 3, then 9") == "9"                            # then the LAST number
    assert extract_answer("11 is larger than 5") == "5"                        # (so, untagged, this is 5: say it)
    assert extract_answer("\\boxed{1} and \\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"  # the last boxed, braces nested
    assert extract_answer("<answer>1</answer><answer>2</answer>") == "2"      # the last tag
    assert extract_answer("-3.5 and 1,000 and 1/2") == "1/2"
    # the first kind present decides: an empty tag is no answer, not a reason to take the number before it
    assert extract_answer("<think>3 + 4 = 7</think><answer> </answer>") is None
    assert extract_answer("\\boxed{} 7") is None
    assert extract_answer("no number here") is None
    assert match(["<answer>11</answer> is larger than 5", "11 is larger than 5", "<answer></answer> 7"],
                 ["11", "11", "7"]) == [1.0, 0.0, 0.0]


def test_math_answers_by_math_verify():
    comps = ["\\boxed{\\frac{1}{2}}", "so the answer is 1/2", "<answer>0.50</answer>", "The total is 1,000 apples",
             "x = -3.5", "<answer>\\sqrt{2}</answer>", "<answer>The answer is 7</answer>", "I think 3"]
    gold = ["0.5", "0.5", "\\frac{1}{2}", "1000", "-7/2", "\\sqrt 2", "7", "4"]
    assert match(comps, gold) == [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0]


def test_word_answers_by_normalised_string():
    """Fails on the old code: a word answer never parses in math-verify, so the row scored None."""
    comps = ["<answer> Paris. </answer>", "\\boxed{\\text{Paris}}", "<answer>PARIS</answer>", "<answer>no</answer>",
             "<answer>London</answer>", "<answer>Yes</answer>"]
    gold = ["paris", "Paris", "Paris", "on", "Paris", "yes"]
    # "no" vs "on": as math, both are the product n·o; words never go through math-verify
    assert match(comps, gold) == [1.0, 1.0, 1.0, 0.0, 0.0, 1.0]


def test_missing_answers_score_none_and_a_missing_column_is_named():
    from rlhf_train.rewards.functions import final_answer_match

    assert match(["<answer>1</answer>", "1", "no answer at all"], [None, "  ", "1"]) == [None, None, 0.0]
    with pytest.raises(KeyError, match="column 'solution'"):
        final_answer_match(["p"], ["1"], column="solution", answer=["1"])


# --------------------------------------------------------------------------- think_answer_format
def test_think_answer_format_pays_only_for_a_readable_answer_inside_the_format():
    from rlhf_train.rewards.functions import think_answer_format

    comps = [
        "<think>3 + 4 = 7</think><answer>7</answer>",          # 1: the format, a number
        " <think>\nadd\n</think>\n\n<answer> 7 </answer>\n",     # 1: whitespace around and between the blocks
        "<think></think><answer>\\frac{1}{2}</answer>",          # 1: an empty think is allowed; LaTeX reads
        "<think>3 + 4</think><answer></answer>",                 # 0: the gamed case, empty answer tags
        "<think>3 + 4</think><answer>   </answer>",              # 0: blank
        "<think>3 + 4</think><answer>seven</answer>",            # 0: no number for a math answer
        "<think>3 + 4</think><answer>7</answer> and more",       # 0: text after </answer>
        "<answer>7</answer>",                                    # 0: no think block
        "I think <think>x</think><answer>7</answer>",            # 0: text before <think>
        "<think>a<answer>7</answer></think><answer>7</answer>",  # 0: a tag inside the think block
        "<think>a</think><answer>7</answer><answer>8</answer>",  # 0: two answers
    ]
    assert think_answer_format([""] * len(comps), comps) == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    words = ["<think>capital</think><answer>Paris</answer>", "<think>capital</think><answer> </answer>"]
    assert think_answer_format(["", ""], words, answer_kind="text") == [1.0, 0.0]
    with pytest.raises(ValueError, match="answer_kind"):
        think_answer_format([""], ["x"], answer_kind="number")


# --------------------------------------------------------------------------- soft overlong punishment
def test_soft_overlong_punishment_by_hand():
    """DAPO eq. 13 with L_max = 10, L_cache = 4: 0 up to 6 tokens, (6 − |y|) / 4 from 7 to 10, −1 past 10."""
    from rlhf_train.core.overlong import soft_overlong_punishment

    lengths = torch.tensor([0, 6, 7, 8, 9, 10, 11, 50])
    expected = torch.tensor([0.0, 0.0, -0.25, -0.5, -0.75, -1.0, -1.0, -1.0])
    torch.testing.assert_close(soft_overlong_punishment(lengths, 10, 4), expected)
    torch.testing.assert_close(soft_overlong_punishment(torch.tensor([9, 10, 11]), 10, 10),  # L_cache = L_max
                               torch.tensor([-0.9, -1.0, -1.0]))
    with pytest.raises(ValueError):
        soft_overlong_punishment(lengths, 4, 10)


def test_soft_overlong_reward_function_counts_tokens_with_the_policy_tokenizer():
    from rlhf_train.infra.errors import ConfigError
    from rlhf_train.rewards.functions import SoftOverlongPunishment
    from rlhf_train.rewards.sources import FunctionRewardSource, build_reward_sources

    tok = chat_tokenizer()  # word level: one token per word
    fn = SoftOverlongPunishment(max_length=5, cache_length=2, tokenizer=tok)  # 0 up to 3, −0.5 at 4, −1 from 5
    comps = ["w4 w5 w6", "w4 w5 w6 w7", "w4 w5 w6 w7 w8", "w4 w5 w6 w7 w8 w9", ""]
    assert fn(["p"] * 5, comps) == [0.0, -0.5, -1.0, -1.0, 0.0]
    assert fn(["p"], ["ignored"], completion_ids=[[1, 2, 3, 4]]) == [-0.5]  # TRL's completion_ids, when given
    entry = {"_target_": "rlhf_train.rewards.functions.SoftOverlongPunishment", "max_length": 5, "cache_length": 2}
    sources = build_reward_sources(None, {"overlong": entry}, tok, tok.pad_token_id)
    source = sources["overlong"][0]
    assert isinstance(source, FunctionRewardSource) and source.fn.tokenizer is tok  # the factory got the tokenizer
    for bad, msg in (({"cache_length": 6}, "0 < cache_length"), ({"max_length": None}, "max_length=None")):
        with pytest.raises(ConfigError, match=msg):
            build_reward_sources(None, {"overlong": {**entry, **bad}}, tok, tok.pad_token_id)
