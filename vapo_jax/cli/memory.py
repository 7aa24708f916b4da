"""`make memory`: XLA's per-device memory of every program of an experiment's run, compiled ahead of time.

  python -m vapo_jax.cli.memory --exp NAME [--topology v5p:8x8x4 | cpu:N] [--mesh fsdp=256] [--layers 2]
                                [--phases rollout] [--tail] [--profile runs/<name>] [--remat] [field=value ...]

Compiles every program of a run (`memory/xla_report.py`) for the target: a TPU topology's compile-only
devices (libtpu's, `pip install -e ".[tpu]"`), `cpu:N` for N CPU devices of this process, or without
`--topology` this machine's own devices (where the run would start), with the configured mesh (or `--mesh`,
axes not named: 1) laid over them, and prints XLA's bytes per device of each phase against the device's
memory (the chip's HBM, what the device reports, or `mesh.device_memory_gib`). `--layers N` compiles the
models with their first N layers only (a quick look), `--phases a,b` only those phases (and the ones whose
outputs they take), `--tail` also the refill engine's decode loop at every slot count it shrinks to. For a
TPU topology, then the roofline of one RL step for each rollout engine under two response-length profiles
(`--profile runs/<name>`: a third, that run's logged lengths). `--remat` also compiles the update under every
`model.remat` policy and names the one that recomputes least and fits (`what_if.remat_policies`). A phase
that needs more than (1 − `mesh.memory_margin`, default 8 %) of the device memory refuses the run, naming
the phase and the settings, each compiled to check it, that bring it under (`memory/what_if.py`): the same
verdict as `make train`'s start-up check. Exit status 1 when a phase does not fit, 2 on a bad argument.
"""

import dataclasses
import os
import sys

from vapo_jax.cli import one_line_warnings, resolve
from vapo_jax.errors import ConfigError


def _parser():
  """`--exp`, `--smoke` and overrides (`resolve.parser`), and this tool's own options."""
  command = resolve.parser("vapo_jax.cli.memory", __doc__.strip())
  command.add_argument("--topology", default="", metavar="TARGET",
                       help="compile for a TPU topology (v5p:8x8x4) or cpu:N; else for this machine's devices")
  command.add_argument("--mesh", default="", metavar="AXIS=SIZE,...", help="the mesh (axes not named: 1)")
  command.add_argument("--layers", default="", metavar="N", help="compile the models' first N layers only")
  command.add_argument("--phases", default="", metavar="A,B", help="compile only these phases")
  command.add_argument("--tail", action="store_true",
                       help="also the decode loop at every slot count it shrinks to")
  command.add_argument("--profile", default="", metavar="RUN_DIR",
                       help="also price the rollout at the response lengths a run logged (its metrics.jsonl)")
  command.add_argument("--remat", action="store_true",
                       help="also the update under every model.remat policy, and the least "
                            "recomputation that fits")
  return command


def mesh_sizes(text: str, axes: tuple[str, ...]) -> dict[str, int]:
  """`data=1,fsdp=256` → {"data": 1, "fsdp": 256, "tensor": 1}: axes not named are 1."""
  sizes = dict.fromkeys(axes, 1)
  for item in filter(None, text.split(",")):
    axis, _, size = item.partition("=")
    if axis not in sizes or not size.isdigit():
      raise ConfigError(f"--mesh takes axis=size pairs of {', '.join(axes)}, got {item!r}")
    sizes[axis] = int(size)
  return sizes


