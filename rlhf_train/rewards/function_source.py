"""A Python reward function as a reward source: :class:`FunctionRewardSource` decodes a batch of sequences
to text, hands it to the function through its :class:`~rlhf_train.rewards.executor.FunctionExecutor`
(in the trainer's process or in worker processes, with a timeout) and turns what comes back into one
score per row, or a :class:`RewardFunctionError` naming the function. Re-exported by
:mod:`rlhf_train.rewards.sources`, where the sources are built and summed.
"""
from __future__ import annotations

import logging
import pickle
from typing import Any, Callable

import torch

from rlhf_train.rewards.executor import DEFAULT_TIMEOUT_S, DEFAULT_WORKERS, FunctionExecutor

log = logging.getLogger(__name__)


def execution_settings(entry: Any, key: str) -> tuple[int, float | None]:
    """``(workers, timeout_s)`` of one ``rewards.<name>`` entry (defaults where unset), or one
    :class:`~rlhf_train.infra.errors.ConfigError` line naming the key."""
    from rlhf_train.infra.errors import ConfigError

    get = entry.get if hasattr(entry, "get") else (lambda k, d=None: d)
    workers, timeout = get("workers", DEFAULT_WORKERS), get("timeout_s", DEFAULT_TIMEOUT_S)
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
        raise ConfigError(f"{key}.workers={workers!r}: set it to a whole number >= 0 (0: in the trainer's process; "
                          f"N: N worker processes, each scoring a slice of the batch)")
    if timeout is not None:
        ok = not isinstance(timeout, bool) and isinstance(timeout, (int, float)) and 0 < timeout < float("inf")
        if not ok:
            raise ConfigError(f"{key}.timeout_s={timeout!r}: set it to a number of seconds > 0, or null for no limit")
        timeout = float(timeout)
    return workers, timeout


def check_entries(entries: Any) -> None:
    """Every ``rewards.<name>``'s ``workers`` / ``timeout_s``, from the config alone (``check_config``)."""
    for name, entry in (entries or {}).items():
        execution_settings(entry, f"rewards.{name}")


def check_picklable(fn: Callable, key: str) -> None:
    """A function for worker processes must pickle (a spawned worker gets it pickled; so that a run behaves
    the same whichever start method it gets, it must pickle under fork too): else one line."""
    from rlhf_train.infra.errors import ConfigError

    try:
        pickle.dumps(fn)
    except Exception as err:
        raise ConfigError(f"{key}: the function cannot be sent to a worker process ({type(err).__name__}: "
                          f"{' '.join(str(err).split())[:120]}); make it a module-level function or a class "
                          f"instance (a closure does not pickle), or set {key}.workers=0 to run it in the "
                          f"trainer's process") from None


class RewardFunctionError(RuntimeError):
    """A reward function raised or returned something unusable; the message names the source."""


