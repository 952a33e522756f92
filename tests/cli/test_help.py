"""``parnas --help``: each command's line is a whole sentence a user can act on, never one cut where the
docstring's first line happened to end."""

import argparse
import contextlib
import io
import re
import shlex

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
            lines[last] += ("" if lines[last].endswith("-") else " ") + line.strip()  # argparse breaks at hyphens
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
    doc = " ".join(commands()[name].description.split())
    assert doc.startswith(line), "the summary is the docstring's opening, not a paraphrase that drifts from it"
    assert f"{line} " in f"{doc} ", "it ends where a sentence of the docstring ends"


def test_a_sentence_runs_over_line_breaks_and_dotted_names():
    doc = """Search with ``search.strategy`` and write
    architecture.json (e.g. found/1.json) on 127.0.0.1. Then more.

    Details."""
    assert summary(doc) == "Search with search.strategy and write architecture.json (e.g. found/1.json) on 127.0.0.1."
    assert summary("One paragraph without a stop\n\nDetails.") == "One paragraph without a stop"



def every_command() -> dict[str, object]:
    """Each sub-command's parser by its words (``table build`` too), the nested ones' groups left out."""
    found, todo = {}, [((), cli.build_parser())]
    while todo:
        words, parser = todo.pop()
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if words and not subs:
            found[" ".join(words)] = parser
        for sub in subs:
            todo += [((*words, name), p) for name, p in sub.choices.items()]
    return found


@pytest.mark.parametrize("name", sorted(every_command()))
def test_each_commands_help_is_plain_text_with_its_defaults_and_an_example(name):
    """What `parnas CMD --help` shows: no reST markup from the docstrings, every option's default, and one
    example command line at its end, of this command, with options it has."""
    parser = every_command()[name]
    text = help_text(*name.split())
    assert not re.search(r"``|:(mod|func|class|meth|attr):|`", text), text
    for action in parser._actions:
        if action.option_strings and not action.required and not isinstance(action, argparse._HelpAction):
            assert "default" in parser._get_formatter()._get_help_string(action), (name, action.option_strings)
    *_, intro, example = text.rstrip("\n").splitlines()
    assert intro == "Example:" and example.startswith(f"  parnas {name} "), text
    options = {o for a in parser._actions for o in a.option_strings}
    assert {w.split("=")[0] for w in shlex.split(example) if w.startswith("--")} <= options, example


def test_one_thing_has_one_name_across_commands():
    """The device is --accelerator wherever a command takes one, and --resume reads the same everywhere."""
    commands = every_command()
    assert not [n for n, p in commands.items() for a in p._actions if "--device" in a.option_strings]
    assert {n for n, p in commands.items() if any("--accelerator" in a.option_strings for a in p._actions)} >= {
        "retrain", "evaluate", "generate"}
    resumes = {a.help for p in commands.values() for a in p._actions if "--resume" in a.option_strings}
    assert len(resumes) == 1, resumes
