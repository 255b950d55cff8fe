"""Metric loggers: W&B (default), CSV, none. Only the main process creates one.

* ``wandb``: with no credentials or no network, W&B runs offline and says so in one line; its files
  land in the run dir. A resumed run continues the same W&B run (the id is kept in checkpoints).
* ``csv``: ``metrics.csv`` in the run dir, one row per iteration, an ``iteration`` column and one column
  per metric; samples go to ``samples.jsonl``.
"""
from __future__ import annotations

import csv
import json
import os
import socket
from pathlib import Path
from typing import Any

SECRET_KEYS = ("api_key", "token", "password", "secret")


def redact(obj: Any) -> Any:
    """Drop values of secret-looking keys from a (nested) config dict before logging or saving it."""
    if isinstance(obj, dict):
        return {k: ("<redacted>" if any(s in str(k).lower() for s in SECRET_KEYS) else redact(v)) for k, v in obj.items()}
    if isinstance(obj, list):
        return [redact(v) for v in obj]
    return obj


class NullLogger:
    run_id: str | None = None

    def log(self, metrics: dict, step: int) -> None: ...

    def log_samples(self, rows: list[dict], step: int) -> None: ...

    def finish(self) -> None: ...


class CSVLogger(NullLogger):
    """``metrics.csv`` (rewritten each iteration so new columns simply appear) + ``samples.jsonl``."""

    def __init__(self, run_dir: str | Path, resume_iteration: int | None = None):
        self.path = Path(run_dir) / "metrics.csv"
        self.samples_path = Path(run_dir) / "samples.jsonl"
        self.rows: list[dict] = []
        if resume_iteration is not None and self.path.exists():
            with open(self.path, newline="") as f:
                self.rows = [r for r in csv.DictReader(f) if int(r["iteration"]) <= resume_iteration]
            self._write()
        elif self.path.exists():
            self.path.unlink()

    def _write(self) -> None:
        columns = ["iteration"] + sorted({k for r in self.rows for k in r} - {"iteration"})
        tmp = self.path.with_suffix(".csv.tmp")
        with open(tmp, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=columns)
            writer.writeheader()
            writer.writerows(self.rows)
        os.replace(tmp, self.path)

    def log(self, metrics: dict, step: int) -> None:
        self.rows.append({"iteration": step, **{k: _num(v) for k, v in metrics.items()}})
        self._write()

    def log_samples(self, rows: list[dict], step: int) -> None:
        with open(self.samples_path, "a") as f:
            for r in rows:
                f.write(json.dumps({"iteration": step, **r}) + "\n")


def _num(v: Any) -> Any:
    try:
        return float(v)
    except (TypeError, ValueError):
        return v


def _wandb_reachable(timeout: float = 2.0) -> bool:
    host = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai").split("://")[-1].split("/")[0]
    try:
        socket.create_connection((host.split(":")[0], 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def _wandb_logged_in() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        import netrc

        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except Exception:
        return False


class WandbLogger(NullLogger):
    def __init__(self, run_dir: str | Path, cfg, config: dict, resume_id: str | None = None):
        import wandb

        mode = cfg.mode
        if mode == "auto":
            mode = "online" if _wandb_logged_in() and _wandb_reachable() else "offline"
            if mode == "offline":
                print(f"[rlhf_train] W&B: no credentials or no network; logging offline to {run_dir}/wandb "
                      f"(sync later with `wandb sync {run_dir}/wandb/offline-run-*`)")
        os.environ.setdefault("WANDB_SILENT", "true")
        self.wandb = wandb
        self.run = wandb.init(
            project=cfg.project, entity=cfg.entity, group=cfg.group, name=cfg.name, tags=list(cfg.tags),
            config=redact(config), dir=str(run_dir), mode=mode, id=resume_id,
            resume="allow" if resume_id else None,
            settings=wandb.Settings(start_method="thread", init_timeout=60, console="off"),
        )
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
