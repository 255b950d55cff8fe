"""``report.md`` in the pipeline's run dir: the before/after table, the reward/KL plot and sample continuations.

:func:`write_report` reads only the finished ``summary`` dict (the same numbers as ``summary.json``), so
the report never disagrees with it. Markdown, readable as plain text and rendered by any viewer.
"""
from __future__ import annotations

import os
from pathlib import Path

REPORT_SAMPLES = 10  # before/after samples shown in report.md (summary.json holds evaluation.num_samples_shown)


def _cell(text: str) -> str:
    """One markdown table cell: no newlines, no unescaped pipes."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _score(row: dict, name: str, sources: list[str]) -> str:
    label = "RM" if sources == ["reward_model"] else "score"
    parts = [f"{label} {row[f'reward_{name}']:+.2f}"]
    if f"sources_{name}" in row:  # several sources: each one's raw score
        parts[0] += " (" + ", ".join(f"{src} {v:+.2f}" for src, v in row[f"sources_{name}"].items()) + ")"
    if f"judge_prob_{name}" in row:
        parts.append(f"judge P(positive) {row[f'judge_prob_{name}']:.2f}")
    return ", ".join(parts)


def report_markdown(summary: dict, title: str = "RLHF pipeline report", n_samples: int = REPORT_SAMPLES) -> str:
    """The text of ``report.md`` for a pipeline ``summary`` (see :func:`rlhf_train.pipeline.run.run_evaluation`)."""
    lines = [f"# {title}", ""]
    policy = summary.get("stage_dirs", {}).get("sft")
    if policy:
        lines += [f"Initial policy: `{policy}`; {summary.get('rl_iterations', '?')} {summary.get('algorithm', 'RL')} "
                  f"iterations; evaluated on "
                  f"{summary['num_prompts']} held-out prompts ('{summary['eval_split']}' split), "
                  f"{summary['max_new_tokens']} new tokens at temperature {summary['temperature']} "
                  f"({summary.get('num_samples', 1)} per prompt), the same sampling seed before and after.", ""]
    lines += ["## Before / after", "", "```", summary.get("table", ""), "```", ""]
    if "fluency_logprob_before" in summary:
        drop = summary["fluency_logprob_before"] - summary["fluency_logprob_after"]
        bound = summary.get("fluency_max_drop")
        verdict = "" if bound is None else (f" (bound: at most {bound:g}; "
                                            f"{'within' if drop <= bound else 'OUTSIDE'} it)")
        lines += [f"Fluency: the samples' mean log-likelihood per token under the initial model went from "
                  f"{summary['fluency_logprob_before']:.3f} to {summary['fluency_logprob_after']:.3f} nats, a drop of "
                  f"{drop:.3f}{verdict}; repeated 3-grams {summary['repetition_rate_before']:.3f} -> "
                  f"{summary['repetition_rate_after']:.3f}.", ""]
    if summary.get("plot"):
        lines += ["## Reward and KL during training", "", f"![reward and KL]({os.path.basename(summary['plot'])})", ""]
    samples = summary.get("samples", [])[:n_samples]
    if samples:
        lines += [f"## {len(samples)} samples (the first held-out prompts; before = initial policy, after = trained)", ""]
        sources = summary.get("reward_sources", ["reward_model"])
        for i, row in enumerate(samples):
            lines += [f"**[{i}] prompt:** {_cell(row['prompt'])}", "",
                      f"- *before* ({_score(row, 'before', sources)}): {_cell(row['before'])}",
                      f"- *after* ({_score(row, 'after', sources)}): {_cell(row['after'])}", ""]
    timings = summary.get("timings", {})
    if timings:
        lines += ["## Time", "", "| stage | wall (s) | CPU (s) |", "|---|---:|---:|"]
        for name, t in timings.items():
            lines.append(f"| {name} | {t.get('wall_s', 0):.1f} | {t.get('cpu_s', 0):.1f} |")
        lines.append("")
    return "\n".join(lines)


def write_report(run_dir: str | Path, summary: dict, title: str = "RLHF pipeline report") -> Path:
    """Write ``run_dir/report.md`` (atomically) and return its path."""
    path = Path(run_dir) / "report.md"
    tmp = path.with_suffix(".md.tmp")
    tmp.write_text(report_markdown(summary, title))
    os.replace(tmp, path)
    return path
