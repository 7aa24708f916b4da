"""The pod section of `make bench`: decoding in the training layout against the rollout layout, on 8 CPU
devices.

  python -m benchmarks.pod_bench [--preset small] [--repeats 5]

  decode    the refill engine's decode program, compiled by the compile report (memory/xla_report.py)
            for an FSDP run over the 8 devices, in the training layout (rollout.tensor_parallel=1: the
            FSDP-sharded float32 weights) and in the rollout layout (rollout.tensor_parallel=2: four
            groups of two devices holding a bfloat16 copy split by heads): the bytes its decode loop's
            collectives move per device per step, read from the HLO, as a share of the policy's weight
            bytes, and the decode program's temporaries and total per device.
  reshard   on real arrays: the reshard of the actor into the rollout layout (its one-per-kind programs)
            against one decode step of the rollout layout (`refill.decode` with one step per call), best
            of `--repeats` after a warm-up each; the reshard runs once per RL step, the decode step
            `max_response_tokens`-odd times.

Targets: the rollout layout's decode loop moves ≤ 1 % of the weight bytes per step (the issue's
acceptance); the training layout's decode program moves ≥ 50 % of them per call (it gathers the
weights: XLA:CPU once per call, before the loop, and holds them in its temporaries; the TPU compiler
inside the loop, every step); and the reshard costs at most 100 decode steps. Prints the load
average, at the start and the end: timings are only comparable on an idle machine.
"""

import argparse
import dataclasses
import os
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import experiments  # noqa: E402
from benchmarks.tables import RatioTarget, Table, best_seconds, print_table, targets_table  # noqa: E402
from experiments.smoke import smoke  # noqa: E402
from vapo_jax import rollout  # noqa: E402
from vapo_jax.config import overrides  # noqa: E402
from vapo_jax.memory import topologies, xla_report  # noqa: E402
from vapo_jax.models import sharding  # noqa: E402
from vapo_jax.models.transformer import CausalLM  # noqa: E402
from vapo_jax.rollout import common  # noqa: E402
from vapo_jax.rollout.layout import layout_for  # noqa: E402
from vapo_jax.train import build  # noqa: E402


def bench_config(preset: str, tensor_parallel: int):
  """The default experiment at a small size: `preset` under FSDP over the 8 devices, 8 prompts x 4
  samples of 256 new tokens through 16 refill slots, float32 compute (XLA:CPU)."""
  return overrides.apply_overrides(smoke(experiments.get_experiment("tiny")), [
      f"model.preset={preset}", "mesh.preset=fsdp", "mesh.data=1", "mesh.fsdp=8", "rollout.slots=16",
      "rollout.max_response_tokens=256", f"rollout.tensor_parallel={tensor_parallel}", "eval.path=None"])


def decode_section(args) -> tuple[list[Table], list[RatioTarget], dict]:
  rows, share, decode = [], {}, {}
  for name, t in (("training layout (fsdp)", 1), ("rollout layout (tensor_parallel=2)", 2)):
    report = xla_report.compile_run(bench_config(args.preset, t), topologies.named("cpu:8"),
                                    phases=("rollout",))
    program = next(p for p in report.phases[0].programs if p.decode is not None)
    outside = sum(max(c.operand_bytes, c.result_bytes) for c in program.collectives if not c.loops)
    share[t] = program.decode.bytes / report.weight_bytes, (outside + program.decode.bytes) / report.weight_bytes
    decode[t] = program
    rows.append((name, program.decode.bytes / 2**20, share[t][0] * 100, program.decode.count, outside / 2**20,
                 program.memory.temporaries / 2**20, program.needs / 2**20))
  table = Table(f"decode program, {args.preset} preset, 8 CPU devices (MiB per device)",
                ("layout", "in the loop, per step", "% of weights", "collectives",
                 "before the loop, per call",
                 "temp", "needs"), rows)
  # XLA:CPU gathers the FSDP weights once per call, before the loop (the TPU compiler, at 4 to 256 chips, inside
  # it); either way they move and sit in the temporaries.
  found = [RatioTarget("rollout layout: decode loop bytes per step / weight bytes", share[2][0], "<=", 0.01),
           RatioTarget("training layout: decode bytes per call (one step) / weight bytes", share[1][1], ">=",
                       0.5)]
  return [table], found, decode


