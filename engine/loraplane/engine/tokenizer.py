"""Tokenizers: the model directory's ``tokenizer.json`` when it has one, else a byte-level tokenizer."""

from __future__ import annotations

import json
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


def _byte_alphabet() -> list[str]:
    """The printable character ``tokenizers``' ByteLevel pre-tokenizer maps each byte 0..255 to (GPT-2's table)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


def write_byte_tokenizer(out_dir: Path, vocab_size: int, bos_token_id: int | None,
                         eos_token_ids: tuple[int, ...]) -> None:
    """Write ``tokenizer.json`` + ``tokenizer_config.json`` that tokenize exactly as :class:`ByteTokenizer`.

    A byte-level BPE without merges (id = byte value), BOS prepended when the model has one, and every id from 256 to
    ``vocab_size`` a special token (``<s>``, ``</s>``, ``<extra_N>``) that decodes to nothing: vLLM, ``transformers``
    and the engine then agree on every id. Needs the ``tokenizers`` package.
    """
    from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors
    from tokenizers import Tokenizer as HfTokenizer

    if vocab_size < 256:
        raise ValueError(f"a byte tokenizer needs vocab_size >= 256, got {vocab_size}")
    alphabet = _byte_alphabet()
    tok = HfTokenizer(models.BPE(vocab={ch: b for b, ch in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    names: dict[int, str] = {eos: "</s>" if i == 0 else f"</s{i}>" for i, eos in enumerate(eos_token_ids)}
    if bos_token_id is not None:
        names[bos_token_id] = "<s>"
    specials = [names.get(i, f"<extra_{i}>") for i in range(256, vocab_size)]
    tok.add_special_tokens([AddedToken(name, special=True, normalized=False) for name in specials])
    if bos_token_id is not None:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                           special_tokens=[("<s>", bos_token_id)])
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    tokenizer_config: dict[str, object] = {
        "tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
        "model_max_length": 1 << 20,
    }
    if bos_token_id is not None:
        tokenizer_config["bos_token"] = "<s>"
    if eos_token_ids:
        tokenizer_config["eos_token"] = "</s>"
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")


def load_tokenizer(model_dir: Path | None, bos_token_id: int | None) -> Tokenizer:
    """``tokenizer.json`` of ``model_dir`` if present, else :class:`ByteTokenizer`."""
    if model_dir is not None and (model_dir / "tokenizer.json").is_file():
        return JsonTokenizer(model_dir / "tokenizer.json")
    return ByteTokenizer(bos_token_id)


def chat_prompt(messages: list[dict[str, str]]) -> str:
    """The engine's plain chat template: ``<|role|>\\ncontent\\n`` per message, then ``<|assistant|>\\n``."""
    return "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages) + "<|assistant|>\n"
