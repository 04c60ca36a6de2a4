"""Tokenizers: the model directory's ``tokenizer.json`` when it has one, else a byte-level tokenizer."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol


class Tokenizer(Protocol):
    """Text <-> token ids."""

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (with the BOS token when the model has one)."""
        ...

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids``; special and out-of-range ids decode to nothing."""
        ...


class ByteTokenizer:
    """One token per UTF-8 byte (ids 0..255); ``bos``/``eos`` and any id >= 256 decode to nothing."""

    def __init__(self, bos_token_id: int | None) -> None:
        self.bos_token_id = bos_token_id

    def encode(self, text: str) -> list[int]:
        """Bytes of ``text``, after BOS when the model has one."""
        prefix = [] if self.bos_token_id is None else [self.bos_token_id]
        return prefix + list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        """The bytes < 256 as UTF-8 (invalid sequences become U+FFFD)."""
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class JsonTokenizer:
    """A ``tokenizers`` ``tokenizer.json`` (needs the ``tokenizers`` package, which ``transformers`` brings)."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer as HfTokenizer

        self._tok = HfTokenizer.from_file(str(path))

    def encode(self, text: str) -> list[int]:
        """Ids with the tokenizer's own special-token template."""
        return list(self._tok.encode(text).ids)

    def decode(self, ids: list[int]) -> str:
        """Text without special tokens."""
        return str(self._tok.decode(ids, skip_special_tokens=True))


def load_tokenizer(model_dir: Path | None, bos_token_id: int | None) -> Tokenizer:
    """``tokenizer.json`` of ``model_dir`` if present, else :class:`ByteTokenizer`."""
    if model_dir is not None and (model_dir / "tokenizer.json").is_file():
        return JsonTokenizer(model_dir / "tokenizer.json")
    return ByteTokenizer(bos_token_id)


def chat_prompt(messages: list[dict[str, str]]) -> str:
    """The engine's plain chat template: ``<|role|>\\ncontent\\n`` per message, then ``<|assistant|>\\n``."""
    return "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages) + "<|assistant|>\n"
