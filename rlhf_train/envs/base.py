"""The environment seam: what a multi-turn episode asks of an environment, and how the ``env`` group builds one.

An :class:`Environment` is a plain Python object, one fresh instance per episode (``B = data.batch_size x
rollout.num_samples`` per iteration), driven by :class:`rlhf_train.rollout.multi_turn.MultiTurnRollout`:

    messages = env.reset(row)            # the first messages (chat format), rendered with the chat template
    loop:  the policy writes an assistant message (token in, token out: sampled after the exact ids so far)
           step = env.step(message)      # Step(new messages, or None: done; reward or None; info)
           the new messages are tokenized as a suffix of the episode and the policy answers again

``row`` is the dataset row of the episode's prompt: its other columns (e.g. ``answer``, ``messages`` for a chat
prompt) and ``prompt``, the prompt's text. ``tools`` (optional): Python functions the template announces to the
model (the tokenizer's chat template ``tools=`` argument: their JSON schemas from their signatures and Google-style
docstrings); :class:`rlhf_train.envs.tools.ToolEnvironment` runs the calls the model writes. Rewards: each step's
reward (``None``: none) is summed over the episode into one score, the ``env`` reward source (weight
``env.weight``, logged as ``reward/env``), summed with the other reward sources by weight; a step's ``info`` may
count ``tool_calls`` and ``tool_errors`` (logged as ``env/tool_calls``, ``env/tool_errors``). Limits
(:class:`EnvSpec`): ``env.max_turns`` assistant turns and ``env.max_tokens`` tokens after the first prompt
(assistant and environment tokens); an episode that reaches one ends, counted in ``env/truncated_episodes``. An
episode a limit ended before any step gave a reward (its first turn cut without EOS) is paid
``env.truncated_reward`` (``None``: no reward, the row is left out as a reward function's ``None``; a game that
counts a cut turn as a loss sets 0).

A new environment: a class with ``reset`` and ``step`` in any importable module (or ``rlhf_train/envs/<name>.py``),
named by ``env._target_`` (or a ``conf/env/<name>.yaml`` selected by ``env=<name>``), its constructor's keyword
arguments in ``env.kwargs``. docs/environments.md has one in 30 lines.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Protocol

import torch

Message = dict  # {"role": "user" | "assistant" | "tool" | "system", "content": str, ...}: the chat-template format


class Step(NamedTuple):
    """What :meth:`Environment.step` returns (a plain 3-tuple works too)."""

    messages: list[Message] | None  # the environment's reply (a user turn, tool results); None: the episode is done
    reward: float | None = None  # this step's reward, summed over the episode (None: no reward at this step)
    info: dict | None = None  # counts the rollout logs: {"tool_calls": int, "tool_errors": int}


class Environment(Protocol):
    """One episode's environment. ``tools`` (optional attribute): functions announced through the chat template."""

    def reset(self, row: dict[str, Any]) -> list[Message]:
        """The episode's first messages (system / user), from the dataset ``row`` of its prompt."""
        ...

    def step(self, message: Message) -> Step:
        """React to the policy's assistant ``message`` (``{"role": "assistant", "content": text}``)."""
        ...


@dataclass(frozen=True)
class EnvSpec:
    """The ``env`` config group, read once: how to make an episode's environment and its limits."""

    make: Callable[[], Environment]  # a fresh environment (``_target_`` with ``kwargs``), one per episode
    max_turns: int  # assistant turns per episode at most
    max_tokens: int  # tokens after the first prompt (assistant + environment) at most
    weight: float  # the episode reward's weight in the sum of reward sources
    target: str  # ``env._target_``, named in messages
    truncated_reward: float | None = None  # the reward of an episode a limit ended before any step paid (None: none)


def tools_of(env: Environment) -> list[Callable] | None:
    """The environment's ``tools`` (functions announced through the chat template), or ``None``."""
    return list(getattr(env, "tools", None) or []) or None


def env_spec(node: Any) -> EnvSpec | None:
    """The :class:`EnvSpec` of the ``env`` config node, ``None`` for no environment (``env=none``); a bad value is
    one :class:`~rlhf_train.infra.errors.ConfigError` line naming the key."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    from rlhf_train.infra.errors import ConfigError

    if node is None or not node.get("_target_"):
        return None
    target = str(node._target_)
    for key in ("max_turns", "max_tokens"):
        value = node.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"env.{key}={value!r}: set it to a whole number >= 1")
    weight, truncated = node.get("weight", 1.0), node.get("truncated_reward")
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
        raise ConfigError(f"env.weight={weight!r} is not a finite number: set it to a float such as 1.0")
    if truncated is not None and (isinstance(truncated, bool) or not isinstance(truncated, (int, float))
                                  or not math.isfinite(truncated)):
        raise ConfigError(f"env.truncated_reward={truncated!r} is not a finite number: set a float such as 0.0, "
                          f"or null")
    try:  # through Hydra's instantiate (a partial, nothing called): its target policy applies here too
        cls = instantiate({"_target_": target, "_partial_": True}).func
    except Exception as err:
        raise ConfigError(f"env._target_={target} cannot be imported ({' '.join(str(err).split())[:160]}); is its "
                          f"module on PYTHONPATH?") from None
    if not callable(cls):
        raise ConfigError(f"env._target_={target} is not callable: name an environment class or a factory")
    kwargs = OmegaConf.to_container(node.kwargs, resolve=True) if node.get("kwargs") else {}
    return EnvSpec(functools.partial(cls, **kwargs), int(node.max_turns), int(node.max_tokens), float(weight), target,
                   None if truncated is None else float(truncated))


def new_env(spec: EnvSpec) -> Environment:
    """One environment from ``spec``; a constructor that raises or an object without ``reset`` / ``step`` is
    a :class:`~rlhf_train.infra.errors.ConfigError` line (the first one is built before training)."""
    from rlhf_train.infra.errors import ConfigError

    try:
        env = spec.make()
    except Exception as err:
        raise ConfigError(f"env._target_={spec.target} failed to build an environment ({type(err).__name__}: "
                          f"{err}); check env.kwargs") from None
    missing = [m for m in ("reset", "step") if not callable(getattr(env, m, None))]
    if missing:
        raise ConfigError(f"env._target_={spec.target} built a {type(env).__name__}, which has no "
                          f"{' / '.join(missing)} method: an environment needs reset(row) and step(message)")
    return env


def as_step(result: Any, target: str) -> Step:
    """An environment's ``step`` result as a :class:`Step` (a 3-tuple, a 2-tuple without info, or a Step)."""
    if isinstance(result, tuple) and 1 <= len(result) <= 3:
        step = Step(*result)
        if step.messages is None or isinstance(step.messages, list):
            return step
    raise TypeError(f"{target}.step must return Step(messages | None, reward | None, info), got {result!r:.120}")


class EpisodeRewards:
    """The environment's reward as a reward source: each episode's summed step rewards, handed over by the
    multi-turn rollout (:meth:`load`) before the sources score its batch. NaN (no step gave a reward, or a batch
    that is not an episode batch) is "no reward", as a reward function's ``None``: left out of the row's sum."""

    overlap = True  # scored as the reward functions are: NaN is not a fault

    def __init__(self):
        self.rewards: torch.Tensor | None = None

    def load(self, rewards: torch.Tensor) -> None:
        self.rewards = rewards

    def __call__(self, sequences: Any) -> torch.Tensor:
        rewards, self.rewards = self.rewards, None
        B = sequences.full.shape[0]
        if rewards is None or rewards.shape != (B,):
            return torch.full((B,), float("nan"), device=sequences.full.device)
        return rewards.float().to(sequences.full.device)
