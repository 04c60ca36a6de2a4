"""The emulator's tokens: one per whitespace-separated word, and deterministic outputs a client can check.

A prompt's text is split on whitespace, one token per word: ``w<id>`` (an id below :data:`VOCAB_SIZE`) is that id,
so an answer sent back as the next prompt tokenizes to the ids it was made of; any other word is a hash into the
vocabulary. Chat messages render as ``role: content`` lines and a last ``assistant:`` (the generation prompt a chat
template adds), so a conversation's next turn starts with the previous turn's prompt and answer.

Output ids are a function of (identity, prompt ids, position), where identity is the adapter's content digest
(``loraplane.api.adapter_digest``) or the served base model name: :func:`expected_tokens` tells a client which
revision answered.
"""

from __future__ import annotations

import hashlib
import re
import zlib
from array import array
from collections.abc import Iterable, Sequence

#: Token ids the emulator writes (and reads back from ``w<id>`` words).
VOCAB_SIZE = 4096

_ID_WORD = re.compile(r"w(\d{1,4})")


def encode(text: str) -> list[int]:
    """One token id per whitespace-separated word."""
    ids = []
    for word in text.split():
        known = _ID_WORD.fullmatch(word)
        if known and int(known.group(1)) < VOCAB_SIZE:
            ids.append(int(known.group(1)))
        else:
            ids.append(zlib.crc32(word.encode()) % VOCAB_SIZE)
    return ids


def token_text(token_id: int) -> str:
    """The text of one token: a space and ``w<id>``."""
    return f" w{token_id}"


def render(ids: Iterable[int]) -> str:
    """The text of a token sequence."""
    return "".join(map(token_text, ids))


def chat_prompt(messages: Sequence[tuple[str, str]]) -> str:
    """``role: content`` per message, then the generation prompt ``assistant:``."""
    return "".join(f"{role}: {content}\n" for role, content in messages) + "assistant:"


class OutputTokens:
    """The output token ids of one (identity, prompt): computed on demand, position by position."""

    def __init__(self, identity: str, prompt_ids: Sequence[int]) -> None:
        self._seed = hashlib.blake2b(identity.encode() + b"\0" + array("q", prompt_ids).tobytes(),
                                     digest_size=16).digest()
        self.ids: list[int] = []

    def first(self, n: int) -> list[int]:
        """The first ``n`` output ids."""
        ids, seed = self.ids, self._seed
        while len(ids) < n:
            digest = hashlib.blake2b(seed + len(ids).to_bytes(4, "little"), digest_size=8).digest()
            ids.append(int.from_bytes(digest, "little") % VOCAB_SIZE)
        return ids[:n]


def expected_tokens(identity: str, prompt_ids: Sequence[int], n: int) -> list[int]:
    """The first ``n`` token ids the emulator answers ``prompt_ids`` with, as the model or adapter ``identity``
    (the adapter's ``loraplane.api.adapter_digest``, or the served base model name)."""
    return OutputTokens(identity, prompt_ids).first(n)


def expected_text(identity: str, prompt: str, n: int) -> str:
    """The text the emulator answers a completion ``prompt`` (text) with, ``n`` tokens long."""
    return render(expected_tokens(identity, encode(prompt), n))
