"""Training: one run from its config to an exported policy.

  state          `TrainState` (one immutable pytree of arrays) and `Progress` (the host record beside it)
  algorithm      which advantage estimator and losses an `AlgoConfig` selects
  optim          AdamW with warm-up, clipping and skipped non-finite updates
  steps          the jitted programs: scoring a rollout, the actor / critic / supervised updates
  experience     prompts → sampled responses → verifier rewards (training and evaluation)
  trainer        the run's stages: supervised warm start, value pretraining, RL; evaluation, export
  checkpoints    Orbax checkpoints of the whole run, resume, preemption
  metrics        metrics.jsonl, TensorBoard, W&B, the progress line, collapse warnings
  memory_plan    the per-device memory of every phase, before compiling; memory_check: its refusal
  runlock        the lock that keeps a second start out of a run directory
"""
