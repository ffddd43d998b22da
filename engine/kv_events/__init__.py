"""KV-cache events as vLLM publishes them: which blocks an engine holds, for routers that route by prefix."""
