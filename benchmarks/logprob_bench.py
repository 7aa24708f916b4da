"""Log-probs + entropy + gradient without `[B, T, V]` logits, against the dense path, side by side.

  python -m benchmarks.long_seq_bench --only logprobs      (part of `make bench`)
  python -m benchmarks.logprob_bench [--repeats 3] [--chunk 128]

The Qwen2.5-0.5B output layer (V = 151,936, D = 896, tied `[V, D]` embedding), B = 1, T = 2,048,
float32: value and gradient (with respect to the hidden states and the kernel) of
Σ g·log π + Σ g'·H, through `models/logprobs.token_logprobs_entropy` (at most B·chunk·V logits at a
time) and through the dense `[B, T, V]` logits (`dense_token_logprobs_entropy`, plain autodiff).
Memory is XLA's compiled temp size; time the best wall time of `--repeats` calls, the two paths
called alternately so that load from other processes falls on both.
"""

import argparse
import sys
import time

import jax
import jax.numpy as jnp

from benchmarks.tables import RatioTarget, Table, print_table, targets_table
from vapo_jax.models import logprobs

SHAPE = dict(batch=1, tokens=2048, width=896, vocab=151936)  # Qwen2.5-0.5B's output layer.
CHUNK = 128  # B·128·V logits at a time: about 1/16 of the dense path's [B, T, V].


def _inputs():
  b, t, d, v = SHAPE["batch"], SHAPE["tokens"], SHAPE["width"], SHAPE["vocab"]
  keys = jax.random.split(jax.random.key(0), 5)
  hidden = jax.random.normal(keys[0], (b, t, d))
  kernel = 0.05 * jax.random.normal(keys[1], (v, d))  # Tied embedding layout [V, D].
  tokens = jax.random.randint(keys[2], (b, t), 0, v)
  return hidden, kernel, tokens, jax.random.normal(keys[3], (b, t)), jax.random.normal(keys[4], (b, t))


def _step(fn):
  """jit of (loss, (log π, H)), (∂hidden, ∂kernel) for Σ g·log π + Σ g'·H."""
  def loss(hidden, kernel, tokens, g_lp, g_h):
    logp, ent = fn(hidden, kernel, tokens)
    return jnp.sum(g_lp * logp) + jnp.sum(g_h * ent), (logp, ent)
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))


def measure(repeats: int, chunk: int) -> dict:
  inputs = _inputs()
  steps = {
      "dense": _step(lambda h, w, t: logprobs.dense_token_logprobs_entropy(h, w, t, entropy=True, transposed=True)),
      f"chunked ({chunk})": _step(lambda h, w, t: logprobs.token_logprobs_entropy(
          h, w, t, chunk=chunk, entropy=True, transposed=True)),
  }
  compiled = {name: step.lower(*inputs).compile() for name, step in steps.items()}
  temp = {name: c.memory_analysis().temp_size_in_bytes for name, c in compiled.items()}
  outputs = {name: jax.block_until_ready(c(*inputs)) for name, c in compiled.items()}  # Warm-up calls.
  (_, (lp_a, h_a)), (gh_a, gk_a) = outputs["dense"]
  (_, (lp_b, h_b)), (gh_b, gk_b) = outputs[f"chunked ({chunk})"]
  rel = lambda a, b: float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))
  agreement = {"log π": rel(lp_b, lp_a), "H": rel(h_b, h_a), "∂hidden": rel(gh_b, gh_a), "∂kernel": rel(gk_b, gk_a)}
  seconds = {name: [] for name in compiled}
  for _ in range(repeats):
    for name, c in compiled.items():
      start = time.perf_counter()
      jax.block_until_ready(c(*inputs))
      seconds[name].append(time.perf_counter() - start)
  return dict(temp=temp, seconds={k: min(v) for k, v in seconds.items()}, agreement=agreement, chunk=chunk)


def logprob_section(args):
  """The `long_seq_bench` section: (tables, targets)."""
  m = measure(args.repeats, getattr(args, "chunk", CHUNK))
  dense, chunked = m["temp"]  # Names, in order.
  rows = [(name, m["temp"][name] / 2**20, m["temp"][name] / m["temp"][dense], m["seconds"][name],
           m["seconds"][name] / m["seconds"][dense]) for name in m["temp"]]
  s = SHAPE
  table = Table(f"log-probs + entropy + gradient: B={s['batch']} T={s['tokens']:,} D={s['width']} "
                f"V={s['vocab']:,} float32, tied kernel (best of {args.repeats}, {jax.devices()[0].platform})",
                ("path", "temp MiB", "temp / dense", "seconds", "time / dense"), rows)
  agreement = Table("chunked against dense: max |difference| / max |dense|", ("quantity", "relative"),
                    [(k, f"{v:.1e}") for k, v in m["agreement"].items()])
  targets = [RatioTarget("log-probs temp: chunked / dense", m["temp"][chunked] / m["temp"][dense], "<=", 1 / 8),
             RatioTarget("log-probs time: chunked / dense", m["seconds"][chunked] / m["seconds"][dense], "<=", 1.3)]
  return [table, agreement], targets


def main(argv) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--repeats", type=int, default=3, help="timed calls per path (best of)")
  parser.add_argument("--chunk", type=int, default=CHUNK, help="logits budget: B·chunk·V at a time")
  args = parser.parse_args(argv)
  tables, targets = logprob_section(args)
  for table in tables + [targets_table(targets)]:
    print_table(table)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
