"""Reward execution (rlhf_train/rewards/executor.py, function_source.py): worker processes give the same
rewards as one call in the trainer's process; a call past ``rewards.<name>.timeout_s`` or whose worker dies
scores None for its rows, is counted (``faults/reward_timeouts``) and training goes on; a hanging function
never blocks the run; ``async def`` functions are awaited (concurrently); bad settings are one line at start.

Budget: ~25 s on 2 quiet cores (worker start-ups, two 2-iteration smoke runs, timeouts of 0.5-1 s).
"""
from __future__ import annotations

import asyncio
import json
import math
import multiprocessing

import pytest
import torch

from tests.helpers import reward_fns

FNS = "tests.helpers.reward_fns"


class Tok:
    """Decodes ids to words (``5`` -> "slow", ``6`` -> "die", else ``w<id>``), enough for reward functions."""

    WORDS = {5: "slow", 6: "die"}

    def batch_decode(self, rows, skip_special_tokens=False):
        return [" ".join(self.WORDS.get(int(i), f"w{int(i)}") for i in r) for r in rows]


def sequences(completion_ids: list[list[int]], columns: dict | None = None):
    """One prompt token per row, then the completion's tokens (all the same length here)."""
    from rlhf_train.rewards.sources import Sequences

    full = torch.tensor([[9] + ids for ids in completion_ids])
    return Sequences(full, torch.ones_like(full, dtype=torch.bool), 1, columns or {})


def build(entries: dict):
    from rlhf_train.rewards.sources import build_reward_sources

    return build_reward_sources(None, entries, Tok(), 0)


def reward_children() -> list:
    return [p for p in multiprocessing.active_children() if p.name.startswith("reward-")]


@pytest.fixture
def release():
    """Threads a test leaves waiting on ``reward_fns.RELEASE`` return at its end."""
    reward_fns.RELEASE.clear()
    yield
    reward_fns.RELEASE.set()


