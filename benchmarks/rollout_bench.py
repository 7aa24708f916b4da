"""Rollout benchmark on this CPU: decode attention, slot refill, sort-free top-p, and transformers.

  python -m benchmarks.rollout_bench [--quick] [--no-transformers]

Random-weight models, float32 weights, KV cache and logits. Compilation is excluded (each program
runs once before it is timed). Five measurements, each a ratio measured side by side in one run:

  1. decode step of the `small` preset, batch 16, a 4,096-slot cache holding 256 tokens:
     length-bounded decode attention (the CPU's default `decode_block`, 64 slots) against reading
     every slot (0, the dense reference); target ≤ 0.5×; and the layers as a scan against the
     unrolled Python loop over the same stacked parameters: decode tokens/s, target ≥ 0.9×;
  2. long tail: 64 sequences (16 prompts × 4 samples) with lengths forced from a fixed heavy-tailed
     list (`LONG_TAIL`, mean/max = 0.25), sampled at temperature 1: the refill engine with 16
     slots (shrinking in the tail, and without) against the static batch of 64; useful tokens/s,
     target ≥ 2×, identical tokens;
  3. top-p 0.7 on `[16, 151936]` float32 logits: threshold bisection against the sort, target ≥ 3×;
  4. against transformers' `generate` on the same weights (`hf_export.export`): a small Qwen2
     (4 layers, width 256, 32k vocabulary), batch 16, greedy, no stop tokens, at 64→256 (target
     ≥ 2×) and 512→512 (target ≥ 1.2×); and the Qwen2.5-0.5B shape at 4 × 32→32 (target ≥ 1×;
     skipped by --quick);
  5. the load average, at the start and the end.

torch runs on 2 threads with OMP_WAIT_POLICY=PASSIVE (unless set): with OpenMP threads on 2 cores
shared with other work, libgomp's spin-waiting made transformers 5–60× slower and erratic, which
would flatter vapo_jax. Torch slows down far more than XLA when other work shares the cores: the
comparison is only meaningful on an idle machine (see the load average).
"""

import dataclasses
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # Read when torch loads libgomp: set before importing it.
import sys
import tempfile
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from vapo_jax import rollout
from vapo_jax.config import RolloutConfig
from vapo_jax.models import decode_attention, hf_export
from vapo_jax.models.config import TransformerConfig, preset
from vapo_jax.models.kv_cache import KVCache
from vapo_jax.models.transformer import CausalLM
from vapo_jax.rollout import common, next_token

PAD = 0
# Response lengths of the long-tail case: 64 draws of a log-normal (σ 0.7, numpy seed 2) scaled to a
# maximum of 256, in draw order (the longest is queued 57th); mean 64.0, mean/max 0.25.
LONG_TAIL = (55, 34, 36, 9, 171, 108, 39, 83, 59, 33, 96, 39, 39, 28, 67, 45, 71, 32, 53, 26, 88, 55, 61, 65,
             24, 84, 205, 15, 14, 17, 88, 53, 103, 81, 56, 59, 43, 89, 22, 36, 58, 171, 28, 23, 33, 96, 41,
             123, 13, 107, 100, 18, 54, 114, 52, 98, 256, 59, 40, 28, 76, 42, 43, 45)
# The small Qwen2 of the transformers comparison.
SMALL_QWEN2 = dict(model_type="qwen2", vocab_size=32000, hidden_size=256, intermediate_size=768,
                   num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                   rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=True,
                   max_position_embeddings=4096)


def one_device_plan(config: RolloutConfig, model, tokens, *, samples_per_prompt: int,
                    max_response_tokens: int) -> rollout.RolloutPlan:
  """`config`'s rollout plan for the prompts `tokens` × `samples_per_prompt` on one device."""
  return rollout.plan_rollout(dataclasses.replace(config, max_response_tokens=max_response_tokens), model.cfg,
                              prompts=tokens.shape[0], samples_per_prompt=samples_per_prompt,
                              prompt_tokens=tokens.shape[1], dtype=jnp.float32, devices=1)


