"""The reference runtime: a small vLLM-API-compatible multi-LoRA server built on ``loraplane.kernels``."""
