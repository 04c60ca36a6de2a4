"""Every ``loraplane`` command's help: each option explained with its default, no rst markup, subcommands listed.

The parsers are the real ones: each command's entry point runs until it parses its arguments, where the test takes
the parser it built (every command builds its parser before doing anything else).
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Iterator

import pytest

from loraplane.cli import BENCHMARKS, COMMANDS, main
from loraplane.engine.cli import TOOLS

#: what ``loraplane --help`` must name: the components' commands
COMPONENT_COMMANDS = ("picker", "controller", "sidecar", "engine", "sim", "plan", "up", "devcluster", "bench")


class _Parsed(Exception):
    """Raised in place of parsing: carries the parser the entry point built."""


def _parser_of(target: str, monkeypatch: pytest.MonkeyPatch) -> argparse.ArgumentParser:
    def capture(self: argparse.ArgumentParser, *_args: object, **_kwargs: object) -> None:
        raise _Parsed(self)

    module, _, function = target.partition(":")
    entry = getattr(importlib.import_module(module), function)
    with monkeypatch.context() as patch:
        patch.setattr(argparse.ArgumentParser, "parse_known_args", capture)
        with pytest.raises(_Parsed) as parsed:
            entry([])
    parser: argparse.ArgumentParser = parsed.value.args[0]
    return parser


def _walk(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _walk(sub)


TARGETS = {
    "loraplane": "loraplane.cli:main",
    **{f"loraplane {name}": target for name, (target, _) in COMMANDS.items()},
    **{f"loraplane bench {name}": target for name, (target, _) in BENCHMARKS.items()},
    **{f"loraplane engine {name}": target for name, (target, _) in TOOLS.items()},
}


@pytest.mark.parametrize("command", sorted(TARGETS))
def test_every_option_has_help_with_its_default_and_no_rst(command: str, monkeypatch: pytest.MonkeyPatch) -> None:
    for parser in _walk(_parser_of(TARGETS[command], monkeypatch)):
        text = parser.format_help()
        assert "``" not in text, f"{parser.prog}: rst literal in its help"
        assert parser.description, f"{parser.prog} has no description"
        formatter = parser._get_formatter()
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction | argparse._VersionAction):
                continue
            name = "/".join(action.option_strings) or action.dest
            if isinstance(action, argparse._SubParsersAction):
                assert all(choice.help for choice in action._choices_actions), f"{parser.prog}: a command lacks help"
                continue
            assert action.help and action.help is not argparse.SUPPRESS, f"{parser.prog} {name} has no help"
            shown = formatter._expand_help(action)
            default = action.default
            if action.option_strings and default not in (None, argparse.SUPPRESS, [], ()) and not isinstance(default, bool):
                assert "default" in shown.lower(), f"{parser.prog} {name}: default {default!r} not shown: {shown!r}"


def test_top_level_help_names_the_component_commands(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 0
    text = capsys.readouterr().out
    for command in COMPONENT_COMMANDS:
        assert f"\n    {command}" in text, (command, text)


@pytest.mark.parametrize("name", ["controller", "picker"])
def test_bench_help_shows_the_benchmarks_own_options(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["bench", name, "--help"])
    assert exited.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith(f"usage: loraplane bench {name} ")
    assert "--quick" in text or "--revisions" in text


def test_bench_without_a_name_lists_the_benchmarks(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench"]) == 2
    text = capsys.readouterr().out
    assert all(f"\n    {name}" in text for name in BENCHMARKS), text


def test_engine_help_lists_its_tools(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["engine", "--help"])
    assert exited.value.code == 0
    text = capsys.readouterr().out
    assert all(f"\n    {tool}" in text for tool in TOOLS), text
    with pytest.raises(SystemExit) as exited:
        main(["engine", "frobnicate"])
    assert exited.value.code == 2
