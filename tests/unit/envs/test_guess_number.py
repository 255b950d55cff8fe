"""Guess the number (rlhf_train/envs/guess_number.py): the replies and rewards of a game played by hand, the seeded
games and their held-out split."""
from __future__ import annotations

import random

import pytest

from rlhf_train.envs.guess_number import GuessNumber, game, guess_number_prompts, guess_of
from rlhf_train.envs.prompts import held_out, seeded_rows
from rlhf_train.infra.errors import ConfigError
from tests.helpers.envs import chatml_tokenizer


def say(text):
    return {"role": "assistant", "content": text}


def test_a_game_played_by_hand():
    env = GuessNumber(valid_guess_reward=0.05)
    first = env.reset({"low": 11, "high": 20, "secret": 17})
    assert first == [{"role": "user", "content": "I am thinking of a number from 11 to 20. Guess it. Reply with one "
                                                 "number only."}]
    assert env.step(say("I'd say 15.")) == ([{"role": "user", "content": "My number is higher than 15. Guess again."}],
                                            0.05, {})
    assert env.step(say("19")) == ([{"role": "user", "content": "My number is lower than 19. Guess again."}], 0.05, {})
    assert env.step(say("Is it 25?")) == ([{"role": "user", "content": "Reply with one number from 11 to 20."}], 0.0, {})
    assert env.step(say("no idea")).reward == 0.0
    assert env.step(say("From 16 to 18: 17")) == (None, 1.0, {})  # the last number is the guess
    assert GuessNumber().valid_guess_reward == 0.0


def test_guess_of():
    assert guess_of("12, no, 13") == 13 and guess_of("-4") == -4 and guess_of("none") is None


def test_games_are_seeded_and_held_out_games_are_never_trained_on():
    make = game(10, 90)
    rows = [make(random.Random(i)) for i in range(500)]
    assert all(r["low"] <= r["secret"] <= r["high"] == r["low"] + 9 and 1 <= r["low"] <= 91 for r in rows)
    key = lambda r: (r["low"], r["secret"])  # noqa: E731
    train = seeded_rows("guess_number", "train", 400, 0, make, key)
    test = seeded_rows("guess_number", "test", 100, 0, make, key)
    assert train == seeded_rows("guess_number", "train", 400, 0, make, key)
    assert not {key(r) for r in train} & {key(r) for r in test}
    assert all(held_out(key(r), 10) for r in test)
    assert len({key(r) for r in test}) > 30  # many distinct held-out games


def test_guess_number_prompts():
    tok = chatml_tokenizer()
    data = guess_number_prompts(tok, split="test", max_prompts=3)
    assert len(data) == 3 and set(data.columns) == {"low", "high", "secret"}
    row = {k: v[0] for k, v in data.columns.items()}
    assert tok.decode(data[0]["input_ids"].tolist()) == (
        f"<|im_start|>user\nI am thinking of a number from {row['low']} to {row['high']}. Guess it. Reply with one "
        f"number only.<|im_end|>\n<|im_start|>assistant\n")
    with pytest.raises(ConfigError, match="data.size=1"):
        guess_number_prompts(tok, size=1)
    with pytest.raises(ConfigError, match="data.max_prompts=None"):
        guess_number_prompts(tok, max_prompts=None)
