"""Pictures of a search: how each block's choice settles, what was found, and what it cost.

A search run directory holds ``history.jsonl`` (one line per logged step: ``step``, ``tau``,
``probabilities`` -- block label -> kind -> softmax(alpha) -- and optionally ``val_ppl``) and
``architecture.json`` (DESIGN.md). :func:`plot_run` turns them into ``probabilities.gif`` (a
blocks x kinds heat map per frame), ``probabilities.png`` (lines over steps, one panel per
block) and ``architecture.png`` (the found column of blocks), and logs the final heat map to
TensorBoard. :mod:`parnas.pareto` does that for every trial of an nnictl experiment and adds
``pareto.png`` (validation perplexity against cost). Each kind keeps one colour everywhere.

Figures are built on matplotlib's Agg canvas directly (no pyplot, no display) and every file
is written to a temp file in the same folder and renamed, so a reader never sees half an image.
"""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from parnas.errors import ParnasError
from parnas.files import current_umask

HISTORY, ARCHITECTURE = "history.jsonl", "architecture.json"
KIND_ORDER = ("attention", "dense", "identity")
KIND_COLOURS = {"attention": "#1f77b4", "dense": "#ff7f0e", "identity": "#8c8c8c"}
_SPARE_COLOURS = ("#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf")
DPI = 100
MAX_FRAMES = 100
GIF_SECONDS = 8.0  # the whole animation, before the last frame's hold
TB_TAG = "search/probabilities"

Note = Callable[[str], None]


class HistoryError(ParnasError):
    """A run directory whose history is missing, empty or malformed."""


@dataclass(frozen=True)
class History:
    """``history.jsonl`` as arrays: ``probs[t, block, kind]`` at ``steps[t]``."""

    steps: np.ndarray  # (T,) int
    tau: np.ndarray  # (T,) float
    blocks: tuple[str, ...]  # block labels in depth order
    kinds: tuple[str, ...]  # candidate kinds, canonical order first
    probs: np.ndarray  # (T, n_blocks, n_kinds)
    val_steps: np.ndarray
    val_ppl: np.ndarray
    source: Path


def kind_colour(kind: str) -> str:
    """Fixed colour of a kind (attention blue, dense orange, identity grey; others stable by name)."""
    if kind in KIND_COLOURS:
        return KIND_COLOURS[kind]
    return _SPARE_COLOURS[sum(map(ord, kind)) % len(_SPARE_COLOURS)]


def block_key(label: str) -> tuple[int, int | str]:
    prefix, _, index = label.rpartition("_")
    return (0, int(index)) if prefix and index.isdigit() else (1, label)


def _display(label: str) -> str:
    """``block_3`` -> ``block 3`` (other labels as they are)."""
    return f"block {label.rpartition('_')[2]}" if block_key(label)[0] == 0 else label


