"""parnas plot: pictures of a search from synthetic run directories (the history.jsonl contract)."""

import json
import math

import numpy as np
import pytest
from PIL import Image

from parnas import pareto, plots
from parnas.cli import main

KINDS = ("attention", "dense", "identity")


def write_run(run, *, steps=60, every=2, n_blocks=4, kinds=KINDS, seed=0, val_ppl=42.0, cost=2.5, arch=True):
    """A search that learns attention early and dense late, logged every ``every`` steps."""
    run.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    lines, probs = [], {}
    for step in range(0, steps + 1, every):
        frac = step / steps
        probs = {}
        for b in range(n_blocks):
            logits = rng.normal(0, 0.1, len(kinds))
            logits[0 if b < n_blocks // 2 else 1] += 5 * frac
            p = np.exp(logits) / np.exp(logits).sum()
            probs[f"block_{b}"] = {k: float(v) for k, v in zip(kinds, p)}
        record = {"step": step, "tau": 0.1 ** frac, "probabilities": probs}
        if step % 20 == 0:
            record["val_ppl"] = 300 * math.exp(-3 * frac) + 40
        lines.append(json.dumps(record))
    (run / "history.jsonl").write_text("\n".join(lines) + "\n")
    if arch:
        chosen = {b: max(p, key=p.get) for b, p in probs.items()}
        search = {"val_ppl": val_ppl, "steps": steps, "tau_final": 0.1, "cost_unit": "ms/step",
                  "block_costs": {"attention": 1.0, "dense": 0.4, "identity": 0.0}}
        if cost is not None:
            search["architecture_cost"] = cost
        (run / "architecture.json").write_text(json.dumps({
            "format": "parnas.architecture", "version": 1, "architecture": chosen, "probabilities": probs,
            "model": {"n_blocks": n_blocks, "d_model": 32, "cutoffs": [100, 400], "vocab_size": 1000},
            "tokenizer": {"kind": "sentencepiece"}, "search": search}))
    return run


def first_line(path):
    return json.loads(path.read_text().splitlines()[0])


def test_history_arrays_come_from_the_file(tmp_path):
    run = write_run(tmp_path / "run")
    history = plots.load_history(run)
    assert history.kinds == KINDS and history.blocks == ("block_0", "block_1", "block_2", "block_3")
    assert history.probs.shape == (31, 4, 3) and list(history.steps[:3]) == [0, 2, 4]
    np.testing.assert_allclose(history.probs.sum(axis=2), 1.0, atol=1e-9)
    assert list(history.val_steps) == [0, 20, 40, 60] and history.val_ppl[0] == pytest.approx(340.0)
    probs, best = plots.heatmap_data(history, 0)
    assert probs[2, 1] == first_line(run / "history.jsonl")["probabilities"]["block_2"]["dense"]
    last = json.loads((run / "history.jsonl").read_text().splitlines()[-1])["probabilities"]
    probs, best = plots.heatmap_data(history, -1)
    assert [KINDS[j] for j in best] == [max(last[f"block_{i}"], key=last[f"block_{i}"].get) for i in range(4)]
    assert [KINDS[j] for j in best] == ["attention", "attention", "dense", "dense"]


def test_heatmap_cells_take_their_kind_colour_by_probability():
    colours = plots.cell_colours(np.array([[1.0, 0.0, 0.5]]), KINDS)
    np.testing.assert_allclose(colours[0, 1], 1.0)  # probability 0: white
    attention = np.array([int(plots.KIND_COLOURS["attention"][i:i + 2], 16) / 255 for i in (1, 3, 5)])
    np.testing.assert_allclose(colours[0, 0], attention)  # probability 1: the kind's colour
    assert np.all(colours[0, 2] < 1.0) and np.all(colours[0, 2] > 0.5)


def test_rendered_frame_shows_the_history(tmp_path):
    history = plots.load_history(write_run(tmp_path / "run"))
    frame = plots.render_heatmap(history, -1)
    assert frame.shape == (*reversed(plots.frame_size(4)), 3) and frame.dtype == np.uint8
    drawer = plots._HeatmapFigure(history)
    drawer.update(-1)
    shown = [t.get_text() for t in drawer.texts]
    assert shown == [f"{history.probs[-1, i].max():.2f}" for i in range(4)]
    assert drawer.step_text.get_text() == "step 60 of 60"
    # block 0's attention cell (top left quarter of the map) is attention-blue in the last frame
    w, h = plots.frame_size(4)
    pixel = frame[92 + 52 // 4, 150 + 20].astype(float) / 255
    assert np.allclose(pixel, plots.cell_colours(history.probs[-1], KINDS)[0, 0], atol=0.03)


def test_plot_run_writes_valid_images(tmp_path):
    run = write_run(tmp_path / "run", steps=120, every=2)  # 61 records
    paths = plots.plot_run(run, max_frames=25)
    assert [p.name for p in paths] == ["probabilities.gif", "probabilities.png", "architecture.png"]
    with Image.open(run / "probabilities.gif") as gif:
        assert gif.format == "GIF" and gif.n_frames == 25 and gif.size == plots.frame_size(4)
        gif.seek(gif.n_frames - 1)
        gif.convert("RGB").load()
    for name in ("probabilities.png", "architecture.png"):
        with Image.open(run / name) as png:
            png.load()
            assert png.format == "PNG" and png.size[0] > 300 and png.size[1] > 300
    assert not list(run.glob(".*.tmp"))  # temp files renamed, none left
    event_files = list((run / "tensorboard").glob("events.out.tfevents.*"))
    assert event_files
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    (image,) = events.Images(plots.TB_TAG)
    assert image.step == 120 and (image.width, image.height) == plots.frame_size(4)


def test_short_history_and_subset_of_kinds(tmp_path):
    run = write_run(tmp_path / "run", steps=8, every=2, n_blocks=3, kinds=("attention", "dense"), arch=False)
    plots.plot_run(run, tensorboard=False)
    with Image.open(run / "probabilities.gif") as gif:
        assert gif.n_frames == 5 and gif.size == plots.frame_size(3, 2)
    assert plots.load_history(run).kinds == ("attention", "dense")
    assert (run / "architecture.png").is_file()  # from the last probabilities when there is no architecture.json


def test_frame_indices_are_even_and_include_both_ends():
    for n, m in ((61, 25), (100, 100), (7, 100), (1000, 99), (1, 5)):
        idx = plots.frame_indices(n, m)
        assert len(idx) == min(n, m) and idx[0] == (0 if n > 1 else n - 1) and idx[-1] == n - 1
        assert np.all(np.diff(idx) > 0)


def test_partial_last_line_and_repeated_steps(tmp_path):
    run = write_run(tmp_path / "run", steps=10, every=2, arch=False)
    path = run / "history.jsonl"
    lines = path.read_text().splitlines()
    repeat = json.loads(lines[-1])
    repeat.pop("val_ppl", None)
    path.write_text("\n".join([*lines, json.dumps(repeat)]) + "\n" + '{"step": 12, "tau": 0.1, "probab')
    history = plots.load_history(run)
    assert list(history.steps) == [0, 2, 4, 6, 8, 10] and 10 not in history.val_steps
    assert 0 in history.val_steps


def test_pareto_front():
    points = [(1.0, 50.0), (2.0, 45.0), (2.5, 47.0), (3.0, 40.0), (0.5, 60.0), (3.0, 41.0)]
    assert pareto.pareto_front(points) == [4, 0, 1, 3]


def make_experiment(root, exp="abc123"):
    trials = root / exp / "trials"
    write_run(trials / "t1", seed=1, val_ppl=45.0, cost=2.8)
    write_run(trials / "t2", seed=2, val_ppl=41.0, cost=4.0)
    write_run(trials / "t3", seed=3, val_ppl=48.0, cost=3.5)  # dominated by t1
    return exp


def test_plot_experiment(tmp_path, capsys):
    exp = make_experiment(tmp_path)
    assert main(["plot", "--experiment", exp, "--experiments-dir", str(tmp_path), "--max-frames", "5",
                 "--no-tensorboard"]) == 0
    out = capsys.readouterr().out.split()
    assert len(out) == 10 and out[-1].endswith("pareto.png")
    with Image.open(tmp_path / exp / "pareto.png") as png:
        png.load()
    points, xlabel = pareto.experiment_points(plots_runs(tmp_path, exp))
    assert xlabel == "cost (ms/step)" and [p.trial for p in points] == ["t1", "t2", "t3"]
    assert [points[i].trial for i in pareto.pareto_front([(p.cost, p.val_ppl) for p in points])] == ["t1", "t2"]


def plots_runs(root, exp):
    from parnas.experiments import trial_run_dirs
    return trial_run_dirs(exp, root)


def test_pareto_cost_fallbacks(tmp_path):
    trials = tmp_path / "e" / "trials"
    write_run(trials / "a", cost=None)  # falls back to the sum of block_costs: 2 x 1.0 + 2 x 0.4
    write_run(trials / "b", cost=1.0)
    points, xlabel = pareto.experiment_points(plots_runs(tmp_path, "e"), note=lambda m: None)
    assert xlabel == "cost (ms/step)" and points[0].cost == pytest.approx(2.8)
    record = json.loads((trials / "a" / "architecture.json").read_text())
    del record["search"]["block_costs"]
    (trials / "a" / "architecture.json").write_text(json.dumps(record))
    notes = []
    points, xlabel = pareto.experiment_points(plots_runs(tmp_path, "e"), note=notes.append)
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
