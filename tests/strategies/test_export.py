"""parnas export: a table of what an experiment's trials found, how sure each block is, and what is unfinished."""

import json
import sqlite3

import pytest

from parnas.cli import main
from tests.report.test_plots import make_experiment, write_run

UNDECIDED = {"block_1": {"attention": 0.22, "dense": 0.33, "identity": 0.45},   # margin 0.12: decided
             "block_3": {"attention": 0.10, "dense": 0.46, "identity": 0.44}}   # margin 0.02: undecided


def export(capsys, root, *args):
    code = main(["export", "--experiment", "abc123", "--experiments-dir", str(root), *args])
    out, err = capsys.readouterr()
    return code, out, err


def with_probabilities(run, probabilities):
    record = json.loads((run / "architecture.json").read_text())
    record["probabilities"] |= probabilities
    (run / "architecture.json").write_text(json.dumps(record))


@pytest.fixture
def experiment(tmp_path):
    make_experiment(tmp_path)  # t1 AIDD 45.0, t2 AADD 41.0, t3 ADAD 48.0 (exported architectures' val ppl)
    trials = tmp_path / "abc123" / "environments" / "local-env" / "trials"
    with_probabilities(trials / "t1", UNDECIDED)
    write_run(trials / "t4", arch=False)  # still running
    return tmp_path


def test_table_ranks_by_the_exported_architectures_val_ppl(capsys, experiment):
    code, out, err = export(capsys, experiment)
    lines = out.splitlines()
    assert code == 0 and lines[0].split()[:4] == ["trial", "val", "ppl", "supernet"]
    rows = [line.split() for line in lines[1:4]]
    assert [r[0] for r in rows] == ["t2", "t1", "t3"] and [r[1] for r in rows] == ["41.00", "45.00", "48.00"]
    assert [r[2] for r in rows] == ["36.00", "40.00", "43.00"]  # the supernet's, beside it
    assert [r[3:5] for r in rows] == [["-", "-"]] * 3  # no final pick in these searches: nothing retrained
    assert [r[5] for r in rows] == ["AADD", "AIDD", "ADAD"] and rows[0][6] == "1.00" and rows[1][6] == "0.74"
    assert rows[1][7:11] == ["0.98", "0.12", "0.98", "0.02"] and rows[1][11] == "block_3"
    assert rows[0][-1] == "-" and lines[4] == ""
    assert "val ppl: validation perplexity of the exported architecture (supernet weights, not retrained)" in out
    assert "A = attention, D = dense, I = identity" in out and "t4" not in out


def test_undecided_blocks_warn_once_per_trial(capsys, experiment):
    trials = experiment / "abc123" / "environments" / "local-env" / "trials"
    with_probabilities(trials / "t2", {"block_0": {"attention": 1 / 3, "dense": 1 / 3, "identity": 1 / 3},
                                       "block_2": {"attention": 0.3, "dense": 0.35, "identity": 0.35}})
    code, out, err = export(capsys, experiment, "--json")
    lines = err.splitlines()
    assert code == 0 and len(lines) == 2, err
    assert lines[0].startswith("parnas export: warning: trial t2: undecided block_0 (margin 0.00), "
                               "block_2 (margin 0.00)")
    assert lines[1].startswith("parnas export: warning: trial t1: undecided block_3 (margin 0.02)")


def test_json_dump_and_out_folder(capsys, experiment, tmp_path):
    code, out, _ = export(capsys, experiment, "--json", "--out", str(tmp_path / "found"))
    rows = json.loads(out)
    assert code == 0 and [r["trial"] for r in rows] == ["t2", "t1", "t3"]
    t1 = rows[1]
    assert (t1["val_ppl"], t1["supernet_val_ppl"], t1["discretisation_gap"]) == (45.0, 40.0, 5.0)
    assert t1["architecture"] == "AIDD" and t1["latency_ratio"] == t1["latency"]["ratio"] == pytest.approx(26.5 / 36)
    assert t1["margins"]["block_1"] == pytest.approx(0.12) and t1["undecided"] == ["block_3"]
    assert json.loads((tmp_path / "found" / "summary.json").read_text()) == rows
    assert json.loads((tmp_path / "found" / "t1.json").read_text())["probabilities"]["block_3"] == UNDECIDED["block_3"]


