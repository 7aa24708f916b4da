"""Packed rows against padded sequences: one PPO update per layout, interleaved in one process, two shapes.

  make bench        (or: python -m benchmarks.packing_bench [--scale 32] [--repeats 3] [--shapes small,qwen0.5b])

Full size (`--scale 1`): 64 sequences, each a 256-token prompt and a response of at most 4,096 tokens,
so a padded sequence and a packed row are both L = 4,352 tokens. Response lengths: the quantiles
(i + ½)/64 of an exponential capped at 4,096, its scale chosen (by bisection) so that mean/max is 0.3
(long-tailed, about 4 % at the cap), then 0.9, shuffled as a rollout returns them. Shapes:
  small     the `small` preset (4 layers, D 128, F 352, 4 query and 2 kv heads of 32, vocab 259):
            attention-bound (at L = 4,352 about 70 % of its FLOPs are attention).
  qwen0.5b  one layer of Qwen2.5-0.5B (D 896, F 4,864, 14 query and 2 kv heads of 64) and a vocabulary
            of 151,936 / 24, so that the head holds the FLOP share it has beside 24 layers: linear-bound.
`--scale s` divides the lengths, the attention blocks (256) and the width D by s and keeps F, the heads
and the vocabulary: each term's FLOPs per column (linear layers, head, attention) and the columns fall
by s, every term by s², so the FLOP ceiling is the full size's up to rounding (both are printed).
`make bench` runs `--scale 32` (a few minutes on two idle CPU cores).

One PPO update is what `Trainer.step` runs after sampling: `Steps.plan_packing` (packed: lengths to the host,
first-fit decreasing, placements back), `Steps.score` (critic values, actor log-probs and entropy, GAE)
and `Steps.ppo_update` (one mini-batch of all 64: critic, then actor), float32 (`--dtype`), `model.remat`
on, chunked attention (`--attention`), each row's block loops over its own key blocks. Padded:
micro-batches of 8 sequences; packed: micro-batches of 8 rows, the same [8, L] shape, and only those
holding a sequence run. "union" is padded with every row of a call over the union of its rows' key
blocks (`flash.defaults(per_row=False)`, the attention of commit 46f9118), for the figures against it.

Measured: the state is committed to its sharding before the warm-up, warm-up updates run until one
compiles nothing, and a timed update that compiles raises. The layouts take turns (the order rotated
each round) for `--repeats` updates each; the median wall time gives real tokens/s = Σ (prompt + response) tokens /
time; CPU seconds and the 1-minute load stand beside it. The FLOP model (`flops`) counts the linear
layers over every computed column, attention over the (row, query block, key block) triples that
`flash.visited_block_pairs` counts, and the log-prob head over scored columns (padded: the response
columns; packed: every column of a row that runs); the FLOP ceiling is padded FLOPs / packed FLOPs.
"""

import argparse
import dataclasses
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks.tables import RatioTarget, Table, print_table, targets_table
from vapo_jax.config import AlgoConfig, ExperimentConfig, OptimizerConfig, PackingConfig, RolloutConfig
from vapo_jax.config.sections import MeshConfig, ModelConfig
from vapo_jax.models import flash, sharding
from vapo_jax.models.config import TransformerConfig, preset
from vapo_jax.models.transformer import CausalLM, ValueModel
from vapo_jax.rollout.common import Rollout
from vapo_jax.train import optim, packed_batch, packing
from vapo_jax.train.state import TrainState
from vapo_jax.train.steps import Steps

PROMPT, RESPONSE, MICRO, SEQUENCES, BLOCK = 256, 4096, 8, 64, 256  # Full size.
RATIOS = (0.3, 0.9)
COMPILE_EVENTS = ("/jax/core/compile/jaxpr_to_mlir_module_duration", "/jax/core/compile/backend_compile_duration")
_compiles = [0]
jax.monitoring.register_event_duration_secs_listener(
    lambda event, duration, **kwargs: _compiles.__setitem__(0, _compiles[0] + (event in COMPILE_EVENTS)))


