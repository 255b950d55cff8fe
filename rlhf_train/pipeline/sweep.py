"""Hydra sweeps (``python -m rlhf_train -m ...``): every job runs, and a report lands in the sweep dir.

    python -m rlhf_train -m +recipe=smoke kl_controller=adaptive \\
        kl_controller.init_kl_coef=0.05,0.1,0.2 kl_controller.target=3,6

1. Each job runs in its own dir ``<sweep dir>/<num>_<overrides>`` (``hydra.sweep`` in conf/config.yaml),
   one level below the sweep dir whatever the overrides hold: :func:`job_dirname` keeps the name short and
   safe (a path's ``/`` would nest the dir, 300 characters would not fit in a file name); the job's full
   overrides are in its ``.hydra/overrides.yaml`` and in the report. With W&B, all jobs join one group named after the sweep and each is named by its overrides
   (:func:`wandb_names`; an explicit ``logger.group`` / ``logger.name`` wins).
2. A job that raises does not stop the sweep: :func:`run_job` catches the error (any ``BaseException``:
   a ``sys.exit`` in a user's hook too), prints one line and returns normally, so the other jobs still run
   (Hydra's own sweeper would re-raise it after the batch and skip the report). Two stop the sweep: a
   preemption (``SystemExit(143)``) and Ctrl-C (``KeyboardInterrupt``); the report of the jobs that
   started is then written on the way out (:meth:`SweepReportCallback.on_multirun_start` registers it with
   ``atexit``, which also covers anything else that ends the sweep early, e.g. a launcher's crash), and
   the sweep exits with their status (143, 130). What no process can report on (SIGKILL, ``os._exit``):
   ``python -m rlhf_train.tools.sweep_report <sweep dir>`` writes the report afterwards.
3. At the end of each job, :meth:`SweepReportCallback.on_job_end` writes ``job_status.json`` into the
   job's dir (``completed``, or ``failed`` with the error). The callback runs where the job runs, so the
   same works with the joblib launcher's worker processes.
4. At the end of the sweep, :meth:`SweepReportCallback.on_multirun_end` reads every job dir of this
   sweep (any dir under the sweep dir with a ``.hydra/hydra.yaml`` written since the sweep started; its ``.hydra/hydra.yaml``, ``job_status.json``, ``final_metrics.json`` written by
   :func:`rlhf_train.loop.trainer.train`, and ``summary.json`` of the pipeline if any) and writes into the
   sweep dir:
     * ``sweep_summary.csv``: one row per job: job number, the swept values, status, the final
       ``objective/reward_raw``, ``objective/kl`` (per sequence), ``objective/kl_coef`` (used in the
       last iteration) and ``objective/kl_coef_next`` (after the controller's last step), the independent
       judge's score ``judge_positive_rate`` where the pipeline produced one, iterations, run dir, error
       and the job's full command-line overrides;
     * ``sweep_summary.md``: the same as a Markdown table, with the plot below it;
     * ``sweep_report.png``: final reward against final KL (one point per job) and the reward and
       KL curves over iterations, one line per job (:mod:`rlhf_train.pipeline.sweep_figure`).
   If any job failed, the sweep then exits with status 1 (like Hydra's own sweeper) after the report is
   written; otherwise 0.
"""
from __future__ import annotations

import atexit
import csv
import json
import logging
import math
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from rlhf_train.pipeline.sweep_figure import plot_report

log = logging.getLogger(__name__)


METRICS = ("objective/reward_raw", "objective/kl", "objective/kl_coef", "objective/kl_coef_next")


def _rank0() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


@dataclass
class JobFailed:
    """What :func:`run_job` returns for a job that raised (picklable, for the joblib launcher)."""

    error: str


JOB_DIRNAME_CHARS = 80  # of the overrides in a job dir's name: ``<num>_`` + at most this (a file name: 255)


def job_dirname(override_dirname: str) -> str:
    """The overrides part of a multirun job dir's name (``hydra.sweep.subdir`` = ``<num>_<this>``): Hydra's
    ``override_dirname`` without secret overrides, every run of characters other than letters, digits and
    ``._,=+-`` replaced by one ``_`` (a path's ``/`` would nest the dir), cut to :data:`JOB_DIRNAME_CHARS`.
    A summary only: the job number keeps the name unique, ``.hydra/overrides.yaml`` and the report keep
    the full overrides."""
    from rlhf_train.infra.secrets import dirname_overrides

    return re.sub(r"[^A-Za-z0-9._,=+-]+", "_", dirname_overrides(override_dirname))[:JOB_DIRNAME_CHARS].rstrip("_")


