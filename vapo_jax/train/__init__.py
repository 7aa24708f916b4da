"""Training: one run from its config to an exported policy.

  state          `TrainState` (one immutable pytree of arrays) and `Progress` (the host record beside it)
  algorithm      which advantage estimator and losses an `AlgoConfig` selects
  optim          AdamW with warm-up, clipping and skipped non-finite updates
  steps          the jitted programs: scoring a rollout, the actor / critic / supervised updates
  updates        a mini-batch's forward passes and updates as pure functions, padded or packed
  micro_batches  splitting a mini-batch, gradient accumulation, forward passes part by part
  packing        packed rows: first-fit decreasing, the device layout of rows
  packed_batch   a batch's packing plan (host) and its packed rows (device)
  experience     prompts → sampled responses → verifier rewards (training and evaluation)
  trainer        the run's stages: supervised warm start, value pretraining, RL; evaluation, export
  checkpoints    Orbax checkpoints of the whole run, resume, preemption
  metrics        metrics.jsonl, TensorBoard, W&B, the progress line, collapse warnings
  memory_plan    the per-device memory of every phase, before compiling
  memory_check   the refusal of a plan over the device memory, with what to change
  build          what a run is built from: architecture, settings, optimizers, the abstract `TrainState`
  targets        where a compile report compiles for: a TPU topology's compile-only devices, or CPUs
  aot            one jitted program compiled ahead of time on abstract inputs, and what XLA says of it
  compile_report every program of a run compiled for a target, and its bytes per device
  compile_format the compile report in words: its table, and what to change where a phase does not fit
  roofline       a roofline estimate of one RL step from a compile report
  runlock        the lock that keeps a second start out of a run directory
"""
