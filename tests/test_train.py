"""End to end through Lightning: it learns, and it writes what a user keeps."""

import json

from parnas.cli import main
from parnas.config import DataConfig
from parnas.data.corpora import load_splits, unigram_perplexity


def test_it_learns_far_below_the_unigram_perplexity(wt2_slice, tmp_path, capsys):
    out = tmp_path / "run"
    code = main(["train", "--config", "tiny", "--set", f"data.path={wt2_slice}", "--set", "data.vocab_size=500",
                 "--set", "model.cutoffs=[100, 250]", "--set", "train.max_steps=300",
                 "--set", "train.eval_every=150", "--set", f"train.out_dir={out}"])
    assert code == 0
    metrics = json.loads((out / "metrics.json").read_text())
    tokenizer, splits = load_splits(DataConfig(path=str(wt2_slice), vocab_size=500))
    unigram = unigram_perplexity(splits["valid"], tokenizer.vocab_size)
    assert metrics["steps"] == 300
    assert metrics["val_ppl"] < 0.6 * unigram, (metrics["val_ppl"], unigram)
    assert metrics["val_tokens"] + metrics["val_untargeted_tokens"] == len(splits["valid"])
    assert "validation perplexity" in capsys.readouterr().out
    assert (out / "checkpoints" / "last.ckpt").is_file()
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
