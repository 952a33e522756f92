"""``parnas --help``: each command's line is a whole sentence a user can act on, never one cut where the
docstring's first line happened to end."""

import contextlib
import io
import re

import pytest

from parnas import cli
from parnas.arguments import summary


def help_text(*argv: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main([*argv, "--help"]) == 0
    return out.getvalue()


def summaries() -> dict[str, str]:
    """Each sub-command's line in ``parnas --help``, its wrapped lines joined."""
    text = help_text()
    block = text.split("positional arguments:\n", 1)[1].split("\n\n", 1)[0].splitlines()[1:]
    lines: dict[str, str] = {}
    for line in block:
        name = re.match(r"    (\w+)\s{2,}(.*)", line)
        if name:
            lines[name[1]] = name[2]
        else:
            last = list(lines)[-1]
            lines[last] += " " + line.strip()
    return lines


def commands() -> dict[str, object]:
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    return dict(sub.choices)


def test_every_command_has_a_line_in_the_help():
    assert set(summaries()) == set(commands()) and len(commands()) >= 12


@pytest.mark.parametrize("name", sorted(commands()))
def test_each_commands_line_is_a_whole_sentence(name):
    line = summaries()[name]
    assert line.endswith("."), f"parnas {name}'s summary is cut: {line!r}"
    assert line.count("(") == line.count(")") and "``" not in line
    doc = " ".join(commands()[name].get_default("fn").__doc__.split()).replace("``", "")
    assert doc.startswith(line), "the summary is the docstring's opening, not a paraphrase that drifts from it"
    assert f"{line} " in f"{doc} ", "it ends where a sentence of the docstring ends"


def test_a_sentence_runs_over_line_breaks_and_dotted_names():
    doc = """Search with ``search.strategy`` and write
    architecture.json (e.g. found/1.json) on 127.0.0.1. Then more.

    Details."""
    assert summary(doc) == "Search with search.strategy and write architecture.json (e.g. found/1.json) on 127.0.0.1."
    assert summary("One paragraph without a stop\n\nDetails.") == "One paragraph without a stop"

