"""Inference: generation with the KV cache."""

from shardforge.infer.generate import generate

__all__ = ["generate"]
