"""``python -m rlhf_train`` as a user runs it (subprocesses, offline).

1. Bad keys and values fail at start with a non-zero exit and a message naming the key (Hydra's
   messages for unknown keys / wrong types; ours for values Hydra cannot check).
2. An unknown KL estimator fails at start — before any model is built — with one line listing k1, k2, k3.
3. The reward-shaping stack can be changed from the command line: the k3 estimator, and the EOS-penalty
   entry dropped (``~transforms.eos_penalty``), both run.
4. The process-wide CPU settings (``THP_MEM_ALLOC_ENABLE`` and glibc's malloc; the OpenMP wait policy,
   ``OMP_WAIT_POLICY`` and ``GOMP_SPINCOUNT``, stays libgomp's) belong to the command-line entry point:
   ``import rlhf_train`` leaves the environment alone.
5. ``--help`` says how to run the tool and lists every recipe and every config group with exactly its
   option files (no ``*_schema``, no ``accelerate``), read from ``conf/`` so it cannot drift.
6. A run says where it is: the run-dir line first, the files it wrote last, both in ``__main__.log``; a
   pipeline stage that raises is logged as failed, not done.

Budget: ~45 s on 2 CPU cores (three short training runs; each start imports torch and transformers).
"""
import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import zygote

ROOT = Path(__file__).resolve().parents[2]


def run(*overrides, tmp_path, timeout=300):
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    env["WANDB_MODE"] = "disabled"
    cmd = ["+recipe=smoke", f"hydra.run.dir={tmp_path}",
           "trainer.progress_bar=false", *overrides]
    return zygote.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("override, key", [
    ("update.nonexistent=1", "update.nonexistent"),   # unknown key
    ("ppo.num_epochs=2", "update.num_epochs"),   # a moved key: named with its new place
    ("update.clip_eps=abc", "update.clip_eps"),       # wrong type
])
def test_bad_override_exits_nonzero_naming_the_key(override, key, tmp_path):
    proc = run(override, tmp_path=tmp_path)
    assert proc.returncode != 0
    assert key in proc.stderr, proc.stderr


def test_unknown_estimator_fails_at_start_with_one_line(tmp_path):
    proc = run("transforms.kl.estimator=k4", "logger=csv", tmp_path=tmp_path)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if "estimator" in line]
    assert len(lines) == 1, proc.stderr
    assert "transforms.kl.estimator" in lines[0] and "k1, k2, k3" in lines[0]
    assert "Traceback" not in proc.stderr
    # nothing was started: no checkpoint, no metrics
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "metrics.csv").exists()


