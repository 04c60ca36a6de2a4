"""The twin's replayed prompts: as many emulator tokens as the trace row says, a first block of their own, and about
four bytes a token, so the picker's estimate from the body's size is the simulator's count."""

from __future__ import annotations

import orjson
import pytest

from loraplane.emulator.tokens import encode
from loraplane.picker.body import parse_body
from loraplane.stack.twin import prompt_text


@pytest.mark.parametrize("tokens", [1, 40, 1_000, 7_435])
def test_a_prompt_is_the_rows_tokens_and_the_picker_estimates_them_from_its_size(tokens: int) -> None:
    prompt = prompt_text(17, tokens)
    assert len(encode(prompt)) == tokens
    body = orjson.dumps({"model": "claims", "prompt": prompt, "max_tokens": 16})
    estimate = parse_body(body, 1 << 30).prompt_tokens
    assert estimate == pytest.approx(tokens, rel=0.1, abs=60)


def test_no_two_requests_share_a_first_block() -> None:
    assert encode(prompt_text(1, 1_000))[:16] != encode(prompt_text(2, 1_000))[:16]
