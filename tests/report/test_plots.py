"""parnas plot: pictures of a search from synthetic run directories (the history.jsonl contract)."""

import json
import math
import shutil
import sqlite3

import numpy as np
import pytest
from PIL import Image

from parnas.cli import main
from parnas.report import heatmap, pareto, plots
from parnas.report.experiments import EXPORTED_PPL_LABEL, SUPERNET_PPL_LABEL, experiment_trials
from parnas.report.history import KIND_COLOURS, History, load_history

KINDS = ("attention", "dense", "identity")


STEP_MS = {"attention": 10.0, "dense": 6.0, "identity": 0.5}  # a latency table: 4 ms + each block's


ON_CPU = pareto.LATENCY_LABEL.replace("train step", "train step on cpu")  # the records' latency device


def write_run(run, *, steps=60, every=2, n_blocks=4, kinds=KINDS, seed=0, val_ppl=42.0, cost=2.5, arch=True,
              winners=None, latency=True, legacy=False):
    """A search whose blocks settle on ``winners`` (default: attention early, dense late), logged every
    ``every`` steps and evaluated every 20; ``architecture.json`` at the end unless ``arch`` is false.

    ``legacy``: the records of a search from before ``supernet_val_ppl`` (``val_ppl`` is the supernet's)."""
    winners = winners or [kinds[0] if b < n_blocks // 2 else kinds[1] for b in range(n_blocks)]
    run.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    lines, probs = [], {}
    for step in range(0, steps + 1, every):
        frac = step / steps
        probs = {}
        for b in range(n_blocks):
            logits = rng.normal(0, 0.1, len(kinds))
            logits[kinds.index(winners[b])] += 5 * frac
            p = np.exp(logits) / np.exp(logits).sum()
            probs[f"block_{b}"] = {k: float(v) for k, v in zip(kinds, p)}
        record = {"step": step, "tau": 0.1 ** frac, "probabilities": probs}
        if step % 20 == 0:
            supernet = 300 * math.exp(-3 * frac) + 40
            record["val_ppl"] = supernet
            if not legacy:
                record |= {"val_ppl": supernet * 1.5, "supernet_val_ppl": supernet,
                           "architecture": "".join(max(p, key=p.get)[0].upper() for p in probs.values())}
                if step < steps:  # a mid-search evaluation reads the first quarter of the split, the last all of it
                    record["valid_fraction"] = 0.25
        lines.append(json.dumps(record))
    (run / "history.jsonl").write_text("\n".join(lines) + "\n")
    if arch:
        chosen = {b: max(p, key=p.get) for b, p in probs.items()}
        search = {"val_ppl": val_ppl, "steps": steps, "tau_final": 0.1, "cost_unit": "ms/step",
                  "block_costs": {"attention": 1.0, "dense": 0.4, "identity": 0.0}}
        if not legacy:
            search |= {"supernet_val_ppl": val_ppl - 5, "discretisation_gap": 5.0}
        if cost is not None:
            search["architecture_cost"] = cost
        if latency and not legacy:
            ms = 4.0 + sum(STEP_MS[k] for k in chosen.values())
            txl = 4.0 + sum(STEP_MS[("attention", "dense")[i % 2]] for i in range(n_blocks))
            search["latency"] = {"unit": "ms", "device": "cpu", "train_step_ms": ms, "inference_step_ms": ms / 3,
                                 "transformer_xl_ms": txl, "ratio": ms / txl, "budget": None, "within_budget": None}
        (run / "architecture.json").write_text(json.dumps({
            "format": "parnas.architecture", "version": 1, "architecture": chosen, "probabilities": probs,
            "model": {"n_blocks": n_blocks, "d_model": 32, "cutoffs": [100, 400], "vocab_size": 1000},
            "tokenizer": {"kind": "sentencepiece"}, "search": search}))
    return run


def first_line(path):
    return json.loads(path.read_text().splitlines()[0])


def test_history_arrays_come_from_the_file(tmp_path):
    run = write_run(tmp_path / "run")
    history = load_history(run)
    assert history.kinds == KINDS and history.blocks == ("block_0", "block_1", "block_2", "block_3")
    assert history.probs.shape == (31, 4, 3) and list(history.steps[:3]) == [0, 2, 4]
    np.testing.assert_allclose(history.probs.sum(axis=2), 1.0, atol=1e-9)
    assert list(history.val_steps) == [0, 20, 40, 60]
    assert history.val_ppl[0] == pytest.approx(510.0) and history.supernet_val_ppl[0] == pytest.approx(340.0)
    assert history.architectures[-1] == "AADD"
    probs, best = heatmap.heatmap_data(history, 0)
    assert probs[2, 1] == first_line(run / "history.jsonl")["probabilities"]["block_2"]["dense"]
    last = json.loads((run / "history.jsonl").read_text().splitlines()[-1])["probabilities"]
    probs, best = heatmap.heatmap_data(history, -1)
    assert [KINDS[j] for j in best] == [max(last[f"block_{i}"], key=last[f"block_{i}"].get) for i in range(4)]
    assert [KINDS[j] for j in best] == ["attention", "attention", "dense", "dense"]


def test_old_history_val_ppl_is_the_supernets(tmp_path):
    history = load_history(write_run(tmp_path / "run", legacy=True))
    assert np.isnan(history.val_ppl).all() and history.supernet_val_ppl[0] == pytest.approx(340.0)


def test_the_probabilities_figure_says_which_part_of_the_split_each_perplexity_read(tmp_path):
    """The mid-search evaluations read the first quarter of the validation split, the final one all of it: each
    plotted perplexity is in a series whose legend says which, and no line joins the two."""
    history = load_history(write_run(tmp_path / "run"))
    assert list(history.val_fraction) == [0.25, 0.25, 0.25, 1.0]
    twin = plots.lines_figure(history).axes[1]  # the perplexities' axis, over the temperature's
    plotted = {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in twin.get_lines()}
    quarter, whole = "first 1/4 of the validation split", "whole validation split"
    for whose, values in ((EXPORTED_PPL_LABEL, history.val_ppl), (SUPERNET_PPL_LABEL, history.supernet_val_ppl)):
        assert plotted[f"{whose}, {quarter}"] == ([0, 20, 40], list(values[:3]))
        assert plotted[f"{whose}, {whole}"] == ([60], [values[3]])
    assert len(plotted) == 4 and [t.get_text() for t in twin.get_legend().get_texts()][1:] == list(plotted)
    old = tmp_path / "old"  # a history without valid_fraction (every evaluation read the whole split): one series
    old.mkdir()
    (old / "history.jsonl").write_text("".join(json.dumps({k: v for k, v in json.loads(line).items()
                                                           if k != "valid_fraction"}) + "\n"
                                               for line in (tmp_path / "run" / "history.jsonl").open()))
    labels = [line.get_label() for line in plots.lines_figure(load_history(old)).axes[1].get_lines()]
    assert labels == [f"{EXPORTED_PPL_LABEL}, {whole}", f"{SUPERNET_PPL_LABEL}, {whole}"]


def test_heatmap_cells_take_their_kind_colour_by_probability():
    colours = heatmap.cell_colours(np.array([[1.0, 0.0, 0.5]]), KINDS)
    np.testing.assert_allclose(colours[0, 1], 1.0)  # probability 0: white
    attention = np.array([int(KIND_COLOURS["attention"][i:i + 2], 16) / 255 for i in (1, 3, 5)])
    np.testing.assert_allclose(colours[0, 0], attention)  # probability 1: the kind's colour
    assert np.all(colours[0, 2] < 1.0) and np.all(colours[0, 2] > 0.5)


def test_rendered_frame_shows_the_history(tmp_path):
    history = load_history(write_run(tmp_path / "run"))
    drawer = heatmap.HeatmapFigure(history)
    frame = drawer.render(-1)
    assert frame.shape == (*reversed(heatmap.frame_size(4)), 3) and frame.dtype == np.uint8
    assert [[t.get_text() for t in row] for row in drawer.texts] == [
        [f"{p:.2f}" for p in history.probs[-1, i]] for i in range(4)]  # every probability, in its cell
    top2 = np.sort(history.probs[-1], axis=1)[:, -2:]
    assert [t.get_text() for t in drawer.margins] == [f"{b - a:.2f}" for a, b in top2]
    assert drawer.bar_text.get_text() == "step 60 / 60, tau 0.100"
    drawer.update(15)
    assert drawer.bar_text.get_text() == f"step 30 / 60, tau {history.tau[15]:.3f}"
    # block 0's attention cell (top left of the map) is attention-blue in the last frame
    pixel = frame[72 + 52 // 2, 150 + 4].astype(float) / 255
    assert np.allclose(pixel, heatmap.cell_colours(history.probs[-1], KINDS)[0, 0], atol=0.03)


def outline_pixels(frame, block, kind):
    """Dark pixels on the left edge of the outline a leading kind's cell gets (text stays in the middle)."""
    x = 150 + kind * 130 + round(0.08 * 130)
    column = frame[72 + block * 52 + 15:72 + block * 52 + 37, x - 1:x + 2].astype(int)
    return int((column.sum(axis=2) < 3 * 80).sum())


@pytest.mark.slow
def test_gif_frame_0_at_exact_ties_shows_no_winner(tmp_path):
    run = write_run(tmp_path / "run", steps=20, every=2)
    lines = (run / "history.jsonl").read_text().splitlines()
    first = json.loads(lines[0])
    first["probabilities"] = {b: {k: 1 / 3 for k in KINDS} for b in first["probabilities"]}  # uniform logits
    lines[0] = json.dumps(first)
    (run / "history.jsonl").write_text("\n".join(lines) + "\n")
    plots.plot_run(run, tensorboard=False)
    with Image.open(run / "probabilities.gif") as gif:
        start = np.asarray(gif.convert("RGB"))
        gif.seek(gif.n_frames - 1)
        end = np.asarray(gif.convert("RGB"))
    assert all(outline_pixels(start, b, k) == 0 for b in range(4) for k in range(3))  # no cell singled out
    assert outline_pixels(end, 0, 0) > 10 and outline_pixels(end, 0, 1) == 0  # block 0 settled on attention
    history = load_history(run)
    assert list(heatmap.heatmap_data(history, 0)[1]) == [-1] * 4
    drawer = heatmap.HeatmapFigure(history)
    drawer.update(0)
    assert [t.get_text() for t in drawer.margins] == ["tie"] * 4
    assert {t.get_text() for row in drawer.texts for t in row} == {"0.33"}
    assert {t.get_fontweight() for row in drawer.texts for t in row} == {"normal"}


def test_undecided_block_is_marked(tmp_path):
    history = load_history(write_run(tmp_path / "run"))
    probs = np.array([[0.45, 0.40, 0.15], [0.8, 0.1, 0.1], [1 / 3, 1 / 3, 1 / 3], [0.5, 0.5, 0.0]])
    assert list(heatmap.block_margins(probs).round(6)) == [0.05, 0.7, 0.0, 0.0]
    assert list(heatmap.heatmap_data(History(**{**history.__dict__, "probs": probs[None]}), 0)[1]) == [0, 0, -1, -1]
    assert heatmap.margin_text(0.05) == ("0.05 undecided", "#b22222") and heatmap.margin_text(0.7)[0] == "0.70"


@pytest.mark.slow
def test_plot_run_writes_valid_images(tmp_path):
    run = write_run(tmp_path / "run", steps=120, every=2)  # 61 records
    paths = plots.plot_run(run, max_frames=25)
    assert [p.name for p in paths] == ["probabilities.gif", "probabilities.png", "architecture.png"]
    with Image.open(run / "probabilities.gif") as gif:
        assert gif.format == "GIF" and gif.n_frames == 25 and gif.size == heatmap.frame_size(4)
        gif.seek(gif.n_frames - 1)
        gif.convert("RGB").load()
    for name in ("probabilities.png", "architecture.png"):
        with Image.open(run / name) as png:
            png.load()
            assert png.format == "PNG" and png.size[0] > 300 and png.size[1] > 300
    assert not list(run.glob(".*.tmp"))  # temp files renamed, none left
    (image,) = tensorboard_images(run)
    assert image.step == 120 and (image.width, image.height) == heatmap.frame_size(4)


def tensorboard_images(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tensorboard"), size_guidance={"images": 0})
    events.Reload()
    return events.Images(plots.TB_TAG)


@pytest.mark.slow
def test_plotting_twice_keeps_one_tensorboard_image(tmp_path, capsys):
    run = write_run(tmp_path / "run", steps=10)
    for _ in range(2):
        assert main(["plot", str(run), "--max-frames", "2"]) == 0
    assert len(list((run / "tensorboard").glob("*tfevents*"))) == 1
    assert [image.step for image in tensorboard_images(run)] == [10]
    assert sorted(p.name for p in run.iterdir() if p.name.startswith(".")) == []  # no temp folder left


@pytest.mark.slow
def test_short_history_and_subset_of_kinds(tmp_path):
    run = write_run(tmp_path / "run", steps=8, every=2, n_blocks=3, kinds=("attention", "dense"), arch=False)
    plots.plot_run(run, tensorboard=False)
    with Image.open(run / "probabilities.gif") as gif:
        assert gif.n_frames == 5 and gif.size == heatmap.frame_size(3, 2)
    assert load_history(run).kinds == ("attention", "dense")
    assert (run / "architecture.png").is_file()  # from the last probabilities when there is no architecture.json


def test_frame_indices_are_even_and_include_both_ends():
    for n, m in ((61, 25), (100, 100), (7, 100), (1000, 99), (1, 5)):
        idx = heatmap.frame_indices(n, m)
        assert len(idx) == min(n, m) and idx[0] == (0 if n > 1 else n - 1) and idx[-1] == n - 1
        assert np.all(np.diff(idx) > 0)


def test_partial_last_line_and_repeated_steps(tmp_path):
    run = write_run(tmp_path / "run", steps=10, every=2, arch=False)
    path = run / "history.jsonl"
    lines = path.read_text().splitlines()
    repeat = json.loads(lines[-1])
    repeat.pop("val_ppl", None)
    path.write_text("\n".join([*lines, json.dumps(repeat)]) + "\n" + '{"step": 12, "tau": 0.1, "probab')
    history = load_history(run)
    assert list(history.steps) == [0, 2, 4, 6, 8, 10] and 10 not in history.val_steps
    assert 0 in history.val_steps


def test_pareto_front():
    points = [(1.0, 50.0), (2.0, 45.0), (2.5, 47.0), (3.0, 40.0), (0.5, 60.0), (3.0, 41.0)]
    assert pareto.pareto_front(points) == [4, 0, 1, 3]


def make_experiment(root, exp="abc123"):
    trials = root / exp / "environments" / "local-env" / "trials"  # NNI 3.0's local training service
    write_run(trials / "t1", seed=1, val_ppl=45.0, winners=["attention", "identity", "dense", "dense"])  # 0.74
    write_run(trials / "t2", seed=2, val_ppl=41.0)  # AADD: 1.0 x Transformer-XL's step
    write_run(root / exp / "trials" / "t3", seed=3, val_ppl=48.0, winners=["attention", "dense"] * 2)  # dominated
    return exp


@pytest.mark.slow
def test_plot_experiment(tmp_path, capsys):
    exp = make_experiment(tmp_path)
    assert main(["plot", "--experiment", exp, "--experiments-dir", str(tmp_path), "--max-frames", "5",
                 "--no-tensorboard"]) == 0
    captured = capsys.readouterr()
    out = captured.out.split()
    assert len(out) == 10 and out[-1].endswith("pareto.png") and not captured.err
    with Image.open(tmp_path / exp / "pareto.png") as png:
        png.load()
    points, xlabel = pareto.experiment_points(experiment_trials(exp, tmp_path))
    assert xlabel == ON_CPU and [p.trial for p in points] == ["t1", "t2", "t3"]
    assert [p.val_ppl for p in points] == [45.0, 41.0, 48.0]  # the exported architecture's, not the supernet's
    assert [points[i].trial for i in pareto.pareto_front([(p.cost, p.val_ppl) for p in points])] == ["t1", "t2"]


@pytest.mark.slow
def test_plot_of_a_running_experiment(tmp_path, capsys):
    exp = "abc123"
    trials = tmp_path / exp / "environments" / "local-env" / "trials"
    write_run(trials / "t1", seed=1, val_ppl=45.0, winners=["attention", "identity", "dense", "dense"])
    write_run(trials / "t4", seed=4, steps=40, arch=False, winners=["attention", "identity", "dense", "dense"])
    write_run(trials / "t5", seed=5, steps=20, arch=False, winners=["identity"] * 4)  # stopped by NNI (below)
    (trials / "t6").mkdir()  # just started: nothing logged
    db = tmp_path / exp / "db"
    db.mkdir()
    with sqlite3.connect(db / "nni.sqlite") as con:  # NNI's own record of trial statuses
        con.execute("create table TrialJobEvent (timestamp integer, trialJobId text, event text, data text, "
                    "logPath text, sequenceId integer, message text, environmentId text)")
        for trial, event in [("t4", "WAITING"), ("t5", "WAITING"), ("t4", "RUNNING"), ("t5", "RUNNING"),
                             ("t5", "USER_TO_CANCEL"), ("t5", "USER_CANCELED"), ("t6", "RUNNING")]:
            con.execute("insert into TrialJobEvent (trialJobId, event) values (?, ?)", (trial, event))
    trials_now = experiment_trials(exp, tmp_path)
    assert {t: trials_now[t].status for t in trials_now} == {"t1": "finished", "t4": "running", "t5": "stopped",
                                                             "t6": "running"}
    assert main(["plot", "--experiment", exp, "--experiments-dir", str(tmp_path), "--max-frames", "1",
                 "--no-tensorboard"]) == 0
    captured = capsys.readouterr()
    assert (trials / "t4" / "probabilities.gif").is_file() and (trials / "t5" / "architecture.png").is_file()
    assert captured.out.split()[-1].endswith("pareto.png") and "1 finished, 2 running, 1 stopped" in captured.err
    notes = []
    points, xlabel = pareto.experiment_points(experiment_trials(exp, tmp_path), note=notes.append)
    assert xlabel == ON_CPU and sorted((p.trial, p.status) for p in points) == [
        ("t1", "finished"), ("t4", "running")]  # in start order: t4's start is known, t1's is not
    t1, t4 = sorted(points, key=lambda p: p.trial)
    history = load_history(trials / "t4")
    assert (t4.step, t4.val_ppl, t4.layout) == (40, history.val_ppl[-1], "AIDD") and t4.cost == t1.cost
    assert len(notes) == 1 and "t5 (stopped)" in notes[0] and "IIII" in notes[0]  # no finished IIII to compare
    # no finished trial: the axis counts attention blocks, and the histories so far are drawn
    shutil.rmtree(trials / "t1")
    points, xlabel = pareto.experiment_points(experiment_trials(exp, tmp_path), note=notes.append)
    assert xlabel == "attention blocks" and sorted((p.trial, p.status, p.cost) for p in points) == [
        ("t4", "running", 1.0), ("t5", "stopped", 0.0)]
    assert main(["plot", "--experiment", exp, "--experiments-dir", str(tmp_path), "--max-frames", "1",
                 "--no-tensorboard"]) == 0
    assert capsys.readouterr().out.split()[-1].endswith("pareto.png")


def test_experiment_stopped_by_nnictl_has_no_running_trials(tmp_path):
    exp = make_experiment(tmp_path)
    write_run(tmp_path / exp / "trials" / "t4", arch=False)
    assert experiment_trials(exp, tmp_path)["t4"].status == "running"
    (tmp_path / ".experiment").write_text(json.dumps({exp: {"id": exp, "status": "STOPPED", "pid": 1}}))
    assert experiment_trials(exp, tmp_path)["t4"].status == "stopped"


@pytest.mark.slow
def test_old_records_are_left_out_of_the_pareto_plot(tmp_path):
    exp = make_experiment(tmp_path)
    write_run(tmp_path / exp / "trials" / "old", legacy=True, val_ppl=30.0)  # its 30.0 is the supernet's
    notes = []
    points, _ = pareto.experiment_points(experiment_trials(exp, tmp_path), note=notes.append)
    assert "old" not in [p.trial for p in points] and len(notes) == 1
    assert "only the supernet's val ppl (30.00)" in notes[0]
    plots.plot_run(tmp_path / exp / "trials" / "old", max_frames=1, tensorboard=False)  # its pictures still draw


def test_pareto_cost_fallbacks(tmp_path):
    trials = tmp_path / "e" / "trials"
    write_run(trials / "a", cost=None, latency=False)  # falls back to the sum of block_costs: 2 x 1.0 + 2 x 0.4
    write_run(trials / "b", cost=1.0)
    points, xlabel = pareto.experiment_points(experiment_trials("e", tmp_path), note=lambda m: None)
    assert xlabel == "cost of the exported architecture (ms/step)" and points[0].cost == pytest.approx(2.8)
    record = json.loads((trials / "a" / "architecture.json").read_text())
    del record["search"]["block_costs"]
    (trials / "a" / "architecture.json").write_text(json.dumps(record))
    notes = []
    points, xlabel = pareto.experiment_points(experiment_trials("e", tmp_path), note=notes.append)
    assert xlabel == "attention blocks" and [p.cost for p in points] == [2.0, 2.0] and notes


@pytest.mark.parametrize("setup, args, needle", [
    (lambda d: None, ["{d}/nothing"], "no run directory"),
    (lambda d: (d / "run").mkdir(), ["{d}/run"], "no history.jsonl"),
    (lambda d: ((d / "run").mkdir(), (d / "run" / "history.jsonl").write_text("")), ["{d}/run"], "empty"),
    (lambda d: ((d / "run").mkdir(), (d / "run" / "history.jsonl").write_text("{\"step\": 1}\n")), ["{d}/run"],
     "line 1"),
    (lambda d: None, ["--experiment", "nope", "--experiments-dir", "{d}"], "no NNI experiment 'nope'"),
    (lambda d: (d / "e" / "trials").mkdir(parents=True), ["--experiment", "e", "--experiments-dir", "{d}"],
     "no trial"),
    (lambda d: None, [], "run directory or --experiment"),
])
def test_bad_input_exits_2_with_one_line(tmp_path, capsys, setup, args, needle):
    setup(tmp_path)
    code = main(["plot", *[a.format(d=tmp_path) for a in args]])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert needle in err, err
    assert not list(tmp_path.rglob("*.gif")) and not list(tmp_path.rglob("*.tmp"))


def test_pictures_of_seven_kinds_keep_every_label_apart_and_inside(tmp_path):
    """With 5-7 candidates the architecture picture's title still fits and its legend stays clear of the
    blocks; the heat map gives each kind its own column header."""
    from matplotlib.patches import FancyBboxPatch

    seven = ("attention", "dense", "identity", "conv", "glu", "sqrelu", "compressive")
    winners = [seven[b % 7] for b in range(12)]
    history = load_history(write_run(tmp_path / "run", n_blocks=12, kinds=seven, winners=winners, arch=False))
    fig = plots.architecture_figure(history)
    renderer = fig.canvas.get_renderer()
    width = fig.bbox.width
    for text in fig.axes[0].texts:
        box = text.get_window_extent(renderer)
        assert 0 <= box.x0 and box.x1 <= width, text.get_text()
    legend = fig.axes[0].get_legend().get_window_extent(renderer)
    blocks = [p.get_window_extent(renderer) for p in fig.axes[0].patches if isinstance(p, FancyBboxPatch)]
    assert len(fig.axes[0].get_legend().get_texts()) == 7
    assert all(legend.y1 < b.y0 or legend.y0 > b.y1 or legend.x1 < b.x0 or legend.x0 > b.x1 for b in blocks)

    frame = heatmap.HeatmapFigure(history)
    fig = frame.fig
    renderer = fig.canvas.get_renderer()
    headers = sorted((t.get_window_extent(renderer) for t in frame.ax.texts if t.get_text() in seven),
                     key=lambda b: b.x0)
    assert len(headers) == 7 and all(a.x1 < b.x0 for a, b in zip(headers, headers[1:]))