def load_history(run_dir: str | Path) -> History:
    """Read ``<run_dir>/history.jsonl`` (or that file itself). A last line without its newline that
    does not parse is a line still being written by a running search, and is skipped."""
    path = Path(run_dir).expanduser()
    path = path / HISTORY if path.is_dir() else path
    if not path.is_file():
        where = path.parent if path.name == HISTORY else path
        raise HistoryError(f"no {HISTORY} in {where}: pass the run directory of a parnas search (search.out_dir)")
    text = path.read_text(encoding="utf-8", errors="replace")
    lines = text.split("\n")
    records: dict[int, dict] = {}
    blocks: tuple[str, ...] = ()
    kinds: tuple[str, ...] = ()
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            step, tau, probs = int(rec["step"]), float(rec["tau"]), rec["probabilities"]
            row = {b: {k: float(p) for k, p in probs[b].items()} for b in probs}
        except (ValueError, KeyError, TypeError, AttributeError):
            if number == len(lines) and not text.endswith("\n"):
                continue  # being written right now
            raise HistoryError(f"{path} line {number} is not a history record "
                               '({"step": int, "tau": float, "probabilities": {block: {kind: p}}})') from None
        if not blocks:
            blocks = tuple(sorted(row, key=block_key))
            kinds = tuple(sorted(row[blocks[0]] if blocks else (),
                                 key=lambda k: (KIND_ORDER.index(k) if k in KIND_ORDER else len(KIND_ORDER), k)))
            if not blocks or not kinds:
                raise HistoryError(f"{path} line {number} has no block probabilities")
        if set(row) != set(blocks) or any(set(row[b]) != set(kinds) for b in blocks):
            raise HistoryError(f"{path} line {number} has other blocks or kinds than the first record "
                               f"({len(blocks)} blocks x {', '.join(kinds)})")
        ppl = rec.get("val_ppl")
        ppl = float(ppl) if isinstance(ppl, (int, float)) else (records.get(step) or {}).get("ppl")
        records[step] = {"tau": tau, "p": [[row[b][k] for k in kinds] for b in blocks], "ppl": ppl}  # repeats: last
    if not records:
        raise HistoryError(f"{path} is empty: the search has not logged a step yet")
    steps = np.array(sorted(records))
    evals = [(s, records[s]["ppl"]) for s in steps if records[s]["ppl"] is not None]
    return History(steps=steps, tau=np.array([records[s]["tau"] for s in steps]), blocks=blocks, kinds=kinds,
                   probs=np.array([records[s]["p"] for s in steps], dtype=np.float64),
                   val_steps=np.array([s for s, _ in evals], dtype=np.int64),
                   val_ppl=np.array([p for _, p in evals], dtype=np.float64), source=path)


def frame_indices(n_records: int, max_frames: int = MAX_FRAMES) -> np.ndarray:
    """Evenly spaced record indices, first and last included: ``min(n_records, max_frames)`` of them."""
    count = max(1, min(n_records, max_frames))
    if count == 1:
        return np.array([n_records - 1])
    return np.floor(np.linspace(0, n_records - 1, count) + 0.5).astype(np.int64)


def heatmap_data(history: History, index: int = -1) -> tuple[np.ndarray, np.ndarray]:
    """What one frame shows: ``probs`` (blocks x kinds) and each block's most likely kind index."""
    probs = history.probs[index]
    return probs, probs.argmax(axis=1)


def cell_colours(probs: np.ndarray, kinds: Sequence[str]) -> np.ndarray:
    """RGB per cell: white blended towards the kind's colour by its probability (darker = likelier)."""
    from matplotlib.colors import to_rgb

    base = np.array([to_rgb(kind_colour(k)) for k in kinds])  # (kinds, 3)
    p = np.clip(probs, 0.0, 1.0)[..., None]
    return 1.0 - p * (1.0 - base[None, :, :])


def frame_size(n_blocks: int, n_kinds: int = 3) -> tuple[int, int]:
    """Width and height in pixels of one heat-map frame."""
    return 640, 150 + _cell_height(n_blocks) * n_blocks


