"""A Llama-style decoder (RMSNorm, RoPE, GQA attention, SwiGLU MLP) in plain torch, with multi-LoRA linears.

Weights come from a directory as ``transformers`` saves a ``LlamaForCausalLM`` (``config.json`` + safetensors with
the standard names, tied or untied embeddings) or are created deterministically from a seed and a size preset.
Every projection (q/k/v/o/gate/up/down) is a ``loraplane.kernels`` ``LoraLinear`` whose adapter weights live in
stacked slot tensors; one :class:`~loraplane.kernels.BatchPlan` per step, set on the shared ``LoraContext``,
serves every layer.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from loraplane.kernels import BatchPlan, LoraSlots
from loraplane.kernels.layers import LoraContext, LoraLinear, merge_slot, unmerge_slot
from loraplane.kernels.peft import PeftAdapter

#: The projections LoRA can target, PEFT's module names.
LORA_MODULES: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")


@dataclass(frozen=True)
class ModelConfig:
    """The subset of a ``transformers`` ``LlamaConfig`` the engine uses."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> ModelConfig:
        """Read a ``config.json`` dict; refuse what this engine does not implement, with the reason."""
        if raw.get("model_type", "llama") != "llama":
            raise ValueError(f"model_type {raw.get('model_type')!r} is not supported (only llama)")
        if raw.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {raw.get('hidden_act')!r} is not supported (only silu)")
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"rope type {rope_type!r} is not supported (only default RoPE)")
        heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        bos = raw.get("bos_token_id")
        return cls(
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_hidden_layers=int(raw["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 10000.0))),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", False)),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=eos_ids,
        )

    def to_hf(self) -> dict[str, Any]:
        """The ``config.json`` dict of a ``transformers`` ``LlamaForCausalLM`` with this config (``from_hf``'s inverse)."""
        eos: int | list[int] | None = (list(self.eos_token_ids) if len(self.eos_token_ids) > 1
                                       else (self.eos_token_ids[0] if self.eos_token_ids else None))
        return {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim, "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings, "attention_bias": self.attention_bias,
            "mlp_bias": self.mlp_bias, "bos_token_id": self.bos_token_id, "eos_token_id": eos,
            "torch_dtype": "float32", "initializer_range": 0.02, "use_cache": True,
        }

    def module_shape(self, module: str) -> tuple[int, int]:
        """(in_features, out_features) of one LoRA-targetable projection."""
        q = self.num_attention_heads * self.head_dim
        kv = self.num_key_value_heads * self.head_dim
        return {
            "q_proj": (self.hidden_size, q),
            "k_proj": (self.hidden_size, kv),
            "v_proj": (self.hidden_size, kv),
            "o_proj": (q, self.hidden_size),
            "gate_proj": (self.hidden_size, self.intermediate_size),
            "up_proj": (self.hidden_size, self.intermediate_size),
            "down_proj": (self.intermediate_size, self.hidden_size),
        }[module]


#: Seeded size presets. ``tiny`` runs several engines at once on 2 CPU cores; the byte tokenizer needs vocab >= 258.
PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(vocab_size=288, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, bos_token_id=256,
                        eos_token_ids=(257,)),
    # tiny with two 32-wide heads: vLLM-CPU's attention kernels take head sizes 32, 64, 80, ... but not 16
    "tiny-hd32": ModelConfig(vocab_size=288, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=2, num_key_value_heads=1, head_dim=32, bos_token_id=256,
                             eos_token_ids=(257,)),
    "small": ModelConfig(vocab_size=288, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=4, head_dim=32, bos_token_id=256,
                         eos_token_ids=(257,)),
    "medium": ModelConfig(vocab_size=288, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                          num_attention_heads=16, num_key_value_heads=8, head_dim=64, bos_token_id=256,
                          eos_token_ids=(257,)),
}


def module_path(layer: int, module: str) -> str:
    """``transformers``' name of one projection: ``model.layers.0.self_attn.q_proj``."""
    group = "self_attn" if module in _ATTENTION_MODULES else "mlp"
    return f"model.layers.{layer}.{group}.{module}"


