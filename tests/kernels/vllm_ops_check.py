"""Run under vLLM's environment by test_vllm_plugin.py: one LoRA linear layer through vLLM-CPU's own punica
wrapper and through loraplane's, on the same stacked weights and batch mapping.

Usage: ``python vllm_ops_check.py CASE.safetensors OUT.safetensors``. The case file holds ``x``, ``base`` (the base
layer's output), per adapter ``<name>.a.<slice>`` / ``<name>.b.<slice>`` (B already scaled, as vLLM folds the scale
in at load) and ``rows`` (each row's slot, -1 = no LoRA); ``slot.<name>`` says where each adapter goes. Written:
``vllm.prefill``/``vllm.decode`` and ``loraplane.prefill``/``loraplane.decode`` (the layer output),
``vllm.logits``/``loraplane.logits`` (the first slice alone through ``add_lora_logits``), ``loraplane.bfloat16``
(the prefill case in bfloat16), and
``loraplane.reloaded`` (after slot 0 is rewritten with another adapter and the mirror is told, as vLLM's
activation does through the plugin).
"""

from __future__ import annotations

import sys

import torch
from safetensors.torch import load_file, save_file
from vllm.lora.layers.utils import LoRAMapping
from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU

from loraplane.kernels.vllm_punica import LoraplanePunicaWrapperCPU

MAX_RANK = 16
MAX_TOKENS = 64


def main(case_path: str, out_path: str) -> None:
    case = load_file(case_path)
    x, base, rows = case["x"], case["base"], case["rows"].tolist()
    widths = [int(w) for w in case["widths"].tolist()]
    adapters = sorted({key.split(".")[0] for key in case if key.endswith(".a.0")})
    slot_of = {name: int(case[f"slot.{name}"]) for name in adapters}
    num_slots = int(case["num_slots"])
    a_stacked = tuple(torch.zeros(num_slots, 1, MAX_RANK, x.shape[1]) for _ in widths)
    b_stacked = tuple(torch.zeros(num_slots, 1, width, MAX_RANK) for width in widths)

    def write(slot: int, name: str) -> None:  # what vLLM's set_lora does: copy at the adapter's rank, zero the rest
        for index in range(len(widths)):
            a, b = case[f"{name}.a.{index}"], case[f"{name}.b.{index}"]
            a_stacked[index][slot].zero_()
            b_stacked[index][slot].zero_()
            a_stacked[index][slot, 0, : a.shape[0]] = a
            b_stacked[index][slot, 0, :, : a.shape[0]] = b

    for name, slot in slot_of.items():
        write(slot, name)
    lora_index_to_id: list[int | None] = [None] * num_slots
    for slot in slot_of.values():
        lora_index_to_id[slot] = slot + 1
    ids = tuple(slot + 1 if slot >= 0 else 0 for slot in rows)
    out: dict[str, torch.Tensor] = {}
    wrappers = {
        "vllm": PunicaWrapperCPU(MAX_TOKENS, MAX_TOKENS, "cpu"),
        "loraplane": LoraplanePunicaWrapperCPU(MAX_TOKENS, MAX_TOKENS, "cpu"),
    }
    for label, wrapper in wrappers.items():
        for mode, is_prefill in (("prefill", True), ("decode", False)):
            wrapper.update_metadata(LoRAMapping(ids, ids, is_prefill=is_prefill), lora_index_to_id, num_slots + 1, 128)
            y = base.clone()
            wrapper.add_lora_linear(y, x, a_stacked, b_stacked, 1.0, tuple(widths))
            out[f"{label}.{mode}"] = y
        logits = base[:, : widths[0]].clone()  # the first slice alone as a logits head (per-request rows)
        wrapper.add_lora_logits(logits, x, a_stacked[0], b_stacked[0], 1.0)
        out[f"{label}.logits"] = logits
    ours = wrappers["loraplane"]
    half = torch.bfloat16  # vLLM-CPU's default dtype: the cpu backend hands it to the torch backend
    ours.update_metadata(LoRAMapping(ids, ids, is_prefill=True), lora_index_to_id, num_slots + 1, 128)
    y = base.to(half)
    ours.add_lora_linear(
        y, x.to(half), tuple(t.to(half) for t in a_stacked), tuple(t.to(half) for t in b_stacked), 1.0, tuple(widths)
    )
    out["loraplane.bfloat16"] = y.float()
    first, second = adapters[0], adapters[1]
    write(slot_of[first], second)
    assert isinstance(ours, LoraplanePunicaWrapperCPU)
    ours.mirror.slot_written(slot_of[first])
    y = base.clone()
    ours.add_lora_linear(y, x, a_stacked, b_stacked, 1.0, tuple(widths))
    out["loraplane.reloaded"] = y
    save_file({key: value.contiguous() for key, value in out.items()}, out_path)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
