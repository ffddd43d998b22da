"""Speculative decoding: the config, proposers (n-gram, draft model) and verification."""