def test_old_records_keep_their_supernet_val_ppl(capsys, experiment):
    write_run(experiment / "abc123" / "trials" / "old", legacy=True, val_ppl=30.0)  # 30.0: the supernet's
    code, out, err = export(capsys, experiment, "--json")
    old = json.loads(out)[-1]
    assert (old["trial"], old["val_ppl"], old["supernet_val_ppl"]) == ("old", None, 30.0)


def test_no_finished_trial_says_how_many_run(capsys, tmp_path):
    trials = tmp_path / "abc123" / "environments" / "local-env" / "trials"
    for trial in ("r1", "r2", "s1"):
        write_run(trials / trial, steps=10, arch=False)
    (tmp_path / "abc123" / "db").mkdir()
    with sqlite3.connect(tmp_path / "abc123" / "db" / "nni.sqlite") as con:  # NNI's record: s1 failed
        con.execute("create table TrialJobEvent (timestamp integer, trialJobId text, event text, data text, "
                    "logPath text, sequenceId integer, message text, environmentId text)")
        con.executemany("insert into TrialJobEvent (trialJobId, event) values (?, ?)",
                        [("r1", "RUNNING"), ("s1", "RUNNING"), ("s1", "FAILED")])
    code, out, err = export(capsys, tmp_path)
    assert code == 0 and not err and "[]" not in out
    assert out.startswith("no trial of experiment abc123 has finished yet") and "2 running, 1 stopped" in out
    code, out, err = export(capsys, tmp_path, "--json", "--out", str(tmp_path / "found"))
    assert json.loads(out) == [] and "2 running, 1 stopped" in err and not (tmp_path / "found").exists()


@pytest.mark.parametrize("args, needle", [
    (["--experiment", "nope"], "no NNI experiment 'nope'"),
    (["--experiment", "abc123", "--out", "{d}/a_file/found"], "a parent is a file"),
    (["--experiment", "abc123", "--out", "{d}/a_file"], "a_file: it is a file, not a folder"),
])
def test_bad_input_exits_2_with_one_line(capsys, experiment, args, needle):
    (experiment / "a_file").write_text("")
    code = main(["export", *[a.format(d=experiment) for a in args], "--experiments-dir", str(experiment)])
    out, err = capsys.readouterr()
    assert code == 2 and len(err.splitlines()) == 1 and needle in err and not out, err


@pytest.mark.parametrize("experiment_id", ["../../x", "abc123/..", "a b", ""])
def test_an_experiment_id_that_is_a_path_is_refused_before_any_folder_is_read(capsys, tmp_path, experiment_id):
    """The id names a folder under --experiments-dir, never one outside it."""
    make_experiment(tmp_path / "elsewhere")  # a real experiment, reachable only by climbing out of D
    root = tmp_path / "D" / "E"
    root.mkdir(parents=True)
    code = main(["export", "--experiment", experiment_id, "--experiments-dir", str(root)])
    out, err = capsys.readouterr()
    assert code == 2 and len(err.splitlines()) == 1 and "is not an NNI experiment id" in err and not out, err


def test_out_writes_no_file_through_a_link_planted_there(capsys, experiment, tmp_path):
    """A link at ``<out>/<trial>.json`` is replaced, never followed: its target keeps its bytes."""
    victim, found = tmp_path / "victim.txt", tmp_path / "found"
    victim.write_text("the user's own\n")
    found.mkdir()
    (found / "t1.json").symlink_to(victim)
    code, out, err = export(capsys, experiment, "--json", "--out", str(found))
    assert code == 0 and victim.read_text() == "the user's own\n"
    assert not (found / "t1.json").is_symlink() and json.loads((found / "t1.json").read_text())["architecture"]


def test_out_that_is_a_link_is_refused_in_one_line(capsys, experiment, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "found").symlink_to(elsewhere)
    code, out, err = export(capsys, experiment, "--out", str(tmp_path / "found"))
    assert code == 2 and len(err.splitlines()) == 1 and "symbolic link" in err and not list(elsewhere.iterdir()), err