def stops_sweep(err: BaseException) -> bool:
    """A preemption (``SystemExit(143)``, :mod:`rlhf_train.infra.preemption`) or Ctrl-C: the whole sweep
    stops (after the report); anything else fails only its job."""
    from rlhf_train.infra.preemption import PREEMPTED_EXIT_CODE

    return isinstance(err, KeyboardInterrupt) or (isinstance(err, SystemExit) and err.code == PREEMPTED_EXIT_CODE)


def _null_as_nan(d: dict) -> dict:
    return {k: math.nan if v is None else v for k, v in d.items()}


def _write_status(job_dir: Path, status: str, error: str | None, num: Any, overrides: list) -> None:
    from rlhf_train.infra.secrets import redact_overrides

    (job_dir / "job_status.json").write_text(json.dumps(
        {"status": status, "error": error, "num": num, "overrides": redact_overrides(list(overrides))}, indent=1))


def run_job(fn: Callable[[DictConfig], Any], cfg: DictConfig) -> Any:
    """Run one multirun job; an exception, or any other ``BaseException`` such as a hook's ``sys.exit``
    (Hydra catches ``Exception`` only: anything else would end the sweep with no report), is logged
    (traceback in the job's log) and returned as :class:`JobFailed` instead of raised, so the sweep goes on
    and the report is written. A preemption or Ctrl-C (:func:`stops_sweep`) is recorded in the job's
    ``job_status.json``, then re-raised: the sweep stops, its report is written on the way out."""
    from rlhf_train.infra.errors import ConfigError

    try:
        return fn(cfg)
    except BaseException as err:
        hc = HydraConfig.get()
        if not isinstance(err, (ConfigError, SystemExit, KeyboardInterrupt)):  # bad input, an exit: no traceback
            log.exception("job %s failed", hc.job.num)
        error = f"{type(err).__name__}: {err}".replace("\n", " ")  # one line, in the report too
        from rlhf_train.infra.secrets import redact_overrides

        stop = stops_sweep(err)
        print(f"[rlhf_train] job {hc.job.num} ({redact_overrides(hc.job.override_dirname)}) failed: {error}"
              + ("; the sweep stops here" if stop else ""), file=sys.stderr, flush=True)
        if stop:
            if _rank0():
                _write_status(Path(hc.runtime.output_dir), "failed", error, hc.job.num, list(hc.overrides.task))
            raise
        return JobFailed(error)


# --------------------------------------------------------------------------------------------
# The callback (registered in conf/config.yaml under hydra.callbacks)
# --------------------------------------------------------------------------------------------
class SweepReportCallback(Callback):
    """Writes ``job_status.json`` per job and the sweep report at the end of a multirun."""

    def __init__(self, exit_nonzero_on_failure: bool = True):
        self.exit_nonzero_on_failure = exit_nonzero_on_failure
        self.started = time.time()
        self._unfinished: tuple[Path, list[str]] | None = None  # (sweep dir, overrides) until on_multirun_end

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self.started = time.time()
        # whatever ends the sweep before on_multirun_end (a preemption, Ctrl-C, a launcher's or Hydra's own
        # error creating a job's dir), the jobs that started still get their report, on the way out
        self._unfinished = (Path(str(config.hydra.sweep.dir)), list(config.hydra.overrides.task))
        atexit.register(self._report_unfinished)

    def _report_unfinished(self) -> None:
        unfinished, self._unfinished = self._unfinished, None
        if unfinished is None or not _rank0():
            return
        sweep_dir, overrides = unfinished
        try:
            rows, paths = report_sweep(sweep_dir, overrides, since=self.started - 1.0)
            print(f"[rlhf_train] the sweep stopped early; report of the {len(rows)} jobs that started "
                  f"({sum(r['status'] != 'completed' for r in rows)} failed): " + ", ".join(map(str, paths)),
                  file=sys.stderr, flush=True)
        except Exception as err:  # on the way out: one line, the exit status stays the sweep's
            print(f"[rlhf_train] the sweep stopped early; its report could not be written: {err}", file=sys.stderr,
                  flush=True)

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        if config.hydra.mode == RunMode.MULTIRUN:  # a status left by an earlier sweep into the same dir
            (Path(config.hydra.runtime.output_dir) / "job_status.json").unlink(missing_ok=True)

    def on_job_end(self, config: DictConfig, job_return, **kwargs: Any) -> None:
        from hydra.core.utils import JobStatus

        if config.hydra.mode != RunMode.MULTIRUN or not _rank0():
            return
        value = job_return._return_value
        status, error = "completed", None
        if job_return.status != JobStatus.COMPLETED:
            status, error = "failed", f"{type(value).__name__}: {value}".replace("\n", " ")
        elif isinstance(value, JobFailed):
            status, error = "failed", value.error
        _write_status(Path(config.hydra.runtime.output_dir), status, error, config.hydra.job.num,
                      list(job_return.overrides or []))

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        self._unfinished = None
        atexit.unregister(self._report_unfinished)
        if not _rank0():  # a multi-process launch: rank 0 writes the report
            return
        sweep_dir = Path(str(config.hydra.sweep.dir))
        rows, paths = report_sweep(sweep_dir, list(config.hydra.overrides.task), since=self.started - 1.0)
        failed = sum(r["status"] != "completed" for r in rows)
        print(f"[rlhf_train] sweep report ({len(rows)} jobs, {failed} failed): "
              + ", ".join(str(p) for p in paths), flush=True)
        if failed and self.exit_nonzero_on_failure:
            print(f"[rlhf_train] {failed} of {len(rows)} sweep jobs failed; see the error column of "
                  f"{sweep_dir / 'sweep_summary.csv'}", file=sys.stderr, flush=True)
            raise SystemExit(1)  # not an Exception: Hydra's callback guard lets it through


