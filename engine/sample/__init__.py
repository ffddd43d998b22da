"""The sampler and its per-sequence penalty state."""
