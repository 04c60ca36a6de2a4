"""A vLLM emulator: vLLM 0.32's OpenAI HTTP API, metrics and LoRA semantics, with time charged from a simulator
profile (``loraplane.sim.profile.Profile``) instead of computed. See ``docs/emulator.md``."""
