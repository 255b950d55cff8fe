"""Metric loggers: W&B (default), CSV, none. Only the main process creates one.

* ``wandb``: ``logger.mode=auto`` runs online unless ``WANDB_MODE`` says otherwise, W&B has no
  credentials, or its server cannot be reached; then it runs offline (or disabled) and says which of
  these in one line (:func:`wandb_mode`). Its files land in ``<run dir>/wandb``. A resumed run continues the same W&B run (the id is kept in checkpoints).
  In a Hydra multirun, unless ``logger.group`` / ``logger.name`` are set, the jobs join one group named
  after the sweep and each run is named by its overrides (:func:`rlhf_train.infra.logger.wandb_names`).
* ``csv``: ``metrics.csv`` in the run dir, one row per iteration, an ``iteration`` column and one column
  per metric (``time/*`` in ``timings.csv``, so that ``metrics.csv`` is reproducible); samples go to
  ``samples.jsonl``.
"""
from __future__ import annotations

import csv
import json
import math
import os
import socket
import sys
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode

from rlhf_train.infra.secrets import redact, redact_overrides

__all__ = ["redact", "redact_overrides"]  # redact is the trainer's (secrets live in rlhf_train/infra/secrets.py)


class NullLogger:
    run_id: str | None = None

    def log(self, metrics: dict, step: int) -> None: ...

    def log_samples(self, rows: list[dict], step: int) -> None: ...

    def finish(self) -> None: ...


class CSVLogger(NullLogger):
    """``metrics.csv`` + ``timings.csv`` + ``samples.jsonl`` in the run dir.

    ``metrics.csv``: one row per iteration, rewritten each iteration so new columns simply appear; values
    are written with full precision (``repr`` of the float, which reads back bit for bit). The ``time/*``
    metrics go to ``timings.csv`` instead: wall-clock times differ from run to run, and a resumed run must
    reproduce ``metrics.csv`` exactly. On resume, every file keeps the rows up to the checkpoint's
    iteration and drops the rest (they were logged after the checkpoint and will be logged again).
    A fresh run replaces any files left in the run dir.
    """

    def __init__(self, run_dir: str | Path, resume_iteration: int | None = None):
        run_dir = Path(run_dir)
        self.path, self.timings_path = run_dir / "metrics.csv", run_dir / "timings.csv"
        self.samples_path = run_dir / "samples.jsonl"
        keep = (lambda it: int(it) <= resume_iteration) if resume_iteration is not None else (lambda it: False)
        self.rows = _read_csv(self.path, keep)
        self.timing_rows = _read_csv(self.timings_path, keep)
        samples = self.samples_path.read_text().splitlines(keepends=True) if self.samples_path.exists() else []
        _replace_text(self.samples_path, "".join(ln.rstrip("\n") + "\n" for ln in samples if keep(_sample_iteration(ln))))
        _write_csv(self.path, self.rows)
        _write_csv(self.timings_path, self.timing_rows)

    def log(self, metrics: dict, step: int) -> None:
        timings = {k: _num(v) for k, v in metrics.items() if k.startswith("time/")}
        self.rows.append({"iteration": step, **{k: _num(v) for k, v in metrics.items() if k not in timings}})
        _write_csv(self.path, self.rows)
        if timings:
            self.timing_rows.append({"iteration": step, **timings})
            _write_csv(self.timings_path, self.timing_rows)

    def log_samples(self, rows: list[dict], step: int) -> None:
        with open(self.samples_path, "a") as f:
            for r in rows:
                f.write(json.dumps(finite_json({"iteration": step, **r}), allow_nan=False) + "\n")


def _sample_iteration(line: str) -> int:
    """The iteration of one ``samples.jsonl`` line; a line cut short by a kill counts as "after"."""
    try:
        return int(json.loads(line)["iteration"])
    except (ValueError, KeyError, TypeError):
        return 1 << 62


def _read_csv(path: Path, keep) -> list[dict]:
    if not path.exists():
        return []
    with open(path, newline="") as f:
        return [r for r in csv.DictReader(f) if keep(r["iteration"])]


