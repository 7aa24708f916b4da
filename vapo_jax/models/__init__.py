"""Decoder-only transformers (Qwen2 / Qwen2.5 and Llama families) as Flax NNX modules.

  config            the architecture, read from a Hugging Face `config.json`, and the named presets
  transformer       the causal LM and the value model, decoder layers stacked and scanned, with KV cache
  remat             rematerialisation policies: what a decoder layer keeps for the backward pass
  glu               the MLP's middle, silu(gate) · up, its gradient written out and written to memory once
  int8_weights      int8 matmul kernels with a scale per output channel: the rollout's quantised weights
  attention         `attend`: flash attention in pure JAX, the platform kernels, the dense oracle
  flash             `chunked`, the pure-JAX flash attention that runs everywhere
  splash            the Pallas TPU splash kernel, visiting only the block pairs whose tokens share a segment
  kv_cache          the KV cache, one interface: contiguous (`KVCache`) and paged (`PagedKVCache`)
  decode_attention  one-token decode attention over the filled part of a contiguous KV cache
  paged_attention   one-token decode attention over a paged KV cache: the TPU and GPU kernels, a gather, the oracle
  paged_int8        int8 pages with per-token scales, and a Pallas TPU decode kernel that reads them
  pallas_gpu        the Pallas GPU kernels JAX ships, in this package's layouts: paged decode, packed rows
  logprobs          log-probabilities and entropy of tokens from vocabulary blocks, without `[B, T, V]` logits
  sharding          logical axis names → mesh axes: the parallelism presets, the mesh, sharded creation
  collective_matmul a tensor group's activation gathers and reductions in steps around the matmuls' chunks
  huggingface       Hugging Face checkpoints in: config.json + safetensors, the tensor names both ways
  hub               `hf:NAME[@REVISION]`: a Hub model downloaded into its cache (or read from it), one line on failure
  hf_export         Hugging Face checkpoints out: the export, sharded, with the tokenizer's files
  safetensors_io    the safetensors format, read and written one tensor at a time
"""
