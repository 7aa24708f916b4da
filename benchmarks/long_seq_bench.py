"""Long sequences: memory and time of the paths that grow with the sequence, measured side by side.

  make bench        (or: python -m benchmarks.long_seq_bench [--repeats 3])

Each section measures on this machine and returns tables; one printer formats them all, and a
"targets" table gives each ratio with its target and whether it is met. Memory is XLA's compiled
`memory_analysis().temp_size_in_bytes` (the scratch a program needs besides its inputs and
outputs); time is the best wall time of `--repeats` jitted calls after a warm-up call, the variants
compared called in turn (the best, not the median: other processes on a shared machine only ever
add time).

Sections:
  attention   forward+backward of `models/attention.py`: `chunked` against the dense `reference`
              at T = 2,048 / 4,096 / 8,192 (B=1, 4 query heads on 2 kv heads, H=64, float32,
              causal), and `chunked` with and without causal block skipping.
  logprobs    log-probs + entropy + gradient of the Qwen2.5-0.5B output layer (V = 151,936, D = 896)
              at T = 2,048: vocabulary-blocked against dense logits (`benchmarks/logprob_bench.py`).
  actor_update  compiled memory of one actor update of the `small` preset at T = 4,096, before
              (reference attention, whole-response logits) and after (chunked, 512-position blocks).
"""

import argparse
import sys
from collections.abc import Callable

import jax
import jax.numpy as jnp

from benchmarks import logprob_bench
from benchmarks.tables import RatioTarget, Table, best_seconds, print_table, targets_table
from vapo_jax.models import attention, flash


def temp_bytes(fn: Callable, *args) -> int:
  return fn.lower(*args).compile().memory_analysis().temp_size_in_bytes


# ----------------------------------------------------------------------------- attention

ATTENTION_SHAPE = dict(batch=1, heads=4, kv_heads=2, head_dim=64)


def _attention_inputs(length: int):
  s = ATTENTION_SHAPE
  keys = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(keys[0], (s["batch"], length, s["heads"], s["head_dim"]))
  k, v = (jax.random.normal(x, (s["batch"], length, s["kv_heads"], s["head_dim"])) for x in keys[1:3])
  weights = jax.random.normal(keys[3], q.shape)
  return q, k, v, weights


def _attention_step(impl: str, length: int, **options):
  """jit of (loss, dq, dk, dv) for Σ w ∘ attention(q, k, v): forward and backward."""
  ranges = dict(key_start=jnp.zeros(ATTENTION_SHAPE["batch"], jnp.int32),
                key_end=jnp.full(ATTENTION_SHAPE["batch"], length, jnp.int32))
  fn = attention.reference if impl == "reference" else flash.chunked
  loss = lambda q, k, v, w: jnp.sum(fn(q, k, v, **ranges, causal=True, **options) * w)
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def attention_section(args) -> tuple[list[Table], list[RatioTarget]]:
  mib = lambda n: n / 2**20
  memory, rows = {}, []
  for length in (2048, 4096, 8192):
    inputs = _attention_inputs(length)
    for impl in ("reference", "chunked"):
      memory[impl, length] = temp_bytes(_attention_step(impl, length), *inputs)
      rows.append((length, impl, mib(memory[impl, length])))
  memory_table = Table("attention fwd+bwd: compiled temp memory (MiB), B=1 N=4 K=2 H=64 float32 causal",
                       ("T", "impl", "temp MiB"), rows)

  seconds, rows = {}, []
  for length, variants in ((2048, ("reference", "chunked")), (4096, ("chunked", "chunked, no skipping"))):
    steps = {name: _attention_step("reference" if name == "reference" else "chunked", length,
                                   **(dict(skip_masked_blocks=False) if name.endswith("no skipping") else {}))
             for name in variants}
    for name, best in best_seconds(steps, *_attention_inputs(length), repeats=args.repeats).items():
      seconds[name, length] = best
      rows.append((length, name, best))
  time_table = Table(f"attention fwd+bwd: time (s, best of {args.repeats}), {jax.devices()[0].platform}",
                     ("T", "impl", "seconds"), rows)

  targets = [
      RatioTarget("attention temp @4096: chunked / reference", memory["chunked", 4096] / memory["reference", 4096],
             "<=", 1 / 8),
      RatioTarget("attention temp 8192 / 4096: chunked", memory["chunked", 8192] / memory["chunked", 4096], "<=", 2.5),
      RatioTarget("attention temp 8192 / 4096: reference (≈ 4)",
             memory["reference", 8192] / memory["reference", 4096], ">=", 3.0),
      RatioTarget("attention time @2048: chunked / reference", seconds["chunked", 2048] / seconds["reference", 2048],
             "<=", 1.5),
      RatioTarget("attention time @4096: no skipping / skipping",
             seconds["chunked, no skipping", 4096] / seconds["chunked", 4096], ">=", 1.6),
  ]
  return [memory_table, time_table], targets


