"""Pictures of a search run directory (``history.jsonl``, and ``architecture.json`` once finished):
``probabilities.gif``, ``probabilities.png``, ``architecture.png`` and the final heat map in TensorBoard, as
docs/reference.md ("Seeing the search") shows them. Figures are built on matplotlib's Agg canvas (no pyplot, no
display) and written atomically, so a reader never sees half an image.
"""

from __future__ import annotations

import math
import os
import sys
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, Any

import numpy as np

from parnas import reading
from parnas.config import TARGET_LABELS
from parnas.files import check_not_link, ensure_writable_dir, write_atomic
from parnas.report.experiments import EXPORTED_PPL_LABEL, SUPERNET_PPL_LABEL, perplexities
from parnas.report.heatmap import (
    DPI,
    MAX_FRAMES,
    HeatmapFigure,
    block_margins,
    frame_indices,
    heatmap_data,
    margin_text,
)
from parnas.report.history import KIND_ORDER, History, HistoryError, block_key, block_name, kind_colour, load_history

ARCHITECTURE = "architecture.json"
GIF_SECONDS = 8.0  # the whole animation, before the last frame's hold
TB_TAG = "search/probabilities"
# One events file that each plot replaces ("tfevents" in the name is what TensorBoard looks for); it sorts
# before the search's own files, so a TensorBoard already following those keeps following them.
TB_FILE = "events.out.tfevents.0000000000.parnas-plot"

Note = Callable[[str], None]


def _save_atomic(path: Path, write: Callable[[IO[bytes]], None]) -> Path:
    ensure_writable_dir(path.parent)  # a link or a file there is refused, not written through
    return write_atomic(path, write, "wb")


def save_figure(fig: Any, path: Path) -> Path:
    return _save_atomic(path, lambda f: fig.savefig(f, format="png", dpi=DPI))


