"""The GIF's frame: a blocks x kinds heat map of softmax(alpha) at one logged step, each block's margin (top minus
second probability) beside it and a progress bar under it."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from parnas.report.experiments import UNDECIDED_MARGIN, margin
from parnas.report.history import History, block_name, kind_colour

DPI = 100
MAX_FRAMES = 100
TIE = 0.005  # margins below this print as 0.00: the block's top kinds are tied


def frame_indices(n_records: int, max_frames: int = MAX_FRAMES) -> np.ndarray:
    """Evenly spaced record indices, first and last included: ``min(n_records, max_frames)`` of them."""
    count = max(1, min(n_records, max_frames))
    if count == 1:
        return np.array([n_records - 1])
    return np.floor(np.linspace(0, n_records - 1, count) + 0.5).astype(np.int64)


def heatmap_data(history: History, index: int = -1) -> tuple[np.ndarray, np.ndarray]:
    """One frame's ``probs`` (blocks x kinds) and each block's leading kind, -1 at a tie (margin rounds to 0.00)."""
    probs = history.probs[index]
    return probs, np.where(block_margins(probs) < TIE, -1, probs.argmax(axis=1))


def block_margins(probs: np.ndarray) -> np.ndarray:
    """Each block's :func:`~parnas.report.experiments.margin`: ``(n_blocks, n_kinds) -> (n_blocks,)``."""
    return np.array([margin(row) for row in probs])


def cell_colours(probs: np.ndarray, kinds: Sequence[str]) -> np.ndarray:
    """RGB per cell: white blended towards the kind's colour by its probability (darker = likelier)."""
    from matplotlib.colors import to_rgb

    base = np.array([to_rgb(kind_colour(k)) for k in kinds])  # (kinds, 3)
    p = np.clip(probs, 0.0, 1.0)[..., None]
    return 1.0 - p * (1.0 - base[None, :, :])


_LEFT, _RIGHT, _TOP, _BOTTOM, _KIND_WIDTH = 150, 150, 72, 78, 130  # pixels


def frame_size(n_blocks: int, n_kinds: int = 3) -> tuple[int, int]:
    """Width and height in pixels of one heat-map frame."""
    return _LEFT + _KIND_WIDTH * n_kinds + _RIGHT, _TOP + _cell_height(n_blocks) * n_blocks + _BOTTOM


