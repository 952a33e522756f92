"""Bad input that reaches past the settings: files too large or nested too deep to parse, an empty strategy
name, a data folder that does not exist, an NNI port that is taken. Each is exit status 2 and one line on
stderr, and nothing is written."""

import http.server
import json
import threading

import pytest
from test_bad_input import assert_refused, cli

from parnas import reading
from parnas.config import load_config
from parnas.errors import ParnasError

DEEP = "[" * 5 * 2**20  # 5 MB of "[": Python's parsers would recurse until RecursionError
NESTED = "[" * 10_000 + "]" * 10_000  # small, but nested far deeper than any parnas file


@pytest.mark.parametrize("text, needle", [(DEEP, "MiB, above the 4 MiB"), (NESTED, "more than 64 levels deep")])
def test_an_architecture_file_too_large_or_too_deep_is_one_line(capsys, tmp_path, text, needle):
    arch = tmp_path / "arch.json"
    arch.write_text(text)
    code, _, err = cli(capsys, "retrain", "--arch", arch, "--config", "tiny", "--set", f"train.out_dir={tmp_path}/run")
    assert_refused(code, err, str(arch), needle)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("text", ["model:\n  blocks: " + NESTED + "\n",
                                  "model:\n" + "".join(" " * i + f"k{i}:\n" for i in range(2, 400))])
def test_a_config_nested_too_deep_is_one_line(capsys, tmp_path, text):
    """Brackets or indentation: YAML nests both ways."""
    config = tmp_path / "c.yaml"
    config.write_text(text)
    code, _, err = cli(capsys, "train", "--config", config, "--set", f"train.out_dir={tmp_path}/run")
    assert_refused(code, err, str(config), "more than 64 levels deep")
    assert not (tmp_path / "run").exists()


def test_a_set_value_nested_too_deep_is_one_line(capsys, tmp_path):
    code, _, err = cli(capsys, "train", "--config", "tiny", "--set", f"model.cutoffs={NESTED}",
                       "--set", f"train.out_dir={tmp_path}/run")
    assert_refused(code, err, "--set model.cutoffs", "more than 64 levels deep")


@pytest.mark.slow
def test_a_latency_table_too_deep_is_one_line(capsys, tmp_path):
    table = tmp_path / "table.json"
    table.write_text('{"format": "parnas.latency", "version": 2, "key": ' + NESTED + "}")
    code, _, err = cli(capsys, "search", "--config", "tiny", "--set", f"search.latency_table={table}",
                       "--set", f"search.out_dir={tmp_path}/run")
    assert_refused(code, err, "search.latency_table", "more than 64 levels deep")
    assert not (tmp_path / "run").exists()


def _special(path, kind):
    import os
    import socket

    if kind == "FIFO":
        os.mkfifo(path)
    else:
        socket.socket(socket.AF_UNIX).bind(str(path))  # left bound: the test's folder goes with it
    return path


@pytest.mark.parametrize("kind", ["FIFO", "socket"])
@pytest.mark.parametrize("given", ["config", "architecture", "latency table"])
def test_a_special_file_given_as_input_is_refused_by_what_it_is_before_the_run_folder_is_taken(capsys, tmp_path,
                                                                                              given, kind):
    """A FIFO opened for reading blocks until a writer comes: refused by stat, never opened, before any lock."""
    path = _special(tmp_path / "f.json", kind)
    out = f"train.out_dir={tmp_path}/run"
    args = {"config": ["train", "--config", path, "--set", out],
            "architecture": ["retrain", "--arch", path, "--config", "tiny", "--set", out],
            "latency table": ["search", "--config", "tiny", "--set", f"search.latency_table={path}",
                              "--set", f"search.out_dir={tmp_path}/run", "--set", "search.penalty_cost=latency"]}
    code, _, err = cli(capsys, *args[given])
    assert_refused(code, err, f"{path} is a {kind}", "not a file")
    assert not (tmp_path / "run").exists()


