"""docs/cli.md stays in sync with the click commands: every command has a section, every
visible option is documented there, every documented option exists, and the examples of
each ``--help`` are the section's examples."""

from __future__ import annotations

import re
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from sclayout.cli import main

DOC = Path(__file__).resolve().parents[2] / "docs" / "cli.md"
OPTION = re.compile(r"(?<![\w-])(--?[a-z][a-z0-9-]*)")


def sections() -> dict[str, str]:
    parts = re.split(r"^## `sclayout (\w+)`\s*$", DOC.read_text(), flags=re.M)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def documented_options(section: str) -> set[str]:
    """Options named in the first column of the section's option table."""
    rows = [ln.split("|")[1] for ln in section.splitlines() if ln.startswith("| `-")]
    return {o for row in rows for o in OPTION.findall(row.split("`")[1])}


def visible_options(cmd: click.Command) -> set[str]:
    return {
        o
        for p in cmd.params
        if isinstance(p, click.Option) and not p.hidden
        for o in (*p.opts, *p.secondary_opts)
    } - {"-h", "--help"}


def all_options(cmd: click.Command) -> set[str]:
    return {o for p in cmd.params for o in (*p.opts, *p.secondary_opts)} | {"-h", "--help"}


def test_every_command_has_a_section_and_nothing_else() -> None:
    assert sorted(sections()) == sorted(main.commands)


def test_the_command_table_is_the_short_help() -> None:
    text = DOC.read_text()
    for name, cmd in main.commands.items():
        assert f"| [`{name}`](#sclayout-{name}) | {cmd.short_help} |" in text, name


@pytest.mark.parametrize("name", sorted(main.commands))
def test_the_option_table_matches_the_command(name: str) -> None:
    cmd, doc = main.commands[name], documented_options(sections()[name])
    assert visible_options(cmd) - doc == set(), "undocumented options"
    assert doc - visible_options(cmd) == set(), "documented options that do not exist"


@pytest.mark.parametrize("name", sorted(main.commands))
def test_the_examples_are_those_of_the_help_and_use_real_options(name: str) -> None:
    section = sections()[name]
    blocks = re.findall(r"```\n(.*?)```", section, flags=re.S)
    examples = [ln for b in blocks for ln in b.splitlines() if ln.startswith("sclayout ")]
    helptext = CliRunner().invoke(main, [name, "--help"]).output
    in_help = helptext.split("Examples:")[1].split("Exit codes:")[0]
    assert [ln.strip() for ln in in_help.strip().splitlines()] == examples[1:]
    assert examples[0].startswith(f"sclayout {name} [OPTIONS]")  # the usage line
    for ex in examples[1:]:
        used = set(OPTION.findall(ex.split(f"sclayout {name} ", 1)[1]))
        assert used <= all_options(main.commands[name]), (
            ex,
            used - all_options(main.commands[name]),
        )


def test_the_deprecated_names_are_hidden_options_of_their_command() -> None:
    doc = DOC.read_text().split("### Deprecated names")[1].split("\n## ")[0]
    rows = [ln for ln in doc.splitlines() if ln.startswith("| `")]
    assert len(rows) == 3
    for row in rows:
        name, old = re.match(r"\| `(\w+) (--[\w-]+)", row).groups()
        params = main.commands[name].params
        hidden = {o for p in params if getattr(p, "hidden", False) for o in p.opts}
        assert old in hidden, row


def test_the_exit_codes_table_is_the_one_the_commands_use() -> None:
    from sclayout.cli import _common

    doc = DOC.read_text().split("### Exit codes")[1].split("###")[0]
    codes = {int(m) for m in re.findall(r"^\| (\d+) \|", doc, flags=re.M)}
    used = {_common.EXIT_OK, _common.EXIT_DIFFERS, _common.EXIT_USAGE, _common.EXIT_INTERRUPTED}
    assert codes == used == {0, 1, 2, 130}
