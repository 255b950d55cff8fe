"""Hydra sweeps (``python -m rlhf_train -m ...``): every job runs, and a report lands in the sweep dir.

    python -m rlhf_train -m +recipe=smoke kl_controller=adaptive \\
        kl_controller.init_kl_coef=0.05,0.1,0.2 kl_controller.target=3,6

1. Each job runs in its own dir ``<sweep dir>/<num>_<overrides>`` (``hydra.sweep`` in conf/config.yaml).
   With W&B, all jobs join one group named after the sweep and each is named by its overrides
   (:func:`wandb_names`; an explicit ``logger.group`` / ``logger.name`` wins).
2. A job that raises does not stop the sweep: :func:`run_job` catches the error, prints one line and
   returns normally, so the other jobs still run (Hydra's own sweeper would re-raise it after the batch
   and skip the report).
3. At the end of each job, :meth:`SweepReportCallback.on_job_end` writes ``job_status.json`` into the
   job's dir (``completed``, or ``failed`` with the error). The callback runs where the job runs, so the
   same works with the joblib launcher's worker processes.
4. At the end of the sweep, :meth:`SweepReportCallback.on_multirun_end` reads every job dir of this
   sweep (its ``.hydra/hydra.yaml``, ``job_status.json``, ``final_metrics.json`` written by
   :func:`rlhf_train.loop.trainer.train`, and ``summary.json`` of the pipeline if any) and writes into the
   sweep dir:
     * ``sweep_summary.csv``: one row per job: job number, the swept values, status, the final
       ``objective/reward_raw``, ``objective/kl`` (per sequence), ``objective/kl_coef`` (used in the
       last iteration) and ``objective/kl_coef_next`` (after the controller's last step), the independent
       judge's score ``judge_positive_rate`` where the pipeline produced one, iterations, run dir, error;
     * ``sweep_summary.md``: the same as a Markdown table, with the plot below it;
     * ``sweep_report.png``: final reward against final KL (one point per job) and the reward and
       KL curves over iterations, one line per job.
   If any job failed, the sweep then exits with status 1 (like Hydra's own sweeper) after the report is
   written; otherwise 0.
"""
from __future__ import annotations

import csv
import json
import logging
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

log = logging.getLogger(__name__)


METRICS = ("objective/reward_raw", "objective/kl", "objective/kl_coef", "objective/kl_coef_next")


CURVES = ("objective/reward_raw", "objective/kl")


def _rank0() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


@dataclass
class JobFailed:
    """What :func:`run_job` returns for a job that raised (picklable, for the joblib launcher)."""

    error: str


def run_job(fn: Callable[[DictConfig], Any], cfg: DictConfig) -> Any:
    """Run one multirun job; an exception is logged (traceback in the job's log) and returned as
    :class:`JobFailed` instead of raised, so the sweep goes on and the report is written."""
    from rlhf_train.infra.errors import ConfigError

    try:
        return fn(cfg)
    except Exception as err:
        hc = HydraConfig.get()
        if not isinstance(err, ConfigError):  # bad input needs no traceback: the message names the key
            log.exception("job %s failed", hc.job.num)
        error = f"{type(err).__name__}: {err}".replace("\n", " ")  # one line, in the report too
        from rlhf_train.infra.secrets import redact_overrides

        print(f"[rlhf_train] job {hc.job.num} ({redact_overrides(hc.job.override_dirname)}) failed: {error}",
              file=sys.stderr,
              flush=True)
        return JobFailed(error)


