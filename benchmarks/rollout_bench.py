"""Rollout benchmark: vapo_jax's jitted `generate` against transformers' `generate` on this CPU.

  python -m benchmarks.rollout_bench [--quick]

Random-weight models, float32 weights, KV cache and logits on both sides, sampling at temperature
1.0 with no top-k / top-p and no stop tokens, so every row runs to `max_new_tokens`:

  1. decode throughput of vapo_jax (`rollout.make_generate`, compiled ahead of time so compilation
     is excluded) for the `tiny` test model and the Qwen2.5-0.5B shape: batch 16, 64-token
     prompts, 256 new tokens;
  2. the same weights (`checkpoint.export`) in transformers' PyTorch `generate` (2 threads), the
     same left-padded prompts, and the ratio vapo_jax / transformers against the targets
     (≥ 3× on tiny, ≥ 1× on 0.5B);
  3. group sampling: 4 prompts × 16 samples with one shared prefill against 64 independent prompts.

tokens/s counts generated tokens (the sum of response lengths) over the wall time of the whole
generate call. Each engine is also run with max_new_tokens=1 ("prefill + 1st token"); the
difference gives the decode-only rate, (N − 1)·B tokens over t(N) − t(1). The default run keeps
to about 8 minutes: the 0.5B calls (about 3 minutes each) run once, and the 0.5B group sampling
runs only when the time left allows it.

torch runs with OMP_WAIT_POLICY=PASSIVE (unless set): with 2 OpenMP threads on 2 cores shared with
other work, libgomp's spin-waiting made transformers 5–60× slower and erratic (64 tiny-model steps:
1.6–17 s instead of 0.25 s), which would flatter vapo_jax.
"""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # Read when torch loads libgomp: set before importing it.
import sys
import tempfile
import time
from typing import Callable, NamedTuple

import jax
import numpy as np
from flax import nnx

from vapo_jax import rollout
from vapo_jax.models import checkpoint
from vapo_jax.models.config import preset
from vapo_jax.models.transformer import CausalLM

PAD = 0
BUDGET_S = 480  # The default run's time budget, checked before the optional 0.5B group sampling.


class Shape(NamedTuple):
  batch: int  # Rows (P prompts × G samples).
  prompt_tokens: int  # Every prompt has this many tokens (no left padding needed at this length).
  new_tokens: int  # max_new_tokens.


class Measured(NamedTuple):
  engine: str
  shape: Shape
  first_s: float  # One generate call with max_new_tokens=1: prefill + first token.
  total_s: float  # Median wall time of one generate call with shape.new_tokens.
  runs: int  # Timed calls behind total_s.
  compile_s: float | None = None  # vapo_jax only: compiling the shape.new_tokens program.

  @property
  def tokens_per_s(self) -> float:
    return self.shape.batch * self.shape.new_tokens / self.total_s

  @property
  def decode_tokens_per_s(self) -> float:
    return self.shape.batch * (self.shape.new_tokens - 1) / (self.total_s - self.first_s)


def make_prompts(vocab_size: int, count: int, length: int, seed: int = 0):
  """`count` random prompts of `length` tokens, left-padded by `rollout.pad_prompts`."""
  rng = np.random.default_rng(seed)
  return rollout.pad_prompts([list(rng.integers(3, vocab_size, length)) for _ in range(count)], pad_id=PAD)


def timed(run: Callable[[int], object], *, repeats: int, budget_s: float) -> tuple[float, int, object]:
  """(median seconds, calls, last result) of `run(i)`: at least one call, at most `repeats`, and no
  further call once one more would take the time spent past `budget_s`."""
  times, result = [], None
  while not times or (len(times) < repeats and sum(times) + max(times) <= budget_s):
    start = time.perf_counter()
    result = run(len(times))
    times.append(time.perf_counter() - start)
  return float(np.median(times)), len(times), result


def compile_generate(model, tokens, mask, *, new_tokens: int, group: int = 1):
  """vapo_jax's jitted generate for this shape, compiled ahead of time: (call(seed), seconds)."""
  sampling = rollout.Sampling(max_new_tokens=new_tokens, stop_token_ids=(), temperature=1.0)
  fn = rollout.make_generate(sampling=sampling, samples_per_prompt=group, pad_id=PAD)
  start = time.perf_counter()
  compiled = fn.lower(model, tokens, mask, jax.random.key(0)).compile()
  seconds = time.perf_counter() - start
  return lambda seed: jax.block_until_ready(compiled(model, tokens, mask, jax.random.key(seed))), seconds


def bench_vapo_jax(model, shape: Shape, *, repeats: int, budget_s: float, warmup: bool) -> Measured:
  tokens, mask = make_prompts(model.cfg.vocab_size, shape.batch, shape.prompt_tokens)
  first, _ = compile_generate(model, tokens, mask, new_tokens=1)
  full, compile_s = compile_generate(model, tokens, mask, new_tokens=shape.new_tokens)
  if warmup:
    first(0), full(0)
  first_s, _, _ = timed(lambda i: first(1 + i), repeats=repeats, budget_s=budget_s / 4)
  total_s, runs, out = timed(lambda i: full(1 + i), repeats=repeats, budget_s=budget_s)
  assert int(out.response_lengths.sum()) == shape.batch * shape.new_tokens  # Every row ran to the end.
  return Measured("vapo_jax", shape, first_s, total_s, runs, compile_s)