def _replace_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically (temp file + rename); an empty text removes the file."""
    if not text:
        path.unlink(missing_ok=True)
        return
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _write_csv(path: Path, rows: list[dict]) -> None:
    """``rows`` as CSV (an ``iteration`` column, then the union of the rows' keys, sorted), atomically."""
    if not rows:
        path.unlink(missing_ok=True)
        return
    import io

    columns = ["iteration"] + sorted({k for r in rows for k in r} - {"iteration"})
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    writer.writerows({k: (repr(v) if isinstance(v, float) else v) for k, v in r.items()} for r in rows)
    _replace_text(path, buf.getvalue())


def _num(v: Any) -> Any:
    try:
        return float(v)
    except (TypeError, ValueError):
        return v


def _wandb_host() -> str:
    """The W&B server's host name (``WANDB_BASE_URL``, else api.wandb.ai)."""
    return os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai").split("://")[-1].split("/")[0].split(":")[0]


def _wandb_reachable(timeout: float = 2.0) -> bool:
    try:
        socket.create_connection((_wandb_host(), 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def _wandb_logged_in() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        import netrc

        return netrc.netrc().authenticators(_wandb_host()) is not None
    except Exception:
        return False


WANDB_MODES = ("auto", "online", "offline", "disabled")


def wandb_mode(cfg_mode: str, run_dir: str | Path) -> tuple[str, str | None]:
    """``(mode, why)``: the mode ``wandb.init`` gets, and the one line that tells the user why it is not
    online (``None`` when it is online).

    ``logger.mode`` other than ``auto`` wins (``wandb.init(mode=...)`` overrides ``WANDB_MODE``). With
    ``auto``, a ``WANDB_MODE`` in the environment decides (``offline``/``dryrun``, ``disabled``,
    ``online``); else online if W&B has credentials (``WANDB_API_KEY`` or a netrc entry) and its server
    answers on port 443, else offline, saying which of the two was missing.
    """
    from rlhf_train.infra.errors import ConfigError

    if cfg_mode not in WANDB_MODES:
        raise ConfigError(f"logger.mode='{cfg_mode}' is not valid; choose one of {', '.join(WANDB_MODES)}")
    files = Path(run_dir) / "wandb"
    later = f"`wandb sync {files}/offline-run-*` uploads it later"
    if cfg_mode == "offline":
        return "offline", f"logger.mode=offline: logging offline to {files}; {later}"
    if cfg_mode == "disabled":
        return "disabled", "logger.mode=disabled: W&B logs nothing (logger=csv writes metrics.csv instead)"
    if cfg_mode == "online":
        return "online", None
    env = os.environ.get("WANDB_MODE", "").strip()
    if env.lower() in ("offline", "dryrun"):
        return "offline", f"WANDB_MODE={env} is set: logging offline to {files}; {later}"
    if env.lower() == "disabled":
        return "disabled", (f"WANDB_MODE={env} is set: W&B logs nothing (unset it to log, or use logger=csv "
                            f"for metrics.csv)")
    if env.lower() == "online":
        return "online", None
    if env:
        raise ConfigError(f"WANDB_MODE='{env}' (environment) is not valid; set it to online, offline or disabled, "
                          f"or unset it")
    if not _wandb_logged_in():
        return "offline", (f"not logged in to W&B (no WANDB_API_KEY, no {_wandb_host()} entry in ~/.netrc): "
                           f"logging offline to {files}; run `wandb login` (or set WANDB_API_KEY) to log online "
                           f"next time; {later}")
    if not _wandb_reachable():
        return "offline", (f"W&B server {_wandb_host()}:443 cannot be reached (no network?): logging offline to "
                           f"{files}; {later}")
    return "online", None


class WandbLogger(NullLogger):
    def __init__(self, run_dir: str | Path, cfg, config: dict, resume_id: str | None = None):
        import wandb

        mode, why = wandb_mode(cfg.mode, run_dir)
        if why:
            print(f"[rlhf_train] W&B: {why}", flush=True)
        os.environ.setdefault("WANDB_SILENT", "true")
        self.wandb = wandb
        from rlhf_train.infra.logger import wandb_names

        sweep_group, job_name = wandb_names(config.get("task_name"))  # multirun: group = sweep, name = overrides
        argv = sys.argv
        sys.argv = redact_overrides(list(argv), sep="\0")  # W&B records the command line as the run's args
        try:
            self.run = wandb.init(
                project=cfg.project, entity=cfg.entity, group=redact_overrides(cfg.group or sweep_group),
                name=redact_overrides(cfg.name or job_name), tags=list(cfg.tags),
                config=redact(config), dir=str(run_dir), mode=mode, id=resume_id,
                resume="allow" if resume_id else None,
                settings=wandb.Settings(init_timeout=60, console="off"),
            )
        finally:
            sys.argv = argv
        self.run_id = self.run.id
        self.table_rows: list[list] = []

    def log(self, metrics: dict, step: int) -> None:
        self.run.log({k: _num(v) for k, v in metrics.items()}, step=step)

    def log_samples(self, rows: list[dict], step: int) -> None:
        if not rows:
            return
        columns = ["iteration"] + list(rows[0])
        self.table_rows += [[step] + list(r.values()) for r in rows]
        self.run.log({"samples": self.wandb.Table(columns=columns, data=self.table_rows)}, step=step)

    def finish(self) -> None:
        self.run.finish()


def build_logger(cfg, run_dir: str | Path, config: dict, resume_iteration: int | None = None,
                 resume_id: str | None = None):
    kind = cfg.kind
    if kind == "wandb":
        return WandbLogger(run_dir, cfg, config, resume_id)
    if kind == "csv":
        return CSVLogger(run_dir, resume_iteration)
    if kind == "none":
        return NullLogger()
    raise ValueError(f"logger.kind='{kind}' is not valid; choose one of wandb, csv, none")


# --------------------------------------------------------------------------------------------
# Inside a job
# --------------------------------------------------------------------------------------------
def in_multirun() -> bool:
    """True inside a job of ``python -m rlhf_train -m ...``."""
    try:
        return HydraConfig.get().mode == RunMode.MULTIRUN
    except ValueError:  # not under @hydra.main
        return False


def wandb_names(task_name: str | None = None) -> tuple[str | None, str | None]:
    """``(group, name)`` of a multirun job's W&B run: the sweep's name and the job's overrides.

    The sweep's name is the sweep dir's base name, prefixed by ``task_name`` unless it already says it
    (the default sweep dir ``multirun/<task>/<date>_<time>`` gives ``<task>-<date>_<time>``).
    ``(None, None)`` outside a multirun.
    """
    if not in_multirun():
        return None, None
    hc = HydraConfig.get()
    sweep = Path(str(hc.sweep.dir)).resolve().name
    group = sweep if (not task_name or task_name in sweep) else f"{task_name}-{sweep}"
    return group, redact_overrides(hc.job.override_dirname) or f"job{hc.job.num}"


def finite_json(obj: Any) -> Any:
    """``obj`` as JSON can hold it: a NaN or ±inf as ``None`` (``null``; Python's bare ``NaN`` / ``Infinity``
    are not JSON, and ``jq``, JavaScript and most JSON readers refuse them), a tensor / numpy number as
    ``float``."""
    if isinstance(obj, dict):
        return {k: finite_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_json(v) for v in obj]
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    value = float(obj)  # a float, or a 0-d tensor / numpy number (anything else: TypeError, as json would)
    return value if math.isfinite(value) else None


def write_final_metrics(run_dir: str | Path, metrics: dict, history: list[dict]) -> None:
    """``final_metrics.json``: the last iteration's metrics and the per-iteration history (for sweeps)."""
    path = Path(run_dir) / "final_metrics.json"
    # a resumed run (or a re-run of a finished one) extends what the earlier part of the run wrote
    if path.exists():
        try:
            old = json.loads(path.read_text())
        except (OSError, ValueError):
            old = {}
        first = history[0]["iteration"] if history else float("inf")
        history = [h for h in old.get("history", []) if h.get("iteration", 0) < first] + list(history)
        metrics = metrics or old.get("metrics", {})
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(finite_json({"iteration": history[-1]["iteration"] if history else 0,
                                           "metrics": metrics, "history": history}), allow_nan=False))
    os.replace(tmp, path)
