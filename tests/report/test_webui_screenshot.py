"""The web UI's columns the README has a user choose are the ones ``tools/webui_screenshot.py`` photographs at
1,280 px (where they were seen to fit), so the picture checks what the README says; with a headless Chromium, the
picture of four trials shows each trial's row with both (issue #66)."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tools.webui_screenshot import COLUMNS, columns_entry

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()
CHROMIUM = next((shutil.which(name) for name in ("chromium", "chromium-browser", "google-chrome")
                 if shutil.which(name)), None)


def test_the_photographed_columns_are_the_ones_the_readme_has_a_user_choose():
    ticked = re.findall(r"`(\w+) \(metric\)`", README)
    unticked = re.search(r"untick \*(\w+)\* and \*(\w+)\*", README)
    assert ticked == ["architecture", "latency_ratio"] and unticked, "the README's column advice moved"
    assert [c for c in COLUMNS if c.startswith("metric/")] == [f"metric/{name}" for name in ticked]
    assert not {name.lower() for name in unticked.groups()} & set(COLUMNS)
    assert "1,280-px" in README


def test_the_columns_are_written_as_the_web_uis_own_column_dialog_writes_them():
    entry = columns_entry("abc123")
    value = json.loads(entry["abc123_columns"])
    assert json.loads(value["value"]) == COLUMNS and value["isSelectall"] is False and value["expire"] > 0


@pytest.mark.slow
@pytest.mark.skipif(CHROMIUM is None, reason="no headless Chromium (chromium, chromium-browser or google-chrome on "
                    "PATH) to photograph the web UI with; what the rows show, each evaluation's exported layout and "
                    "its cost ratio from the first one on, is what tests/cli/test_first_hour.py's "
                    "test_a_trial_reports_what_it_found_at_every_evaluation... and tests/cli/test_nnictl.py check NNI "
                    "gets")
def test_the_picture_at_1280_by_800_shows_four_trials_rows_each_with_its_architecture_and_cost(tmp_path,
                                                                                             shrunk_search_yaml):
    config_path = shrunk_search_yaml(4)
    bin_dir = Path(sys.executable).parent
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", PYTHONPATH=str(REPO),
               OMP_NUM_THREADS="1")
    shots = tmp_path / "shots"
    done = subprocess.run([sys.executable, str(REPO / "tools" / "webui_screenshot.py"), "--config", str(config_path),
                           "--out", str(shots), "--window", "1280x800", "--timeout", "1500"],
                          capture_output=True, text=True, env=env, timeout=1800)  # it stops its experiment itself
    assert done.returncode == 0 and (shots / "trials-done.png").is_file(), done.stdout + done.stderr
    rows = json.loads((shots / "trials-done.json").read_text())  # the cells wholly inside the 1,280 x 800 window
    assert len(rows) == 4, rows
    for row in rows:
        assert re.fullmatch(r"[A-Z]{4}", row.get("metric/architecture", "")), row
        assert float(row.get("metric/latency_ratio", "nan")) >= 0, row
    # (NNI 3.0's web UI fills a metric column from the trial's final result only, its Trial.metrics reading
    # finalMetricData: a running trial's row shows its latest evaluation's default metric, trials-running.png)