def report_sweep(sweep_dir: Path, task_overrides: list[str], since: float = 0.0) -> tuple[list[dict], list[Path]]:
    """The report of the jobs in ``sweep_dir`` (:func:`collect_rows`, :func:`write_report`) of the sweep
    whose command-line overrides were ``task_overrides``: ``(rows, written paths)``."""
    rows, swept = collect_rows(sweep_dir, swept_keys(task_overrides), since=since)
    return rows, write_report(sweep_dir, rows, swept)


# --------------------------------------------------------------------------------------------
# Reading the job dirs
# --------------------------------------------------------------------------------------------
def _parse(overrides: list[str]):
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return OverridesParser.create().parse_overrides(overrides)


def swept_keys(task_overrides: list[str]) -> list[str]:
    """Keys (or config groups) that the multirun's command line sweeps over, in command-line order."""
    return [o.key_or_group for o in _parse(task_overrides) if o.is_sweep_override()]


def _find(job_dir: Path, name: str) -> Path | None:
    """``job_dir/name``, else the shallowest ``job_dir/**/name`` (a pipeline may nest its RL run)."""
    if (job_dir / name).is_file():
        return job_dir / name
    found = sorted(job_dir.rglob(name), key=lambda p: len(p.parts))
    return found[0] if found else None


def _judge_score(summary: dict) -> dict[str, float]:
    """The independent judge's score of the trained (RL stage) policy from the pipeline's ``summary.json``: the
    fraction of held-out continuations it calls positive (``judge_positive_rate_after``)."""
    value = summary.get("judge_positive_rate_after") if isinstance(summary, dict) else None
    return {"judge_positive_rate": float(value)} if isinstance(value, (int, float)) else {}


def job_dirs(sweep_dir: Path, since: float = 0.0) -> list[Path]:
    """The job dirs of a sweep: every dir under ``sweep_dir`` with a ``.hydra/hydra.yaml`` written at or after
    ``since`` (older ones: an earlier sweep into the same dir), at any depth (a ``hydra.sweep.subdir`` of the
    user's may nest them), but none inside another (a pipeline's nested run is part of its job)."""
    found = sorted((p.parent.parent for p in sweep_dir.rglob("hydra.yaml")
                    if p.parent.name == ".hydra" and p.stat().st_mtime >= since), key=lambda d: (len(d.parts), d))
    jobs: list[Path] = []
    for d in found:
        if not any(j in d.parents for j in jobs):
            jobs.append(d)
    return jobs