# --------------------------------------------------------------------------------------------
# The callback (registered in conf/config.yaml under hydra.callbacks)
# --------------------------------------------------------------------------------------------
class SweepReportCallback(Callback):
    """Writes ``job_status.json`` per job and the sweep report at the end of a multirun."""

    def __init__(self, exit_nonzero_on_failure: bool = True):
        self.exit_nonzero_on_failure = exit_nonzero_on_failure
        self.started = time.time()

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self.started = time.time()

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        if config.hydra.mode == RunMode.MULTIRUN:  # a status left by an earlier sweep into the same dir
            (Path(config.hydra.runtime.output_dir) / "job_status.json").unlink(missing_ok=True)

    def on_job_end(self, config: DictConfig, job_return, **kwargs: Any) -> None:
        from hydra.core.utils import JobStatus

        from rlhf_train.infra.secrets import redact_overrides

        if config.hydra.mode != RunMode.MULTIRUN or not _rank0():
            return
        value = job_return._return_value
        status, error = "completed", None
        if job_return.status != JobStatus.COMPLETED:
            status, error = "failed", f"{type(value).__name__}: {value}".replace("\n", " ")
        elif isinstance(value, JobFailed):
            status, error = "failed", value.error
        out = Path(config.hydra.runtime.output_dir) / "job_status.json"
        out.write_text(json.dumps({"status": status, "error": error, "num": config.hydra.job.num,
                                   "overrides": redact_overrides(list(job_return.overrides or []))}, indent=1))

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if not _rank0():  # a multi-process launch: rank 0 writes the report
            return
        sweep_dir = Path(str(config.hydra.sweep.dir))
        swept = swept_keys(list(config.hydra.overrides.task))
        rows, swept = collect_rows(sweep_dir, swept, since=self.started - 1.0)
        paths = write_report(sweep_dir, rows, swept)
        failed = sum(r["status"] != "completed" for r in rows)
        print(f"[rlhf_train] sweep report ({len(rows)} jobs, {failed} failed): "
              + ", ".join(str(p) for p in paths), flush=True)
        if failed and self.exit_nonzero_on_failure:
            print(f"[rlhf_train] {failed} of {len(rows)} sweep jobs failed; see the error column of "
                  f"{sweep_dir / 'sweep_summary.csv'}", file=sys.stderr, flush=True)
            raise SystemExit(1)  # not an Exception: Hydra's callback guard lets it through


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


def collect_rows(sweep_dir: Path, swept: list[str], since: float = 0.0) -> tuple[list[dict], list[str]]:
    """One row per job dir of this sweep (its ``.hydra/hydra.yaml`` written at or after ``since``).

    Returns ``(rows, keys)``: ``keys`` are ``swept`` plus any other override whose value differs between
    jobs (what a sweeper plugin chose), the row's columns of swept values.
    """
    rows, values = [], []
    for hydra_yaml in sweep_dir.glob("*/.hydra/hydra.yaml"):
        if hydra_yaml.stat().st_mtime < since:
            continue  # a job dir left by an earlier sweep into the same dir
        job_dir = hydra_yaml.parent.parent.resolve()
        hcfg = OmegaConf.load(hydra_yaml).hydra
        values.append({o.key_or_group: o.get_value_element_as_str() for o in _parse(list(hcfg.overrides.task))})
        row: dict[str, Any] = {"job": int(hcfg.job.num)}
        status_file = job_dir / "job_status.json"
        if status_file.is_file():
            st = json.loads(status_file.read_text())
            row["status"], row["error"] = st["status"], st.get("error") or ""
        else:
            row["status"], row["error"] = "failed", "no job_status.json: the job's process died"
        final = _find(job_dir, "final_metrics.json")
        fm = json.loads(final.read_text()) if final else {}
        row.update({k: fm.get("metrics", {}).get(k, math.nan) for k in METRICS})
        summary = _find(job_dir, "summary.json")
        if summary:
            try:
                row.update(_judge_score(json.loads(summary.read_text())))
            except json.JSONDecodeError:
                pass
        row["iterations"] = fm.get("iteration", 0)
        row["run_dir"] = str(job_dir)
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
    return ["job", *swept, "status", *METRICS, *judge, "iterations", "run_dir", "error"]


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return "" if math.isnan(v) else f"{v:.4g}"
    return str(v)


def _label(row: dict, swept: list[str]) -> str:
    return f"#{row['job']} " + " ".join(f"{k.split('.')[-1]}={row[k]}" for k in swept)


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

    md_cols = [c for c in columns if c != "run_dir"]
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


def plot_report(path: Path, rows: list[dict], swept: list[str], title: str = "") -> None:
    """Three panels: final reward vs final KL (one point per job); reward and KL over iterations."""
    report_figure(rows, swept, title).savefig(path, dpi=110)