# --------------------------------------------------------------------------- the same rewards
@pytest.mark.parametrize("workers, method", [(1, "fork"), (3, "fork"), (2, "spawn")])
def test_worker_processes_give_the_same_rewards_as_in_process(workers, method, monkeypatch):
    """7 rows (slices of 3/2/2 with 3 workers) and a dataset column: exactly one in-process call's scores,
    None (NaN) rows included, whichever start method the workers get (spawn: the function pickled)."""
    from rlhf_train.rewards import executor
    from rlhf_train.rewards.sources import weighted_sum

    monkeypatch.setattr(executor, "start_method", lambda: method)
    seqs = sequences([[1, 2], [3, 3], [4, 7], [7, 8], [2, 2], [8, 1], [1, 1]],
                     {"answer": ["x", None, "y", "x", "x", None, "z"]})
    entry = {"_target_": f"{FNS}.row_by_row"}
    inline = build({"f": {**entry, "workers": 0}})
    pooled = build({"f": {**entry, "workers": workers}})
    expected, parts = weighted_sum(inline, seqs)
    # by hand: "w1 w2" is 5 characters, + 0.5 for answer "x"; None where the answer is None
    assert parts["f"][0].item() == 5.5 and math.isnan(parts["f"][1])
    got, got_parts = weighted_sum(pooled, seqs)
    torch.testing.assert_close(got_parts["f"], parts["f"], rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert len(reward_children()) == workers
    pooled["f"][0].close()
    assert reward_children() == []


def test_a_forked_worker_can_use_torch_after_the_trainers_thread_pool_ran():
    """A worker forked from a process whose OpenMP pool ran would hang in its first parallel region (GNU
    OpenMP is not fork-safe): the worker runs torch on one thread, as torch's DataLoader workers do."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        x = torch.ones(512, 512)
        _ = x @ x  # the trainer's pool has run
        source = build({"f": {"_target_": f"{FNS}.torch_matmul", "workers": 2, "timeout_s": 20}})["f"][0]
        assert source(sequences([[1], [22], [3]])).tolist() == [2.0, 3.0, 2.0]
        source.close()
    finally:
        torch.set_num_threads(threads)


# --------------------------------------------------------------------------- timeouts and crashes
def test_a_slice_past_its_timeout_scores_none_is_counted_and_its_worker_replaced():
    """2 workers; the slice holding "slow" sleeps a minute: at the 1 s limit its rows are None (NaN), the
    other slice's rows are scored, the lost rows are reported; the next batch gets a fresh worker."""
    from rlhf_train.rewards.sources import RewardReport, score_sources

    sources = build({"f": {"_target_": f"{FNS}.slow_on_slow", "workers": 2, "timeout_s": 1}})
    report = RewardReport()
    total, parts, _ = score_sources(sources, sequences([[1], [5], [2], [3]]), report=report)
    assert torch.isnan(parts["f"][:2]).all() and parts["f"][2:].tolist() == [1.0, 1.0]
    assert total.tolist() == [0.0, 0.0, 1.0, 1.0]  # None is no reward: left out of the sum
    assert report.lost_rows == {"f": 2} and report.lost == 2 and report.seconds >= 1.0
    assert sources["f"][0].last_lost == ["rows 0-1 of 4: did not return within rewards.f.timeout_s=1 s "
                                         "(its worker process was killed and is replaced)"]
    report = RewardReport()
    _, parts, _ = score_sources(sources, sequences([[1], [2], [3], [4]]), report=report)
    assert parts["f"].tolist() == [1.0] * 4 and report.lost == 0
    sources["f"][0].close()


def test_a_hanging_function_in_the_trainers_process_is_abandoned_not_waited_for(release):
    """``workers: 0``: the thread cannot be stopped; at the limit its rows are None and the call returns,
    and the next batch runs in a new thread (the stuck one does not delay it)."""
    source = build({"f": {"_target_": f"{FNS}.hangs_on_completions", "workers": 0, "timeout_s": 0.5}})["f"][0]
    scores, lost, _ = source.finish(source.start(sequences([[1], [2]])))
    assert torch.isnan(scores).all() and lost == 2
    assert "its thread is left running" in source.last_lost[0]
    scores, lost, _ = source.finish(source.start(sequences([[], []])))  # empty completions: returns at once
    assert scores.tolist() == [0.5, 0.5] and lost == 0


def test_a_worker_that_dies_scores_none_for_its_rows_and_is_replaced():
    source = build({"f": {"_target_": f"{FNS}.dies_on_die", "workers": 2}})["f"][0]
    scores, lost, _ = source.finish(source.start(sequences([[6], [1], [2]])))
    assert torch.isnan(scores[:2]).all() and scores[2].item() == 1.0 and lost == 2
    assert source.last_lost == ["rows 0-1 of 3: crashed: its worker process died (exit code 7; a new one is started)"]
    assert source(sequences([[1], [2], [3]])).tolist() == [1.0] * 3
    source.close()


def test_a_function_that_times_out_on_the_first_batch_stops_the_run_with_one_line(release):
    from rlhf_train.infra.errors import ConfigError
    from rlhf_train.rewards.sources import probe_reward_sources

    sources = build({"f": {"_target_": f"{FNS}.always_hangs", "timeout_s": 0.5}})
    with pytest.raises(ConfigError) as err:
        probe_reward_sources(sources, sequences([[1], [2]]))
    assert str(err.value) == ("on the first batch, reward function 'f' did not return within rewards.f.timeout_s=0.5 s "
                              "(its worker process was killed and is replaced); fix the function or raise "
                              "rewards.f.timeout_s")
    assert reward_children() == []  # the failed start leaves no worker behind


# --------------------------------------------------------------------------- async def
@pytest.mark.parametrize("workers", [0, 1])
def test_an_async_function_is_awaited(workers):
    source = build({"f": {"_target_": f"{FNS}.async_length", "workers": workers}})["f"][0]
    assert source.executor.is_async
    assert source(sequences([[1, 2], [3, 44]])).tolist() == [5.0, 6.0]
    source.close()


def test_async_functions_in_the_trainers_process_are_awaited_concurrently():
    """``ping`` returns only once ``pong`` has started and vice versa: awaited one after the other, the
    first would wait for the second until its timeout (None); concurrently, both score."""
    from rlhf_train.rewards.sources import RewardReport, score_sources

    reward_fns._PING, reward_fns._PONG = asyncio.Event(), asyncio.Event()
    sources = build({"a": {"_target_": f"{FNS}.ping", "workers": 0, "timeout_s": 5},
                     "b": {"_target_": f"{FNS}.pong", "workers": 0, "timeout_s": 5}})
    report = RewardReport()
    total, parts, _ = score_sources(sources, sequences([[1], [2]]), report=report)
    assert parts["a"].tolist() == [1.0, 1.0] and parts["b"].tolist() == [2.0, 2.0] and report.lost == 0


# --------------------------------------------------------------------------- settings: one line at start
def test_a_function_that_cannot_be_pickled_is_one_line_unless_it_runs_in_process():
    from rlhf_train.infra.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^rewards.f: the function cannot be sent to a worker process "
                                          r"\(AttributeError: .*set rewards.f.workers=0 to run it in the trainer's"):
        build({"f": {"_target_": f"{FNS}.closure_factory", "scale": 2.0}})
    source = build({"f": {"_target_": f"{FNS}.closure_factory", "scale": 2.0, "workers": 0}})["f"][0]
    assert source(sequences([[1]])).tolist() == [2.0]


