"""Packed rows against padded sequences: one PPO update of the `small` preset, side by side in one process.

  make bench        (or: python -m benchmarks.packing_bench [--repeats 2] [--sequences 64])

A batch of 64 sequences, each a 256-token prompt and a response of at most 4,096 tokens, so a padded
sequence and a packed row are both S = L = 4,352 tokens. Response lengths: the quantiles (i + ½)/64 of
an exponential capped at 4,096 tokens, its scale chosen (by bisection) so that mean/max is 0.3 (long-
tailed, about 4 % at the cap), then 0.9. One PPO update is what `Trainer.step` runs after sampling:
`Steps.plan_packing` (packed: the lengths to the host, first-fit decreasing, the placements back), `Steps.score`
(critic values, actor log-probs and entropy, GAE) and `Steps.ppo_update` (one mini-batch of all 64:
critic update, then actor update), float32, `model.remat` on, chunked attention. Padded: micro-batches
of 8 sequences; packed: micro-batches of 8 rows, the same [8, 4,352] shape, and only those holding a
sequence run.

Measured: the best wall time of `--repeats` updates after a warm-up one, the two layouts in turn;
real tokens/s = Σ (prompt + response) tokens / time; XLA's compiled temporaries
(`memory_analysis().temp_size_in_bytes`) of the scoring and update programs. Targets: at mean/max 0.3
packed ≥ 2.5× the padded tokens/s with temporaries no larger; at 0.9 packed ≥ 0.9× padded.
"""

import argparse
import os
import sys
import time

import jax
import numpy as np
from flax import nnx

from benchmarks.tables import RatioTarget, Table, print_table, targets_table
from vapo_jax.config import AlgoConfig, ExperimentConfig, OptimizerConfig, PackingConfig, RolloutConfig
from vapo_jax.config.sections import MeshConfig, ModelConfig
from vapo_jax.models import sharding
from vapo_jax.models.config import preset
from vapo_jax.models.transformer import CausalLM, ValueModel
from vapo_jax.rollout.common import Rollout
from vapo_jax.train import optim
from vapo_jax.train.state import TrainState
from vapo_jax.train.steps import Steps

PROMPT, RESPONSE, MICRO = 256, 4096, 8


def response_lengths(sequences: int, mean_over_max: float) -> np.ndarray:
  """The quantiles (i + ½)/n of an exponential capped at RESPONSE, scaled to the given mean/max."""
  quantiles = (np.arange(sequences) + 0.5) / sequences
  lengths = lambda scale: np.clip(np.ceil(-scale * np.log1p(-quantiles)), 1, RESPONSE).astype(int)
  low, high = 1.0, 1e7
  for _ in range(60):
    scale = (low * high) ** 0.5
    low, high = (scale, high) if lengths(scale).mean() < mean_over_max * RESPONSE else (low, scale)
  return lengths(high)


def _config(packed: bool, sequences: int) -> ExperimentConfig:
  return ExperimentConfig(
      name="packing_bench", model=ModelConfig(preset="small", dtype="float32", remat=True, random_init=True),
      algo=AlgoConfig(mini_batch_responses=sequences, micro_batch_responses=MICRO, value_pretrain_steps=0),
      packing=PackingConfig(enabled=packed, micro_batch_rows=MICRO), optim=OptimizerConfig(warmup_updates=0),
      rollout=RolloutConfig(prompts_per_step=sequences // 4, samples_per_prompt=4, max_prompt_tokens=PROMPT,
                            max_response_tokens=RESPONSE),
      mesh=MeshConfig(preset="dp"))


