"""A run's memory per device, as XLA compiles its programs.

XLA's own `compiled.memory_analysis()` of the programs a run executes is the run's memory, whatever the
target: the run's own devices at start-up (`verdict`, `make train`), a TPU topology's compile-only devices
or CPUs (`make memory`). A phase over (1 − `mesh.memory_margin`) of the device memory does not fit, and
what to change is found by compiling again (`what_if`); no hand model of the memory is kept beside it.

  verdict          the start-up check: the run's programs compiled on its devices, refused before the first
                   step when a phase does not fit; a verdict that fits kept for the next start
  what_if          the settings, with their values, that bring a phase under: each compiled to check it
  topologies       what a compile report compiles for: a TPU topology's compile-only devices, CPUs, or the
                   devices a run has
  aot              one jitted program compiled ahead of time on abstract inputs, and XLA's figures for it
  tpu_said         what the TPU compiler said of a program, kept on disk for a later compile of the same one
  hlo              the collectives of a compiled program, read from its HLO text, each loop with its trips
  hlo_walk         a compiled program's HBM bytes and compiler cycles, walked instruction by instruction (here,
                   beside `hlo`, because `aot` walks each program as it compiles it; the roofline reads the walk)
  hlo_ops          what one instruction of a compiled program is: its group, a convolution's multiply-adds, a
                   collective's channel, libtpu's asynchronous collective fusions
  overlap          what of a walked computation's collectives runs under its core's work, in the compiled order
  xla_report       every program of a run compiled for a target: XLA's bytes per device of each phase
  phases           a compile report's phase: its programs, each compiled with what the run holds beside it
  rollout_phases   the reshard, the training rollout as its plan runs it, and a partial rollout's round
  xla_report_text  the compile report as a table, and its refusal naming what to change

The roofline of one step, which prices these programs, is the tier above (`vapo_jax.roofline`).
"""