def timed(run: Callable[[int], object], *, repeats: int, budget_s: float) -> tuple[float, int, object]:
  """(median seconds, calls, last result) of `run(i)`: at least one call, at most `repeats`, and no
  further call once one more would take the time spent past `budget_s`."""
  times, result = [], None
  while not times or (len(times) < repeats and sum(times) + max(times) <= budget_s):
    start = time.perf_counter()
    result = run(len(times))
    times.append(time.perf_counter() - start)
  return float(np.median(times)), len(times), result


def verdict(ratio: float, target: float, *, at_most: bool = False) -> str:
  met = ratio <= target if at_most else ratio >= target
  return f"{ratio:.2f}× (target {'≤' if at_most else '≥'} {target:g}×: {'met' if met else 'NOT met'})"


def random_prompts(vocab_size: int, count: int, length: int, seed: int = 0):
  rng = np.random.default_rng(seed)
  return common.pad_prompts([list(rng.integers(3, vocab_size, length)) for _ in range(count)], pad_id=PAD)


def decode_step(repeats: int):
  """1. One decode step, length-bounded against full-cache reads, and the layers scanned against the
  unrolled loop over the same parameters (16 steps per timed call)."""
  model = CausalLM(preset("small"), rngs=nnx.Rngs(0))
  loop = nnx.merge(*nnx.split(model))
  loop.model.scan_layers = False
  batch, slots, live, steps = 16, 4096, 256, 16

  def run(model, cache):
    def body(i, carry):
      cache, _ = carry
      logits, cache = model(jnp.full((batch, 1), 7), jnp.full((batch, 1), live) + i,
                            jnp.ones((batch, 1), bool), cache)
      return cache, logits[:, 0]
    return jax.lax.fori_loop(0, steps, body, (cache, jnp.zeros((batch, model.cfg.vocab_size))))

  fn = jax.jit(run, donate_argnums=1)
  seconds, logits = {}, {}
  bounded = decode_attention.default_block()
  for name, layers, block in (("bounded", model, bounded), ("dense", model, 0), ("unrolled", loop, bounded)):
    cache = KVCache.zeros(model.cfg, batch, slots, jnp.float32, decode_block=block)
    keys = lambda seed: jax.random.normal(jax.random.key(seed), cache.keys.shape)  # [L, B, K, S, H].
    cache = KVCache(keys(0), keys(100), jnp.arange(slots)[None].repeat(batch, 0) < live, jnp.asarray(live),
                    block)
    state = [jax.block_until_ready(fn(layers, cache))]  # Compiles; the first 16 steps.
    first = state[0][1]

    def call(_):
      state[0] = jax.block_until_ready(fn(layers, state[0][0]))
    # Every call continues from the cache the last one returned: 256 + 16·k live tokens.
    seconds[name] = timed(call, repeats=repeats, budget_s=30)[0] / steps
    logits[name] = first
  error = float(jnp.max(jnp.abs(logits["bounded"] - logits["dense"])))
  print(f"\n1. Decode step, small preset ({model.cfg.num_layers} layers), batch 16, 4,096-slot cache, 256 "
        "live tokens (+16 per timed call)")
  print(f"  length-bounded (blocks of {bounded}) {seconds['bounded'] * 1e3:8.2f} ms/step")
  print(f"  full cache (dense, every slot)  {seconds['dense'] * 1e3:8.2f} ms/step")
  print(f"  ratio {verdict(seconds['bounded'] / seconds['dense'], 0.5, at_most=True)}; "
        f"max |Δ logits| of the first 16 steps {error:.1e}")
  unrolled_error = float(jnp.max(jnp.abs(logits["bounded"] - logits["unrolled"])))
  print(f"  layers unrolled (Python loop)   {seconds['unrolled'] * 1e3:8.2f} ms/step; scanned / unrolled "
        f"tokens/s {verdict(seconds['unrolled'] / seconds['bounded'], 0.9)}; max |Δ logits| "
        f"{unrolled_error:.1e}")


