"""Stacked phase bars per schedule as a PNG, drawn with Pillow (no plotting dependency).

One bar per (run, schedule): the mean seconds of each phase stacked bottom-up in :data:`PHASES` order, so
the bar's height is the mean step time; the speedup over Native is written above each bar.
"""

from __future__ import annotations

import math
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

from leangrpo_mcore.bench.report import PHASE_LABELS, PHASES

COLORS = {"rollout_nograd_forward": (76, 114, 176), "rollout_grad_forward": (129, 178, 235),
          "recompute": (221, 132, 82), "backward": (196, 78, 82), "sync": (129, 114, 178), "bubble": (240, 200, 80),
          "reward": (85, 168, 104), "optimizer": (147, 120, 96), "other": (180, 180, 180)}
BAR, GAP, LEFT, TOP, PLOT_H, LEGEND_W = 56, 26, 70, 50, 300, 190


def _font(size: int):
    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow < 10.1: fixed-size bitmap font
        return ImageFont.load_default()


def _tick_step(top: float) -> float:
    """A 1-2-5 tick spacing giving about five ticks up to ``top``."""
    raw = top / 5
    power = 10 ** math.floor(math.log10(raw))
    return next(m * power for m in (1, 2, 5, 10) if m * power >= raw)


def _bars(document: dict) -> list[tuple[str, dict, str]]:
    """(label, mean phases, speedup text) per bar."""
    sweep = document.get("sweep")
    bars = []
    for index, run in enumerate(document["runs"]):
        prefix = f"{sweep['values'][index]} " if sweep else ""
        for name, entry in run["schedules"].items():
            speedup = entry.get("speedup")
            bars.append((f"{prefix}{name}", entry["phases_s"], "" if speedup is None else f"{speedup:.2f}x"))
    return bars


def plot_document(document: dict, path: str | Path, title: str = "") -> Path:
    """Draw the stacked phase bars of every run of ``document`` into the PNG ``path``."""
    bars = _bars(document)
    if not bars:
        raise ValueError("nothing to plot: the document has no runs")
    top = max(sum(max(v, 0.0) for v in phases.values()) for _, phases, _ in bars) or 1.0
    step = _tick_step(top)
    top = math.ceil(top / step) * step
    width = LEFT + len(bars) * (BAR + GAP) + GAP + LEGEND_W
    height = TOP + PLOT_H + 90
    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)
    small, large = _font(11), _font(14)
    draw.text((LEFT, 12), title or "step time by phase (mean s)", fill="black", font=large)
    base = TOP + PLOT_H
    for k in range(int(round(top / step)) + 1):
        y = base - k * step / top * PLOT_H
        draw.line([(LEFT - 4, y), (LEFT + len(bars) * (BAR + GAP) + GAP, y)], fill=(225, 225, 225))
        draw.text((8, y - 6), f"{k * step:.3g} s", fill="black", font=small)
    for i, (label, phases, speedup) in enumerate(bars):
        x = LEFT + GAP + i * (BAR + GAP)
        y = float(base)
        for phase in PHASES:
            h = max(phases.get(phase, 0.0), 0.0) / top * PLOT_H
            if h > 0:
                draw.rectangle([x, y - h, x + BAR, y], fill=COLORS[phase])
            y -= h
        draw.text((x, y - 16), speedup, fill="black", font=small)
        for j, part in enumerate(label.replace("_", " ").split()):  # one word per line: labels stay under their bar
            draw.text((x, base + 6 + 14 * j), part, fill="black", font=small)
    draw.line([(LEFT, TOP), (LEFT, base)], fill="black")
    draw.line([(LEFT, base), (LEFT + len(bars) * (BAR + GAP) + GAP, base)], fill="black")
    legend_x = LEFT + len(bars) * (BAR + GAP) + GAP + 16
    for j, phase in enumerate(reversed(PHASES)):
        y = TOP + 18 * j
        draw.rectangle([legend_x, y, legend_x + 12, y + 12], fill=COLORS[phase])
        draw.text((legend_x + 18, y), PHASE_LABELS[phase], fill="black", font=small)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path, format="PNG")
    return path
