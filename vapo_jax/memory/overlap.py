"""What of a computation's collectives runs while its core computes: one run of it on a chip's TensorCore and its
ICI link, instruction by instruction in the order the compiler scheduled them (`hlo_walk` feeds it).

  timeline = Timeline()
  timeline.compute((bound_s, cycles_s))                # an instruction on the core
  timeline.collective(name, seconds, asynchronous)     # a collective (an asynchronous one: its `-start`)
  timeline.done(start_name)                            # its `-done`
  hidden_bound_s, hidden_cycles_s = timeline.hidden()

Pure Python.
"""


class Timeline:
  """One run of a computation on a chip's core and its ICI link, instruction by instruction in the order the
  compiler scheduled them (`is_scheduled`): the core runs one instruction at a time; a collective occupies the
  link from when both are free for its bytes over the chip's ICI bandwidth (one at a time); a synchronous one
  holds the core until it ends, an asynchronous one (its `-start`) only its `-done`, so that what the core runs in
  between overlaps it. Kept twice: each instruction at its bound, and at the compiler's cycles."""

  def __init__(self):
    self.core, self.link, self.serial = [0.0, 0.0], [0.0, 0.0], [0.0, 0.0]
    self.pending: dict[str, list[float]] = {}

  def compute(self, seconds: tuple[float, float]) -> None:
    for k in (0, 1):
      self.core[k] += seconds[k]
      self.serial[k] += seconds[k]

  def collective(self, name: str, seconds: float, asynchronous: bool) -> None:
    ends = []
    for k in (0, 1):
      ends.append(max(self.core[k], self.link[k]) + seconds)
      self.link[k], self.serial[k] = ends[k], self.serial[k] + seconds
      if not asynchronous:
        self.core[k] = ends[k]
    if asynchronous:
      self.pending[name] = ends

  def done(self, start: str) -> None:
    ends = self.pending.pop(start, None)
    if ends is not None:
      self.core = [max(c, e) for c, e in zip(self.core, ends)]

  def hidden(self) -> tuple[float, float]:
    """(bound, cycles) seconds of collectives that ran under the core's work: one after another less as run."""
    for start in list(self.pending):  # A start never awaited here: awaited at the computation's end.
      self.done(start)
    return self.serial[0] - self.core[0], self.serial[1] - self.core[1]
