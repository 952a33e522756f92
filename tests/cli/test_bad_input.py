"""Bad input, as a user tries it: exit status 2, one line on stderr, nothing written and nothing damaged.

Also what a user sees when nothing goes wrong: quiet output without a terminal, files with their umask.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from parnas.cli import main
from parnas.errors import ConfigError
from parnas.files import check_writable_dir, write_json_atomic
from parnas.retrain.evaluate import Sampling
from parnas.retrain.load import device_for
from parnas.training import checkpoint as ckpt

ROOT = Path(__file__).parents[2]


def cli(capsys, *args):
    """Run ``parnas ARGS`` in this process: (exit status, stdout, stderr)."""
    code = main([str(a) for a in args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err.strip()


def assert_refused(code, err, *needles):
    assert code == 2, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, err


def micro_settings(corpus, out, *extra):
    sets = [f"data.path={corpus}", "data.tokenizer=char", "model.cutoffs=[20, 40]", "train.max_steps=2",
            "train.eval_every=2", f"train.out_dir={out}", *extra]
    return ["--config", "tiny", *[a for s in sets for a in ("--set", s)]]


@pytest.fixture(scope="module")
def finished(micro, tmp_path_factory):
    """A finished two-step run of the standard layout."""
    out = tmp_path_factory.mktemp("finished") / "run"
    with pytest.MonkeyPatch.context() as mp:  # module scope: set the private cache ourselves
        mp.setenv("PARNAS_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "parnas-cache"))
        assert main(["train", *micro_settings(micro, out)]) == 0
    return out


# --- settings and arguments: refused at once, before torch is imported ------------------------------

@pytest.mark.parametrize("setting, needle", [
    ("train.precision=bogus", "train.precision"),
    ("train.accelerator=tpu", "train.accelerator"),
    ("train.weight_decay=0.1", "train.weight_decay was removed"),
    ("train.lr=.inf", "train.lr must be a finite number"),
    ("train.lr=.nan", "train.lr must be a finite number"),
    ("search.par-gumbel-darts.tau_start=.inf", "search.par-gumbel-darts.tau_start must be a finite number"),
    ("model.dropout=.nan", "model.dropout must be a finite number"),
    ("train.devices=3", "divisible by the 3 processes"),
    ("train.compile=cudagraphs", "train.compile must be one of none, default, reduce-overhead, max-autotune"),
    ("model.attention_kernel=flash", "model.attention_kernel must be one of sdpa, flex, not 'flash'"),
    ("model.eval_mem_len=-1", "model.eval_mem_len must be >= 0"),
    ("model.clamp_len=-4", "model.clamp_len must be >= 0"),
    ("train.seed=-1", "train.seed must be in 0..4294967295"),  # Lightning's seed_everything would raise
    ("train.seed=4294967296", "train.seed must be in 0..4294967295"),
    ("data.vocab_size=2", "data.vocab_size=2 leaves a SentencePiece vocabulary no room"),  # not SentencePiece's own
])
@pytest.mark.parametrize("command", ["train", "search", "retrain"])
def test_settings_that_cannot_be_honoured_are_refused(capsys, tmp_path, setting, needle, command):
    arch = ["--arch", "transformer-xl"] if command == "retrain" else []
    code, _, err = cli(capsys, command, *arch, "--config", "tiny", "--set", setting,
                       "--set", f"train.out_dir={tmp_path}/run", "--set", f"search.out_dir={tmp_path}/run")
    assert_refused(code, err, needle)
    assert not (tmp_path / "run").exists()


def test_config_mistakes_are_reported_before_torch_is_imported():
    code = ("import sys; from parnas.cli import main\n"
            "codes = [main([cmd, *arch, '--config', 'tiny', '--set', 'train.max_step=5'])\n"
            "         for cmd, arch in (('train', []), ('search', []), ('retrain', ['--arch', 'transformer-xl']))]\n"
            "print(codes, 'torch' in sys.modules)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert run.stdout.strip() == "[2, 2, 2] False", run.stdout + run.stderr
    assert run.stderr.count("unknown config key train.max_step") == 3


@pytest.mark.parametrize("args, needle", [
    (["train", "--bogus"], "--bogus"),
    (["retrain", "--config", "tiny"], "--arch"),
    (["generate", __file__, "--temperature", "nan"], "--temperature"),
    (["generate", __file__, "--temperature", "inf"], "--temperature"),
    (["generate", __file__, "--tokens", "0"], "--tokens"),
    (["generate", __file__, "--accelerator", "foo"], "--accelerator"),
    (["evaluate", __file__, "--accelerator", "cuda"], "--accelerator"),
    (["evaluate", __file__, "--mem-len", "-1"], "--mem-len"),
    (["evaluate", __file__, "--clamp-len", "-1"], "--clamp-len"),
    (["generate", __file__, "--clamp-len", "-2"], "--clamp-len"),
])
def test_argument_mistakes_are_one_line_pointing_at_help(capsys, args, needle):
    code, _, err = cli(capsys, *args)
    assert_refused(code, err, needle, "--help")


def test_a_wrong_run_or_checkpoint_is_refused_before_torch_loads():
    """evaluate, generate and compare take a run folder or a checkpoint; a wrong one is one line, exit 2, from
    the argument parser: torch (seconds to import) is never loaded. One process tries them all."""
    wrong = [["evaluate", "nowhere"], ["generate", "nowhere/last.ckpt"], ["compare", "runs-that-are-not-there"],
             ["evaluate", "."]]
    probe = ("import contextlib, io, json, sys; from parnas.cli import main\n"
             "said = []\n"
             "for args in json.loads(sys.argv[1]):\n"
             "    err = io.StringIO()\n"
             "    with contextlib.redirect_stderr(err):\n"
             "        try:\n"
             "            code = main(args)\n"
             "        except SystemExit as exit:\n"
             "            code = exit.code\n"
             "    said.append([code, err.getvalue()])\n"
             "print(json.dumps([said, 'torch' in sys.modules]))")
    run = subprocess.run([sys.executable, "-c", probe, json.dumps(wrong)], capture_output=True, text=True,
                         timeout=60)
    said, torch_loaded = json.loads(run.stdout)
    assert not torch_loaded, run.stderr
    for args, (code, err) in zip(wrong, said, strict=True):
        assert code == 2 and len(err.strip().splitlines()) == 1, (args, err)
        assert "run folder" in err or "finished run" in err, (args, err)


def test_library_checks_sampling_and_devices():
    with pytest.raises(ConfigError, match="temperature"):
        Sampling(temperature=float("nan"))
    for seed in (-1, 2**64):  # torch.Generator.manual_seed's range: a traceback outside it
        with pytest.raises(ConfigError, match="--seed must be in 0..2"):
            Sampling(seed=seed)
    with pytest.raises(ConfigError, match="--accelerator"):
        device_for("foo")


# --- output folders: checked before the work ----------------------------------------------------------

@pytest.fixture(params=["parent is a file", "under /proc"])
def unwritable(request, tmp_path):
    if request.param == "under /proc":
        if not Path("/proc/self").is_dir():
            pytest.skip("no /proc")
        return Path("/proc/parnas-test/out")
    (tmp_path / "file").write_text("not a folder\n")
    return tmp_path / "file" / "out"


def test_train_retrain_and_search_refuse_an_output_folder_that_cannot_be_made(capsys, unwritable, micro):
    for command, extra in (("train", []), ("retrain", ["--arch", "transformer-xl"]),
                           ("search", ["--set", f"search.out_dir={unwritable}"])):
        code, out, err = cli(capsys, command, *extra, *micro_settings(micro, unwritable))
        assert_refused(code, err, str(unwritable))
        assert not out


def test_compare_and_evaluate_check_their_output_first(capsys, unwritable, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.json").write_text(json.dumps({"architecture": "ADAD", "steps": 2, "val_ppl": 3.0}))
    code, out, err = cli(capsys, "compare", run, "--out", unwritable / "table")
    assert_refused(code, err, str(unwritable))
    assert not out  # no table printed before the failure
    # the checkpoint is never read: the folder is checked before the evaluation starts
    (tmp_path / "unread.ckpt").write_bytes(b"not a checkpoint")
    code, out, err = cli(capsys, "evaluate", tmp_path / "unread.ckpt", "--out", unwritable / "e.json")
    assert_refused(code, err, str(unwritable))


def test_checking_a_folder_leaves_nothing_behind(tmp_path):
    assert check_writable_dir(tmp_path / "a" / "b") == tmp_path / "a" / "b"
    assert list(tmp_path.iterdir()) == []


# --- a finished run is not overwritten; data that cannot fill a segment writes nothing ----------------

def test_a_finished_run_is_not_overwritten_without_resume(capsys, finished, micro):
    before = {p: p.read_bytes() for p in (finished / "metrics.json", finished / "checkpoints" / "last.ckpt")}
    for command, arch in (("train", []), ("retrain", ["--arch", "transformer-xl"])):
        code, _, err = cli(capsys, command, *arch, *micro_settings(micro, finished))
        assert_refused(code, err, "already holds a run", "--resume")
    assert {p: p.read_bytes() for p in before} == before


def test_search_refuses_to_compile_a_sampled_supernet(capsys, micro, tmp_path):
    """A sampled step runs other candidates from step to step: no one static graph holds it."""
    code, _, err = cli(capsys, "search", *micro_settings(micro, tmp_path / "run", "train.compile=default",
                                                        "search.par-gumbel-darts.forward=sampled",
                                                        f"search.out_dir={tmp_path / 'run'}"))
    assert_refused(code, err, "train.compile=default", "sampled", "train.compile=none")
    assert not (tmp_path / "run").exists()


def test_segments_longer_than_the_data_write_nothing(capsys, micro, tmp_path):
    code, _, err = cli(capsys, "train", *micro_settings(micro, tmp_path / "run", "data.seg_len=100000"))
    assert_refused(code, err, "too short")
    assert not (tmp_path / "run").exists()


def test_a_loss_that_is_not_finite_stops_the_run_naming_the_step(capsys, micro, tmp_path):
    code, _, err = cli(capsys, "train", *micro_settings(micro, tmp_path / "run", "train.lr=1e30", "train.clip=0",
                                                       "train.warmup_steps=0", "train.max_steps=20"))
    assert_refused(code, err, "diverged at step", "not finite", "lower train.lr")


def test_resume_after_the_tokenizer_cache_was_rebuilt(capsys, micro, tmp_path, monkeypatch):
    """spm.model's bytes change with every build (it embeds its build path); a resume must not care."""
    monkeypatch.setenv("PARNAS_CACHE_DIR", str(tmp_path / "cache"))
    args = micro_settings(micro, tmp_path / "run", "data.tokenizer=sentencepiece", "data.vocab_size=120",
                          "train.max_steps=4", "train.eval_every=4")
    assert main(["train", *args, "--set", "train.stop_at=2"]) == 0
    shutil.rmtree(tmp_path / "cache")  # e.g. the user cleared ~/.cache
    code, _, err = cli(capsys, "train", *args, "--resume")
    assert code == 0, err
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["steps"] == 4


