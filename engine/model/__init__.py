"""The model and what runs it: the Llama-family decoder, attention backends, loading, the runner."""
