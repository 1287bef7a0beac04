"""Llama decoder family: Llama 2/3.x, Mistral, Qwen2/2.5, Qwen3."""