def _rollout_state(config, layout, cfg):
  """A real actor on the training mesh and one started refill state on the rollout mesh."""
  mesh, rules = layout.training_mesh, layout.training_rules
  actor = sharding.create_sharded(lambda: CausalLM(cfg, rngs=nnx.Rngs(0)), mesh, rules)
  graphdef, params = nnx.split(actor)
  r = config.rollout
  sampling = common.Sampling(max_response_tokens=r.max_response_tokens, stop_token_ids=(-1,), temperature=1.0)
  plan = rollout.plan_rollout(r, cfg, prompts=r.prompts_per_step, samples_per_prompt=r.samples_per_prompt,
                              prompt_tokens=16,
                              dtype=jnp.dtype(config.cache_dtype), devices=layout.data_devices, budgeted=True)
  plan = dataclasses.replace(plan, steps_per_call=1, min_slots=0)
  fns = plan.programs(sampling=sampling, pad_id=0, cache_dtype=jnp.dtype(config.cache_dtype), jit=layout.jit)
  rng = np.random.default_rng(0)
  tokens = rng.integers(3, cfg.vocab_size, (r.prompts_per_step, 16)).astype(np.int32)
  prompts_tokens, mask = layout.place((tokens, np.ones_like(tokens, bool)))
  model = nnx.merge(graphdef, layout.reshard(params))
  state = fns.start(model, prompts_tokens, mask)
  return params, model, fns, state


def reshard_section(args) -> tuple[list[Table], list[RatioTarget]]:
  config = bench_config(args.preset, 2)
  cfg = build.model_configs(config)[0]
  mesh = sharding.make_mesh(data=1, fsdp=8, devices=sharding.tensor_groups(jax.devices(), 2))
  layout = layout_for(config.rollout, mesh, compute_dtype=config.model.dtype,
                      training_rules=sharding.PRESETS["fsdp"])
  params, model, fns, state = _rollout_state(config, layout, cfg)
  key, held = layout.place(jax.random.key(0)), [state]

  def step():  # The decode donates its state: each call takes the last one's (a step further).
    held[0], status = fns.decode(model, held[0], key, None)
    return status

  seconds = best_seconds({"reshard": lambda: layout.reshard(params), "decode step": step},
                         repeats=args.repeats)
  decode = seconds["decode step"]
  rows = [("reshard (all kinds)", seconds["reshard"] * 1e3), ("one decode step", decode * 1e3),
          ("reshard / decode step", seconds["reshard"] / decode)]
  table = Table(f"reshard against a decode step, {args.preset} preset, fsdp over 8 -> tensor_parallel=2, "
                f"{config.rollout.slots} slots (ms, best of {args.repeats})", ("what", "value"), rows)
  return [table], [RatioTarget("reshard / one decode step", seconds["reshard"] / decode, "<=", 100)]


def main(argv) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--preset", default="small", help="model preset (its KV heads must split in two)")
  parser.add_argument("--repeats", type=int, default=5, help="timed calls per measurement (best of)")
  args = parser.parse_args(argv)
  print(f"pod benchmark on {len(jax.devices())} {jax.devices()[0].platform} devices; load average "
        f"{os.getloadavg()[0]:.2f} at the start")
  start = time.perf_counter()
  tables, found, _ = decode_section(args)
  more_tables, more = reshard_section(args)
  for table in tables + more_tables:
    print_table(table)
  print_table(targets_table(found + more))
  print(f"\n{time.perf_counter() - start:.0f} s; load average {os.getloadavg()[0]:.2f} at the end")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
