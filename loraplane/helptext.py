"""The help format every loraplane command uses: each option's default shown, docstrings readable as plain text."""

from __future__ import annotations

import argparse
import re

_RST_LITERAL = re.compile(r"``(.+?)``", re.S)


def plain(text: str) -> str:
    """``text`` without reStructuredText literal markup (a docstring used as a command's description)."""
    return _RST_LITERAL.sub(r"\1", text)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` with each option's default appended (unless its help already names one or there is none), and
    descriptions kept in paragraphs with their rst literal markup removed."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if ("default" in text.lower() or default is None or default is argparse.SUPPRESS
                or isinstance(default, bool) or (isinstance(default, list | tuple | dict) and not default)):
            return text
        return super()._get_help_string(action)

    def _expand_help(self, action: argparse.Action) -> str:
        return plain(super()._expand_help(action))

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        paragraphs = re.split(r"\n\s*\n", plain(text).strip())
        return "\n\n".join(super(HelpFormatter, self)._fill_text(p, width, indent) for p in paragraphs)