def long_tail(repeats: int):
  """2. Refill (16 slots) against the static batch of 64 on forced heavy-tailed lengths."""
  model = CausalLM(TransformerConfig.from_hf(SMALL_QWEN2), rngs=nnx.Rngs(0))
  tokens, mask = random_prompts(model.cfg.vocab_size, 16, 32, seed=3)
  limits = np.asarray(LONG_TAIL, np.int32)
  spec = common.Sampling(max_response_tokens=max(LONG_TAIL), stop_token_ids=(), temperature=1.0)
  engines = {"static, batch 64": RolloutConfig(engine="static"), "refill, 16 slots": RolloutConfig(slots=16),
             "(without shrink)": RolloutConfig(slots=16, shrink_slots=False)}
  results = {}
  for name, engine in engines.items():
    plan = one_device_plan(engine, model, tokens, samples_per_prompt=4,
                           max_response_tokens=spec.max_response_tokens)
    call = lambda i, plan=plan: rollout.sample(model, tokens, mask, jax.random.key(i % 2), sampling=spec,
                                               plan=plan, length_limits=limits)
    call(0)  # Compiles.
    seconds, runs, (_, metrics) = timed(call, repeats=repeats, budget_s=40)
    results[name] = seconds, runs, call(0)[0], metrics  # Both engines' tokens from the same key (key 0).
  print(f"\n2. Long tail: 16 prompts × 4 samples, 32→≤256 tokens, lengths forced (mean/max "
        f"{np.mean(LONG_TAIL) / max(LONG_TAIL):.2f}), temperature 1, small Qwen2 (32k vocabulary)")
  print(f"  {'engine':<17} {'time':>8} {'useful tok/s':>13} {'decode steps':>13} {'slot use':>9}  timing")
  for name, (seconds, runs, _, metrics) in results.items():
    print(f"  {name:<17} {seconds:>6.2f} s {sum(LONG_TAIL) / seconds:>13,.0f} "
          f"{metrics['rollout/decode_steps']:>13.0f} "
          f"{metrics['rollout/slot_utilization']:>9.2f}  median of {runs}")
  (static_s, _, static, _), (refill_s, _, refilled, _), (fixed_s, _, fixed, _) = results.values()
  same = all(np.array_equal(np.asarray(a), np.asarray(b)) for out in (refilled, fixed) for a, b in
             zip((static.response_tokens, static.response_lengths),
                 (out.response_tokens, out.response_lengths)))
  print(f"  refill / static useful tokens/s: {verdict(static_s / refill_s, 2)} ({static_s / fixed_s:.2f}× "
        f"without shrinking the slots in the tail); identical tokens: {same}")


def top_p(repeats: int):
  """3. Top-p 0.7 filtering of [16, 151936] logits, bisection against the sort."""
  logits = jax.random.normal(jax.random.key(0), (16, 151936)) * 3.0
  fns = {name: jax.jit(lambda x, f=f: f(x, temperature=1.0, top_k=0, top_p=0.7))
         for name, f in (("sort", next_token.filter_logits_sorted), ("bisection", next_token.filter_logits))}
  seconds, kept = {}, {}
  for name, fn in fns.items():
    kept[name] = np.isfinite(np.asarray(fn(logits)))
    seconds[name] = timed(lambda _: jax.block_until_ready(fn(logits)), repeats=repeats, budget_s=20)[0]
  print("\n3. Top-p 0.7, [16, 151936] float32 logits (N(0, 3²))")
  print(f"  sort {seconds['sort'] * 1e3:8.1f} ms   bisection {seconds['bisection'] * 1e3:8.1f} ms   "
        f"speed-up {verdict(seconds['sort'] / seconds['bisection'], 3)}; same kept set: "
        f"{np.array_equal(kept['sort'], kept['bisection'])} ({kept['sort'].sum(1).mean():.0f} tokens per row)")