def _cell_height(n_blocks: int) -> int:
    return 52 if n_blocks <= 12 else max(20, 624 // n_blocks)


class _HeatmapFigure:
    """One figure redrawn per frame (cheap: only the image data and the texts change)."""

    def __init__(self, history: History) -> None:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        self.history = history
        n, k = len(history.blocks), len(history.kinds)
        w, h = frame_size(n, k)
        self.fig = Figure(figsize=(w / DPI, h / DPI), dpi=DPI)
        FigureCanvasAgg(self.fig)
        cell = _cell_height(n)
        left, right, top = 150, 40, 92

        def box(x: float, y: float, bw: float, bh: float) -> list[float]:  # pixels from the top left
            return [x / w, 1 - (y + bh) / h, bw / w, bh / h]

        ax = self.ax = self.fig.add_axes(box(left, top, w - left - right, cell * n))
        probs, _ = heatmap_data(history, 0)
        self.image = ax.imshow(cell_colours(probs, history.kinds), aspect="auto", interpolation="nearest",
                               extent=(-0.5, k - 0.5, n - 0.5, -0.5))
        ax.set_xticks([])
        for j, kind in enumerate(history.kinds):
            ax.text(j, -0.62, kind, ha="center", va="bottom", fontsize=12, fontweight="bold",
                    color=kind_colour(kind))
        names = [_display(b) for b in history.blocks]
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
        size = 13 if n <= 12 else 9
        self.texts = [ax.text(0, i, "", ha="center", va="center", fontsize=size, fontweight="bold")
                      for i in range(n)]
        middle = (left + (w - right)) / 2 / w
        self.fig.text(middle, 1 - 16 / h, "Which kind of block does each layer choose?", ha="center", va="center",
                      fontsize=14, fontweight="bold")
        self.step_text = self.fig.text(middle - 0.02, 1 - 42 / h, "", ha="right", va="center", fontsize=12)
        self.tau_text = self.fig.text(middle + 0.02, 1 - 42 / h, "", ha="left", va="center", fontsize=12)
        bar = self.bar_ax = self.fig.add_axes(box(left, top + cell * n + 14, w - left - right, 10))
        bar.set_xlim(0, 1)
        bar.set_axis_off()
        bar.barh(0, 1, color="#e6e6e6", height=1)
        self.progress = bar.barh(0, 0, color="#555555", height=1)[0]
        self.fig.text(0.5, 1 - (top + cell * n + 38) / h,
                      "darker = more likely; the number is the probability of the most likely kind",
                      ha="center", va="center", fontsize=9, color="#444444")

    def update(self, index: int) -> None:
        h = self.history
        probs, best = heatmap_data(h, index)
        colours = cell_colours(probs, h.kinds)
        self.image.set_data(colours)
        for i, (text, j) in enumerate(zip(self.texts, best)):
            dark = float(np.dot(colours[i, j], (0.299, 0.587, 0.114))) < 0.55
            text.set_position((j, i))
            text.set_text(f"{probs[i, j]:.2f}")
            text.set_color("white" if dark else "black")
        self.step_text.set_text(f"step {int(h.steps[index]):,} of {int(h.steps[-1]):,}")
        self.tau_text.set_text(f"temperature \u03c4 = {h.tau[index]:.3f}")
        span = max(int(h.steps[-1] - h.steps[0]), 1)
        self.progress.set_width((int(h.steps[index]) - int(h.steps[0])) / span if len(h.steps) > 1 else 1.0)

    def render(self, index: int) -> np.ndarray:
        """The frame at record ``index`` as an (H, W, 3) uint8 array."""
        self.update(index)
        self.fig.canvas.draw()
        return np.asarray(self.fig.canvas.buffer_rgba())[..., :3].copy()


def render_heatmap(history: History, index: int = -1) -> np.ndarray:
    """One heat-map frame as an RGB array (what the GIF and TensorBoard show)."""
    return _HeatmapFigure(history).render(index % len(history.steps))


def _save_atomic(path: Path, write: Callable[[str], None]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~current_umask())  # the user's umask, as for any new file
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def save_figure(fig: Any, path: Path) -> Path:
    return _save_atomic(path, lambda tmp: fig.savefig(tmp, format="png", dpi=DPI))


def write_gif(history: History, path: Path, max_frames: int = MAX_FRAMES) -> tuple[Path, np.ndarray]:
    """The animation, one frame per selected record; the last frame is held 2 s. Returns the last frame."""
    from PIL import Image

    drawer = _HeatmapFigure(history)
    indices = frame_indices(len(history.steps), max_frames)
    images, frame = [], None
    for i in indices:  # frames are palette images as they come: a fraction of the RGB memory
        frame = drawer.render(int(i))
        images.append(Image.fromarray(frame).quantize(256, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE))
    each = int(min(250, max(40, 1000 * GIF_SECONDS / len(images))) // 10 * 10)
    durations = [each] * (len(images) - 1) + [2000]
    _save_atomic(path, lambda tmp: images[0].save(tmp, format="GIF", save_all=True, append_images=images[1:],
                                                  duration=durations, loop=0, disposal=1))
    return path, frame


def stderr_note(message: str) -> None:
    print(message, file=sys.stderr)


def read_architecture(run_dir: Path, note: Note) -> dict | None:
    path = run_dir / ARCHITECTURE
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
        if not isinstance(record, dict) or not isinstance(record.get("architecture"), dict):
            raise ValueError("no 'architecture' mapping")
        return record
    except (OSError, ValueError) as e:
        note(f"{path}: unreadable ({e}); the architecture figure uses the last logged probabilities")
        return None


def plot_run(run_dir: str | Path, *, max_frames: int = MAX_FRAMES, tensorboard: bool = True,
             note: Note = stderr_note) -> list[Path]:
    """Write ``probabilities.gif``, ``probabilities.png`` and ``architecture.png`` into ``run_dir`` and
    the final heat map to ``<run_dir>/tensorboard`` (tag ``search/probabilities``); returns the images."""
    run = Path(run_dir).expanduser()
    if not run.is_dir():
        raise HistoryError(f"no run directory {run}")
    history = load_history(run)
    record = read_architecture(run, note)
    gif, last = write_gif(history, run / "probabilities.gif", max_frames)
    lines = save_figure(lines_figure(history), run / "probabilities.png")
    arch = save_figure(architecture_figure(history, record), run / "architecture.png")
    if tensorboard:
        log_tensorboard(run / "tensorboard", last, int(history.steps[-1]), note)
    return [gif, lines, arch]


def log_tensorboard(log_dir: Path, image: np.ndarray, step: int, note: Note = stderr_note) -> None:
    """The final heat map as an image (HWC uint8) at ``step``, beside the search's own scalars."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:  # tensorboard is a dependency; a broken install should not lose the plots
        note(f"TensorBoard image skipped ({e})")
        return
    writer = SummaryWriter(log_dir=str(log_dir))
    try:
        writer.add_image(TB_TAG, image, global_step=step, dataformats="HWC")
    finally:
        writer.close()


# --- static figures -------------------------------------------------------------------------------

def figure(width: float, height: float, **kwargs: Any) -> Any:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=DPI, **kwargs)
    FigureCanvasAgg(fig)
    return fig


def lines_figure(history: History) -> Any:
    """Each block's probabilities over steps (one panel per block), tau and validation perplexity on top."""
    n = len(history.blocks)
    cols = 1 if n <= 3 else 2 if n <= 8 else 3
    rows = math.ceil(n / cols)
    fig = figure(4.2 * cols + 1.0, 2.0 * rows + 2.2, layout="constrained")
    grid = fig.add_gridspec(rows + 1, cols, height_ratios=[1.1] + [1.0] * rows)
    top = fig.add_subplot(grid[0, :])
    top.plot(history.steps, history.tau, color="#444444", label="temperature \u03c4")
    top.set_ylabel("\u03c4")
    if history.val_ppl.size:
        twin = top.twinx()
        twin.plot(history.val_steps, history.val_ppl, "o-", color="#2ca02c", markersize=3, label="validation ppl")
        twin.set_ylabel("validation perplexity", color="#2ca02c")
    top.set_title("temperature" + (" and validation perplexity" if history.val_ppl.size else ""), fontsize=10)
    first = None
    for i, block in enumerate(history.blocks):
        ax = fig.add_subplot(grid[1 + i // cols, i % cols], sharex=top, sharey=first)
        first = first or ax
        for j, kind in enumerate(history.kinds):
            ax.plot(history.steps, history.probs[:, i, j], color=kind_colour(kind), linewidth=1.8, label=kind)
        best = int(history.probs[-1, i].argmax())
        ax.set_title(f"{_display(block)}: {history.kinds[best]} {history.probs[-1, i, best]:.2f}", fontsize=10,
                     color=kind_colour(history.kinds[best]))
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
        if i // cols == rows - 1 or i + cols >= n:
            ax.set_xlabel("step")
        if i % cols == 0:
            ax.set_ylabel("probability")
    handles, labels = first.get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncols=len(labels), frameon=False)
    fig.suptitle("Block-kind probabilities during the search", fontweight="bold")
    return fig


def architecture_figure(history: History, record: Mapping[str, Any] | None = None) -> Any:
    """The found architecture as a column of blocks, input at the top, each with its probabilities
    (from ``architecture.json``; without one, the argmax of the last logged probabilities)."""
    from matplotlib.patches import FancyBboxPatch, Patch

    kinds = history.kinds
    final = {b: dict(zip(kinds, history.probs[-1, i])) for i, b in enumerate(history.blocks)}
    arch = {b: max(final[b], key=final[b].get) for b in history.blocks}
    if record:
        arch = dict(record.get("architecture") or arch)
        final.update({b: dict(p) for b, p in (record.get("probabilities") or {}).items() if isinstance(p, dict)})
    blocks = sorted(arch, key=block_key)
    search = (record or {}).get("search") or {}
    fig = figure(7.0, 0.6 * (len(blocks) + 4.8))
    ax = fig.add_axes([0, 0, 1, 1])
    ax.set_xlim(0, 10)
    ax.set_ylim(-(len(blocks) + 3.2), 1.6)
    ax.set_axis_off()

    def box(y: float, text: str, face: str, edge: str = "none", colour: str = "white") -> None:
        ax.add_patch(FancyBboxPatch((0.6, y - 0.36), 4.2, 0.72, boxstyle="round,pad=0.02,rounding_size=0.12",
                                    facecolor=face, edgecolor=edge, linewidth=1.2))
        ax.text(2.7, y, text, ha="center", va="center", color=colour, fontsize=11, fontweight="bold")

    box(-1, "token embedding", "white", "#666666", "#333333")
    for i, block in enumerate(blocks):
        y, kind = -(i + 2), arch[block]
        box(y, f"{_display(block)}: {kind}", kind_colour(kind))
        probs = final.get(block) or {}
        left = 5.2
        for k in [k for k in KIND_ORDER if k in probs] + sorted(set(probs) - set(KIND_ORDER)):
            width = 3.0 * float(probs[k])
            ax.add_patch(FancyBboxPatch((left, y - 0.2), width, 0.4, boxstyle="square,pad=0",
                                        facecolor=kind_colour(k), edgecolor="none"))
            left += width
        if kind in probs:
            ax.text(8.4, y, f"p = {float(probs[kind]):.2f}", va="center", fontsize=10)
    softmax = "adaptive softmax" if ((record or {}).get("model") or {}).get("cutoffs") else "softmax"
    box(-(len(blocks) + 2), softmax, "white", "#666666", "#333333")
    for i in range(len(blocks) + 1):
        ax.annotate("", xy=(2.7, -(i + 1.62)), xytext=(2.7, -(i + 1.38)),
                    arrowprops={"arrowstyle": "-|>", "color": "#666666"})
    counts = ", ".join(f"{sum(v == k for v in arch.values())} {k}" for k in dict.fromkeys(arch.values()))
    ax.text(5, 1.05, f"Found architecture: {len(blocks)} blocks ({counts})", ha="center", fontsize=13,
            fontweight="bold")
    facts = [f"validation ppl {search['val_ppl']:.2f}" if isinstance(search.get("val_ppl"), (int, float)) else "",
             f"{search['steps']:,} steps" if isinstance(search.get("steps"), int) else "",
             f"\u03c4 final {search['tau_final']:.3g}" if isinstance(search.get("tau_final"), (int, float)) else "",
             f"cost {search['architecture_cost']:.4g} {search.get('cost_unit', '')}".rstrip()
             if isinstance(search.get("architecture_cost"), (int, float)) else ""]
    facts = [f for f in facts if f] or ([] if record else ["from the last logged probabilities (no architecture.json)"])
    ax.text(5, 0.45, " \u00b7 ".join(facts), ha="center", fontsize=10, color="#333333")
    ax.text(6.7, -0.95, "probabilities", ha="center", fontsize=9, color="#555555")
    ax.legend(handles=[Patch(color=kind_colour(k), label=k) for k in dict.fromkeys([*kinds, *arch.values()])],
              loc="lower center", ncols=3, frameon=False, bbox_to_anchor=(0.5, 0.0))
    return fig