def test_compare_refuses_a_metrics_file_too_deep(capsys, tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.json").write_text(NESTED)
    code, _, err = cli(capsys, "compare", tmp_path / "run", "--out", tmp_path / "table")
    assert_refused(code, err, "metrics.json", "more than 64 levels deep")
    assert not list(tmp_path.glob("table*"))


def test_the_limits_leave_every_shipped_file_readable():
    """What parnas ships and writes is far inside both limits: the presets parse as before."""
    from importlib import resources

    import yaml

    for preset in (resources.files("parnas") / "presets").iterdir():
        text = preset.read_text()
        assert reading.parse_yaml(text, preset.name) == yaml.safe_load(text)
    depth_64 = "[" * 64 + "]" * 64
    assert reading.parse_json(depth_64, "x") == json.loads(depth_64)
    assert reading.parse_json('{"a": "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[["}', "x")
    with pytest.raises(ParnasError, match="more than 64 levels deep"):
        reading.parse_json("[" + depth_64 + "]", "x")


@pytest.mark.parametrize("name", ["", " ", "\t"])
def test_an_empty_strategy_name_is_refused_not_read_as_the_default(capsys, tmp_path, name):
    code, out, err = cli(capsys, "search", "--config", "tiny", "--strategy", name,
                         "--set", f"search.out_dir={tmp_path}/run")
    assert_refused(code, err, "--strategy", "names no strategy")
    assert out == "" and not (tmp_path / "run").exists()


def test_a_strategy_name_is_taken_as_given(capsys, tmp_path):
    code, _, err = cli(capsys, "search", "--config", "tiny", "--strategy", "random ", "--dry-run")
    assert_refused(code, err, "unknown search strategy 'random '", "known strategies: par-gumbel-darts")


def test_a_data_dir_that_does_not_exist_is_refused(capsys, tmp_path, monkeypatch):
    """Even when the cache remembers where the corpus was found before: a typo never trains on another."""
    monkeypatch.setenv("PARNAS_DATA_DIR", str(tmp_path / "no-such-folder"))
    code, _, err = cli(capsys, "train", "--config", "tiny", "--set", f"train.out_dir={tmp_path}/run")
    assert_refused(code, err, f"PARNAS_DATA_DIR={tmp_path / 'no-such-folder'} is not a folder")
    assert not (tmp_path / "run").exists()


@pytest.fixture
def html_server():
    """Something that is not NNI answering HTTP on a loopback port."""
    class Page(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"<html>not NNI</html>")

        do_POST = do_PUT = do_DELETE = do_GET

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Page)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def multi_trial_config(micro, run):
    return load_config("tiny", [f"data.path={micro}", "data.tokenizer=char", "model.cutoffs=[20, 40]",
                                "train.max_steps=2", "train.eval_every=2", "search.strategy=random",
                                "search.penalty_cost=flops", f"search.out_dir={run}"])


def test_a_multi_trial_search_on_a_port_in_use_is_one_line(micro, tmp_path, html_server):
    from parnas.strategies.multi_trial import run_multi_trial

    with pytest.raises(ParnasError, match=f"port {html_server} is already in use"):
        run_multi_trial(multi_trial_config(micro, tmp_path / "run"), trials=1, port=html_server)
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_nni_failing_to_create_its_experiment_is_one_line_and_leaves_nothing(micro, tmp_path, html_server,
                                                                             monkeypatch):
    """The port taken between NNI's own check and its manager's start: NNI's client then reads another
    server's answers (requests' JSONDecodeError). The search names the port, and its run folder is gone."""
    import nni.experiment.launcher

    from parnas.strategies.multi_trial import run_multi_trial

    monkeypatch.setattr(nni.experiment.launcher, "_ensure_port_idle", lambda *args, **kwargs: None)
    monkeypatch.setattr("parnas.report.experiments.port_in_use", lambda port: False)
    with pytest.raises(ParnasError) as refused:
        run_multi_trial(multi_trial_config(micro, tmp_path / "run"), trials=1, port=html_server)
    message = str(refused.value)
    assert f"on port {html_server}" in message and "\n" not in message and "nothing was kept" in message, message
    assert not (tmp_path / "run").exists()
