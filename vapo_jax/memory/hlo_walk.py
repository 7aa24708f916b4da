"""What a compiled program reads and writes in HBM, and the compiler's cycle estimate, walked instruction by
instruction through its HLO text (`compiled.as_text()`), every loop body times its trip count.

  walked = hlo_walk.walk(compiled.as_text())
  walked.bytes, walked.flops, walked.cycles, walked.kernel_bytes # per device, one run of the program
  walked.loop("decode_loop")                                     # one iteration of the loop traced in that scope

`cost_analysis` counts a loop body once and a buffer updated in place whole. This walk prices each
instruction of a computation that runs (the entry, `while` bodies and conditions, `conditional` branches,
`call`s; a fusion is one kernel: its operands and results, not what it computes inside) as the bytes of its
operands and results, except:
- an array outside HBM (a layout with a memory space `S(n)`, n > 0: VMEM, SMEM) counts nothing;
- a buffer updated in place (the TPU compiler's `aliasing_operands` pairs an operand with the result it is
  written into) by a scatter or dynamic-update-slice counts as the update it writes (the bytes of the other
  operands, at most the buffer's), not its whole size; elsewhere an aliased operand is still read whole;
- an operand that a fusion only gathers from or slices (every use inside a `gather` or `dynamic-slice`)
  counts the rows taken, not the whole operand; a top-level gather or dynamic-slice likewise;
- bookkeeping (parameter, constant, tuple, get-tuple-element, bitcast, the `-done` half of an asynchronous
  pair) counts nothing;
- a Pallas kernel (`custom-call` to `tpu_custom_call`) counts its operands and results, the same bytes reported
  apart (`kernel_bytes`) and its calls by kernel name (`kernels`), for a caller that prices the kernel itself.

With a chip, each collective crosses ICI at its bandwidth (`overlap.Timeline`): a synchronous one holding the
core, an asynchronous one (`-start` … `-done`) under what the core runs in between, and the collective of a
continuation fusion (libtpu's asynchronous collective fusion, `hlo_ops.CONTINUATION`; its share where one
collective is split over several) under the work fused beside it, which is grouped and priced as that work.

FLOPs are the matmuls' (dots, and convolutions, XLA's form of many sharded einsums: per output element its
group's input features times the window taps that land inside the input, padded taps multiplying nothing),
inside fusions too; elementwise work and Pallas kernels count none.

A `while` runs its condition and body `trips` times: XLA's `known_trip_count` when printed, else read from
the condition, `counter < constant(N)` (the counter's start traced through copies to a constant, its step
read from the body, as the TPU compiler's windowed einsums count by two; a start it cannot trace is taken
as 0, where JAX's scans and fori_loops start); a loop whose condition is anything
else (the decode loop's) counts once, and `loops` keeps one iteration of every loop so that a caller prices
it by its own count. A `conditional` counts its costliest branch; a loop's `plain` iteration counts each
conditional's cheapest (the refill engine's decode step without a preemption or a prefill chunk, which a
caller prices by how often they run). The compiler's `estimated_cycles`
(in a fusion's `backend_config`) add up the same way: uncalibrated, but the compiler's own. Pure Python.
"""

import dataclasses
import math
import re

from vapo_jax.memory import hlo, hlo_ops, overlap

_FREE = frozenset({"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "after-all", "partition-id",
                   "replica-id", "opt-barrier", "add-dependency"})
_CYCLES = re.compile(r'"estimated_cycles":"(\d+)"')
_SPACE = re.compile(r"S\((\d+)\)")
_TYPED = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\](\{[^}]*\})?")
_IN_PLACE = ("scatter", "dynamic-update-slice")


