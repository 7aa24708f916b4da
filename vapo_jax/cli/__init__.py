"""The command-line entry points: the only layer that imports the experiment registry (`experiments/`).

  train      `make train`: resolve an experiment, run it       python -m vapo_jax.cli.train
  evaluate   `make eval`: avg@k / pass@k / maj@k of responses  python -m vapo_jax.cli.evaluate
  sweep      `make sweep`: every member × seed, then a report  python -m vapo_jax.cli.sweep
  plots      `make plot`: PNG curves of runs                   python -m vapo_jax.cli.plots
  memory     `make memory`: the per-device memory plan         python -m vapo_jax.cli.memory
  resolve    `--exp`, `--smoke` and `field.path=value` overrides into a config (no JAX)
  preflight  the machine's checks before a run starts: backend, devices, run directory
"""
