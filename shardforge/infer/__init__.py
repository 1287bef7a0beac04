"""Inference: the engine (continuous batching over a paged KV cache), its sampling, the OpenAI-compatible
server and the sessions `chat`/`generate` use."""
