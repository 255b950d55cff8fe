"""Plot helpers shared by the sweep report and the RL curves: axes that stay readable and curves that
stay visible.

* :func:`readable_axis`: a few ticks at round steps (1, 2, 5 × 10^k), each labelled with its full value
  and just enough digits to tell it from its neighbours (:class:`ShortTicks`: no offset text in the
  axis corner, where it runs into the axis label), and a minimum span around nearly equal values, so
  float noise is not blown up into a full axis; :func:`declutter` then takes ticks away from an axis
  whose labels touch, as drawn.
* :func:`curve_style`: a colour, a hollow marker (of its own size) and a dash pattern per curve, all
  different for neighbouring curves, so that two identical curves are still both visible.
All work on a bare :class:`~matplotlib.figure.Figure` (no pyplot: the user's backend is never touched).
"""
from __future__ import annotations

import math
from collections.abc import Iterable
from itertools import pairwise

from matplotlib.ticker import Formatter, MaxNLocator

MARKERS = "osD^vP*X"
# solid, dashed, dotted, dash-dot: different periods, so overlaid identical curves interleave
DASHES = ["-", "--", ":", "-."]
MIN_REL_SPAN = 1e-4  # an axis spans at least this fraction of its largest |value| (see readable_axis)
MIN_ABS_SPAN = 1e-9  # ... and at least this much (values all 0: a span of 1)
MAX_MARKERS = 15  # markers per curve at most (see curve_style)
MAX_TICKS = 9  # at most this many ticks per axis (fewer where their labels would touch: see declutter)


def curve_style(i: int, points: int = 0) -> dict:
    """Line style of the ``i``-th curve: colour, hollow marker (9, 7 or 5.5 points) and dash pattern.

    Colours cycle every 10, markers every 8, dashes every 4: two curves get the same triple only when
    40 curves apart. Hollow markers of different shapes and sizes stay visible on the same point. A
    curve of more than ``MAX_MARKERS`` ``points`` gets a marker every few points, starting at a point
    of its own, so that the markers of identical curves do not sit on each other.
    """
    color = f"C{i % 10}"
    every = max(1, math.ceil(points / MAX_MARKERS))
    return {"color": color, "marker": MARKERS[i % len(MARKERS)], "linestyle": DASHES[i % len(DASHES)],
            "markerfacecolor": "none", "markeredgecolor": color, "markeredgewidth": 1.4, "ms": (9, 7, 5.5)[i % 3],
            "lw": 1.6, "alpha": 0.9, "markevery": (i % every, every)}


def _finite(values: Iterable) -> list[float]:
    out = []
    for v in values:
        try:
            f = float(v)
        except (TypeError, ValueError):
            continue
        if math.isfinite(f):
            out.append(f)
    return out


class ShortTicks(Formatter):
    """Tick labels with the fewest digits that still tell neighbouring ticks apart.

    Fixed-point (``2.71830``) for magnitudes in [1e-3, 1e5), else scientific (``5.2e-07``); the number
    of digits follows the tick step, so ticks 2e-5 apart on values near 2.718 read ``2.71828``,
    ``2.71830``, ...
    """

    fmt = "{:g}"

    def set_locs(self, locs):
        super().set_locs(locs)
        locs = sorted(float(v) for v in locs)
        steps = [b - a for a, b in pairwise(locs) if b > a]
        biggest = max((abs(v) for v in locs), default=0.0)
        if not steps or biggest == 0:
            self.fmt = "{:g}"
        elif 1e-3 <= biggest < 1e5:
            self.fmt = f"{{:.{max(0, -math.floor(math.log10(min(steps)) + 1e-9))}f}}"
        else:
            digits = max(0, math.floor(math.log10(biggest)) - math.floor(math.log10(min(steps)) + 1e-9))
            self.fmt = f"{{:.{digits}e}}"

    def __call__(self, x, pos=None):
        text = self.fmt.format(x)
        return text[1:] if text.startswith("-") and float(text) == 0 else text  # no "-0.00"


def readable_axis(axis, values: Iterable, margin: float = 0.1, integer: bool = False,
                  max_ticks: int = MAX_TICKS) -> None:
    """Make ``axis`` (``ax.xaxis`` / ``ax.yaxis``) readable for the data ``values`` it shows.

    * the view spans at least ``MIN_REL_SPAN`` × max|value| (values closer than that are, for a plot,
      equal: they are drawn on one point instead of magnifying float noise to the full axis; values that
      are exactly equal get ±5 %; an integer axis spans at least 2), plus ``margin`` of the span on each side;
    * at most ``max_ticks`` ticks at round steps (:class:`~matplotlib.ticker.MaxNLocator`), integers if
      ``integer``, labelled by :class:`ShortTicks`.
    """
    axis.set_major_locator(MaxNLocator(nbins=max_ticks - 1, steps=[1, 2, 5, 10], integer=integer, min_n_ticks=2))
    axis.set_major_formatter(ShortTicks())
    vals = _finite(values)
    if not vals:
        return
    lo, hi = min(vals), max(vals)
    biggest = max(abs(lo), abs(hi))
    floor = 0.1 * biggest if hi == lo else MIN_REL_SPAN * biggest
    span = max(hi - lo, floor, MIN_ABS_SPAN if biggest else 1.0, 2.0 if integer else 0.0)  # integers: 2 steps
    if hi - lo < span:  # widened: centred on the values
        mid = (lo + hi) / 2
        lo, hi = mid - span / 2, mid + span / 2
    pad = margin * span
    set_lim = axis.axes.set_xlim if axis is axis.axes.xaxis else axis.axes.set_ylim
    set_lim(lo - pad, hi + pad)


def tick_labels_touch(axis, renderer) -> bool:
    """Whether two of the tick labels ``axis`` shows overlap (their bounding boxes, as drawn)."""
    lo, hi = sorted(axis.get_view_interval())
    eps = 1e-9 * (hi - lo)
    boxes = [t.get_window_extent(renderer) for tick, t in zip(axis.get_majorticklocs(), axis.get_ticklabels())
             if lo - eps <= tick <= hi + eps and t.get_visible() and t.get_text()]
    return any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1:])


def declutter(fig) -> None:
    """Draw ``fig``; on every axis set up by :func:`readable_axis` whose tick labels touch, ask for fewer
    ticks and draw again (down to 2 ticks)."""
    fig.canvas.draw()
    for _ in range(MAX_TICKS):
        renderer = fig.canvas.get_renderer()
        crowded = [axis for ax in fig.axes for axis in (ax.xaxis, ax.yaxis)
                   if isinstance(axis.get_major_formatter(), ShortTicks) and tick_labels_touch(axis, renderer)]
        crowded = [a for a in crowded if a.get_major_locator()._nbins > 1]
        if not crowded:
            return
        for axis in crowded:
            locator = axis.get_major_locator()
            locator.set_params(nbins=locator._nbins - 1)
        fig.canvas.draw()