def _roofline(config, target, report, log, logged=None) -> str:
  """The roofline of one RL step (`memory/step.py`) under two response-length profiles (every response at the
  cap; a log-normal one, mean 0.3 of the cap) and, given `logged`, a run's logged lengths (`_logged`), for
  each rollout engine. Programs walked from their HLO count every layer; otherwise scanned layers compile the
  per-step programs a second time with two layers per scan iteration, so that every layer is counted."""
  from vapo_jax.memory import xla_report
  from vapo_jax.roofline import profiles, step, text

  layers = report.architecture.num_layers
  if report.layers:  # cost_analysis saw the programs of a shallower model.
    return f"roofline: not estimated (only {report.layers} decoder layers compiled; it needs the run's programs)"
  if step.walked_through(report):
    log("roofline: every per-step program walked from its HLO (loops by their trips): no second compile")
  elif config.model.scan_layers and layers > 1:
    if layers % 2:
      return f"roofline: not estimated ({layers} scanned layers: the per-layer count needs an even number)"
    log("roofline: the per-step programs again with two layers per scan iteration (model.scan_unroll=2)")
    twice = xla_report.compile_run(step.twice_unrolled(config), target, phases=("update",), log=log)
    report = step.every_layer(report, twice)
  prompts, where = profiles.prompt_lengths(config)
  profiles = [profiles.at_cap(config, prompts, where), profiles.log_normal(config, prompts, where)]
  estimates = step.compare(report, profiles + [logged] * (logged is not None))
  if report.refill:  # Profile B under partial rollouts: the config's budget, or a third of the cap.
    budget = step.partial_budget(config)
    estimates.append((f"B, paged, budget {budget[0]}", step.estimate(report, profiles[1], "paged", budget)))
  return text.format_comparison(report, estimates)


def _logged(config, profile_run: str):
  """`--profile`'s run read now, before anything compiles: a mistake there is one line at once."""
  from vapo_jax.roofline import profiles
  if not profile_run:
    return None
  prompts, where = profiles.prompt_lengths(config)
  return profiles.from_run(config, prompts, where, profile_run)


def compiled(config, topology: str, mesh_text: str, layers: str, phases: str, tail: bool, profile: str = "",
             remat: bool = False) -> int:
  """Compiles every program of a run for `topology` and prints the compile report; 1 if over."""
  import jax

  from vapo_jax import compile_cache
  from vapo_jax.memory import topologies, xla_report, xla_report_text
  compile_cache.bound()  # make memory's cache (what the compiler said before), at its size.
  compile_cache.install()

  if layers and not (layers.isdigit() and int(layers) > 0):
    raise ConfigError(f"--layers takes a positive number of decoder layers, got {layers!r}")
  from vapo_jax import distributed
  distributed.tpu_compiler_flags(config.mesh)  # Before libtpu starts (compile-only devices too).
  target = topologies.named(topology) if topology else topologies.here(jax.devices())
  if mesh_text:
    sizes = mesh_sizes(mesh_text, ("data", "fsdp", "tensor"))
    config = dataclasses.replace(config, mesh=dataclasses.replace(config.mesh, **sizes))
  log = lambda message: print(message, file=sys.stderr, flush=True)
  logged = _logged(config, profile)
  report = xla_report.compile_run(
      config, target, layers=int(layers) if layers else None,
      phases=tuple(p.strip() for p in phases.split(",")) if phases else xla_report.PHASES, tail=tail, log=log)
  print(xla_report_text.table(report))
  if remat and any(p.name == "update" for p in report.phases):
    from vapo_jax.memory import what_if
    log("remat: the update compiled under each model.remat policy")
    print(xla_report_text.remat_table(what_if.remat_policies(report, log), report.allowed))
  whole = target.chip is not None and {"rollout", "scoring", "update"} <= {p.name for p in report.phases}
  if message := xla_report_text.refusal(report):
    if whole:  # A run that does not fit has no step time; the roofline's second compile would take minutes.
      print("roofline: not estimated (the run does not fit)")
    print(f"refused: {message}")
    return 1
  if whole:
    print(_roofline(config, target, report, log, logged))
  return 0


def main(argv: list[str]) -> int:
  command = _parser()
  options, _ = command.parse_known_intermixed_args(argv)  # Mistakes: one line, exit 2 (cli.ArgumentParser).
  if options.help:  # The usage, before anything imports JAX.
    print(command.format_help().strip())
    return 0
  topology = options.topology
  if topology:  # Compile-only devices need no backend; a CPU target's devices must exist before JAX starts.
    from vapo_jax.memory import topologies
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    topologies.cpu_flags(topology)
  try:
    config, _ = resolve.resolve(argv, command)
    return compiled(config, topology, options.mesh, options.layers, options.phases, options.tail,
                    options.profile, options.remat)
  except (ConfigError, ValueError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2


if __name__ == "__main__":
  with one_line_warnings():
    sys.exit(main(sys.argv[1:]))