def write_gif(history: History, path: Path, max_frames: int = MAX_FRAMES) -> tuple[Path, np.ndarray]:
    """The animation, one frame per selected record; the last frame is held 2 s. Returns the last frame."""
    from PIL import Image

    drawer = HeatmapFigure(history)
    indices = frame_indices(len(history.steps), max_frames)
    images, frame = [], None
    for i in indices:  # frames are palette images as they come: a fraction of the RGB memory
        frame = drawer.render(int(i))  # fast octree: a few flat colours and their anti-aliased edges, as median
        # cut renders them, in a fraction of its time
        images.append(Image.fromarray(frame).quantize(256, method=Image.Quantize.FASTOCTREE, dither=Image.Dither.NONE))
    each = int(min(250, max(40, 1000 * GIF_SECONDS / len(images))) // 10 * 10)
    durations = [each] * (len(images) - 1) + [2000]
    _save_atomic(path, lambda f: images[0].save(f, format="GIF", save_all=True, append_images=images[1:],
                                                duration=durations, loop=0, disposal=1))
    return path, frame


def stderr_note(message: str) -> None:
    print(message, file=sys.stderr)


def read_architecture(run_dir: Path, note: Note) -> dict | None:
    path = run_dir / ARCHITECTURE
    if not path.is_file():
        return None
    try:
        record = reading.read_json(path)
        if not isinstance(record, dict) or not isinstance(record.get("architecture"), dict):
            raise ValueError("no 'architecture' mapping")
        return record
    except (OSError, ValueError) as e:
        note(f"{path}: unreadable ({e}); the architecture figure uses the last logged probabilities")
        return None


def plot_run(run_dir: str | Path, *, max_frames: int = MAX_FRAMES, tensorboard: bool = True,
             note: Note = stderr_note) -> list[Path]:
    """Draw ``run_dir``'s pictures into it, the final heat map into its ``tensorboard``; returns the images' paths."""
    run = Path(run_dir).expanduser()
    if not run.is_dir():
        raise HistoryError(f"no run directory {run}")
    if tensorboard:
        check_not_link(run / "tensorboard")  # refused before any figure is drawn, not after
    history = load_history(run)
    record = read_architecture(run, note)
    gif, last = write_gif(history, run / "probabilities.gif", max_frames)
    lines = save_figure(lines_figure(history), run / "probabilities.png")
    arch = save_figure(architecture_figure(history, record), run / "architecture.png")
    if tensorboard:
        log_tensorboard(run / "tensorboard", last, int(history.steps[-1]), note)
    return [gif, lines, arch]


# TensorBoard's Scalars tab sorts cards by name; its Custom Scalars tab shows these first, in this order: what a user
# of a search looks at first (the loss, both perplexities, the temperature, the cost), then the rest
FIRST_SCALARS = {"the search": {
    "train loss": ["Multiline", ["train/loss"]],
    "val ppl: exported architecture (supernet weights) and supernet":
        ["Multiline", ["val/ppl_exported", "val/ppl_supernet"]],
    "temperature tau": ["Multiline", ["search/tau"]],
    "expected cost ratio (to Transformer-XL's) and the budget's multiplier":
        ["Multiline", ["search/expected_cost_ratio", "search/lambda"]]}}


def log_tensorboard(log_dir: Path, image: np.ndarray, step: int, note: Note = stderr_note) -> None:
    """The final heat map as an image (HWC uint8) at ``step`` and :data:`FIRST_SCALARS`, in one events file,
    ``<log_dir>/<TB_FILE>``, which each call replaces: plotting a run again never adds a second copy of the image."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:  # tensorboard is a dependency; a broken install should not lose the plots
        note(f"TensorBoard image skipped ({e})")
        return
    ensure_writable_dir(log_dir)
    with tempfile.TemporaryDirectory(dir=log_dir.parent, prefix=".tensorboard-") as tmp:  # same file system
        writer = SummaryWriter(log_dir=tmp)
        try:
            writer.add_image(TB_TAG, image, global_step=step, dataformats="HWC")
            writer.add_custom_scalars(FIRST_SCALARS)
        finally:
            writer.close()
        (written,) = Path(tmp).glob("events.out.tfevents.*")
        os.chmod(written, 0o644)
        os.replace(written, log_dir / TB_FILE)


# --- static figures -------------------------------------------------------------------------------

def figure(width: float, height: float, **kwargs: Any) -> Any:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=DPI, **kwargs)
    FigureCanvasAgg(fig)
    return fig


def split_part(fraction: float) -> str:
    """What part of the validation split a perplexity read, as its legend says it."""
    return "whole validation split" if fraction >= 1 else f"first 1/{round(1 / fraction)} of the validation split"


def perplexity_series(history: History) -> list[tuple[np.ndarray, np.ndarray, str, str, str, float]]:
    """(steps, values, label, style, colour, marker size) per whose perplexity and per part of the split read: the
    mid-search evaluations read the first part, the final one all of it, not on one scale, so never one line."""
    out = []
    for values, whose, line, marker, colour in ((history.val_ppl, EXPORTED_PPL_LABEL, "-", "o", "#2ca02c"),
                                                (history.supernet_val_ppl, SUPERNET_PPL_LABEL, "--", "s", "#9467bd")):
        for fraction in sorted(set(history.val_fraction.tolist())):
            part = history.val_fraction == fraction
            whole = fraction >= 1
            out.append((history.val_steps[part], values[part], f"{whose}, {split_part(fraction)}",
                        marker if whole else marker + line, colour, 7.0 if whole else 3.0))
    return out


def lines_figure(history: History) -> Any:
    """Each block's probabilities over steps (one panel per block), tau and validation perplexity on top."""
    n = len(history.blocks)
    cols = 1 if n <= 3 else 2 if n <= 8 else 3
    rows = math.ceil(n / cols)
    # never narrower than the title and the perplexities' legend, whose lines say whose and which part of the split
    fig = figure(max(4.2 * cols + 1.0, 6.8), 2.0 * rows + 2.2, layout="constrained")
    grid = fig.add_gridspec(rows + 1, cols, height_ratios=[1.1] + [1.0] * rows)
    top = fig.add_subplot(grid[0, :])
    if np.isfinite(history.tau).any():  # NaN: the search read no temperature (its forward drew no sample)
        top.plot(history.steps, history.tau, color="#444444", label="temperature \u03c4")
        top.set_ylabel("\u03c4")
    else:
        top.set_yticks([])
    series = [s for s in perplexity_series(history) if np.isfinite(s[1]).any()]
    if series:
        twin = top.twinx()
        for steps, values, label, style, colour, size in series:
            known = np.isfinite(values)
            twin.plot(steps[known], values[known], style, color=colour, markersize=size, label=label)
        twin.set_ylabel("validation perplexity")
        # above the panel, not in it: wherever the lines start or end inside, a legend there would hide them
        handles = [*top.get_legend_handles_labels()[0], *twin.get_legend_handles_labels()[0]]
        twin.legend(handles=handles, loc="lower left", bbox_to_anchor=(0.0, 1.0), ncols=1, fontsize=8,
                    frameon=False, borderaxespad=0.2)
    elif np.isfinite(history.tau).any():
        top.set_title("temperature", fontsize=10)
    first = None
    for i, block in enumerate(history.blocks):
        ax = fig.add_subplot(grid[1 + i // cols, i % cols], sharex=top, sharey=first)
        first = first or ax
        for j, kind in enumerate(history.kinds):
            ax.plot(history.steps, history.probs[:, i, j], color=kind_colour(kind), linewidth=1.8, label=kind)
        best = int(heatmap_data(history, -1)[1][i])
        label, _ = margin_text(float(block_margins(history.probs[-1])[i]))
        if best < 0:
            ax.set_title(f"{block_name(block)}: tied", fontsize=10)
        else:
            kind = history.kinds[best]
            ax.set_title(f"{block_name(block)}: {kind} {history.probs[-1, i, best]:.2f} (margin {label})",
                         fontsize=10, color=kind_colour(kind))
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
        if i // cols == rows - 1 or i + cols >= n:
            ax.set_xlabel("step")
        if i % cols == 0:
            ax.set_ylabel("probability")
    handles, labels = first.get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncols=len(labels), frameon=False)
    fig.suptitle("The supernet's block-kind probabilities during the search", fontweight="bold")
    return fig


def architecture_figure(history: History, record: Mapping[str, Any] | None = None) -> Any:
    """The exported architecture (else the last argmax) as a column of blocks, input at the top; apart from it, the
    supernet's probabilities and, where it preferred another kind than the export, that kind."""
    from matplotlib.patches import FancyBboxPatch, Patch

    kinds = history.kinds
    final = {b: dict(zip(kinds, history.probs[-1, i])) for i, b in enumerate(history.blocks)}
    arch = {b: max(final[b], key=final[b].get) for b in history.blocks}
    if record:
        arch = dict(record.get("architecture") or arch)
        final.update({b: dict(p) for b, p in (record.get("probabilities") or {}).items() if isinstance(p, dict)})
    blocks = sorted(arch, key=block_key)
    search = (record or {}).get("search") or {}
    legend_kinds = list(dict.fromkeys([*kinds, *arch.values()]))
    legend_rows = math.ceil(len(legend_kinds) / 4)  # 4 kinds a row; 7 kinds take two rows under the softmax
    bottom = len(blocks) + 2.65 + 0.55 * legend_rows
    fig = figure(7.4, 0.6 * (bottom + 2.0))
    ax = fig.add_axes([0, 0, 1, 1])
    ax.set_xlim(0, 10)
    ax.set_ylim(-bottom, 2.0)
    ax.set_axis_off()

    def box(y: float, text: str, face: str, edge: str = "none", colour: str = "white") -> None:
        ax.add_patch(FancyBboxPatch((0.6, y - 0.36), 4.2, 0.72, boxstyle="round,pad=0.02,rounding_size=0.12",
                                    facecolor=face, edgecolor=edge, linewidth=1.2))
        ax.text(2.7, y, text, ha="center", va="center", color=colour, fontsize=11, fontweight="bold")

    box(-1, "token embedding", "white", "#666666", "#333333")
    for i, block in enumerate(blocks):
        y, kind = -(i + 2), arch[block]
        steps = history.act_steps.get(block) if kind == "ut" else None  # how long its ut block pondered
        box(y, f"{block_name(block)}: {kind}" + (f" \u00b7 {steps:.1f} steps" if steps else ""), kind_colour(kind))
        probs = final.get(block) or {}
        left = 5.2
        for k in [k for k in KIND_ORDER if k in probs] + sorted(set(probs) - set(KIND_ORDER)):
            width = 3.0 * float(probs[k])
            ax.add_patch(FancyBboxPatch((left, y - 0.2), width, 0.4, boxstyle="square,pad=0",
                                        facecolor=kind_colour(k), edgecolor="none"))
            left += width
        top = max(probs, key=probs.get) if probs else kind
        if top != kind:  # the supernet preferred another kind here: said, in that kind's colour
            ax.text(8.3, y, f"preferred {top}\n{float(probs[top]):.2f}", va="center", fontsize=8.5,
                    color=kind_colour(top), fontstyle="italic")
        elif kind in probs:
            ax.text(8.3, y, f"{float(probs[kind]):.2f}", va="center", fontsize=10)
    softmax = "adaptive softmax" if ((record or {}).get("model") or {}).get("cutoffs") else "softmax"
    box(-(len(blocks) + 2), softmax, "white", "#666666", "#333333")
    for i in range(len(blocks) + 1):
        ax.annotate("", xy=(2.7, -(i + 1.62)), xytext=(2.7, -(i + 1.38)),
                    arrowprops={"arrowstyle": "-|>", "color": "#666666"})
    counts = ", ".join(f"{sum(v == k for v in arch.values())} {k}" for k in dict.fromkeys(arch.values()))
    title = f"{'Exported architecture' if record else 'Architecture so far'}: {len(blocks)} blocks ({counts})"
    ax.text(5, 1.55, title, ha="center", fontsize=min(13.0, 13.0 * 62 / len(title)), fontweight="bold")  # fits 7.4 in
    exported, supernet = perplexities(search)
    at = ""
    if not record and history.val_steps.size:  # a search still running: its last evaluation so far
        exported, supernet = (float(v[-1]) if np.isfinite(v[-1]) else None
                              for v in (history.val_ppl, history.supernet_val_ppl))
        at = f" at step {int(history.val_steps[-1]):,}"
    latency = search.get("latency") if isinstance(search.get("latency"), dict) else {}
    ratio, device = latency.get("ratio"), latency.get("device")
    target = TARGET_LABELS.get(latency.get("target"), "train step")  # records before targets priced train steps
    on = f" on {device}" if isinstance(device, str) else ""  # the device whose costs priced it, maybe not this one
    facts = [f"{search['steps']:,} steps" if isinstance(search.get("steps"), int) else "",
             f"\u03c4 final {search['tau_final']:.3g}" if isinstance(search.get("tau_final"), (int, float)) else "",
             f"predicted {target} {ratio:.2f} \u00d7 Transformer-XL's{on}" if isinstance(ratio, (int, float))
             else "",
             f"cost {search['architecture_cost']:.4g} {search.get('cost_unit', '')}".rstrip()
             if isinstance(search.get("architecture_cost"), (int, float)) else ""]
    facts = [f for f in facts if f] or ([] if record else ["from the last logged probabilities (no architecture.json)"])
    lines = [" \u00b7 ".join(facts),
             f"{EXPORTED_PPL_LABEL}{at}: {exported:.2f}" if exported else
             "val ppl of the exported architecture: not recorded (an older search)" if supernet else "",
             f"supernet's val ppl{at}: {supernet:.2f} (candidates mixed by softmax(\u03b1))" if supernet else ""]
    for y, line in zip((1.12, 0.72, 0.37), [line for line in lines if line]):
        ax.text(5, y, line, ha="center", fontsize=10 if y > 1 else 9, color="#333333")
    preferred = "".join(max(final[b], key=final[b].get)[0].upper() for b in blocks if final.get(b))
    exported_layout = "".join(arch[b][0].upper() for b in blocks)
    ax.text(6.7, -0.95, "supernet's probabilities (softmax \u03b1)", ha="center", fontsize=9, color="#555555")
    if record and preferred and preferred != exported_layout:
        ax.text(6.7, -0.62, f"the supernet preferred {preferred}; exported {exported_layout}", ha="center",
                fontsize=9, color="#b22222")
    ax.legend(handles=[Patch(color=kind_colour(k), label=k) for k in legend_kinds],
              loc="lower center", ncols=min(4, len(legend_kinds)), frameon=False, bbox_to_anchor=(0.5, 0.0))
    return fig
