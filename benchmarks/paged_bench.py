"""The paged refill engine against the contiguous one at the same bytes of KV cache, on this CPU.

  python -m benchmarks.paged_bench [--quick]

The `small` preset (random weights, float32), 32 prompts of 8-32 tokens × 4 samples, response lengths forced
from a long tail (a log-normal, σ 0.8, numpy seed 4, scaled to a maximum of 256: mean/max about 0.2), sampled at
temperature 1. The contiguous engine (`rollout/refill/contiguous.py`, each slot owning the 32-token prompt bucket + 256
tokens) gets `slots` slots; the paged engine (`rollout/refill/engine.py`) the same bytes as a pool of 16-token pages and
`paged_factor` times the slots, which the pool holds at the tail's live lengths (preempting when it does not).
Printed for each: time (median of runs, compilation excluded), useful tokens/s, decode steps, slot use, pages at
their peak, preemptions; then one summary line per shape:

  paged: <shape> tokens/s paged/contiguous <x>x at equal KV bytes (<slots> vs <slots> slots), tokens identical: yes|no

On a CPU the decode of a tiny model is bound by compute, not memory: more slots mostly buy concurrency, not
speed (the contiguous engine's tokens/s grows 1.16× from 24 to 96 slots on such a tail). What the CPU shows
is the concurrency the pages buy at equal memory and what their bookkeeping costs; the speed-up of per-row
reads is the TPU's (`make memory`'s roofline).
"""

import os
import sys
import time

import jax
import numpy as np
from flax import nnx

from benchmarks import contiguous_refill as contiguous
from benchmarks.rollout_bench import timed
from vapo_jax import rollout
from vapo_jax.config import RolloutConfig
from vapo_jax.models.config import preset
from vapo_jax.models.kv_cache import KVCache
from vapo_jax.models.transformer import CausalLM
from vapo_jax.rollout import common

PROMPTS, GROUP, CAP, PAGE_TOKENS = 32, 4, 256, 16


def tail_lengths(count: int, seed: int = 4) -> np.ndarray:
  drawn = np.random.default_rng(seed).lognormal(0.0, 0.8, size=count)
  return np.clip(np.round(drawn / drawn.max() * CAP), 1, CAP).astype(np.int32)


def prompts(vocab: int, seed: int = 5) -> tuple[np.ndarray, np.ndarray]:
  rng = np.random.default_rng(seed)
  return common.pad_prompts([list(rng.integers(3, vocab, rng.integers(8, 33))) for _ in range(PROMPTS)],
                            pad_id=0)


def shape(model, tokens, mask, limits, *, slots: int, paged_factor: int, repeats: int):
  """One shape: the contiguous engine in `slots` slots, the paged one in `paged_factor` × as many over the same
  KV bytes. Returns the summary line."""
  spec = common.Sampling(max_response_tokens=CAP, stop_token_ids=(), temperature=1.0)
  prompt_len = tokens.shape[1]
  token_bytes = KVCache.bytes_per_token(model.cfg, np.float32)
  kv_bytes = slots * (prompt_len + CAP) * token_bytes  # The contiguous engine's cache (its slot mask aside).
  pages = int(kv_bytes // (PAGE_TOKENS * token_bytes))
  paged = rollout.plan_rollout(
      RolloutConfig(slots=slots * paged_factor, decode_steps_per_call=64, pages=pages,
                    page_tokens=PAGE_TOKENS,
                    max_response_tokens=CAP), model.cfg, prompts=tokens.shape[0], samples_per_prompt=GROUP,
      prompt_tokens=prompt_len, dtype=np.float32, devices=1)
  place = lambda x: jax.device_put(x)

  def run_contiguous(i):
    out, steps, row_steps = contiguous.generate_contiguous(
        model, place(tokens), place(mask), jax.random.key(i % 2), sampling=spec, samples_per_prompt=GROUP,
        slots=slots, steps_per_call=64, min_slots=1, length_limits=place(limits))
    lengths = np.asarray(out.response_lengths)
    return out, {"rollout/decode_steps": steps, "rollout/slot_utilization": lengths.sum() / row_steps,
                 "rollout/queue_pages_peak": 0.0, "rollout/preemptions": 0.0}

  def run_paged(i):
    return rollout.sample(model, tokens, mask, jax.random.key(i % 2), sampling=spec, plan=paged,
                          length_limits=limits)

  results = {}
  for name, run in (("contiguous", run_contiguous), ("paged", run_paged)):
    run(0)  # Compiles.
    seconds, runs, (_, metrics) = timed(run, repeats=repeats, budget_s=60)
    results[name] = seconds, runs, run(0)[0], metrics  # Key 0: the tokens compared.
  useful = float(limits.sum())
  label = f"small, {PROMPTS}x{GROUP} sequences, cap {CAP} (mean/max {limits.mean() / CAP:.2f})"
  print(f"\n{label}: {kv_bytes / 2**20:.2f} MiB of KV cache ({pages} pages of {PAGE_TOKENS} tokens)")
  print(f"  {'engine':<11}{'slots':>6}{'time':>9}{'tok/s':>9}{'steps':>7}{'slot use':>9}{'pages peak':>11}"
        f"{'preempt':>9}  timing")
  for name, (seconds, runs, _, m) in results.items():
    rows = slots if name == "contiguous" else paged.slots
    print(f"  {name:<11}{rows:>6}{seconds:>7.2f} s{useful / seconds:>9,.0f}{m['rollout/decode_steps']:>7.0f}"
          f"{m['rollout/slot_utilization']:>9.2f}{m['rollout/queue_pages_peak']:>11.0f}{m['rollout/preemptions']:>9.0f}"
          f"  median of {runs}")
  (flat_s, _, flat, _), (paged_s, _, out, _) = results.values()
  same = all(np.array_equal(np.asarray(getattr(flat, f)), np.asarray(getattr(out, f)))
             for f in ("response_tokens", "response_lengths"))
  return (f"paged: {label} tokens/s paged/contiguous {flat_s / paged_s:.2f}x at equal KV bytes "
          f"({paged.slots} vs {slots} slots), tokens identical: {'yes' if same else 'no'}")


def main(argv) -> int:
  quick = "--quick" in argv
  load = os.getloadavg()[0]
  start = time.perf_counter()
  print(f"Paged refill benchmark: {jax.devices()[0].platform}, {os.cpu_count()} CPU cores, load average "
        f"{load:.1f} at start{' (other work is running: expect noisy figures)' if load > 1 else ''}")
  model = CausalLM(preset("small"), rngs=nnx.Rngs(0))
  tokens, mask = prompts(model.cfg.vocab_size)
  limits = tail_lengths(PROMPTS * GROUP)
  lines = [shape(model, tokens, mask, limits, slots=slots, paged_factor=4, repeats=3 if quick else 5)
           for slots in ((24,) if quick else (16, 24))]
  print()
  print("\n".join(lines))
  print(f"\ntotal {time.perf_counter() - start:.0f} s; load average {os.getloadavg()[0]:.1f} at the end")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
