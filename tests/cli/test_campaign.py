"""tools/campaign.py, the hostile user's campaign as a command anyone can rerun: its quick cases are answered well,
and its checker can fail (a wrong expectation is reported BAD, never passed)."""

import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import WT2, needs_wt2

ROOT = Path(__file__).parents[2]


@needs_wt2
@pytest.mark.slow
def test_the_quick_campaign_is_answered_well():
    done = subprocess.run([sys.executable, "tools/campaign.py", "--quick"], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT), "PARNAS_DATA_DIR": str(WT2.parent)})
    *cases, last = done.stdout.strip().splitlines()
    assert done.returncode == 0, done.stdout + done.stderr
    assert len(cases) >= 5 and all(line.startswith("ok ") for line in cases), cases
    assert re.match(rf"{len(cases)} of {len(cases)} answered well \(seed 0, \d+ s\)$", last), last


def test_a_wrong_expectation_is_reported_bad(tmp_path):
    """A refusal whose line lacks the expected words, one expected with another status, and an input that is not
    refused at all: each BAD, and the summary counts none of them as answered well."""
    from tools.campaign import run_cases, summary
    from tools.campaign_cases.bench import Bench, refused

    unknown_key = ["train", "--config", "tiny", "--set", "train.max_step=5", "--set", "train.out_dir={out}"]
    cases = [refused("wrong words", unknown_key, "no such words in the line"),
             refused("wrong status", unknown_key, "train.max_step", status=3),
             refused("not refused", ["train", "--help"], "anything")]
    printed = io.StringIO()
    results = run_cases(cases, Bench(tmp_path, tmp_path, seed=0), out=printed)
    assert [verdict for verdict, _, _ in results] == ["BAD"] * 3, printed.getvalue()
    lines = printed.getvalue().splitlines()
    assert "lacks 'no such words in the line'" in lines[0] and "exit 2, not 3" in lines[1], lines
    assert "exit 0, not 2" in lines[2], lines
    assert summary(results) == "0 of 3 answered well"


def test_the_campaign_tries_every_family_of_trust():
    """Removal beside another process, links at every folder a command writes, damaged caches, special files, ids,
    JSON types, numbers, non-finite weights and the pick's steps (issue 63's families), each with variants."""
    from tools.campaign import all_cases

    names = [c.name for c in all_cases()]
    for prefix, least in (("removal: ", 1), ("links: ", 12), ("cache: token ids", 2), ("cache: a vocabulary", 1),
                          ("special: ", 12), ("ids: ", 4), ("json: an architecture whose", 5), ("numbers: ", 4),
                          ("weights: ", 2), ("settings: search.par-gumbel-darts.select.steps", 2)):
        assert sum(n.startswith(prefix) for n in names) >= least, prefix
    for sub in ("checkpoints/", "tensorboard/", "select/", "search/", "retrain/", "t1.json", "summary.json"):
        assert any(n.startswith("links: ") and sub in n for n in names), sub
    for kind in ("FIFO", "socket", "character device"):
        for given in ("a config", "an architecture", "a latency table", "a corpus split"):
            assert f"special: a {kind} as {given}" in names
