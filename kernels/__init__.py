"""Multi-LoRA ops (shrink/expand, SGMV/BGMV, fused delta), host-side batch planning and backends."""
