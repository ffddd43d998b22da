"""Tensor and pipeline parallelism: shards, stages, their communication, and the worker processes."""
