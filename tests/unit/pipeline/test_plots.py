"""The sweep report and the PPO curves stay readable (issue 18, item 4).

Each test renders the real PNG (``plot_report`` / ``plot_rl_history``) and reads the figure that was
saved: tick labels are read with their bounding boxes from the figure's renderer.
"""
from __future__ import annotations

import math

import pytest
from matplotlib.figure import Figure

from rlhf_train.pipeline.evaluate import plot_rl_history
from rlhf_train.pipeline.sweep import plot_report


@pytest.fixture
def saved(monkeypatch):
    """Every figure saved while the test runs (the PNG is still written)."""
    figures = []
    original = Figure.savefig

    def savefig(self, *args, **kwargs):
        figures.append(self)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", savefig)
    return figures


def _visible_ticklabels(axis, renderer):
    lo, hi = sorted(axis.get_view_interval())
    span = hi - lo
    return [t for tick, t in zip(axis.get_majorticklocs(), axis.get_ticklabels())
            if lo - 1e-9 * span <= tick <= hi + 1e-9 * span and t.get_visible() and t.get_text()]


def _check_readable(fig):
    """Every axis: >= 2 tick labels, all different, none overlapping each other or the axis label,
    no offset text in the axis corner."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    if not hasattr(fig.canvas, "get_renderer"):  # a pyplot figure closed after saving
        FigureCanvasAgg(fig)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            labels = _visible_ticklabels(axis, renderer)
            texts = [t.get_text() for t in labels]
            where = f"{ax.get_title()!r} {axis.axis_name}-axis {texts}"
            assert len(texts) >= 2, where
            assert len(set(texts)) == len(texts), f"repeated tick labels: {where}"
            boxes = [t.get_window_extent(renderer) for t in labels]
            overlaps = [(texts[i], texts[j]) for i in range(len(boxes)) for j in range(i + 1, len(boxes))
                        if boxes[i].overlaps(boxes[j])]
            assert not overlaps, f"tick labels overlap: {overlaps} in {where}"
            label_box = axis.label.get_window_extent(renderer)
            assert not any(b.overlaps(label_box) for b in boxes), f"tick labels overlap the axis label: {where}"
            offset = axis.get_offset_text()
            assert not (offset.get_visible() and offset.get_text()), f"offset text {offset.get_text()!r}: {where}"


def _row(job, kl, rew, seed):
    hist = [{"iteration": i, "objective/reward_raw": rew * i / 3, "objective/kl": kl * i / 3} for i in (1, 2, 3)]
    return {"job": job, "status": "completed", "objective/kl": kl, "objective/reward_raw": rew, "_history": hist,
            "seed": seed}


@pytest.mark.parametrize("kls, rews", [
    ([2.71828, 2.71831, 2.71831], [0.40010, 0.40012, 0.40012]),  # 3e-5 apart on values of a few nats
    ([0.012341, 0.012371, 0.012371], [0.4, 0.4, 0.4]),            # small KL, equal rewards
    ([3.1e-7, 3.4e-7, 3.4e-7], [-1.5, -1.5, -1.5]),                # KL near 0
])
def test_sweep_report_near_equal_values_has_readable_ticks(tmp_path, saved, kls, rews):
    rows = [_row(j, k, r, j) for j, (k, r) in enumerate(zip(kls, rews))]
    plot_report(tmp_path / "sweep_report.png", rows, ["seed"], title="near-equal")
    assert (tmp_path / "sweep_report.png").stat().st_size > 10_000
    (fig,) = saved
    _check_readable(fig)


def test_sweep_report_identical_curves_stay_visible(tmp_path, saved):
    rows = [_row(j, 2.0, 0.5, j) for j in range(3)]  # three jobs with exactly the same history
    plot_report(tmp_path / "sweep_report.png", rows, ["seed"])
    (fig,) = saved
    for ax in fig.axes[1:]:  # the reward and the KL curves
        lines = ax.get_lines()
        assert len(lines) == 3
        assert all(list(ln.get_ydata()) == list(lines[0].get_ydata()) for ln in lines)
        styles = [(ln.get_marker(), str(ln.get_linestyle()), ln.get_markersize()) for ln in lines]
        assert len({s[0] for s in styles}) == 3, f"the same marker twice: {styles}"
        assert len({s[1] for s in styles}) == 3, f"the same dash pattern twice: {styles}"
        assert all(ln.get_markerfacecolor() == "none" for ln in lines)  # hollow: the ones below show through


def test_rl_curves_label_what_is_plotted(tmp_path, saved):
    hist = [{"iteration": i, "objective/score": 0.1 * i, "objective/reward_raw": 0.1 * i - 0.5,
             "objective/reward_total": 0.05 * i - 0.5, "objective/kl": 0.5 * i} for i in range(1, 9)]
    out = plot_rl_history(hist, tmp_path / "rl_curves.png", kl_target=3.0, algorithm="GRPO")
    assert out.stat().st_size > 10_000
    (fig,) = saved
    _check_readable(fig)
    ax_reward, ax_kl = fig.axes
    labels = [ln.get_label() for ln in ax_reward.get_lines()]
    assert [lab.split(":")[0] for lab in labels] == ["objective/score", "objective/reward_raw", "objective/reward_total"]
    total = labels[2]
    assert "β·KL" in total and "shaped score" in total and "score - KL penalty" not in total
    assert "unshaped" in labels[0] and "baseline" in labels[1]
    for ln, key in zip(ax_reward.get_lines(), ("objective/score", "objective/reward_raw", "objective/reward_total")):
        assert list(ln.get_ydata()) == [h[key] for h in hist]  # the curve is the metric its label names
    kl_line = ax_kl.get_lines()[0]
    assert kl_line.get_label().startswith("objective/kl") and list(kl_line.get_ydata()) == [h["objective/kl"] for h in hist]
    assert "per sequence" in ax_reward.get_ylabel() and "nats" in ax_kl.get_ylabel()
    assert ax_reward.get_xlabel() == ax_kl.get_xlabel() == "GRPO iteration"  # the RL stage named by its algorithm
    legend_texts = [t.get_text() for leg in fig.legends + [a.get_legend() for a in fig.axes if a.get_legend()]
                    for t in leg.get_texts()]
    assert total in legend_texts and any("KL target 3" in t for t in legend_texts)


def test_rl_curves_near_constant_values_are_readable(tmp_path, saved):
    hist = [{"iteration": i, "objective/score": 0.4, "objective/reward_raw": 0.4,
             "objective/reward_total": 0.4 - 1e-5 * i, "objective/kl": 1e-4 * i} for i in range(1, 5)]
    plot_rl_history(hist, tmp_path / "rl_curves.png")
    (fig,) = saved
    _check_readable(fig)
    assert not any(math.isnan(v) for ln in fig.axes[0].get_lines() for v in ln.get_ydata())