class LayoutBench:
  """One layout's programs, state and batch on one device; `update()` runs one PPO update."""

  def __init__(self, packed: bool, lengths: np.ndarray):
    config = _config(packed, lengths.size)
    mesh = sharding.make_mesh(data=1, devices=jax.devices()[:1])
    cfg = preset("small")
    actor_def, actor = nnx.split(CausalLM(cfg, remat=True, rngs=nnx.Rngs(0)))
    critic_def, critic = nnx.split(ValueModel(cfg, remat=True, rngs=nnx.Rngs(1)))
    txs = [optim.make_optimizer(config.optim, lr) for lr in (1e-5, 1e-5)]
    self.steps = Steps(config, mesh, sharding.PRESETS["dp"], actor_def=actor_def, critic_def=critic_def,
                       actor_tx=txs[0], critic_tx=txs[1], sft_tx=txs[0])
    self.state = TrainState(actor, critic, txs[0].init(actor), txs[1].init(critic), key=jax.random.key(0))
    rng = np.random.default_rng(0)
    b = lengths.size
    response_mask = np.arange(RESPONSE)[None] < lengths[:, None]
    logprobs = -rng.exponential(size=(b, RESPONSE)).astype(np.float32) * response_mask
    self.out = Rollout(rng.integers(3, 259, (b, PROMPT)), np.ones((b, PROMPT), bool),
                       rng.integers(3, 259, (b, RESPONSE)) * response_mask, response_mask,
                       lengths.astype(np.int32), np.zeros(b, np.int32), logprobs, logprobs)
    correct = rng.random(b) < 0.5
    self.out, self.rewards, self.correct = self.steps.place((self.out, np.where(correct, 1.0, -1.0).astype(
        np.float32), correct))
    self.metrics, self.tokens = {}, int(b * PROMPT + lengths.sum())

  def update(self) -> float:
    """Seconds of one PPO update (plan, score, update), synchronised at the end."""
    start = time.perf_counter()
    plan = self.steps.plan_packing(self.state, self.out)
    batch, _ = self.steps.score(self.state, self.out, self.rewards, self.correct, plan=plan)
    self.state, metrics = self.steps.ppo_update(self.state, batch, actor=True, critic=True, plan=plan)
    self.metrics = jax.device_get(metrics)
    self.last = (plan, batch)
    return time.perf_counter() - start

  def temp_bytes(self) -> dict[str, int]:
    """XLA's temporaries of the scoring and update programs just run (lowered again, not run)."""
    plan, batch = self.last
    placement = plan and plan.placement
    found = {}
    for key, program in self.steps._programs.items():  # The programs `update` compiled.
      if key[0] == "score":
        lowered = program.lower(self.state, self.out, self.rewards, self.correct, placement)
      elif isinstance(key[0], tuple) and key[0][0] == "ppo":
        lowered = program.lower(self.state, batch, placement)
      else:
        continue
      found["score" if key[0] == "score" else "update"] = lowered.compile().memory_analysis().temp_size_in_bytes
    return found


def measure(mean_over_max: float, sequences: int, repeats: int) -> dict:
  lengths = response_lengths(sequences, mean_over_max)
  layouts = {"padded": LayoutBench(False, lengths), "packed": LayoutBench(True, lengths)}
  for layout in layouts.values():
    layout.update()  # Compiles.
  best = {name: float("inf") for name in layouts}
  for _ in range(repeats):
    for name, layout in layouts.items():
      best[name] = min(best[name], layout.update())
  return {"lengths": lengths, **{name: dict(seconds=best[name], tokens_per_s=layout.tokens / best[name],
                                            temps=layout.temp_bytes(), metrics=layout.metrics)
                                 for name, layout in layouts.items()}}


def main(argv) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--repeats", type=int, default=2, help="timed updates per layout (best of)")
  parser.add_argument("--sequences", type=int, default=64, help="sequences per batch (a multiple of 4)")
  args = parser.parse_args(argv)
  print(f"packing benchmark on {jax.devices()[0].device_kind}; load average {os.getloadavg()[0]:.1f} at the start")
  rows, targets, mib = [], [], lambda n: n / 2**20
  for ratio in (0.3, 0.9):
    result = measure(ratio, args.sequences, args.repeats)
    lengths = result["lengths"]
    for name in ("padded", "packed"):
      r = result[name]
      rows.append((f"{lengths.mean() / RESPONSE:.2f}", name, r["metrics"]["perf/micro_batches"],
                   r["metrics"]["perf/padding_frac_update"], r["seconds"], r["tokens_per_s"],
                   mib(r["temps"]["score"]), mib(r["temps"]["update"])))
    speed = result["packed"]["tokens_per_s"] / result["padded"]["tokens_per_s"]
    rows.append(("", "packed / padded", "", "", "", speed, *(result["packed"]["temps"][k] / result["padded"]["temps"][k]
                                                               for k in ("score", "update"))))
    if ratio < 0.5:
      targets += [RatioTarget("tokens/s @0.3: packed / padded", speed, ">=", 2.5)] + [
          RatioTarget(f"{k} temp @0.3: packed / padded", result["packed"]["temps"][k] / result["padded"]["temps"][k],
                 "<=", 1.0) for k in ("score", "update")]
    else:
      targets.append(RatioTarget("tokens/s @0.9: packed / padded", speed, ">=", 0.9))
  print_table(Table(f"one PPO update (plan + score + actor and critic updates), small preset, {args.sequences} x "
                    f"({PROMPT} + up to {RESPONSE}) tokens, micro-batches of {MICRO} sequences / rows of "
                    f"{PROMPT + RESPONSE}, best of {args.repeats}, {jax.devices()[0].platform}",
                    ("mean/max", "layout", "micro-batches", "padding frac", "seconds", "real tokens/s",
                     "score temp MiB", "update temp MiB"), rows))
  print_table(targets_table(targets))
  print(f"load average {os.getloadavg()[0]:.1f} at the end")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
