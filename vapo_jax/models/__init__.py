"""Decoder-only transformers (Qwen2 / Qwen2.5 and Llama families) as Flax NNX modules."""
