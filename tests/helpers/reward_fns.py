"""Reward functions for the reward-execution tests (tests/unit/rewards/test_executor.py): module-level, so
that they pickle, and importing only the standard library, so that a spawned worker starts fast."""
from __future__ import annotations

import asyncio
import os
import threading
import time

RELEASE = threading.Event()  # set by a test at its end: threads left running by a timeout return


def row_by_row(prompts, completions, answer=None, **_):
    """Each row on its own: the completion's length, plus 0.5 where the answer column says "x"."""
    answer = answer if answer is not None else [None] * len(completions)
    return [None if a is None else float(len(c)) + 0.5 * (a == "x") for c, a in zip(completions, answer)]


def slow_on_slow(prompts, completions, **_):
    """1.0 per row, but a batch holding a completion "slow" sleeps a minute first."""
    if "slow" in completions:
        time.sleep(60)
    return [1.0] * len(completions)


def hangs_on_completions(prompts, completions, **_):
    """Fine on the start-up probe (empty completions); hangs on any real batch until ``RELEASE`` is set (a
    copy of it in a worker process never is)."""
    if any(completions):
        RELEASE.wait()
    return [0.5] * len(completions)


def always_hangs(prompts, completions, **_):
    RELEASE.wait()
    return [0.5] * len(completions)


def dies_on_die(prompts, completions, **_):
    """A crash the function cannot report (a segfault's stand-in): the process ends on a completion "die"."""
    if "die" in completions:
        os._exit(7)
    return [1.0] * len(completions)


async def async_length(prompts, completions, **_):
    await asyncio.sleep(0.05)
    return [float(len(c)) for c in completions]


_PING, _PONG = asyncio.Event(), asyncio.Event()  # bound to the event loop that first awaits them


async def ping(prompts, completions, **_):
    """Returns only once :func:`pong` has started: the two finish only when awaited concurrently."""
    _PING.set()
    await _PONG.wait()
    return [1.0] * len(completions)


async def pong(prompts, completions, **_):
    _PONG.set()
    await _PING.wait()
    return [2.0] * len(completions)


def closure_factory(scale: float = 1.0):
    """A factory returning a closure: fine in the trainer's process, cannot be pickled for a worker."""
    def reward(prompts, completions, **_):
        return [scale] * len(completions)
    return reward


def torch_matmul(prompts, completions, **_):
    """Uses torch's thread pool (a 256 x 256 matmul) and returns each completion's length."""
    import torch

    x = torch.ones(256, 256)
    return [float(len(c)) + 0.0 * float((x @ x)[0, 0]) for c in completions]
