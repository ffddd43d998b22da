"""OpenAI-compatible HTTP server over the AsyncEngine."""