# --- checkpoints: every part is checked -------------------------------------------------------------

def test_an_edited_optimiser_state_is_refused(capsys, finished, tmp_path):
    ckpt.load(finished / "checkpoints" / "last.ckpt")  # as written, it passes every check
    checkpoint = torch.load(finished / "checkpoints" / "last.ckpt", weights_only=True)
    state = checkpoint["optimizer_states"][0]["state"]
    first = next(iter(state))
    state[first]["exp_avg"] += 1.0
    edited = tmp_path / "edited.ckpt"
    torch.save(checkpoint, edited)
    code, _, err = cli(capsys, "evaluate", edited, "--out", tmp_path / "e.json")
    assert_refused(code, err, "optimiser", "edited")
    assert not (tmp_path / "e.json").exists()


def test_a_kill_during_a_checkpoint_write_leaves_no_temp_file_after_the_next(tmp_path):
    stale = tmp_path / ".last.ckpt.x1y2z3.tmp"
    stale.write_bytes(b"")  # what a kill between mkstemp and rename leaves
    ckpt.save({"step": 1}, tmp_path / "last.ckpt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


# --- files keep the user's umask -----------------------------------------------------------------------

@pytest.mark.parametrize("umask, mode", [(0o002, 0o664), (0o077, 0o600), (0o022, 0o644)])
def test_written_files_keep_the_users_umask(tmp_path, umask, mode):
    old = os.umask(umask)
    try:
        write_json_atomic(tmp_path / "a.json", {"x": 1})
        ckpt.save({"step": 1}, tmp_path / "last.ckpt")
    finally:
        os.umask(old)
    assert (tmp_path / "a.json").stat().st_mode & 0o777 == mode
    assert (tmp_path / "last.ckpt").stat().st_mode & 0o777 == mode


# --- quiet without a terminal --------------------------------------------------------------------------

@pytest.mark.slow
def test_output_without_a_terminal_is_plain_and_quiet(micro, tmp_path, tmp_path_factory):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PARNAS_CACHE_DIR": str(tmp_path_factory.getbasetemp() / "pc")}
    base = [sys.executable, "-m", "parnas.cli"]
    quiet = subprocess.run([*base, "train", *micro_settings(micro, tmp_path / "quiet")], capture_output=True,
                           text=True, cwd=ROOT, env=env, timeout=300)
    assert quiet.returncode == 0, quiet.stderr[-2000:]
    both = quiet.stdout + quiet.stderr
    assert "\x1b[" not in both and "\r" not in both  # no progress-bar escapes
    for noise in ("GPU available", "TPU available", "litlogger", "Trainer.fit"):
        assert noise not in both, both
    assert "validation perplexity" in quiet.stdout and "metrics in" in quiet.stdout
    assert len(quiet.stdout.splitlines()) <= 8, quiet.stdout  # a short block, no raw metrics dict
    assert not any(len(word) > 12 and word.replace(".", "").isdigit() for word in quiet.stdout.split())
    verbose = subprocess.run([*base, "--verbose", "train", *micro_settings(micro, tmp_path / "verbose")],
                             capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert verbose.returncode == 0 and "GPU available" in verbose.stdout + verbose.stderr


# --- a model too large for this machine: refused before anything is allocated ------------------------

@pytest.mark.parametrize("setting, named", [("model.d_model=100000000000", "model.d_model=100000000000"),
                                            ("model.d_ff=10000000000", "model.d_ff=10000000000")])
@pytest.mark.parametrize("command", ["train", "retrain", "search"])
def test_a_model_too_large_for_this_machine_names_the_setting(capsys, micro, tmp_path, command, setting, named):
    arch = ["--arch", "transformer-xl"] if command == "retrain" else []
    code, _, err = cli(capsys, command, *arch, *micro_settings(micro, tmp_path / "run", setting,
                                                               f"search.out_dir={tmp_path / 'run'}"))
    assert_refused(code, err, "training needs", "memory", "this machine has", named)
    assert not (tmp_path / "run").exists()


# --- files that are not what they should be ------------------------------------------------------------

def test_a_truncated_architecture_file_says_where_it_ends(capsys, tmp_path):
    cut = tmp_path / "arch.json"
    cut.write_text('{"format": "parnas.archi')
    code, _, err = cli(capsys, "retrain", "--arch", cut, "--config", "tiny", "--set", f"train.out_dir={tmp_path}/r")
    assert_refused(code, err, f"{cut} is not JSON (Unterminated string starting at: line 1, column 12)")
    assert not (tmp_path / "r").exists()


def test_a_binary_architecture_file_is_one_line(capsys, tmp_path):
    binary = tmp_path / "arch.json"
    binary.write_bytes(bytes(range(256)) * 4)
    code, _, err = cli(capsys, "retrain", "--arch", binary, "--config", "tiny", "--set", f"train.out_dir={tmp_path}/r")
    assert_refused(code, err, str(binary), "not JSON")
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("text", ["", "\n\n", "# nothing set here\n"])
@pytest.mark.parametrize("command", ["train", "search", "retrain"])
def test_an_empty_config_file_is_an_error(capsys, tmp_path, text, command):
    (tmp_path / "c.yaml").write_text(text)
    arch = ["--arch", "transformer-xl"] if command == "retrain" else []
    code, _, err = cli(capsys, command, *arch, "--config", tmp_path / "c.yaml", "--set", f"train.out_dir={tmp_path}/r",
                       "--set", f"search.out_dir={tmp_path}/r")
    assert_refused(code, err, "empty config; omit --config for the defaults")
    assert not (tmp_path / "r").exists()


# --- a search shorter than its intervals; resuming the wrong thing ---------------------------------------

@pytest.fixture(scope="module")
def searched(micro, tmp_path_factory):
    """A search of 3 steps, fewer than search.log_every (10) and train.eval_every (100)."""
    out = tmp_path_factory.mktemp("searched") / "run"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PARNAS_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "parnas-cache"))
        code = main(["search", *search_settings(micro, out)])
    return out, code


