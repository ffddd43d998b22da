"""Linear-layer variants beside the dense one: a GGUF's Q4_1 blocks (LoRA and quantized linears next)."""
