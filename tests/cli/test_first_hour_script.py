"""``tools/first_hour.py`` is where the README's first-hour times come from: it runs the README's own lines and
rewrites only their times."""

import re
import subprocess
import sys
from pathlib import Path

from tools.first_hour import README, first_hour_lines, medians, report, report_medians, rewrite, timed

REPO = Path(__file__).resolve().parents[2]


def test_it_times_the_readme_lines_that_state_a_time():
    lines = [line for line in first_hour_lines(README.read_text()) if timed(line)]
    commands = [line.split("  #")[0].strip() for line in lines]
    assert commands[0] == "make search" and any(c.startswith("parnas compare") for c in commands)
    assert not any("--accelerator gpu" in c or c.startswith(("nnictl", "tensorboard")) for c in commands)


def test_the_rewrite_changes_the_times_and_the_load_sentence_only():
    readme = README.read_text()
    lines = [line for line in first_hour_lines(readme) if timed(line)]
    times = {line.split("  #")[0].strip(): 12.0 + i for i, line in enumerate(lines)}
    new = rewrite(readme, times, load=1.2)
    assert "at a load average\nof about 1.2 ([how](docs/benchmarks.md#the-first-hour-timed))." in new
    changed = [(a, b) for a, b in zip(readme.splitlines(), new.splitlines()) if a != b]
    assert all(a.split("  #")[0] == b.split("  #")[0] for a, b in changed if "  #" in a)  # commands kept
    for line in first_hour_lines(new):
        command = line.split("  #")[0].strip()
        if command in times and any(ch.isdigit() for ch in line.split("  #", 1)[1]):
            assert f"{times[command]:.0f} s" in line, line
    assert len(new.splitlines()) == len(readme.splitlines())


def test_the_dry_run_runs_nothing():
    done = subprocess.run([sys.executable, "tools/first_hour.py", "--dry-run"], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.splitlines()[0].startswith("parnas launch --config search.yaml")
    assert "--wait" in done.stdout.splitlines()[0]


def test_the_report_shows_the_times_then_what_the_search_the_export_and_the_compare_found():
    rows = [("parnas launch --config search.yaml --port 1 --wait", 300.0, 0.2, 1.0,
             "".join(f"progress {i}\n" for i in range(40)) + "trial  val ppl  architecture\nAbCdE  55.1  ADADDD\n"),
            ("parnas export --experiment Ab12 --out found/", 0.1, 1.0, 1.0, "AbCdE  55.1  ADADDD\n"),
            ("parnas plot --experiment Ab12", 19.0, 1.0, 1.0, "wrote pareto.png\n")]
    text = report(rows)
    assert "| `parnas plot --experiment Ab12` | 19 s | 1.0 -> 1.0 |" in text
    assert "$ parnas export --experiment Ab12 --out found/  (its last 25 lines)\nAbCdE  55.1  ADADDD" in text
    assert "AbCdE  55.1  ADADDD" in text.split("$ parnas launch")[1] and "progress 16\n" not in text
    assert "progress 17" in text and "wrote pareto.png" not in text  # the last 25 lines; plot prints no finding


def test_several_runs_give_the_readme_each_steps_median_and_say_so():
    """One run's times differ from the next one's by up to a third on a 2-core machine: the README can take each
    step's median over several, and its sentence says how many."""
    runs = [{"make search": 360.0, "parnas plot --experiment <id>": 19.0},
            {"make search": 420.0, "parnas plot --experiment <id>": 26.0},
            {"make search": 380.0, "parnas plot --experiment <id>": 20.0}]
    assert medians(runs) == {"make search": 380.0, "parnas plot --experiment <id>": 20.0}
    assert "| `make search` | 6.3 min | 6.0 min - 7.0 min | 6.0 min, 7.0 min, 6.3 min |" in report_medians(runs)
    new = rewrite(README.read_text(), medians(runs), load=1.0, runs=3)
    assert "of about 1.0, each the median of 3 runs ([how]" in new
    assert re.search(r"^make search +# about 6\.3 min on a 2-core CPU", new, flags=re.M)


def test_fewer_than_one_run_is_refused():
    done = subprocess.run([sys.executable, "tools/first_hour.py", "--runs", "0"], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and "--runs must be at least 1" in done.stderr