@pytest.mark.slow
def test_k3_estimator_runs(tmp_path):
    proc = run("transforms.kl.estimator=k3", "logger=csv", tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = list(csv.DictReader(open(tmp_path / "metrics.csv")))
    assert len(rows) == 2
    assert all(float(r["objective/kl"]) >= 0 for r in rows)  # k3 is never negative


@pytest.mark.slow
def test_dropping_the_eos_penalty_entry_runs(tmp_path):
    proc = run("~transforms.eos_penalty", "trainer.num_iterations=1", "logger=csv", tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(list(csv.DictReader(open(tmp_path / "metrics.csv")))) == 1


# --------------------------------------------------------------------------- 4. CPU settings
CPU_VARS = ("OMP_WAIT_POLICY", "THP_MEM_ALLOC_ENABLE", "GOMP_SPINCOUNT")


def _env_after(statement: str) -> list[str]:
    """The variables as seen by a fresh interpreter (started with all unset) after ``statement``."""
    env = {k: v for k, v in os.environ.items() if k not in CPU_VARS}
    code = f"import os; {statement}; print([os.environ.get(k) for k in {CPU_VARS!r}])"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return eval(proc.stdout.strip().splitlines()[-1])


def test_import_leaves_cpu_settings_untouched():
    assert _env_after("import rlhf_train") == [None, None, None]


def test_entry_point_sets_cpu_settings_before_torch():
    # the entry point sets them at import, before anything it imports can import torch
    got = _env_after("import rlhf_train.__main__, sys; assert 'torch' not in sys.modules")
    assert got == [None, "1", None]  # the OpenMP wait policy is libgomp's own (why: infra/cpu_defaults.py)


# --------------------------------------------------------------------------- 5. --help
CONF = ROOT / "conf"


def _help(*args) -> str:
    proc = zygote.run([*args, "--help"], cwd=ROOT, capture_output=True,
                      text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def _section(text: str, title: str) -> list[str]:
    """The lines of the ``== title ...`` section of the help page, up to the next ``==`` header."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"== {title}"))
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("== ")), len(lines))
    return lines[start + 1:end]


def test_help_says_how_to_run_and_lists_recipes_and_groups():
    import yaml

    text = _help()
    assert "powered by Hydra" not in text
    for usage in ("python -m rlhf_train +recipe=NAME", "+recipe=default", "key=value", " -m ",
                  "accelerate launch", "README.md", "recipes/NAME.md", "--hydra-help"):
        assert usage in text, usage
    # every recipe file, one entry each (the name at the start of its line), and nothing else
    recipes = [line.split()[0] for line in _section(text, "Recipes") if line.startswith("  ") and line[2] != " "]
    assert recipes == sorted(p.stem for p in (CONF / "recipe").glob("*.yaml"))
    # every config group with exactly its option files (the selected one starred), no schema entries
    lines = _section(text, "Config groups")
    names = [i for i, line in enumerate(lines) if line.startswith("  ") and line[2] != " "]
    # each group: its name and one-line description, then its options (over one or more lines)
    ends = [*names[1:], len(lines)]
    listed = {lines[i].split()[0]: {o.strip().rstrip("*") for o in " ".join(lines[i + 1:end]).split(",") if o.strip()}
              for i, end in zip(names, ends)}
    defaults = yaml.safe_load((CONF / "config.yaml").read_text())["defaults"]
    groups = [g for d in defaults if isinstance(d, dict) for g in d if not g.startswith("override ")]
    assert listed == {g: {p.stem for p in (CONF / g).glob("*.yaml")} for g in groups}
    assert "_schema" not in "\n".join(lines) and "accelerate" not in listed
    # the embedded default's choices are starred; the accelerate configs are launcher files, not a group
    assert "smollm2_135m_instruct*" in lines[lines.index(next(line for line in lines if line.startswith("  policy"))) + 1]
    assert not (CONF / "accelerate").exists() and (ROOT / "accelerate" / "cpu_2proc.yaml").exists()


def test_help_stars_the_options_of_the_given_recipe():
    lines = _section(_help("+recipe=smoke"), "Config groups")
    i = next(i for i, line in enumerate(lines) if line.startswith("  policy"))
    assert "tiny_gpt2*" in lines[i + 1] and "smollm2_135m_instruct*" not in lines[i + 1]


def test_hydra_help_stays_hydras_page_with_a_recipe_given():
    proc = zygote.run(["+recipe=smoke", "--hydra-help"], cwd=ROOT,
                      capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0 and proc.stdout.startswith("Hydra ("), proc.stderr[-3000:]


# --------------------------------------------------------------------------- 6. where the run is
@pytest.mark.slow
def test_run_says_its_run_dir_and_what_it_wrote_into_its_log(tmp_path):
    proc = run("trainer.num_iterations=1", "logger=csv", tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = f"[rlhf_train] run dir: {tmp_path}"
    assert line in proc.stdout
    log = (tmp_path / "__main__.log").read_text()
    assert line in log.splitlines()[0]
    written = next(line for line in log.splitlines() if f"[rlhf_train] written in {tmp_path}: " in line)
    for name in ("metrics.csv", "final_metrics.json", "checkpoints/", "__main__.log"):
        assert name in written, written


def test_a_stage_that_raises_is_logged_as_failed(caplog):
    from rlhf_train.pipeline.cache import Timer

    timer = Timer()
    caplog.set_level("INFO", logger="rlhf_train.pipeline.cache")
    with timer("sft"):
        pass
    with pytest.raises(ValueError), timer("rm"):
        raise ValueError("bad pairs")
    messages = [r.getMessage() for r in caplog.records]
    assert messages[0].startswith("[pipeline] sft") and "done in" in messages[0]
    assert len(messages) == 2 and "done" not in messages[1], messages
    assert messages[1].startswith("[pipeline] rm failed after ") and messages[1].endswith(" s: ValueError")
    assert timer.rows["rm"]["error"] == "ValueError" and "error" not in timer.rows["sft"]


# --------------------------------------------------------------------------- 7. what a failed start leaves
def test_bad_start_leaves_no_run_dir_and_a_kept_run_dir_logs_the_error(tmp_path):
    """Bad input found after a note was logged (LoRA: "no reference copy is built"): the run dir this start
    created goes all the same; a run dir that stays (it existed before) ends its log with the Error line."""
    bad = ("policy.lora.r=4", "data.batch_size=1000", "logger=csv")
    proc = run(*bad, tmp_path=tmp_path / "new" / "run")
    assert proc.returncode == 2 and "no reference copy is built" in proc.stdout, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == [
        "Error: the prompt dataset has 256 prompts, fewer than data.batch_size=1000"]
    assert not (tmp_path / "new").exists()
    kept = tmp_path / "kept"
    (kept / "notes").mkdir(parents=True)
    proc = run(*bad, tmp_path=kept)
    assert proc.returncode == 2 and (kept / "notes").is_dir(), proc.stderr[-3000:]
    log = (kept / "__main__.log").read_text().splitlines()
    assert log[-1].endswith("Error: the prompt dataset has 256 prompts, fewer than data.batch_size=1000"), log


@pytest.mark.slow
def test_a_run_that_stops_on_faults_ends_its_log_with_the_error(tmp_path):
    proc = run("optimizer.lr=1e30", "trainer.max_consecutive_faults=1", "trainer.num_iterations=2", "logger=csv",
               "data.batch_size=4", "update.minibatch_size=2", "rollout.max_new_tokens=8", tmp_path=tmp_path)
    assert proc.returncode == 1, proc.stderr[-3000:]
    error = proc.stderr.strip().splitlines()[-1]
    assert error.startswith("Error: stopped")
    assert (tmp_path / "__main__.log").read_text().splitlines()[-1].endswith(error)
