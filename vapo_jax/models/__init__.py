"""Decoder-only transformers (Qwen2 / Qwen2.5 and Llama families) as Flax NNX modules.

  config            the architecture of a transformer (`TransformerConfig`), presets, a Hugging Face
                    `config.json` read
  transformer       the causal LM and the value model, decoder layers stacked and scanned, with KV cache
  attention         `attend`: one entry point over the pure-JAX flash attention and the platform kernels
  flash             flash attention in pure JAX (`chunked`), which runs everywhere
  decode_attention  one-token decode attention that reads only the filled part of a KV cache
  logprobs          log-probabilities and entropy of tokens from hidden states, vocabulary-blocked
  sharding          logical axis names → mesh axes: the parallelism presets, the mesh, sharded creation
  huggingface       Hugging Face checkpoints in and out (config.json + safetensors)
  safetensors_io    the safetensors format read and written with numpy, one tensor at a time
  footprint         the per-device memory of a model before allocation: parameters, optimizer state,
                    activations
  hlo               the collectives of a compiled XLA program, read from its HLO text
"""