def _weight_names(config: ModelConfig) -> Iterable[tuple[str, tuple[int, ...]]]:
    """Every tensor name (``transformers``' naming) with its shape."""
    yield "model.embed_tokens.weight", (config.vocab_size, config.hidden_size)
    for i in range(config.num_hidden_layers):
        for module in LORA_MODULES:
            d_in, d_out = config.module_shape(module)
            yield f"{module_path(i, module)}.weight", (d_out, d_in)
            if config.attention_bias if module in _ATTENTION_MODULES else config.mlp_bias:
                yield f"{module_path(i, module)}.bias", (d_out,)
        yield f"model.layers.{i}.input_layernorm.weight", (config.hidden_size,)
        yield f"model.layers.{i}.post_attention_layernorm.weight", (config.hidden_size,)
    yield "model.norm.weight", (config.hidden_size,)
    if not config.tie_word_embeddings:
        yield "lm_head.weight", (config.vocab_size, config.hidden_size)


def seeded_weights(config: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """Deterministic random weights (the same on every machine for one seed)."""
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in _weight_names(config):
        if name.endswith("norm.weight"):
            weights[name] = torch.ones(shape)
        elif name.endswith(".bias"):
            weights[name] = torch.zeros(shape)
        else:
            weights[name] = torch.randn(shape, generator=gen) * (1.0 / math.sqrt(shape[-1]))
    return weights


def read_checkpoint(model_dir: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Config and weights of a ``transformers``-saved ``LlamaForCausalLM`` directory (one or sharded safetensors)."""
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise ValueError(f"{model_dir} has no config.json: not a transformers model directory")
    config = ModelConfig.from_hf(json.loads(config_path.read_text()))
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{model_dir} has no *.safetensors weights")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                tensors[key] = f.get_tensor(key)
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    missing = [name for name, _ in _weight_names(config) if name not in tensors]
    if missing:
        raise ValueError(f"{model_dir}: weights missing from the checkpoint: {missing[:5]}")
    for name, shape in _weight_names(config):
        if tuple(tensors[name].shape) != shape:
            raise ValueError(f"{model_dir}: {name} has shape {tuple(tensors[name].shape)}, config says {shape}")
    return config, tensors


def checkpoint_digest(model_dir: Path) -> str:
    """``sha256:<hex>`` over ``config.json`` and the safetensors files (name and content hash, sorted)."""
    h = hashlib.sha256(b"loraplane-base-model-digest/1\n")
    for file in sorted([model_dir / "config.json", *model_dir.glob("*.safetensors")]):
        h.update(f"{file.name}\n{_file_sha256(file)}\n".encode())
    return "sha256:" + h.hexdigest()


def preset_digest(preset: str, seed: int) -> str:
    """``sha256:<hex>`` naming a seeded preset model."""
    return "sha256:" + hashlib.sha256(f"loraplane-preset/1\n{preset}\n{seed}\n".encode()).hexdigest()


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


@dataclass
class SequenceChunk:
    """One sequence's tokens in a step: ``length`` tokens at flat offset ``start`` continuing ``context`` cached ones."""

    kv_index: int
    start: int
    length: int
    context: int


class KVCache:
    """Per-sequence contiguous key/value buffers: ``max_seqs`` rows of ``max_len`` positions for every layer."""

    def __init__(self, config: ModelConfig, max_seqs: int, max_len: int, dtype: torch.dtype, device: torch.device) -> None:
        shape = (config.num_hidden_layers, max_seqs, config.num_key_value_heads, max_len, config.head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len
        self.free_rows = list(range(max_seqs - 1, -1, -1))
        self.used_tokens = [0] * max_seqs

    @property
    def capacity_tokens(self) -> int:
        """Positions the cache can hold in all."""
        return len(self.used_tokens) * self.max_len

    def usage(self) -> float:
        """Fraction of reserved positions in use (0..1): reserved = the full length of every admitted sequence."""
        return sum(self.used_tokens) / self.capacity_tokens

    def allocate(self, reserve_tokens: int) -> int | None:
        """A free row reserving ``reserve_tokens`` positions, or None when none is free."""
        if not self.free_rows or reserve_tokens > self.max_len:
            return None
        row = self.free_rows.pop()
        self.used_tokens[row] = reserve_tokens
        return row

    def release(self, row: int) -> None:
        """Give a row back."""
        self.used_tokens[row] = 0
        self.free_rows.append(row)

    @property
    def nbytes(self) -> int:
        """Bytes of the key and value buffers."""
        return self.keys.nbytes + self.values.nbytes


@contextmanager
def single_intra_op_thread() -> Iterator[None]:
    """Run this thread's torch ops on one intra-op thread, then restore its count.

    For memory-bound adapter copies: a second thread adds no bandwidth, and on busy cores every one of the
    hundreds of small per-layer copies waited for the other OpenMP thread to be scheduled (measured on 2 shared
    cores: 112 copies of one 38 MB adapter took 0.6-1.7 s with 2 threads, 45-70 ms with one). torch keeps the
    count per thread, but a thread started meanwhile may adopt the 1, so :meth:`LlamaModel.forward` re-asserts its own.
    """
    threads = torch.get_num_threads()
    if threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LlamaModel:
    """The decoder, with one :class:`LoraSlots` per (layer, projection) and a :class:`KVCache` of its own."""

    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        *,
        max_loras: int,
        max_lora_rank: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        lora_backend: str | None = None,
    ) -> None:
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        self.compute_threads = torch.get_num_threads()

        def w(name: str) -> torch.Tensor:
            return weights[name].to(device=self.device, dtype=dtype)

        self.embed = w("model.embed_tokens.weight")
        self.lm_head = self.embed if config.tie_word_embeddings else w("lm_head.weight")
        self.norm = w("model.norm.weight")
        self.lora_context = LoraContext(backend=lora_backend)
        self.layers: list[dict[str, LoraLinear]] = []
        self.norms: list[tuple[torch.Tensor, torch.Tensor]] = []
        for i in range(config.num_hidden_layers):
            layer = {}
            for module in LORA_MODULES:
                prefix = module_path(i, module)
                d_in, d_out = config.module_shape(module)
                base = nn.Linear(d_in, d_out, bias=f"{prefix}.bias" in weights, device="meta")
                base.weight = nn.Parameter(w(f"{prefix}.weight"), requires_grad=False)
                if base.bias is not None:
                    base.bias = nn.Parameter(w(f"{prefix}.bias"), requires_grad=False)
                slots = LoraSlots(num_slots=max_loras, max_rank=max_lora_rank, d_in=d_in, out_slices=(d_out,),
                                  dtype=dtype, device=self.device)
                layer[module] = LoraLinear(base, slots, self.lora_context, (prefix,))
            self.layers.append(layer)
            self.norms.append((w(f"model.layers.{i}.input_layernorm.weight"),
                               w(f"model.layers.{i}.post_attention_layernorm.weight")))
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, config.head_dim, 2, dtype=torch.float32) / config.head_dim))
        self.inv_freq = inv_freq.to(self.device)
        #: called with ("merge" | "unmerge", seconds) after every merge and unmerge (the engine's metrics)
        self.on_merge: Callable[[str, float], None] | None = None
        self._merged: set[int] = set()  # slots whose merged copies are held

    def lora_linears(self) -> Iterator[LoraLinear]:
        """Every LoRA-wrapped projection."""
        for layer in self.layers:
            yield from layer.values()

    def load_slot(self, slot: int, adapter: PeftAdapter) -> None:
        """Copy ``adapter`` into ``slot`` of every projection (zeroing the projections it does not target);
        a merged slot is unmerged first."""
        self.unmerge_slot(slot)
        with single_intra_op_thread():
            for linear in self.lora_linears():
                linear.load_adapter(slot, adapter)

    def clear_slot(self, slot: int) -> None:
        """Zero ``slot`` everywhere (unmerged first)."""
        self.unmerge_slot(slot)
        with single_intra_op_thread():
            for linear in self.lora_linears():
                linear.slots.clear(slot)

    # --- dynamic merge (engine/loraplane/engine/merging.py decides) -----------------------------------------
    @property
    def merged_slots(self) -> frozenset[int]:
        """Slots whose merged copies are held (used or not in a given step: :meth:`use_merged`)."""
        return frozenset(self._merged)

    def use_merged(self, use: bool) -> None:
        """Whether the coming steps serve the held slots' rows from their copies (True) or through the LoRA ops."""
        self.lora_context.merged_slots = frozenset(self._merged) if use else frozenset()

    def merge_slot(self, slot: int) -> int:
        """Build merged copies of every projection ``slot`` touches (base weights untouched) and use them; bytes."""
        if slot in self._merged:
            return 0
        started = time.perf_counter()
        nbytes = merge_slot(self.lora_linears(), slot)
        self._merged.add(slot)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if self.on_merge is not None:
            self.on_merge("merge", time.perf_counter() - started)
        return nbytes

    def unmerge_slot(self, slot: int) -> bool:
        """Serve ``slot`` through the LoRA ops again and free its merged copies; False when it had none."""
        if slot not in self._merged:
            return False
        started = time.perf_counter()
        unmerge_slot(self.lora_linears(), slot)
        self._merged.discard(slot)
        if self.on_merge is not None:
            self.on_merge("unmerge", time.perf_counter() - started)
        return True

    def merge_nbytes(self, slot: int | None = None) -> int:
        """Bytes merging ``slot`` would allocate (None: an adapter on every projection, the most one can take)."""
        if slot is None:
            return sum(linear.base_weight.nbytes for linear in self.lora_linears())
        return sum(linear.merge_nbytes(slot) for linear in self.lora_linears())

    def merged_nbytes(self) -> int:
        """Bytes of the merged copies held now."""
        return sum(linear.merged_nbytes for linear in self.lora_linears())

    def lora_slot_bytes(self) -> int:
        """Bytes of all stacked slot tensors (the device tier's preallocated footprint)."""
        return sum(linear.slots.nbytes for linear in self.lora_linears())

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(self.dtype), emb.sin().to(self.dtype)

    @torch.inference_mode()
    def forward(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        chunks: Sequence[SequenceChunk],
        plan: BatchPlan,
        kv: KVCache,
        all_logits: bool = False,
    ) -> torch.Tensor:
        """Run one step over flat tokens; logits of each chunk's last token ``[len(chunks), vocab]`` (all with ``all_logits``)."""
        if torch.get_num_threads() != self.compute_threads:
            torch.set_num_threads(self.compute_threads)
        cfg = self.config
        self.lora_context.plan = plan.to(self.device) if self.device.type != "cpu" else plan
        heads, kv_heads, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        cos, sin = self._rope(positions)
        cos, sin = cos[:, None, :], sin[:, None, :]
        h = self.embed[token_ids]
        for i, (layer, (attn_norm, mlp_norm)) in enumerate(zip(self.layers, self.norms, strict=True)):
            x = _rms_norm(h, attn_norm, cfg.rms_norm_eps)
            q = layer["q_proj"](x).view(-1, heads, hd)
            k = layer["k_proj"](x).view(-1, kv_heads, hd)
            v = layer["v_proj"](x).view(-1, kv_heads, hd)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            out = torch.empty_like(q)
            for c in chunks:
                end = c.context + c.length
                kv.keys[i, c.kv_index, :, c.context:end] = k[c.start:c.start + c.length].transpose(0, 1)
                kv.values[i, c.kv_index, :, c.context:end] = v[c.start:c.start + c.length].transpose(0, 1)
                keys = kv.keys[i, c.kv_index, :, :end].repeat_interleave(heads // kv_heads, dim=0)
                values = kv.values[i, c.kv_index, :, :end].repeat_interleave(heads // kv_heads, dim=0)
                query = q[c.start:c.start + c.length].transpose(0, 1)
                mask = None
                if c.length > 1:
                    mask = torch.arange(end, device=self.device)[None, :] <= (c.context + torch.arange(c.length, device=self.device))[:, None]
                attn = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask)
                out[c.start:c.start + c.length] = attn.transpose(0, 1)
            h = h + layer["o_proj"](out.reshape(-1, heads * hd))
            x = _rms_norm(h, mlp_norm, cfg.rms_norm_eps)
            gated = F.silu(layer["gate_proj"](x)) * layer["up_proj"](x)
            h = h + layer["down_proj"](gated)
        h = _rms_norm(h, self.norm, cfg.rms_norm_eps)
        if not all_logits:
            h = h[torch.tensor([c.start + c.length - 1 for c in chunks], device=self.device)]
        return F.linear(h, self.lm_head).float()

