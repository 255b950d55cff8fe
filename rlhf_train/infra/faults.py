"""The run's fault counters, one typed object (:class:`Faults`), written through its methods only.

* skipped updates: a minibatch whose rollout fields, loss or gradient norm is not finite is not applied
  (:mod:`rlhf_train.algorithms.update`); ``max_consecutive`` in a row stop the run;
* reward errors: a batch whose Python reward function raised is skipped (the loop's rollout guard);
  ``max_consecutive`` such batches in a row stop the run;
* reward timeouts: rows that scored ``None`` because a reward function's call timed out or its worker
  process died (``rlhf_train/rewards/executor.py``); the batch goes on, so they never stop the run;
* updates without a signal: iterations whose update was skipped because no row had anything to learn
  (every group's rewards equal for GRPO / RLOO, or every response left out of the loss:
  :mod:`rlhf_train.algorithms.selection`); never a stop.

Saved in every checkpoint (``state_dict``) under the same keys as the logged ``faults/*`` metrics.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class Faults:
    max_consecutive: int = 3        # trainer.max_consecutive_faults: a stop after this many in a row
    skipped: int = 0                # updates skipped in all (faults/skipped_updates)
    consecutive: int = 0            # ... in a row, up to now
    reward_errors: int = 0          # batches skipped because a reward function raised (faults/reward_errors)
    reward_consecutive: int = 0     # ... in a row, up to now
    reward_timeouts: int = 0        # rows scored None: a reward call timed out or its worker died (faults/reward_timeouts)
    no_signal: int = 0              # updates skipped: no row had a learning signal (faults/no_signal_updates)

    def skip_update(self) -> None:
        self.skipped += 1
        self.consecutive += 1

    def good_update(self) -> None:
        self.consecutive = 0

    def too_many_skipped(self) -> bool:
        return self.consecutive >= self.max_consecutive

    def reward_failed(self) -> bool:
        """Count a skipped batch; True when that makes ``max_consecutive`` in a row."""
        self.reward_errors += 1
        self.reward_consecutive += 1
        return self.reward_consecutive >= self.max_consecutive

    def reward_ok(self) -> None:
        self.reward_consecutive = 0

    def reward_rows_lost(self, rows: int) -> None:
        self.reward_timeouts += int(rows)

    def no_signal_update(self) -> None:
        self.no_signal += 1

    def fresh_budget(self) -> None:
        """After a fault stop: whoever resumes the checkpoint it writes gets ``max_consecutive`` faults of each
        kind again (the totals are kept)."""
        self.consecutive = 0
        self.reward_consecutive = 0

    def state_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k != "max_consecutive"}

    def load_state_dict(self, state: dict) -> None:
        for key in ("skipped", "consecutive", "reward_errors", "reward_consecutive", "reward_timeouts", "no_signal"):
            setattr(self, key, int(state.get(key, 0)))