# ------------------------------------------------------------------------------ actor update

def _actor_update_memory(attention_impl: str, chunk: int, *, batch: int = 2, length: int = 4096,
                         response: int = 4032) -> tuple[int, int]:
  """(temp, temp + arguments + outputs) bytes of one compiled actor update of the `small` preset
  (remat on) on `batch` sequences of `length` tokens, the last `response` of them the response."""
  import functools

  import numpy as np
  from flax import nnx

  from vapo_jax.config import AlgoConfig, OptimizerConfig
  from vapo_jax.models.config import preset
  from vapo_jax.models.transformer import CausalLM
  from vapo_jax.train import optim, steps
  graphdef, params = nnx.split(CausalLM(preset("small"), remat=True, attention=attention_impl, rngs=nnx.Rngs(0)))
  tx = optim.make_optimizer(OptimizerConfig(), 1e-6)
  rng = np.random.default_rng(0)
  f32 = lambda shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
  batch_ = steps.TrainBatch(
      jnp.asarray(rng.integers(3, 259, (batch, length)), jnp.int32), jnp.ones((batch, length), bool),
      jnp.ones((batch, response), bool), returns=f32((batch, response)), old_values=f32((batch, response)),
      is_positive=jnp.ones(batch, bool), old_logprobs=f32((batch, response)), advantages=f32((batch, response)))
  fn = jax.jit(functools.partial(steps.actor_update, graphdef, tx, algo=AlgoConfig(mini_batch_responses=batch),
                                 micro=batch, chunk=chunk))
  analysis = fn.lower(params, tx.init(params), batch_).compile().memory_analysis()
  total = analysis.temp_size_in_bytes + analysis.argument_size_in_bytes + analysis.output_size_in_bytes
  return analysis.temp_size_in_bytes, total


def actor_update_section(args) -> tuple[list[Table], list[RatioTarget]]:
  """The `small` preset's actor update at T = 4,096: dense attention and whole-response logits (the
  layout before the long-sequence work) against flash attention and 512-position logit blocks."""
  mib = lambda n: n / 2**20
  before = _actor_update_memory("reference", 4032)
  after = _actor_update_memory("chunked", 512)
  rows = [("before: reference attention, logits of the whole response", mib(before[0]), mib(before[1])),
          ("after: chunked attention, logits_chunk=512", mib(after[0]), mib(after[1]))]
  table = Table("actor update, small preset, B=2, T=4,096 (4,032 response), remat: compiled memory (MiB)",
                ("layout", "temp MiB", "peak MiB (temp + args + outputs)"), rows)
  return [table], [RatioTarget("actor update temp @4096: after / before", after[0] / before[0], "<=", 1 / 4)]


# Each section: (name, function(args) -> (tables, targets)). Later sections append here.
SECTIONS: list[tuple[str, Callable]] = [
    ("attention", attention_section),
    ("logprobs", logprob_bench.logprob_section),  # benchmarks/logprob_bench.py
    ("actor_update", actor_update_section),
]


def main(argv) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--repeats", type=int, default=3, help="timed calls per measurement (best of)")
  parser.add_argument("--only", nargs="*", default=None, help="section names to run (default: all)")
  args = parser.parse_args(argv)
  print(f"long sequences benchmark on {jax.devices()[0].device_kind} ({jax.devices()[0].platform})")
  all_targets = []
  for name, section in SECTIONS:
    if args.only and name not in args.only:
      continue
    tables, targets = section(args)
    for table in tables:
      print_table(table)
    all_targets += targets
  print_table(targets_table(all_targets))
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
