"""The pooling runner: embeddings from encoder (BERT) and decoder (Llama-family) models, no KV cache kept."""