@dataclasses.dataclass
class Cost:
  """HBM bytes, compiler cycles and Pallas kernels' bytes per device (see the module docstring)."""

  bytes: float = 0.0
  cycles: float = 0.0
  kernel_bytes: float = 0.0
  flops: float = 0.0  # Of its matmuls (dots and convolutions, inside fusions too): 2 per multiply-add.
  # With a chip (`walk`'s): its collectives' seconds over ICI one after another, and the seconds of them that run
  # while the core computes (an asynchronous collective's, between its start and done: `overlap.Timeline`), with
  # each instruction at its bound (`hidden_s`) or at the compiler's cycles (`hidden_cycles_s`).
  collective_s: float = 0.0
  hidden_s: float = 0.0
  hidden_cycles_s: float = 0.0
  # The same by instruction group (`group`): name → [instructions run, FLOPs, bytes, cycles, bound bytes], the
  # bound bytes each instruction's max(FLOPs / ridge, bytes) (`walk`'s ridge; bytes without one): at the
  # chip's HBM bandwidth, the time of its instructions one after another, each at the slower of its FLOPs and
  # its bytes.
  groups: dict[str, list[float]] = dataclasses.field(default_factory=dict)
  kernels: dict[str, float] = dataclasses.field(default_factory=dict)  # Pallas kernel calls run, by kernel name.

  def add(self, other: "Cost", times: float = 1.0) -> None:
    self.bytes += other.bytes * times
    self.cycles += other.cycles * times
    self.kernel_bytes += other.kernel_bytes * times
    self.flops += other.flops * times
    self.collective_s += other.collective_s * times
    self.hidden_s += other.hidden_s * times
    self.hidden_cycles_s += other.hidden_cycles_s * times
    for name, figures in other.groups.items():
      mine = self.groups.setdefault(name, [0.0] * len(figures))
      for i, x in enumerate(figures):
        mine[i] += x * times
    for name, calls in other.kernels.items():
      self.kernels[name] = self.kernels.get(name, 0.0) + calls * times


@dataclasses.dataclass(frozen=True)
class Loop:
  """One `while` of the program: one iteration's cost (its nested loops times their trips) and its trips."""

  name: str
  op_name: str  # Its metadata: the `jax.named_scope`s it was traced in ("jit(f)/decode_loop/while").
  trips: int | None  # None: a count the walk could not read (counted once).
  iteration: Cost
  runs: float  # How many times the loop itself runs per run of the program (the trips of the loops around it).
  plain: Cost | None = None  # One iteration with every `conditional` on its cheapest branch (nothing optional runs).


@dataclasses.dataclass(frozen=True)
class Walked:
  bytes: float
  cycles: float
  kernel_bytes: float
  loops: tuple[Loop, ...]
  flops: float = 0.0
  groups: dict[str, list[float]] = dataclasses.field(default_factory=dict)  # As `Cost.groups`.
  collective_s: float = 0.0  # As `Cost`'s (0 without a chip).
  hidden_s: float = 0.0
  hidden_cycles_s: float = 0.0
  kernels: dict[str, float] = dataclasses.field(default_factory=dict)  # As `Cost.kernels`.

  def loop(self, scope: str) -> Loop | None:
    """The outermost loop traced under `jax.named_scope(scope)` (None: none)."""
    found = [x for x in self.loops if x.op_name.endswith(f"{scope}/while")]
    return min(found, key=lambda x: x.runs) if found else None


def hbm_bytes(type_text: str) -> int:
  """Bytes of the arrays of an HLO type (a tuple's added) that live in HBM: no memory space, or `S(0)`."""
  total = 0
  for dtype, dims, layout in _TYPED.findall(type_text):
    size = hlo.array_bytes(dtype, [int(d) for d in dims.split(",") if d])
    if size is None or ((space := _SPACE.search(layout or "")) and space.group(1) != "0"):
      continue
    total += size
  return total


def _aliased(body: str, operands: int) -> list[tuple[int, int]]:
  """(operand, output) index pairs that share a buffer (`aliasing_operands`: operands 0..n−1, then the
  result's arrays n, n+1, ...)."""
  start = body.find('"aliasing_operands":{"lists":[')
  if start < 0:
    return []
  pairs = []
  for group in re.findall(r'\{"indices":\[([^\]]*)\]\}', body[start:]):
    ids = [int(i) for i in re.findall(r'"(\d+)"', group)]
    ins, outs = [i for i in ids if i < operands], [i - operands for i in ids if i >= operands]
    pairs += [(i, o) for i in ins[:1] for o in outs[:1]]
  return pairs


