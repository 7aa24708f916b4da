"""Forward-pass throughput of the real Qwen2.5-0.5B architecture (random weights) on this machine.

  python -m benchmarks.model_bench [--batch 8] [--length 512]

The prompt text is tokenized with the real Qwen2.5 tokenizer from the repository's data/ folder.
"""

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from vapo_jax import paths
from vapo_jax.models.config import preset
from vapo_jax.models.transformer import CausalLM, positions_from_mask

TOKENIZER = paths.data_path("qwen2.5_tokenizer")


def tokens_for(batch: int, length: int) -> np.ndarray:
  if os.path.isdir(TOKENIZER):
    from vapo_jax.data.tokenizer import load_tokenizer
    tokenizer = load_tokenizer(TOKENIZER)
    text = " ".join(f"Step {i}: multiply {i} by {i + 3} and add the previous total." for i in range(length))
    ids = np.asarray(tokenizer(text).input_ids[:length])
    print(f"tokens: real Qwen2.5 tokenizer ({len(tokenizer)} entries)")
  else:
    ids = np.arange(length) % 151_000
    print("tokens: synthetic ids (tokenizer not found)")
  return np.tile(ids[None], (batch, 1))


def main(argv):
  parser = argparse.ArgumentParser()
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--length", type=int, default=512)
  parser.add_argument("--preset", default="qwen2.5-0.5b")
  args = parser.parse_args(argv)
  cfg = preset(args.preset)
  start = time.perf_counter()
  model = CausalLM(cfg, dtype="float32", param_dtype="float32", rngs=nnx.Rngs(0))
  print(f"{args.preset}: {cfg.num_parameters() / 1e9:.3f} B parameters, built in {time.perf_counter() - start:.1f}s")
  tokens = jnp.asarray(tokens_for(args.batch, args.length))
  mask = jnp.ones_like(tokens)
  positions = positions_from_mask(mask)
  forward = jax.jit(lambda m, t, p, a: jnp.argmax(m(t, p, a)[0], -1))
  start = time.perf_counter()
  jax.block_until_ready(forward(model, tokens, positions, mask))
  print(f"compile + first call: {time.perf_counter() - start:.1f}s")
  times = []
  for _ in range(3):
    start = time.perf_counter()
    jax.block_until_ready(forward(model, tokens, positions, mask))
    times.append(time.perf_counter() - start)
  seconds = float(np.median(times))
  print(f"forward {args.batch} x {args.length} tokens: {seconds:.2f}s median of 3 -> "
        f"{args.batch * args.length / seconds:,.0f} tokens/s ({jax.devices()[0].platform}, float32)")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