class FunctionRewardSource:
    """A Python reward function as a :class:`RewardSource`, called once per batch (TRL's signature):

    ``fn(prompts=[B] str, completions=[B] str, **columns) -> list[float | None]`` of length ``B``.
    ``prompts``: each prompt as the policy saw it (chat template applied; padding dropped);
    ``completions``: the response text (special tokens such as EOS dropped); ``columns``: the dataset's
    other columns for each row (e.g. ``answer``). ``None`` -> NaN (no reward for that row). A raise (any
    ``BaseException``, ``sys.exit`` included), a wrong length, a non-number or a number that is NaN / inf
    in float32 raises :class:`RewardFunctionError` naming the source (the loop skips the batch and counts it).

    ``workers`` / ``timeout_s``: where and for how long it runs (:mod:`rlhf_train.rewards.executor`; here
    the defaults are the trainer's process and no limit, the ``rewards.<name>`` entries' are one worker
    process and 60 s). With ``N`` workers it is called on ``N`` slices of the batch, the results
    concatenated; a slice past the timeout, or whose worker died, scores ``None`` (NaN) for its rows, counted
    by :meth:`finish` (never a :class:`RewardFunctionError`: the batch goes on).
    """

    overlap = True  # handed its batch before the reward models score, collected after them

    def __init__(self, fn: Callable, tokenizer: Any, name: str = "function", workers: int = 0,
                 timeout_s: float | None = None):
        self.fn, self.tokenizer, self.name = fn, tokenizer, name
        self.executor = FunctionExecutor(fn, name, workers, timeout_s)
        self.last_lost: list[str] = []  # why rows of the last batch scored None (a timeout, a dead worker)

    def texts(self, sequences: Any) -> tuple[list[str], list[str]]:
        P = sequences.prompt_len if sequences.prompt_len is not None else 0
        full, mask = sequences.full.cpu(), sequences.full_mask.cpu().bool()
        prompts = [row[m].tolist() for row, m in zip(full[:, :P], mask[:, :P])]
        completions = [row[m].tolist() for row, m in zip(full[:, P:], mask[:, P:])]
        dec = self.tokenizer.batch_decode
        return dec(prompts, skip_special_tokens=False), dec(completions, skip_special_tokens=True)

    def __call__(self, sequences: Any) -> torch.Tensor:
        return self.finish(self.start(sequences))[0]

    def start(self, sequences: Any) -> tuple:
        """Decode the batch and hand it to the function (returns at once); :meth:`finish` collects."""
        prompts, completions = self.texts(sequences)
        return self.executor.submit(prompts, completions, sequences.columns), len(completions), sequences.full.device

    def finish(self, started: tuple, warn: bool = True) -> tuple[torch.Tensor, int, float]:
        """``(scores [B], rows lost to a timeout or a dead worker, the longest call's seconds)``, or
        :class:`RewardFunctionError` when the function raised or returned something unusable. Lost rows are
        said in one warning line (``warn``)."""
        call, B, device = started
        parts, lost, lines = [], 0, []
        slices = self.executor.collect(call)
        for s in slices:
            rows = f" (rows {s.lo}-{s.hi - 1} of {B}, one worker's slice)" if len(slices) > 1 else ""
            if s.raised is not None:
                raise RewardFunctionError(f"reward function '{self.name}' raised {s.raised}{rows}") from s.error
            if s.unusable is not None:
                raise RewardFunctionError(f"reward function '{self.name}' must return a list of float | None, "
                                          f"got {s.unusable}{rows}")
            if s.lost is not None:
                parts.append(torch.full((s.hi - s.lo,), float("nan"), device=device))
                lost += s.hi - s.lo
                lines.append(f"rows {s.lo}-{s.hi - 1} of {B}: {s.lost}" if rows else s.lost)
            else:
                parts.append(self.check(s.out, s.hi - s.lo, device, rows))
        if lines and warn:
            log.warning("[rlhf_train] reward function '%s' scored None for %d rows (faults/reward_timeouts): %s",
                        self.name, lost, "; ".join(lines))
        self.last_lost = lines
        scores = torch.cat(parts) if parts else torch.zeros(0, device=device)
        return scores, lost, max((s.seconds for s in slices), default=0.0)

    def close(self) -> None:
        """Stop the function's worker processes, if any."""
        self.executor.close()

    def check(self, out: Any, B: int, device, rows: str = "") -> torch.Tensor:
        """``out`` as a ``[B]`` float32 tensor (None -> NaN), or :class:`RewardFunctionError`: not a sequence
        of numbers (a ``str`` is not a list of rewards), the wrong length, or a number that is NaN / inf in
        float32 (e.g. 1e39) — a fault of this function, counted like a raise. ``rows``: which slice, said."""
        if isinstance(out, (str, bytes, dict)) or not hasattr(out, "__len__"):
            raise RewardFunctionError(f"reward function '{self.name}' must return a list of float | None, "
                                      f"got {type(out).__name__}: {str(out)[:80]}{rows}")
        try:
            values = [float("nan") if v is None else float(v) for v in out]
        except (TypeError, ValueError):
            raise RewardFunctionError(f"reward function '{self.name}' must return a list of float | None, "
                                      f"got {type(out).__name__}: {str(out)[:80]}{rows}") from None
        if len(values) != B:
            raise RewardFunctionError(f"reward function '{self.name}' returned {len(values)} values for a batch "
                                      f"of {B}{rows}")
        scores = torch.tensor(values, dtype=torch.float32, device=device)
        given = torch.tensor([v is not None for v in out], dtype=torch.bool, device=device)
        bad = given & ~torch.isfinite(scores)  # NaN / inf returned (not None), or past float32's range
        if bad.any():
            i = int(bad.nonzero()[0])
            raise RewardFunctionError(f"reward function '{self.name}' returned {list(out)[i]!r} for row {i}{rows}: "
                                      f"NaN or inf in float32 (return None for 'no reward')")
        return scores
