"""Tensor parallelism: shards, collectives and the worker processes."""
