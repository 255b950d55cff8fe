"""The sweep report's figure (``sweep_report.png``, :mod:`rlhf_train.pipeline.sweep`): final reward against
final KL, one point per job, and the reward and KL curves over iterations, one line per job."""
from __future__ import annotations

import math
from pathlib import Path

CURVES = ("objective/reward_raw", "objective/kl")


def _label(row: dict, swept: list[str]) -> str:
    return f"#{row['job']} " + " ".join(f"{k.split('.')[-1]}={row[k]}" for k in swept)


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