def search_settings(corpus, out, *extra):
    sets = [f"data.path={corpus}", "data.tokenizer=char", "model.cutoffs=[20, 40]", "train.max_steps=3",
            "search.penalty_cost=flops", f"search.out_dir={out}", *extra]
    return ["--config", "tiny", *[a for s in sets for a in ("--set", s)]]


def test_a_search_shorter_than_its_log_and_eval_intervals_finishes(searched):
    out, code = searched
    assert code == 0
    assert all((out / name).is_file() for name in ("architecture.json", "probabilities.gif", "probabilities.png",
                                                   "architecture.png"))
    (last,) = [json.loads(line) for line in (out / "history.jsonl").read_text().splitlines()]
    assert last["step"] == 3 and last["val_ppl"] > 0 and last["architecture"]
    assert json.loads((out / "architecture.json").read_text())["search"]["steps"] == 3


def files(folder):
    return {p: p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_resumed_search_refuses_changed_settings_listing_what_may_change(capsys, searched, micro):
    out, _ = searched
    before = files(out)
    code, _, err = cli(capsys, "search", *search_settings(micro, out, "search.arch_lr=0.1"), "--resume")
    assert_refused(code, err, "search.arch_lr=0.03, now 0.1", "a resume may change", "train.stop_at",
                   "search.out_dir")
    assert files(out) == before


def test_resuming_a_checkpoint_of_the_other_kind_is_one_line(capsys, searched, finished, micro):
    search_dir, _ = searched
    before = {**files(search_dir), **files(finished)}
    code, _, err = cli(capsys, "retrain", "--arch", "transformer-xl", *micro_settings(micro, search_dir), "--resume")
    assert_refused(code, err, "not a fixed model's checkpoint")
    code, _, err = cli(capsys, "search", *search_settings(micro, finished, "train.max_steps=2"), "--resume")
    assert_refused(code, err, "not a search's checkpoint")
    assert {**files(search_dir), **files(finished)} == before


# --- evaluate: only on the corpus the checkpoint's tokenizer was built on ----------------------------------

@pytest.fixture(scope="module")
def other_corpus(wt2_slice, tmp_path_factory):
    folder = tmp_path_factory.mktemp("other")
    for split, size in (("train", 12_000), ("valid", 3_000), ("test", 3_000)):
        text = (wt2_slice / f"{split}.txt").read_text()[size:3 * size]
        (folder / f"{split}.txt").write_text(text[text.index("\n") + 1:text.rindex("\n") + 1])
    return folder


def test_evaluate_refuses_a_checkpoint_without_its_corpus_record(capsys, finished, micro, tmp_path):
    """The corpus a tokenizer was built on is part of its record: a checkpoint without it cannot be checked."""
    checkpoint = torch.load(finished / "checkpoints" / "last.ckpt", weights_only=True)
    del checkpoint["parnas"]["tokenizer"]["corpus_sha256"]
    ckpt.save(checkpoint, tmp_path / "old.ckpt")
    code, _, err = cli(capsys, "evaluate", tmp_path / "old.ckpt", "--data-path", micro, "--out", tmp_path / "e.json")
    assert_refused(code, err, "old.ckpt: its tokenizer record is missing or damaged")
    assert not (tmp_path / "e.json").exists()


def test_evaluate_refuses_a_corpus_the_tokenizer_was_not_built_on(capsys, finished, micro, other_corpus, tmp_path):
    last = finished / "checkpoints" / "last.ckpt"
    code, _, err = cli(capsys, "evaluate", last, "--data-path", other_corpus,
                       "--out", tmp_path / "e.json")
    assert_refused(code, err, str(other_corpus), "not the corpus the checkpoint's tokenizer was built on",
                   f"({micro})")
    assert not (tmp_path / "e.json").exists()
    moved = tmp_path / "moved"
    shutil.copytree(micro, moved)  # the same corpus elsewhere is fine
    code, out, err = cli(capsys, "evaluate", last, "--data-path", moved, "--out", tmp_path / "e.json")
    assert code == 0 and "valid perplexity" in out, err
