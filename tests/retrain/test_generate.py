"""``parnas generate``: sampling from a checkpoint is reproducible with a seed and honours its options."""

import json

import pytest
import torch

from parnas.cli import main
from parnas.retrain.evaluate import Sampling, generate, prompt_ids
from parnas.retrain.load import load_trained
from parnas.retrain.run import retrain

PROMPT = "The game was released in"


@pytest.fixture(scope="module")
def checkpoint(wt2_short_eval, tmp_path_factory):
    out = tmp_path_factory.mktemp("gen") / "run"
    with pytest.MonkeyPatch.context() as mp:  # module scope: set the private cache ourselves
        mp.setenv("PARNAS_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "parnas-cache"))
        retrain("transformer-xl", "tiny", [f"data.path={wt2_short_eval}", "data.vocab_size=300",
                                           "model.cutoffs=[100, 200]", "train.max_steps=60", "train.eval_every=60",
                                           f"train.out_dir={out}"])
    return out / "checkpoints" / "last.ckpt"


def sample(capsys, checkpoint, *args):
    assert main(["generate", str(checkpoint), "--prompt", PROMPT, "--tokens", "40", *args]) == 0
    return capsys.readouterr().out


def test_same_seed_same_text_other_seed_other_text(checkpoint, capsys):
    first = sample(capsys, checkpoint, "--seed", "3")
    assert first == sample(capsys, checkpoint, "--seed", "3")
    assert first != sample(capsys, checkpoint, "--seed", "4")
    assert first.startswith(PROMPT) and len(first) > len(PROMPT) + 20


def test_temperature_zero_and_top_1_are_greedy(checkpoint, capsys):
    greedy = sample(capsys, checkpoint, "--temperature", "0", "--seed", "1")
    assert greedy == sample(capsys, checkpoint, "--temperature", "0", "--seed", "2")
    assert greedy == sample(capsys, checkpoint, "--top-k", "1", "--seed", "5")


def test_memory_is_carried_between_tokens(checkpoint, tmp_path):
    """Token by token with the memory gives the same distribution as one pass over the whole sequence."""
    trained = load_trained(checkpoint, torch.device("cpu"), tmp_path)
    _, new = generate(trained, PROMPT, Sampling(tokens=12, temperature=0, mem_len=200))
    model = trained.model
    ids = torch.tensor([prompt_ids(trained, PROMPT) + new])  # (1, P+12)
    with torch.no_grad():
        h, _ = model(ids[:, :-1])
        logp = model.log_probs(h)[0, -len(new):]  # (12, V)
    logp[0, ~torch.from_numpy(trained.tokenizer.word_starts())] = float("-inf")  # the prompt ends a word
    assert logp.argmax(-1).tolist() == new


@pytest.mark.parametrize("prompt", [PROMPT, PROMPT + " "])
def test_the_continuation_starts_a_new_word(checkpoint, capsys, prompt):
    """Decoded with the prompt, the first token drawn never extends the prompt's last word ("wasth")."""
    for seed in range(8):
        assert main(["generate", str(checkpoint), "--prompt", prompt, "--tokens", "3",
                     "--seed", str(seed)]) == 0
        text = capsys.readouterr().out
        assert text.startswith(PROMPT) and not text[len(PROMPT)].isalnum(), text


def test_unknown_words_show_as_one_marker(checkpoint, tmp_path):
    """WikiText spells an unknown word "<unk>"; a small vocabulary encodes it in several pieces, two of them
    the unknown piece, and decoding shows the one marker again (not "<unk>unk<unk>")."""
    tok = load_trained(checkpoint, torch.device("cpu"), tmp_path).tokenizer
    ids = tok.encode("the <unk> was")
    assert tok.decode(ids) == "the <unk> was"
    assert tok.decode([tok.unk_id]) == "<unk>"


@pytest.mark.parametrize("args, needle", [(["--tokens", "0"], "--tokens"), (["--temperature", "-1"], "--temperature"),
                                          (["--top-k", "-2"], "--top-k")])
def test_bad_options_exit_2(checkpoint, capsys, args, needle):
    assert main(["generate", str(checkpoint), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1


def test_generation_needs_no_corpus(checkpoint, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("PARNAS_DATA_DIR", str(tmp_path / "nowhere"))
    monkeypatch.setenv("PARNAS_CACHE_DIR", str(tmp_path / "empty-cache"))
    text = sample(capsys, checkpoint, "--seed", "3")
    assert text.startswith(PROMPT)
    meta = torch.load(checkpoint, weights_only=True)["parnas"]["tokenizer"]
    assert json.dumps({k: v for k, v in meta.items() if k != "file"})  # plain data beside the file's bytes


def test_the_printed_text_is_the_generated_text(checkpoint, capsys, tmp_path):
    """Printed token by token as it comes, the output is still exactly the decoded prompt and continuation."""
    trained = load_trained(checkpoint, torch.device("cpu"), tmp_path)
    for prompt in (PROMPT, "two lines\nand a second", ""):
        text, _ = generate(trained, prompt, Sampling(tokens=60, seed=2))
        assert main(["generate", str(checkpoint), "--prompt", prompt, "--tokens", "60",
                     "--seed", "2"]) == 0
        assert capsys.readouterr().out == text + "\n"


def test_a_prompt_the_vocabulary_cannot_spell_is_echoed_as_written_and_no_marker_is_printed(checkpoint, capsys,
                                                                                             tmp_path):
    """Issue #66: characters the vocabulary lacks encode as the unknown token, which decodes as "<unk>"; the
    printed prompt is the user's own text all the same, and the continuation never prints the marker."""
    trained = load_trained(checkpoint, torch.device("cpu"), tmp_path)
    prompt = "Caf\u00e9 \u4f60\u597d \u2603 was released in"  # CJK and a snowman: not in a WikiText vocabulary
    assert trained.tokenizer.unk_id in prompt_ids(trained, prompt)  # the ids do hold the unknown token
    for seed in range(3):
        assert main(["generate", str(checkpoint), "--prompt", prompt, "--tokens", "40", "--temperature", "5",
                     "--seed", str(seed)]) == 0
        out = capsys.readouterr().out
        assert out.startswith(prompt + " ") and "<unk>" not in out and len(out) > len(prompt) + 20, out
    text, _ = generate(trained, prompt + "  ", Sampling(tokens=5, seed=0))  # trailing spaces the ids drop
    assert text.startswith(prompt + " ") and not text.startswith(prompt + "  "), text


def test_a_token_count_above_the_maximum_is_one_line(checkpoint, capsys):
    from parnas.retrain.evaluate import MAX_TOKENS

    assert main(["generate", str(checkpoint), "--tokens", str(MAX_TOKENS + 1)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{MAX_TOKENS:,}" in err and "--tokens" in err, err


@pytest.mark.slow
def test_ctrl_c_keeps_the_text_so_far_and_exits_130(checkpoint):
    """Text shows as it is generated (flushed), and Ctrl-C ends the run at once: what was printed stays."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from parnas.retrain.evaluate import MAX_TOKENS

    proc = subprocess.Popen([sys.executable, "-m", "parnas.cli", "generate", str(checkpoint),
                             "--prompt", PROMPT, "--tokens", str(MAX_TOKENS)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        shown = proc.stdout.read(len(PROMPT) + 20)  # returns once that much was flushed, long before the end
        assert shown.startswith(PROMPT), shown
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    err = err.strip()
    assert len(err.splitlines()) == 1 and "stopped by Ctrl-C after" in err and f"of {MAX_TOKENS:,} tokens" in err, err
    done = int(err.split("after ")[1].split(" of")[0].replace(",", ""))
    assert 20 <= done < MAX_TOKENS and len(shown + out) > len(PROMPT) + 20 and out.endswith("\n")


def test_a_run_folder_is_taken_and_the_unknown_marker_is_never_drawn(checkpoint, capsys, tmp_path):
    """`parnas generate RUN` reads RUN/checkpoints/last.ckpt; however flat the distribution (a high temperature
    over 300 pieces, 1,000 draws), the unknown piece is never drawn, so "<unk>" never shows as text."""
    trained = load_trained(checkpoint, torch.device("cpu"), tmp_path)
    _, ids = generate(trained, "", Sampling(tokens=1000, temperature=50.0, seed=0))
    assert trained.tokenizer.unk_id not in ids and len(set(ids)) > 200  # flat enough to have drawn it otherwise
    assert main(["generate", str(checkpoint.parent.parent), "--tokens", "300", "--temperature", "50"]) == 0
    assert "<unk>" not in capsys.readouterr().out


def test_a_checkpoint_with_non_finite_weights_is_one_line_as_evaluate_says_it(checkpoint, capsys, monkeypatch):
    """torch.multinomial would end in a traceback over NaN probabilities: refused first, in evaluate's words."""
    import parnas.retrain.load

    def poisoned(*args, **kwargs):
        trained = load_trained(*args, **kwargs)
        with torch.no_grad():
            next(trained.model.parameters()).view(-1)[0] = float("nan")
        return trained

    monkeypatch.setattr(parnas.retrain.load, "load_trained", poisoned)
    assert main(["generate", str(checkpoint), "--prompt", PROMPT, "--tokens", "5"]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert len(err.splitlines()) == 1 and "training diverged" in err and "weights are not finite" in err, err
    assert captured.out == ""
