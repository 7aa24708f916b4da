"""The roofline of one RL step: the compiled programs' FLOPs, HBM bytes and collectives (`vapo_jax.memory`'s
compile report) priced at a chip's peak FLOP/s and bandwidths, on a response-length profile.

  step              the estimate: each phase's FLOPs, bytes and collectives per chip, the rollout's decode loop
                    priced step by step on the engine's replay, the MFU; partial rollouts in steady state
  estimates         what the estimate holds: a phase's figures (`Estimate`), the step's (`StepEstimate`), MFU
  text              the estimate as text: a step's phases, engines and profiles side by side, what bounds the update
  profiles          response-length profiles: every response at the cap, log-normal, a run's logged lengths
  decode_cost       a decode step's bytes per chip, itemised (weights, KV read, KV written, the rest), priced
  micro_batch_cost  scoring's and the update's micro-batches that run on a profile, and the update's token fill
  attention_cost    what attention's splash kernel computes in scoring and the update: the block pairs it visits

The rollout's schedule itself is the engine's replay, beside the engine (`rollout/refill/replay.py`). This
tier sits above `vapo_jax.memory`, whose compile report it reads; nothing below reads it.
"""
