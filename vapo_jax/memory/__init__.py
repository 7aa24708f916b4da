"""A run's memory per device: planned by hand before anything is compiled, and compiled by XLA.

Which figure governs: wherever a compiled program exists, XLA's own `compiled.memory_analysis()` of
the programs a run executes is the run's memory (`xla_report`, `make memory TOPOLOGY=`), and a
phase over the device's memory there does not fit, whatever the hand plan says. The hand plan
(`hand_plan`) is the estimate before anything is compiled: what `make train` prints and refuses on
at start-up (`cli/preflight.py`) and what `make memory` without TOPOLOGY prints; and its advice
(`advice`) names the setting to change and the value it needs, in both reports (the compile report
aims it at XLA's figure).

  hand_plan        bytes per device of every phase of a run, from its config's sizes (nothing compiled)
  footprint        a model's parameters, optimizer state and activations per device, before allocation
  advice           the settings, with their values, that bring a planned phase under a budget; the refusal
  topologies       what a compile report compiles for: a TPU topology's compile-only devices, or CPUs
  aot              one jitted program compiled ahead of time on abstract inputs, and XLA's figures for it
  compiled_cache   what the TPU compiler said of a program, kept on disk for a later compile of the same one
  hlo              the collectives of a compiled program, read from its HLO text
  xla_report       every program of a run compiled for a topology: XLA's bytes per device of each phase
  xla_report_text  the compile report as a table, and its refusal naming what to change
  roofline         a roofline estimate of one RL step from the compile report's FLOPs and bytes, per rollout
                   engine and response-length profile
  schedule         the refill engine's schedule replayed on the host from a response-length profile
  decode_cost      a decode step's bytes per chip, itemised (weights, KV read, KV written, the rest), priced
"""