def load_transformers(model, directory: str):
  """(hf model, torch) for our weights exported to `directory`, or (None, reason)."""
  try:
    import torch
    import transformers
  except ImportError as error:
    return None, f"transformers / torch not importable ({error}); `.venv/bin/pip install torch` (CPU wheel)"
  torch.set_num_threads(2)
  transformers.logging.set_verbosity_error()
  transformers.utils.logging.disable_progress_bar()
  hf_export.export(model, directory)
  hf = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
  return hf, torch


def versus_transformers(quick: bool, repeats: int, budget_s: float):
  """4. vapo_jax (default engine) against transformers' greedy `generate`, same weights and prompts."""
  cases = [("small Qwen2", SMALL_QWEN2, 16, 64, 256, 2.0), ("small Qwen2", SMALL_QWEN2, 16, 512, 512, 1.2)]
  if not quick:
    cases.append(("qwen2.5-0.5b", None, 4, 32, 32, 1.0))
  print("\n4. Against transformers `generate`: greedy, float32, no stop tokens (every row runs to the end)")
  print(f"  {'model':<13} {'B×prompt→new':>14} {'vapo_jax':>9} {'transformers':>13} {'tok/s ours':>11} "
        f"{'tok/s theirs':>13}  ratio")
  with tempfile.TemporaryDirectory() as directory:
    for name, hf_config, batch, prompt_len, new_tokens, target in cases:
      cfg = preset("qwen2.5-0.5b") if hf_config is None else TransformerConfig.from_hf(hf_config)
      model = CausalLM(cfg, rngs=nnx.Rngs(0))
      tokens, mask = random_prompts(cfg.vocab_size, batch, prompt_len, seed=1)
      spec = common.Sampling(max_response_tokens=new_tokens, stop_token_ids=(), temperature=0.0)
      plan = one_device_plan(RolloutConfig(), model, tokens, samples_per_prompt=1,
                             max_response_tokens=new_tokens)
      call = lambda i, plan=plan: rollout.sample(model, tokens, mask, jax.random.key(i), sampling=spec,
                                                 plan=plan)
      call(0)  # Compiles.
      ours, runs, (out, _) = timed(call, repeats=repeats, budget_s=budget_s / 2)
      hf, torch = load_transformers(model, os.path.join(directory, f"{name}-{prompt_len}"))
      if hf is None:
        print(f"  transformers skipped: {torch}")
        return
      ids, ids_mask = torch.from_numpy(tokens.astype(np.int64)), torch.from_numpy(mask.astype(np.int64))

      def generate(_):
        with torch.no_grad():
          return hf.generate(input_ids=ids, attention_mask=ids_mask, do_sample=False,
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=PAD)
      generate(0)  # Warm-up.
      theirs, hf_runs, hf_out = timed(generate, repeats=repeats, budget_s=budget_s / 2)
      agree = float(np.mean(hf_out[:, prompt_len:].numpy() == np.asarray(out.response_tokens)))
      rate = batch * new_tokens
      print(f"  {name:<13} {f'{batch}×{prompt_len}→{new_tokens}':>14} {ours:>7.2f} s {theirs:>11.2f} s "
            f"{rate / ours:>11,.0f} {rate / theirs:>13,.0f}  {verdict(theirs / ours, target)}  "
            f"(median of {runs} / {hf_runs}; greedy tokens agree {agree:.0%})")
      hf = None  # Frees the model before the next size.


def main(argv):
  quick, repeats = "--quick" in argv, 3 if "--quick" in argv else 5
  start = time.perf_counter()
  load = os.getloadavg()[0]
  print(f"Rollout benchmark{' (--quick)' if quick else ''}: {jax.devices()[0].platform}, "
        f"{jax.device_count()} device(s), {os.cpu_count()} CPU cores, load average {load:.1f} at start"
        f"{' (other work is running: expect noisy figures)' if load > 1 else ''}")
  decode_step(repeats)
  long_tail(repeats)
  top_p(repeats)
  if "--no-transformers" not in argv:
    versus_transformers(quick, repeats, budget_s=60 if quick else 120)
  print(f"\ntotal benchmark time {time.perf_counter() - start:.0f} s; load average {os.getloadavg()[0]:.1f} "
        "at the end")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