def report_figure(rows: list[dict], swept: list[str], title: str = ""):
    """The figure of :func:`plot_report` (a bare matplotlib ``Figure``, already drawn once).

    Robust to near-equal results (:mod:`rlhf_train.pipeline.plots`): a few ticks with just enough digits,
    a minimum axis span; each job has its own colour, hollow marker and dash pattern, so identical curves
    and points stay visible; jobs that end on the same point share one ``#i,#j`` label.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure  # no pyplot: never touches the user's backend

    from rlhf_train.pipeline.plots import curve_style, declutter, readable_axis

    fig = Figure(figsize=(15, 4.8), layout="constrained")
    FigureCanvasAgg(fig)
    ax_pts, ax_rew, ax_kl = fig.subplots(1, 3)
    points, curve_values = [], {CURVES[0]: [], CURVES[1]: []}
    for i, row in enumerate(rows):
        style = curve_style(i, points=len(row["_history"]))
        label = _label(row, swept) + (" (failed)" if row["status"] != "completed" else "")
        kl, rew = row["objective/kl"], row["objective/reward_raw"]
        if not (math.isnan(kl) or math.isnan(rew)):
            ax_pts.scatter([kl], [rew], marker=style["marker"], s=style["ms"] ** 2 * 1.3, facecolors="none", edgecolors=style["color"],
                           linewidths=1.8, zorder=3)
            points.append((kl, rew, f"#{row['job']}"))
        hist = row["_history"]
        its = [h["iteration"] for h in hist]
        for ax, key in ((ax_rew, CURVES[0]), (ax_kl, CURVES[1])):
            ys = [h.get(key, math.nan) for h in hist]
            curve_values[key] += ys
            ax.plot(its, ys, label=label, **style)
    readable_axis(ax_pts.xaxis, [p[0] for p in points], margin=0.2)
    readable_axis(ax_pts.yaxis, [p[1] for p in points], margin=0.2)
    readable_axis(ax_rew.yaxis, curve_values[CURVES[0]])
    readable_axis(ax_kl.yaxis, curve_values[CURVES[1]])
    for ax in (ax_rew, ax_kl):
        readable_axis(ax.xaxis, [h["iteration"] for r in rows for h in r["_history"]], margin=0.05, integer=True)
    _label_points(ax_pts, points)
    ax_pts.set(xlabel="final objective/kl: KL(π‖π_ref) per sequence (nats)",
               ylabel="final objective/reward_raw: shaped score per sequence",
               title="final reward vs KL, one point per job")
    ax_rew.set(xlabel="RL iteration", ylabel="objective/reward_raw: shaped score per sequence",
               title="shaped score over iterations")
    ax_kl.set(xlabel="RL iteration", ylabel="objective/kl: KL(π‖π_ref) per sequence (nats)",
              title="KL over iterations")
    for ax in (ax_pts, ax_rew, ax_kl):
        ax.grid(alpha=0.3)
    if rows:
        fig.legend(*ax_rew.get_legend_handles_labels(), loc="outside right center", fontsize=8,
                   title="job: swept values", title_fontsize=8, handlelength=3.5)
    if title:
        fig.suptitle(title, fontsize=10)
    declutter(fig)
    return fig


def _label_points(ax, points: list[tuple[float, float, str]]) -> None:
    """One ``#i,#j`` label per group of points that are drawn on the same spot (within 2 % of each axis)."""
    (x0, x1), (y0, y1) = ax.get_xlim(), ax.get_ylim()
    groups: dict[tuple[int, int], list[tuple[float, float, str]]] = {}
    for x, y, name in points:
        groups.setdefault((round((x - x0) / (x1 - x0) * 50), round((y - y0) / (y1 - y0) * 50)), []).append((x, y, name))
    for group in groups.values():
        x, y = sum(p[0] for p in group) / len(group), sum(p[1] for p in group) / len(group)
        ax.annotate(",".join(p[2] for p in group), (x, y), textcoords="offset points", xytext=(7, 6), fontsize=9)