def model_shape(name: str, scale: int) -> TransformerConfig:
  """The shape's architecture with the width D divided by `scale` (module doc)."""
  match name:
    case "small":
      cfg = preset("small")
    case "qwen0.5b":
      cfg = dataclasses.replace(preset("qwen2.5-0.5b"), num_layers=1, vocab_size=151936 // 24)
    case _:
      raise ValueError(f"unknown shape {name!r}: small or qwen0.5b")
  return dataclasses.replace(cfg, hidden_size=cfg.hidden_size // scale, max_position_embeddings=PROMPT + RESPONSE)


def response_lengths(mean_over_max: float, scale: int, seed: int = 0) -> np.ndarray:
  """The quantiles (i + ½)/64 of an exponential capped at RESPONSE, scaled to the given mean/max,
  shuffled, then divided by `scale` (rounded up)."""
  quantiles = (np.arange(SEQUENCES) + 0.5) / SEQUENCES
  lengths = lambda s: np.clip(np.ceil(-s * np.log1p(-quantiles)), 1, RESPONSE).astype(int)
  low, high = 1.0, 1e7
  for _ in range(60):
    mid = (low * high) ** 0.5
    low, high = (mid, high) if lengths(mid).mean() < mean_over_max * RESPONSE else (low, mid)
  return -(-np.random.default_rng(seed).permutation(lengths(high)) // scale)


def _config(packed: bool, scale: int, model: dict) -> ExperimentConfig:
  return ExperimentConfig(
      name="packing_bench", model=ModelConfig(preset="small", remat=True, random_init=True, **model),
      algo=AlgoConfig(mini_batch_responses=SEQUENCES, micro_batch_responses=MICRO, value_pretrain_steps=0),
      packing=PackingConfig(enabled=packed, micro_batch_rows=MICRO), optim=OptimizerConfig(warmup_updates=0),
      rollout=RolloutConfig(prompts_per_step=SEQUENCES // 4, samples_per_prompt=4, max_prompt_tokens=PROMPT // scale,
                            max_response_tokens=RESPONSE // scale),
      mesh=MeshConfig(preset="dp"))


class LayoutBench:
  """One layout's programs and committed state on one device; `update` times one PPO update."""

  def __init__(self, cfg: TransformerConfig, packed: bool, scale: int, model: dict, *, per_row: bool = True):
    """model: the `dtype` and `attention` of `ModelConfig`."""
    self.cfg, self.scale = cfg, scale
    self.attention = dict(block_q=BLOCK // scale, block_k=BLOCK // scale, per_row=per_row)
    config = _config(packed, scale, model)
    mesh = sharding.make_mesh(data=1, devices=jax.devices()[:1])
    actor_def, actor = nnx.split(CausalLM(cfg, remat=True, **model, rngs=nnx.Rngs(0)))
    critic_def, critic = nnx.split(ValueModel(cfg, remat=True, **model, rngs=nnx.Rngs(1)))
    txs = [optim.make_optimizer(config.optim, lr) for lr in (1e-5, 1e-5)]
    self.steps = Steps(config, mesh, sharding.PRESETS["dp"], actor_def=actor_def, critic_def=critic_def,
                       actor_tx=txs[0], critic_tx=txs[1], sft_tx=txs[0])
    state = TrainState(actor, critic, txs[0].init(actor), txs[1].init(critic), key=jax.random.key(0))
    # Committed as the donated outputs of an update are: the first timed update hits the jit cache.
    self.state = jax.device_put(state, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))

  def load(self, lengths: np.ndarray) -> None:
    """The batch: full prompts of random tokens and responses of `lengths`, placed on the mesh."""
    rng, b, tp, tr = np.random.default_rng(1), lengths.size, PROMPT // self.scale, RESPONSE // self.scale
    response_mask = np.arange(tr)[None] < lengths[:, None]
    logprobs = -rng.exponential(size=(b, tr)).astype(np.float32) * response_mask
    vocab = self.cfg.vocab_size
    out = Rollout(rng.integers(3, vocab, (b, tp)), np.ones((b, tp), bool), rng.integers(3, vocab, (b, tr)) *
                  response_mask, response_mask, lengths.astype(np.int32), np.zeros(b, np.int32), logprobs, logprobs)
    correct = rng.random(b) < 0.5
    self.out, self.rewards, self.correct = self.steps.place((out, np.where(correct, 1.0, -1.0).astype(np.float32),
                                                             correct))
    self.tokens = int(b * tp + lengths.sum())

  def update(self) -> tuple[float, float, int]:
    """(wall seconds, CPU seconds, compilations) of one PPO update (plan, score, update), synchronised."""
    compiles, wall, cpu = _compiles[0], time.perf_counter(), time.process_time()
    with flash.defaults(**self.attention):
      plan = self.steps.plan_packing(self.state, self.out)
      batch, _ = self.steps.score(self.state, self.out, self.rewards, self.correct, plan=plan)
      self.state, metrics = self.steps.ppo_update(self.state, batch, actor=True, critic=True, plan=plan)
    self.metrics = jax.device_get(metrics)
    return time.perf_counter() - wall, time.process_time() - cpu, _compiles[0] - compiles


def flops(cfg: TransformerConfig, lengths: np.ndarray, scale: int) -> dict[str, dict[str, float]]:
  """{layout: {"flop", "pairs", "rows"}} of one update (module doc): score = one forward of the actor and
  the critic; update = forward, rematerialised forward and backward of each (linear ×4, attention ×4.5:
  its backward's five block matmuls to the forward's two, head ×3). "pairs": one layer's forward."""
  prompt, length, block = PROMPT // scale, (PROMPT + RESPONSE) // scale, BLOCK // scale
  d, f, n, k, h = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  linear = 2 * (d * (n + 2 * k) * h + n * h * d + 3 * d * f)  # Per column and layer.
  pair = 4 * block * block * n * h
  count = lambda **validity: int(flash.visited_block_pairs(length, length, block_q=block, block_k=block,
                                                           **validity)[0])  # Eager: traced under `defaults`.
  found = {}
  plan = packed_batch.plan_rows(np.full(lengths.size, prompt), lengths, np.arange(lengths.size)[None, None],
                                row_tokens=length, micro_rows=MICRO)
  rows = packing.row_layout(plan.placement[0, 0], plan.placement[0, 1], prompt + lengths,
                        rows=plan.scoring_rows, row_tokens=length)
  run = -(-(int(plan.placement[0, 0].max()) + 1) // MICRO) * MICRO  # Rows of the micro-batches that run.
  ranges = lambda part: dict(key_start=jnp.zeros(part.size, jnp.int32), key_end=jnp.asarray(prompt + part))
  with flash.defaults(per_row=False):  # Micro-batches of MICRO sequences, in the batch's order.
    union = sum(count(**ranges(lengths[i:i + MICRO])) for i in range(0, lengths.size, MICRO))
  columns = lengths.size * RESPONSE // scale
  layouts = {"padded": (lengths.size, columns, count(**ranges(lengths))), "union": (lengths.size, columns, union),
             "packed": (run, run * length, count(segment_ids=jnp.asarray(rows.segment_ids[:run])))}
  for name, (computed_rows, head_columns, pairs) in layouts.items():
    layers = cfg.num_layers * (computed_rows * length * linear * 5 + pairs * pair * 5.5)
    found[name] = dict(flop=2 * layers + head_columns * 2 * d * cfg.vocab_size * 4, pairs=pairs, rows=computed_rows)
  return found


def measure(layouts: dict[str, LayoutBench], lengths: np.ndarray, repeats: int) -> dict[str, dict]:
  """Per layout: median and best wall seconds, median CPU seconds, real tokens/s and the update's metrics.
  Warm-up updates run until one compiles nothing; a timed update that compiles raises."""
  for name, layout in layouts.items():
    layout.load(lengths)
    for _ in range(4):
      if layout.update()[2] == 0:
        break
    else:
      raise RuntimeError(f"{name}: every one of 4 warm-up updates compiled")
  times = {name: [] for name in layouts}
  order = list(layouts)
  for rep in range(repeats):
    for name in order[rep % len(order):] + order[:rep % len(order)]:  # Rotated: no layout always runs first.
      wall, cpu, compiles = layouts[name].update()
      if compiles:
        raise RuntimeError(f"{name}: a timed update compiled {compiles} programs")
      times[name].append((wall, cpu))
  found = {}
  for name, layout in layouts.items():
    wall = statistics.median(t[0] for t in times[name])
    found[name] = dict(wall=wall, best=min(t[0] for t in times[name]), cpu=statistics.median(t[1] for t in times[name]),
                       tokens_per_s=layout.tokens / wall, metrics=layout.metrics)
  return found


def run_shape(name: str, scale: int, repeats: int, model: dict) -> tuple[list, list, list]:
  """(table rows, summary lines, targets) of one shape at both mean/max ratios."""
  cfg = model_shape(name, scale)
  layouts = {"padded": LayoutBench(cfg, False, scale, model),
             "union": LayoutBench(cfg, False, scale, model, per_row=False),
             "packed": LayoutBench(cfg, True, scale, model)}
  rows, lines, targets = [], [], []
  for ratio in RATIOS:
    lengths = response_lengths(ratio, scale)
    load = os.getloadavg()[0]
    found, model = measure(layouts, lengths, repeats), flops(cfg, lengths, scale)
    full = flops(model_shape(name, 1), response_lengths(ratio, 1), 1) if scale > 1 else model
    for layout in layouts:
      r, m = found[layout], model[layout]
      rows.append((f"{lengths.mean() / (RESPONSE // scale):.2f}", layout, m["rows"] // MICRO, r["wall"], r["best"],
                   r["cpu"], f"{load:.1f}", r["tokens_per_s"], m["pairs"], m["flop"] / 1e9))
    for base in ("padded", "union"):
      speed = found["packed"]["tokens_per_s"] / found[base]["tokens_per_s"]
      ceiling, full_ceiling = (f[base]["flop"] / f["packed"]["flop"] for f in (model, full))
      rows.append(("", f"packed / {base}", "", "", "", found["packed"]["cpu"] / found[base]["cpu"],
                   f"full: {full_ceiling:.2f}x", speed, "", ceiling))
      goal = (2.5 if name == "qwen0.5b" else 2.2) if ratio < 0.5 else 0.95
      targets.append(RatioTarget(f"{name} tokens/s @{ratio}: packed / {base}", speed, ">=", goal))
      if base == "padded":
        lines.append(f"packing: {name} mean/max {ratio}: packed/padded {speed:.2f}x real tokens/s "
                     f"(FLOP ceiling {ceiling:.2f}x)")
  return rows, lines, targets


def main(argv) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--scale", type=int, default=32,
                      help="divide the lengths, the attention blocks and the width D by this")
  parser.add_argument("--repeats", type=int, default=3, help="timed updates per layout (median of)")
  parser.add_argument("--shapes", default="small,qwen0.5b", help="comma-separated: small, qwen0.5b")
  parser.add_argument("--dtype", default="float32", help="model.dtype (bfloat16 on a GPU: padded runs cuDNN)")
  parser.add_argument("--attention", default="chunked", help="model.attention (auto: the platform's kernel)")
  args = parser.parse_args(argv)
  model = dict(dtype=args.dtype, attention=args.attention)
  print(f"packing benchmark on {jax.devices()[0].device_kind}, {os.cpu_count()} CPUs; "
        f"load average {os.getloadavg()[0]:.1f} at the start")
  summary, targets = [], []
  for name in args.shapes.split(","):
    rows, lines, found = run_shape(name, args.scale, args.repeats, model)
    summary += lines
    targets += found
    print_table(Table(
        f"{name}: one PPO update (plan + score + actor and critic updates), {SEQUENCES} x ({PROMPT} + up to "
        f"{RESPONSE}) tokens / {args.scale}, micro-batches of {MICRO} sequences / rows, median of {args.repeats} "
        f"(rotating order), {jax.devices()[0].platform}, {args.dtype}, attention {args.attention}; ratio rows: "
        "CPU s, full-size and measured-size FLOP ceilings",
        ("mean/max", "layout", "micro-batches", "median s", "best s", "CPU s", "load", "real tokens/s",
         "block triples", "GFLOP"), rows))
  print_table(targets_table(targets))
  print(f"load average {os.getloadavg()[0]:.1f} at the end")
  print("\n".join(summary))
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