def collect_rows(sweep_dir: Path, swept: list[str], since: float = 0.0) -> tuple[list[dict], list[str]]:
    """One row per job dir of this sweep (:func:`job_dirs`).

    Returns ``(rows, keys)``: ``keys`` are ``swept`` plus any other override whose value differs between
    jobs (what a sweeper plugin chose), the row's columns of swept values.
    """
    rows, values = [], []
    for job_dir in job_dirs(sweep_dir, since):
        hcfg = OmegaConf.load(job_dir / ".hydra" / "hydra.yaml").hydra
        job_dir = job_dir.resolve()
        values.append({o.key_or_group: o.get_value_element_as_str() for o in _parse(list(hcfg.overrides.task))})
        row: dict[str, Any] = {"job": int(hcfg.job.num)}
        status_file = job_dir / "job_status.json"
        if status_file.is_file():
            st = json.loads(status_file.read_text())
            row["status"], row["error"] = st["status"], st.get("error") or ""
        else:
            row["status"], row["error"] = "failed", "no job_status.json: the job's process died or the sweep stopped"
        final = _find(job_dir, "final_metrics.json")
        # a metric that was NaN / inf is null in the JSON (rlhf_train.infra.logger.finite_json): NaN here, as before
        fm = json.loads(final.read_text(), object_hook=_null_as_nan) if final else {}
        row.update({k: fm.get("metrics", {}).get(k, math.nan) for k in METRICS})
        summary = _find(job_dir, "summary.json")
        if summary:
            try:
                row.update(_judge_score(json.loads(summary.read_text())))
            except json.JSONDecodeError:
                pass
        row["iterations"] = fm.get("iteration", 0)
        row["run_dir"] = str(job_dir)
        row["overrides"] = " ".join(map(str, hcfg.overrides.task))  # all of them, secrets redacted (RedactSecrets)
        row["_history"] = fm.get("history", [])
        rows.append(row)
    keys = list(swept)
    for v in values:
        keys += [k for k in v if k not in keys and len({str(w.get(k)) for w in values}) > 1]
    for row, v in zip(rows, values):
        row.update({k: v.get(k, "") for k in keys})
    order = sorted(range(len(rows)), key=lambda i: rows[i]["job"])
    return [rows[i] for i in order], keys


# --------------------------------------------------------------------------------------------
# Writing the report
# --------------------------------------------------------------------------------------------
def _columns(rows: list[dict], swept: list[str]) -> list[str]:
    judge = ["judge_positive_rate"] if any("judge_positive_rate" in r for r in rows) else []
    return ["job", *swept, "status", *METRICS, *judge, "iterations", "run_dir", "error", "overrides"]


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return "" if math.isnan(v) else f"{v:.4g}"
    return str(v)


def write_report(sweep_dir: Path, rows: list[dict], swept: list[str]) -> list[Path]:
    """``sweep_summary.csv``, ``sweep_summary.md`` and ``sweep_report.png`` in ``sweep_dir``."""
    sweep_dir.mkdir(parents=True, exist_ok=True)
    columns = _columns(rows, swept)
    csv_path, md_path, png_path = (sweep_dir / n for n in ("sweep_summary.csv", "sweep_summary.md", "sweep_report.png"))
    with open(csv_path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows({k: ("" if isinstance(r.get(k), float) and math.isnan(r[k]) else r.get(k, ""))
                          for k in columns} for r in rows)

    md_cols = [c for c in columns if c not in ("run_dir", "overrides")]  # the CSV has them in full
    lines = [f"# Sweep report: `{sweep_dir}`", "",
             f"{len(rows)} jobs, {sum(r['status'] != 'completed' for r in rows)} failed. Final values are "
             "those of each job's last RL iteration; `objective/kl` is the mean per-sequence KL (nats).", "",
             "| " + " | ".join(md_cols + ["run dir"]) + " |", "|" + "---|" * (len(md_cols) + 1)]
    for r in rows:
        cells = [_fmt(r.get(c, "")).replace("|", "\\|").replace("\n", " ")[:200] for c in md_cols]
        lines.append("| " + " | ".join(cells + [f"`{Path(r['run_dir']).name}`"]) + " |")
    lines += ["", f"![sweep report]({png_path.name})", ""]
    md_path.write_text("\n".join(lines))

    n_failed = sum(r["status"] != "completed" for r in rows)
    plot_report(png_path, rows, swept, title=f"sweep {sweep_dir.resolve().name}: {len(rows)} jobs, {n_failed} failed")
    return [csv_path, md_path, png_path]