def load_transformers(model, directory: str):
  """(hf model, torch) for our weights exported to `directory`, or (None, reason)."""
  try:
    import torch
    import transformers
  except ImportError as error:
    return None, f"transformers / torch not importable ({error})"
  torch.set_num_threads(2)
  transformers.logging.set_verbosity_error()
  transformers.utils.logging.disable_progress_bar()
  checkpoint.export(model, directory)
  hf = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
  return hf, torch


def bench_transformers(hf, torch, vocab_size: int, shape: Shape, *, repeats: int, budget_s: float) -> Measured:
  tokens, mask = make_prompts(vocab_size, shape.batch, shape.prompt_tokens)
  input_ids, attention_mask = torch.from_numpy(tokens.astype(np.int64)), torch.from_numpy(mask.astype(np.int64))

  def generate(new_tokens, ids=input_ids, ids_mask=attention_mask, seed=0):
    torch.manual_seed(seed)
    out = hf.generate(input_ids=ids, attention_mask=ids_mask, do_sample=True, temperature=1.0, top_k=0,
                      top_p=1.0, max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=PAD)
    assert out.shape == (ids.shape[0], ids.shape[1] + new_tokens)

  generate(2, input_ids[:1, -8:], attention_mask[:1, -8:])  # Warm-up, on a short prompt.
  first_s, _, _ = timed(lambda i: generate(1, seed=i), repeats=repeats, budget_s=budget_s / 4)
  total_s, runs, _ = timed(lambda i: generate(shape.new_tokens, seed=i), repeats=repeats, budget_s=budget_s)
  return Measured("transformers", shape, first_s, total_s, runs)


def print_decode_table(rows: list[tuple[str, Measured]]):
  print(f"  {'model':<13} {'engine':<13} {'B×prompt→new':>14} {'compile':>8} {'prefill+1st':>12} "
        f"{'generate':>9} {'tokens/s':>9} {'decode tok/s':>13}  timing")
  for name, m in rows:
    compile_s = f"{m.compile_s:.1f} s" if m.compile_s is not None else "—"
    shape = f"{m.shape.batch}×{m.shape.prompt_tokens}→{m.shape.new_tokens}"
    print(f"  {name:<13} {m.engine:<13} {shape:>14} {compile_s:>8} {m.first_s:>10.2f} s {m.total_s:>7.2f} s "
          f"{m.tokens_per_s:>9,.0f} {m.decode_tokens_per_s:>13,.0f}  median of {m.runs}")


def verdict(ratio: float, target: float) -> str:
  return f"{ratio:.2f}× (target ≥ {target:g}×: {'met' if ratio >= target else 'NOT met'})"


def bench_group(model, name: str, *, prompts: int, group: int, prompt_tokens: int, new_tokens: int,
                repeats: int, budget_s: float, warmup: bool):
  """Shared prefill (P prompts × G samples) against P·G independent prompts; returns the times."""
  tokens, mask = make_prompts(model.cfg.vocab_size, prompts, prompt_tokens, seed=1)
  shared, _ = compile_generate(model, tokens, mask, new_tokens=new_tokens, group=group)
  independent, _ = compile_generate(model, np.repeat(tokens, group, 0), np.repeat(mask, group, 0),
                                    new_tokens=new_tokens)
  if warmup:
    shared(0), independent(0)
  shared_s, shared_runs, _ = timed(lambda i: shared(1 + i), repeats=repeats, budget_s=budget_s / 4)
  independent_s, independent_runs, _ = timed(lambda i: independent(1 + i), repeats=repeats, budget_s=budget_s)
  rows = prompts * group
  print(f"  {name:<13} {f'{prompts}×{group}, {prompt_tokens}→{new_tokens}':>16} {shared_s:>9.2f} s "
        f"{independent_s:>11.2f} s {independent_s / shared_s:>9.2f}×  "
        f"{rows * new_tokens / shared_s:>9,.0f} vs {rows * new_tokens / independent_s:>7,.0f}  "
        f"median of {shared_runs} / {independent_runs}")
  return shared_s, independent_s


def print_ratios(rows: list[tuple[str, Measured]]):
  measured = {(name, m.engine): m for name, m in rows}
  for name, target in (("tiny", 3), ("qwen2.5-0.5b", 1)):
    ours, theirs = measured[name, "vapo_jax"], measured[name, "transformers"]
    print(f"  {name}, vapo_jax / transformers tokens/s: {verdict(ours.tokens_per_s / theirs.tokens_per_s, target)}; "
          f"decode only {ours.decode_tokens_per_s / theirs.decode_tokens_per_s:.2f}×; "
          f"prefill + 1st token {theirs.first_s / ours.first_s:.2f}×")


