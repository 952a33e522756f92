"""The web UI's columns the README has a user choose are the ones ``tools/webui_screenshot.py`` photographs at
1,280 px (where they were seen to fit), so the picture checks what the README says."""

import json
import re
from pathlib import Path

from tools.webui_screenshot import COLUMNS, columns_entry

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


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