@pytest.mark.parametrize("override, line", [
    ("workers=-1", "rewards.f.workers=-1: set it to a whole number >= 0 (0: in the trainer's process; N: N worker "
                   "processes, each scoring a slice of the batch)"),
    ("workers=true", "rewards.f.workers=True: set it to a whole number >= 0"),
    ("timeout_s=0", "rewards.f.timeout_s=0: set it to a number of seconds > 0, or null for no limit"),
    ("timeout_s=soon", "rewards.f.timeout_s='soon': set it to a number of seconds > 0, or null for no limit"),
])
def test_bad_execution_settings_are_one_line_before_any_model(override, line):
    from rlhf_train.infra.errors import ConfigError
    from rlhf_train.loop.checks import check_config
    from tests.helpers.reliability import make_cfg

    cfg = make_cfg("reward_model=none", f"+rewards.f._target_={FNS}.row_by_row", f"+rewards.f.{override}")
    with pytest.raises(ConfigError) as err:
        check_config(cfg)
    assert str(err.value).startswith(line)


def test_a_reward_model_entry_refuses_execution_settings():
    from rlhf_train.infra.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^rewards.rm.timeout_s: only reward functions run in worker processes"):
        build({"rm": {"_target_": "tests.helpers.reliability.BadShapeRewardModel", "timeout_s": 5}})


# --------------------------------------------------------------------------- training goes on
@pytest.mark.parametrize("workers", [1, 0])
def test_training_goes_on_past_a_hanging_function_and_logs_the_timeouts(workers, tmp_path, release):
    """A function that hangs on every real batch (fine on the probe): each iteration's rows score None at the
    0.5 s limit, counted in faults/reward_timeouts (cumulative, in the checkpoint too), time/reward_s logged;
    the run ends normally and leaves no worker process behind."""
    from rlhf_train.loop.trainer import train
    from tests.helpers.reliability import make_cfg

    cfg = make_cfg("trainer.num_iterations=2", "trainer.checkpoint_every=2", "reward_model=none",
                   f"+rewards.slow._target_={FNS}.hangs_on_completions", "+rewards.slow.timeout_s=0.5",
                   f"+rewards.slow.workers={workers}")
    rows = cfg.data.batch_size * cfg.rollout.num_samples
    out = train(cfg, tmp_path / "run")
    assert [h["iteration"] for h in out["history"]] == [1, 2]
    assert [h["faults/reward_timeouts"] for h in out["history"]] == [rows, 2 * rows]
    assert all(0.5 <= h["time/reward_s"] for h in out["history"])
    assert out["metrics"]["faults/reward_errors"] == 0  # a timeout is not a raise: no batch was skipped
    state = json.loads((tmp_path / "run" / "checkpoints" / "iter_000002" / "trainer_state.json").read_text())
    assert state["faults"]["reward_timeouts"] == 2 * rows
    assert reward_children() == []
