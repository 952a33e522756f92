"""docs/reference.md's table of the papers' presets states what ``--dry-run`` prints for each: its parameters and
training FLOPs per token. A user quotes those numbers before paying for a run, so the table is checked against
the code rather than copied from it once."""

import re
from pathlib import Path

import pytest

from parnas.cli import main

REFERENCE = Path(__file__).parents[2] / "docs" / "reference.md"
ROW = re.compile(r"^\| `(?P<preset>[\w-]+)` \| (?P<source>.*) \| (?P<params>[\d,]+) \| (?P<flops>[\d.,]+) M \|$")


def table() -> list[dict[str, str]]:
    """The rows of the presets' table: the one headed ``| preset | source | parameters | training FLOPs / token |``."""
    text = REFERENCE.read_text()
    start = text.index("| preset | source | parameters | training FLOPs / token |")
    rows = []
    for line in text[start:].splitlines()[2:]:
        if not line.startswith("|"):
            break
        match = ROW.match(line)
        assert match, f"a row of the presets' table that is not 'preset | source | parameters | FLOPs M': {line}"
        rows.append(match.groupdict())
    return rows


def command(row: dict[str, str]) -> list[str]:
    """The dry run a row reports: a search's supernet where its source says so, else the Transformer-XL layout."""
    if "`search --dry-run`" in row["source"]:
        return ["search", "--config", row["preset"], "--dry-run"]
    return ["retrain", "--arch", "transformer-xl", "--config", row["preset"], "--dry-run"]


def test_the_table_lists_every_paper_preset():
    assert {r["preset"] for r in table()} == {"wt103-base", "wt103-par", "enwik8-base", "text8-base"}


@pytest.mark.parametrize("row", table(), ids=lambda r: r["preset"])
def test_each_presets_parameters_and_flops_are_what_its_dry_run_prints(row, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PARNAS_DATA_DIR", str(tmp_path / "no-data"))
    assert main(command(row)) == 0
    out = capsys.readouterr().out
    params = re.search(r"parameters ([\d,]+):", out)[1]
    flops = re.search(r"training FLOPs per token ([\d.,]+) M", out)[1]
    assert (row["params"], row["flops"]) == (params, flops), f"docs/reference.md's {row['preset']} row"
