"""The environment seam: the ``env`` group read into an ``EnvSpec`` (bad values in one line), a step's result, and
the episode reward as a reward source."""
from __future__ import annotations

import pytest
import torch

from rlhf_train.envs.base import EnvSpec, EpisodeRewards, Step, as_step, env_spec, new_env
from rlhf_train.envs.checks import check_env_config
from rlhf_train.infra.errors import ConfigError
from rlhf_train.rewards.sources import Sequences, score_sources
from tests.helpers.config import compose

SCRIPTED = "env._target_=tests.helpers.envs.Scripted"


def test_env_none_is_no_environment_and_a_target_is_an_env_spec():
    assert env_spec(compose([]).env) is None
    spec = env_spec(compose([SCRIPTED, "env.max_turns=2", "+env.kwargs.turns=5"]).env)
    assert isinstance(spec, EnvSpec) and (spec.max_turns, spec.max_tokens, spec.weight) == (2, 1024, 1.0)
    env = new_env(spec)
    assert env.turns == 5 and env is not new_env(spec)  # a fresh environment per episode


@pytest.mark.parametrize("override, words", [
    ("env.max_turns=0", "env.max_turns=0"), ("env.max_tokens=-1", "env.max_tokens=-1"),
    ("env._target_=no_such_module.Env", "cannot be imported"), ("env.truncated_reward=inf", "env.truncated_reward=inf"),
])
def test_bad_env_values_are_one_line(override, words):
    with pytest.raises(ConfigError, match=words):
        env_spec(compose([SCRIPTED, override]).env)


def test_an_env_that_cannot_be_built_or_has_no_step_is_one_line():
    with pytest.raises(ConfigError, match="failed to build an environment"):
        new_env(env_spec(compose([SCRIPTED, "+env.kwargs.colour=1"]).env))
    with pytest.raises(ConfigError, match="has no reset / step method"):
        new_env(env_spec(compose(["env._target_=builtins.dict"]).env))


def test_env_with_the_pipeline_evaluation_stage_is_refused_and_the_rl_loops_evaluation_is_not():
    with pytest.raises(ConfigError, match="stage=pipeline: the pipeline's evaluation stage scores single completions"):
        check_env_config(compose([SCRIPTED, "evaluation=verifiable", "stage=pipeline"]))
    check_env_config(compose([SCRIPTED, "evaluation=verifiable", "stage=rl"]))  # plays held-out episodes
    check_env_config(compose([SCRIPTED]))


def test_step_results():
    assert as_step((None, 1.0, {}), "E") == Step(None, 1.0, {})
    assert as_step(([{"role": "user", "content": "x"}], None), "E").messages == [{"role": "user", "content": "x"}]
    with pytest.raises(TypeError, match="E.step must return"):
        as_step("done", "E")


def test_episode_rewards_are_a_source_summed_by_weight():
    """Two sources, weights 2 (the environment) and 1: row 0 = 2·1.5 + 1, row 1 had no reward from the episode
    (None, NaN): left out of its sum, as a reward function's None."""
    env = EpisodeRewards()
    seq = Sequences(torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 3, dtype=torch.bool), 1)

    class One:
        def __call__(self, sequences):
            return torch.ones(2)

    env.load(torch.tensor([1.5, float("nan")]))
    total, parts, _ = score_sources({"env": (env, 2.0), "one": (One(), 1.0)}, seq)
    torch.testing.assert_close(total, torch.tensor([4.0, 1.0]))
    assert torch.isnan(parts["env"][1])
    assert torch.isnan(env(seq)).all()  # used once: a batch that is not an episode batch has no reward from it
