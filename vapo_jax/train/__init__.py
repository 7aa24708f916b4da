"""Training: one run from its config to an exported policy.

  state          `TrainState` (one immutable pytree of arrays) and `Progress` (the host record beside it)
  build          what a run is built from: the models' architectures and settings, optimizers, abstract state
  algorithm      which advantage estimator and losses an `AlgoConfig` selects
  optim          AdamW with warm-up, clipping and skipped non-finite updates
  steps          the jitted programs: scoring a rollout, the actor / critic / supervised updates
  updates        a mini-batch's forward passes and updates as pure functions, padded or packed
  micro_batches  splitting a mini-batch, accumulating gradients, forward passes part by part
  packing        packed rows: sequences laid end to end in rows of a static token length
  packed_batch   a packed batch's plan (made on the host) and its rows (built on the device)
  experience     prompts → sampled responses → verifier rewards, for a run (training and evaluation)
  held_out       the held-out evaluation: avg@k with its keys, its standard error, accuracy by problem level
  responses      problems → sampled responses for a config (its plan and sampling), the warm start's batches
  budgeted_rollout  an RL step's partial rollout (rollout.decode_budget): rounds until P groups are complete
  start_up       the start-up check that runs each rollout engine of the run once, in the rollout layout
  trainer        the run's stages: supervised warm start, value pretraining, RL; evaluation
  saving         the trainer's checkpoints, resume, stop on a signal and export
  checkpoints    Orbax checkpoints of the whole run, resume, preemption
  background_saves  Orbax's background saves: their noise after a failure silenced, their waits bounded
  host_arrays    host NumPy arrays in a checkpoint (partial rollouts' carry): files written from the arrays themselves
  metrics        metrics.jsonl, TensorBoard, W&B, the progress line, collapse warnings
  runlock        the lock that keeps a second start out of a run directory

A run's memory, planned by hand or compiled, is `vapo_jax.memory`, a tier above this one.
"""
