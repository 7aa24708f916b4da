"""What the roofline estimates: one phase of one RL step per chip (`Estimate`), and the step (`StepEstimate`):
their seconds, the compiler's figure beside them, the MFU (see `step`'s docstring for how they are priced)."""

from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
  from vapo_jax.rollout import partial_replay
  from vapo_jax.roofline import decode_cost


class Estimate(NamedTuple):
  """One phase of one RL step, per chip."""

  phase: str
  flops: float
  bytes: float
  compute_s: float  # flops / peak FLOP/s.
  memory_s: float  # bytes / HBM bandwidth.
  collective_bytes: float = 0.0
  collective_s: float = 0.0  # collective_bytes / ICI bandwidth.
  model_flops: float = 0.0  # Useful FLOPs of the phase on all chips.
  priced_s: float | None = None  # Priced part by part (the rollout: its decode steps one by one), else None.
  cycles_s: float = 0.0  # The compiler's estimated cycles at the chip's clock (uncalibrated; kernels count none).
  # Walked programs (scoring, the update): their instruction groups (`hlo_ops.group`) in the step's runs, per
  # chip: name → (instructions run, FLOPs, HBM bytes, bound s, the compiler's cycles s), the bound each
  # instruction at the slower of its FLOPs and its bytes.
  groups: dict[str, tuple[float, ...]] | None = None
  # Of `collective_s`, the seconds that run while the core computes (asynchronous collectives between their start
  # and done, in the compiled schedule: `memory.overlap.Timeline`), with the instructions at their bound and at the
  # compiler's cycles; walked phases only. The figures take at most `collective_s` of them (`collective_s` counts
  # each collective once as `hlo.collectives` finds it, the walk once a call).
  hidden_s: float = 0.0
  hidden_cycles_s: float = 0.0

  @property
  def instructions_s(self) -> float | None:
    """The walked instructions one after another, each at its bound (collectives aside); None unwalked."""
    return None if self.groups is None else sum(g[3] for name, g in self.groups.items() if name != "collective")

  @property
  def kernels_s(self) -> float:
    """The Pallas kernels' share of `instructions_s` (their FLOPs from attention's definition)."""
    return (self.groups or {}).get("Pallas kernel", (0.0,) * 5)[3]

  @property
  def seconds(self) -> float:
    """The rollout's priced steps; scoring's and the update's instructions one after another (a TensorCore runs
    one fusion at a time: a matmul's compute does not hide the next fusion's bytes); else the slower of the
    phase's FLOPs and bytes; collectives over ICI on top, less those the compiled schedule runs under the core's
    work (`hidden_s`)."""
    if self.priced_s is not None:
      return self.priced_s
    if self.instructions_s is None:
      return self.overlapped_s + self.collective_s
    return self.instructions_s + self.collective_s - min(self.hidden_s, self.collective_s)

  @property
  def overlapped_s(self) -> float:
    """The slower of the phase's FLOPs and bytes as if every instruction's overlapped every other's."""
    return max(self.compute_s, self.memory_s)

  @property
  def compiler_s(self) -> float:
    """The compiler's cycles at the clock, the Pallas kernels (which carry none) at their bound, collectives over
    ICI (the compiler gives them none) less those under the core's work (`hidden_cycles_s`): the walked phases'
    second figure; else `seconds`."""
    if self.groups is None:
      return self.seconds
    return self.cycles_s + self.kernels_s + self.collective_s - min(self.hidden_cycles_s, self.collective_s)


class StepEstimate(NamedTuple):
  phases: tuple[Estimate, ...]
  chips: int
  peak_flops: float  # Per chip.
  decode_steps: int
  engine: str = "paged"  # The rollout engine priced.
  profile: str = ""  # The response-length profile, in words.
  decode: "decode_cost.DecodeCost | None" = None
  update_fill: float | None = None  # Real tokens over the update's token slots run (packed rows), else None.
  micro_rows: int = 0  # Rows per micro-batch (packed).
  partial: "partial_replay.PartialLoad | None" = None  # Partial rollouts' replay, per queue.
  budget: tuple[int, int] | None = None  # Partial rollouts: (decode steps a round, max_staleness).
  # Packed rows: the most rows per micro-batch that keep the update's padding within `MAX_PADDING` on the
  # profile's lengths (`micro_batch_cost.fitting_micro_rows`); 0 when none does.
  fitting_rows: int = 0

  @property
  def seconds(self) -> float:
    return sum(p.seconds for p in self.phases)

  @property
  def model_flops(self) -> float:
    return sum(p.model_flops for p in self.phases)

  @property
  def mfu(self) -> float:
    return self.model_flops / (self.chips * self.peak_flops * self.seconds)

  def phase(self, name: str) -> Estimate:
    return next(p for p in self.phases if p.phase == name)

  def phase_mfu(self, name: str) -> float:
    p = self.phase(name)
    return p.model_flops / (self.chips * self.peak_flops * p.seconds)

  @property
  def rollout_share(self) -> float:
    return self.phase("rollout").seconds / self.seconds

  @property
  def compiler_seconds(self) -> float:
    """The step with scoring and the update at the compiler's cycles (`Estimate.compiler_s`)."""
    return sum(p.compiler_s for p in self.phases)

  @property
  def compiler_mfu(self) -> float:
    return self.model_flops / (self.chips * self.peak_flops * self.compiler_seconds)