class _Program:
  def __init__(self, text: str, ridge: float | None = None, chip=None):
    self.ridge = ridge
    self.chip = chip
    self.entry, self.computations, self.types = hlo.parse(text)
    self.by_name = hlo.by_name(self.computations)
    self.loops: list[Loop] = []
    self.flops_memo: dict[str, float] = {}
    self.pick = max  # A conditional's branch: the costliest; `min` while a loop's plain iteration is walked.
    # Each continuation fusion's called computation → its collectives (name, type, opcode, body); and how many
    # such fusions hold a collective of each channel (the steps it is split over).
    self.carried: dict[str, list[tuple[str, str, str, str]]] = {}
    self.steps: dict[str, int] = {}
    for rows in self.computations.values():
      for _, _, opcode, body in rows:
        if opcode == "fusion" and hlo_ops.CONTINUATION in body:
          for callee in self._callees(body, "calls"):
            self.carried[callee] = [r for r in self.computations[callee]
                                    if r[2].removesuffix("-start") in hlo_ops.COLLECTIVES]
            for channel in {hlo_ops.channel(r[3]) for r in self.carried[callee]}:
              self.steps[channel] = self.steps.get(channel, 0) + 1

  def _callees(self, body: str, key: str) -> list[str]:
    return [c for c in re.findall(key + r"=%([\w.\-]+)", body) if c in self.computations]

  def _sliced(self, fused: str, depth: int = 0) -> dict[int, int]:
    """Parameter number → bytes taken, for each parameter of fused computation `fused` used only as the
    sliced or gathered operand of `dynamic-slice`/`gather` (through bitcasts and nested fusions)."""
    rows = self.computations.get(fused, [])
    params = {name: int(re.match(r"parameter\((\d+)\)", body).group(1)) for name, _, op, body in rows
              if op == "parameter"}
    uses: dict[str, list[tuple[str, str, str, int, str]]] = {}
    for name, type_text, op, body in rows:
      for k, o in enumerate(hlo._operands(body, op)):
        uses.setdefault(o, []).append((name, type_text, op, k, body))

    def taken(value: str, hops: int = 0) -> int | None:
      total = 0
      for name, type_text, op, k, body in uses.get(value, []):
        inner = None
        if op in ("dynamic-slice", "gather") and k == 0:
          inner = sum(b for *_, b in hlo.arrays(type_text))
        elif (op == "bitcast" or self._retiled(op, body)) and hops < 4:
          inner = taken(name, hops + 1)
        elif op == "fusion" and depth < 4 and (nested := self._callees(body, "calls")):
          inner = self._sliced(nested[0], depth + 1).get(k)
        if inner is None:
          return None
        total += inner
      return total if uses.get(value) else None
    return {number: t for name, number in params.items() if (t := taken(name)) is not None}

  def _retiled(self, opcode: str, body: str) -> bool:
    """A fusion that only copies its operand into the same buffer (`output_to_operand_aliasing` of a lone
    `copy`): a change of tiling name that moves no byte, as int8's T(32,128)(4,1) → T(8,128)(4,1) (4 rows to a
    word, the same order), which the TPU compiler puts between a pool and the fusion that slices it."""
    if opcode != "fusion" or "output_to_operand_aliasing={{}: (0, {})}" not in body:
      return False
    callees = self._callees(body, "calls")
    ops = {op for _, _, op, _ in self.computations.get(callees[0], [])} if callees else set()
    return ops == {"parameter", "copy"}

  def matmul_flops(self, type_text: str, opcode: str, body: str, depth: int = 0) -> float:
    """2 × multiply-adds of a dot or convolution, or of those inside a fusion (nested ones too)."""
    if opcode == "fusion" and depth < 4:
      return sum(self.fused_flops(c, depth + 1) for c in self._callees(body, "calls"))
    if opcode not in ("dot", "convolution"):
      return 0.0
    out = sum(math.prod(shape) for _, shape, _ in hlo.arrays(type_text)[:1])
    lhs = hlo.arrays(self.types.get(hlo._operands(body, opcode)[0], ""))
    if not lhs:
      return 0.0
    shape = lhs[0][1]
    if opcode == "dot":
      dims = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", body)
      contracted = math.prod(shape[int(d)] for d in dims.group(1).split(",") if d) if dims else 1
      return 2.0 * out * contracted
    return 2.0 * hlo_ops.convolution_macs(body, shape, hlo.arrays(type_text)[0][1])

  def fused_flops(self, comp: str, depth: int) -> float:
    if comp not in self.flops_memo:
      self.flops_memo[comp] = sum(self.matmul_flops(t, op, b, depth) for _, t, op,
                                  b in self.computations.get(comp, []))
    return self.flops_memo[comp]

  def loop(self, name: str, body: str, operands: list[str], runs: float) -> tuple[Cost, float]:
    """A `while`'s (one iteration's cost, its trips: 1 where unknown), kept in `loops` (module docstring)."""
    body_comp, = self._callees(body, "body")
    condition, = self._callees(body, "condition")
    trips = hlo.trip_count(self.computations, self.by_name, body, condition, operands[0])
    count = 1 if trips is None else trips
    iteration, plain = Cost(), Cost()
    iteration.add(self.computation(body_comp, runs * count))
    iteration.add(self.computation(condition, runs * count))
    if self.pick is max:
      found, self.pick = len(self.loops), min
      plain.add(self.computation(body_comp, runs * count))
      plain.add(self.computation(condition, runs * count))
      self.pick, self.loops = max, self.loops[:found]  # The nested loops as walked the first time.
    op_name = m.group(1) if (m := re.search(r'op_name="([^"]*)"', body)) else ""
    if self.pick is max:
      self.loops.append(Loop(name, op_name, trips, iteration, runs, plain))
    return iteration, count

  def instruction(self, name: str, type_text: str, opcode: str, body: str, runs: float) -> Cost:
    cost = Cost(cycles=float(m.group(1)) if (m := _CYCLES.search(body)) else 0.0)
    if opcode in _FREE or opcode.endswith("-done"):
      return cost
    if cost.cycles and opcode in ("while", "conditional", "call"):
      cost.groups["control"] = [1.0, 0.0, 0.0, cost.cycles, 0.0]
    operands = hlo._operands(body, opcode)
    if opcode == "while":
      cost.add(*self.loop(name, body, operands, runs))
      return cost
    if opcode == "conditional":
      listed = re.search(r"branch_computations=\{([^}]*)\}", body)
      branches = re.findall(r"%([\w.\-]+)", listed.group(1)) if listed else []
      branches += self._callees(body, "true_computation") + self._callees(body, "false_computation")
      costs = [self.computation(b, runs) for b in branches if b in self.computations]
      if costs:
        cost.add(self.pick(costs, key=lambda c: c.bytes))
      return cost
    if opcode == "call":
      for callee in self._callees(body, "to_apply"):
        cost.add(self.computation(callee, runs))
      return cost
    sizes = [hbm_bytes(self.types.get(o, "")) for o in operands]
    result = hbm_bytes(type_text)
    fused = self._callees(body, "calls")
    inner = " ".join(op for _, _, op, _ in self.computations.get(fused[0], [])) if fused else opcode
    if fused:
      for number, taken in self._sliced(fused[0]).items():
        if number < len(sizes):
          sizes[number] = min(sizes[number], taken)
    elif opcode in ("gather", "dynamic-slice") and sizes:
      sizes[0] = min(sizes[0], result)
    outputs = [hbm_bytes(t) for t in _result_arrays(type_text)]
    for i, o in _aliased(body, len(operands)):
      if any(op in inner.split() for op in _IN_PLACE) and i < len(sizes) and o < len(outputs):
        written = sum(b for j, name in enumerate(operands) if j != i for *_,
                      b in hlo.arrays(self.types.get(name, "")))
        result -= outputs[o] - min(written, outputs[o])  # The update lands in HBM wherever it was computed.
        sizes[i] = 0
    cost.bytes += sum(sizes) + result
    cost.flops += self.matmul_flops(type_text, opcode, body)
    bound = max(cost.flops / self.ridge, cost.bytes) if self.ridge else cost.bytes
    kind = hlo_ops.group(opcode, set(inner.split()), cost.flops, body)
    cost.groups[kind] = [1.0, cost.flops, cost.bytes, cost.cycles, bound]
    if opcode == "custom-call" and 'custom_call_target="tpu_custom_call"' in body:
      cost.kernel_bytes += sum(sizes) + result
      cost.kernels[re.sub(r"\.\d+$", "", name)] = 1.0  # The kernel's name (splash_mha_fwd_…), not the copy's.
    return cost

  def computation(self, comp: str, runs: float) -> Cost:
    total, timeline = Cost(), overlap.Timeline() if self.chip and self.chip.ici_bandwidth else None
    for row in self.computations.get(comp, []):
      cost = self.instruction(*row, runs=runs)
      if timeline is not None:
        self._schedule(timeline, row, cost)
      total.add(cost)
    if timeline is not None:
      hidden = timeline.hidden()
      total.hidden_s += hidden[0]
      total.hidden_cycles_s += hidden[1]
    return total

  def _schedule(self, timeline: "overlap.Timeline", row: tuple[str, str, str, str], cost: Cost) -> None:
    """One instruction onto the computation's `timeline`: a collective over ICI, a `-done` awaiting its start,
    else the core's work (a loop or call all its instructions, less what overlapped inside it)."""
    name, type_text, opcode, body = row
    chip = self.chip
    if opcode.endswith("-done"):
      timeline.done(hlo._operands(body, opcode)[0] if hlo._operands(body, opcode) else "")
      return
    if "collective" in cost.groups and opcode not in ("while", "conditional", "call"):  # Its own, not nested ones.
      moved = hlo.collective(name, type_text, opcode, body, self.types).moved
      cost.collective_s += moved / chip.ici_bandwidth
      timeline.collective(name, moved / chip.ici_bandwidth, opcode.endswith("-start"))
      return
    carried = [r for c in self._callees(body, "calls") for r in self.carried.get(c, [])] if opcode == "fusion" else []
    # Its collectives' share of their steps, moving while its own work runs.
    carried_s = sum(hlo.collective(*r, self.types).moved / self.steps.get(hlo_ops.channel(r[3]), 1)
                    for r in carried) / chip.ici_bandwidth
    if carried:
      timeline.collective(name, carried_s, True)
    work = {g: f for g, f in cost.groups.items() if g != "collective"}
    bound = sum(f[4] for f in work.values()) / chip.hbm_bandwidth
    kernels = work.get("Pallas kernel", [0.0] * 5)[4] / chip.hbm_bandwidth
    cycles = cost.cycles / chip.clock_hz if chip.clock_hz else 0.0
    timeline.compute((bound + cost.collective_s - cost.hidden_s,  # A loop's or call's collectives, as they ran.
                      cycles + kernels + cost.collective_s - cost.hidden_cycles_s))
    if carried:
      timeline.done(name)
      cost.collective_s += carried_s


def _result_arrays(type_text: str) -> list[str]:
  """A result type's arrays, each as its own type text (a tuple's in order)."""
  return [m.group(0) for m in _TYPED.finditer(type_text)] or [type_text]


def walk(text: str, ridge: float | None = None, chip=None) -> Walked:
  """The program's HBM bytes, cycles and kernels' bytes per device, and its loops (module docstring); `ridge`:
  the chip's FLOPs per HBM byte at its peaks, which its instructions' bounds take (`Cost.groups`); `chip` (a
  `topologies.Chip`, its ridge by default): also the collectives' seconds over ICI and those of them that
  overlap the core's work (`Cost.collective_s`, `overlap.Timeline`)."""
  if chip is not None and ridge is None:
    ridge = chip.peak_flops / chip.hbm_bandwidth
  program = _Program(text, ridge, chip)
  if program.entry is None:
    return Walked(0.0, 0.0, 0.0, ())
  total = program.computation(program.entry, 1.0)
  return Walked(total.bytes, total.cycles, total.kernel_bytes, tuple(program.loops), total.flops, total.groups,
                total.collective_s, total.hidden_s, total.hidden_cycles_s, total.kernels)