def decode_throughput(models: dict, shapes: dict[str, Shape], *, quick: bool, repeats: int):
  """Items 1 and 2: every model in vapo_jax, then in transformers."""
  budgets = {"tiny": 30, "qwen2.5-0.5b": 10 if quick else 60}  # Seconds of timed calls: 0.5B calls run once.
  rows, missing = [], None
  for name, model in models.items():
    rows.append((name, bench_vapo_jax(model, shapes[name], repeats=repeats, budget_s=budgets[name],
                                      warmup=name == "tiny")))
  with tempfile.TemporaryDirectory() as directory:
    for name, model in models.items():
      hf, torch = load_transformers(model, os.path.join(directory, name))
      if hf is None:
        missing = torch
        break
      rows.append((name, bench_transformers(hf, torch, model.cfg.vocab_size, shapes[name], repeats=repeats,
                                            budget_s=budgets[name])))
      del hf
  print("\n1-2. Decode throughput (tokens/s = generated tokens / whole generate call; decode tok/s excludes "
        "prefill + 1st token)")
  print_decode_table(sorted(rows, key=lambda row: (list(models).index(row[0]), row[1].engine != "vapo_jax")))
  if quick:
    print("  (--quick: the 0.5B rows use smaller shapes; the targets are judged by the default run)")
  if missing:
    print(f"  transformers skipped: {missing}")
  else:
    print_ratios(rows)
  return dict(row for row in rows if row[1].engine == "vapo_jax")


def group_sampling(models: dict, big_measured: Measured, *, quick: bool, repeats: int, seconds_left: float):
  """Item 3: the tiny model at two shapes, then the 0.5B shape if the time left allows it."""
  print("\n3. Group sampling, vapo_jax: P prompts × G samples, shared prefill (samples_per_prompt=G) vs "
        "P·G independent prompts")
  print(f"  {'model':<13} {'P×G, prompt→new':>16} {'shared':>11} {'independent':>13} {'ratio':>10}  "
        f"{'tok/s shared vs indep.':>22}  timing")
  for prompt_tokens, new_tokens in ((64, 256), (256, 32)):
    bench_group(models["tiny"], "tiny", prompts=4, group=16, prompt_tokens=prompt_tokens,
                new_tokens=new_tokens, repeats=repeats, budget_s=20, warmup=True)
  m = big_measured
  prefill_rate = m.shape.batch * m.shape.prompt_tokens / m.first_s
  step_s = (m.total_s - m.first_s) / (m.shape.new_tokens - 1)
  prompts, group, prompt_tokens, new_tokens = 4, 16, 64, 8
  # Each call runs once; the independent one prefills all P·G prompts; a 64-row step ≤ 4 16-row steps.
  projected = (prompts * group + prompts) * prompt_tokens / prefill_rate + 2 * new_tokens * 4 * step_s + 30
  if quick or projected > seconds_left:
    reason = "--quick" if quick else f"≈{projected:.0f} s projected, {max(seconds_left, 0):.0f} s left of the budget"
    print(f"  qwen2.5-0.5b  skipped ({reason})")
  else:
    bench_group(models["qwen2.5-0.5b"], "qwen2.5-0.5b", prompts=prompts, group=group,
                prompt_tokens=prompt_tokens, new_tokens=new_tokens, repeats=1, budget_s=0, warmup=False)
  print("  ratio = independent time / shared time (the shared prefill costs 1/G of the independent one)")


def main(argv):
  quick = "--quick" in argv
  start = time.perf_counter()
  repeats = 3 if quick else 5
  load = os.getloadavg()[0]
  print(f"Rollout benchmark{' (--quick: smaller 0.5B shapes, fewer runs)' if quick else ''}: "
        f"{jax.devices()[0].platform}, {jax.device_count()} device, {os.cpu_count()} CPU cores, "
        f"load average {load:.1f} at start{' (other work is running: expect noisy figures)' if load > 1 else ''}")
  print("float32 weights, KV cache and logits; temperature 1.0, top-k off, top-p 1, no stop tokens; "
        f"random weights; transformers on 2 torch threads, OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']}")
  models = {"tiny": CausalLM(preset("tiny"), rngs=nnx.Rngs(0))}
  built = time.perf_counter()
  models["qwen2.5-0.5b"] = CausalLM(preset("qwen2.5-0.5b"), rngs=nnx.Rngs(0))
  print(f"qwen2.5-0.5b: {preset('qwen2.5-0.5b').num_parameters() / 1e9:.3f} B parameters, "
        f"built in {time.perf_counter() - built:.1f} s")
  shapes = {"tiny": Shape(16, 64, 256), "qwen2.5-0.5b": Shape(4, 32, 16) if quick else Shape(16, 64, 256)}
  ours = decode_throughput(models, shapes, quick=quick, repeats=repeats)
  group_sampling(models, ours["qwen2.5-0.5b"], quick=quick, repeats=repeats,
                 seconds_left=BUDGET_S - (time.perf_counter() - start))
  print(f"\ntotal benchmark time {time.perf_counter() - start:.0f} s; "
        f"load average {os.getloadavg()[0]:.1f} at the end")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
