"""Quantized checkpoints: compressed-tensors (W4A16, W8A16, FP8), AutoAWQ, GPTQ and FP8 checkpoints.

schemes.py reads a checkpoint's `quantization_config` (or refuses it, naming the scheme); layouts.py turns each
format's tensors into one packed form (packed.py), which the Linears keep in memory and dequantize per call.
"""