def _cell_height(n_blocks: int) -> int:
    return 52 if n_blocks <= 12 else max(20, 624 // n_blocks)


def margin_text(value: float) -> tuple[str, str]:
    """What the margin column says about a block, and in which colour."""
    if value < TIE:
        return "tie", "#b22222"
    if value < UNDECIDED_MARGIN:
        return f"{value:.2f} undecided", "#b22222"
    return f"{value:.2f}", "#333333"


class HeatmapFigure:
    """One figure redrawn per frame (cheap: only the image data, the texts and the outlines change). The leading
    kind of a block is outlined, dashed while the block is undecided, not at all at a tie."""

    def __init__(self, history: History) -> None:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Rectangle

        self.history = history
        n, k = len(history.blocks), len(history.kinds)
        w, h = frame_size(n, k)
        self.fig = Figure(figsize=(w / DPI, h / DPI), dpi=DPI)
        FigureCanvasAgg(self.fig)
        cell = _cell_height(n)

        def box(x: float, y: float, bw: float, bh: float) -> list[float]:  # pixels from the top left
            return [x / w, 1 - (y + bh) / h, bw / w, bh / h]

        ax = self.ax = self.fig.add_axes(box(_LEFT, _TOP, _KIND_WIDTH * k, cell * n))
        probs, _ = heatmap_data(history, 0)
        self.image = ax.imshow(cell_colours(probs, history.kinds), aspect="auto", interpolation="nearest",
                               extent=(-0.5, k - 0.5, n - 0.5, -0.5))
        ax.set_xticks([])
        for j, kind in enumerate(history.kinds):
            ax.text(j, -0.62, kind, ha="center", va="bottom", fontsize=12, fontweight="bold", color=kind_colour(kind))
        ax.text(k - 0.5 + 18 / _KIND_WIDTH, -0.62, "margin", ha="left", va="bottom", fontsize=11, color="#333333")
        names = [block_name(b) for b in history.blocks]
        if n > 1:
            names[0], names[-1] = names[0] + "  (input)", names[-1] + "  (output)"
        ax.set_yticks(range(n), names, fontsize=10 if n <= 12 else 8)
        ax.tick_params(length=0)
        for x in np.arange(0.5, k - 1):
            ax.axvline(x, color="white", linewidth=3)
        for y in np.arange(0.5, n - 1):
            ax.axhline(y, color="white", linewidth=3)
        for spine in ax.spines.values():
            spine.set_visible(False)
        size = 12 if n <= 12 else 8
        self.texts = [[ax.text(j, i, "", ha="center", va="center", fontsize=size) for j in range(k)]
                      for i in range(n)]  # [block][kind]
        self.outlines = [ax.add_patch(Rectangle((-0.42, i - 0.4), 0.84, 0.8, fill=False, linewidth=2.2,
                                                edgecolor="#222222", visible=False)) for i in range(n)]
        self.margins = [ax.text(k - 0.5 + 18 / _KIND_WIDTH, i, "", ha="left", va="center", fontsize=size - 1,
                                clip_on=False) for i in range(n)]
        middle = (_LEFT + _KIND_WIDTH * k / 2) / w
        self.fig.text(middle, 1 - 18 / h, "Which kind of block does each layer choose?", ha="center", va="center",
                      fontsize=14, fontweight="bold")
        bar = self.bar_ax = self.fig.add_axes(box(_LEFT, _TOP + cell * n + 12, _KIND_WIDTH * k, 10))
        bar.set_xlim(0, 1)
        bar.set_axis_off()
        bar.barh(0, 1, color="#e6e6e6", height=1)
        self.progress = bar.barh(0, 0, color="#555555", height=1)[0]
        self.bar_text = self.fig.text(middle, 1 - (_TOP + cell * n + 36) / h, "", ha="center", va="center", fontsize=11)
        self.fig.text(0.5, 1 - (_TOP + cell * n + 60) / h,
                      "each cell: the kind's probability (darker = likelier); outlined: the block's leading kind; "
                      f"margin = top \u2212 second,\nbelow {UNDECIDED_MARGIN:g} the block is undecided "
                      "(dashed outline), 0.00 is a tie (no leader)",
                      ha="center", va="center", fontsize=8.5, color="#444444")

    def update(self, index: int) -> None:
        h = self.history
        probs, best = heatmap_data(h, index)
        margins = block_margins(probs)
        colours = cell_colours(probs, h.kinds)
        self.image.set_data(colours)
        for i, row in enumerate(self.texts):
            for j, text in enumerate(row):
                dark = float(np.dot(colours[i, j], (0.299, 0.587, 0.114))) < 0.55
                text.set_text(f"{probs[i, j]:.2f}")
                text.set_color("white" if dark else "black")
                text.set_fontweight("bold" if j == best[i] else "normal")
            outline = self.outlines[i]
            outline.set_visible(bool(best[i] >= 0))
            outline.set_x(best[i] - 0.42)
            outline.set_linestyle("-" if margins[i] >= UNDECIDED_MARGIN else "--")
            label, colour = margin_text(float(margins[i]))
            self.margins[i].set_text(label)
            self.margins[i].set_color(colour)
        self.bar_text.set_text(progress_label(h, index))
        span = max(int(h.steps[-1] - h.steps[0]), 1)
        self.progress.set_width((int(h.steps[index]) - int(h.steps[0])) / span if len(h.steps) > 1 else 1.0)

    def render(self, index: int) -> np.ndarray:
        """The frame at record ``index`` as an (H, W, 3) uint8 array."""
        self.update(index)
        self.fig.canvas.draw()
        return np.asarray(self.fig.canvas.buffer_rgba())[..., :3].copy()


def progress_label(history: History, index: int) -> str:
    """The progress bar's label, e.g. ``step 250 / 1,000, tau 0.460``; no tau where the search read none (NaN)."""
    tau = history.tau[index]
    return (f"step {int(history.steps[index]):,} / {int(history.steps[-1]):,}"
            + (f", tau {tau:.3f}" if np.isfinite(tau) else ""))

