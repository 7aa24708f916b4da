"""The collectives of a compiled XLA program, read from its HLO text (`compiled.as_text()`).

  for c in hlo.collectives(jax.jit(f).lower(*args).compile().as_text()):
    c.op, c.operand_bytes, c.result_bytes, c.shapes, c.loops     # per device

`parse` reads a module's computations and instructions (what `hlo_walk` and the tests' checks walk).
`collectives` lists every all-gather, all-reduce, reduce-scatter, all-to-all, collective-permute,
ragged-all-to-all and collective-broadcast (an asynchronous `-start` once, its `-done` skipped),
with the bytes of its operands and result per device and the `while` loops around it (outermost
first, each with its trip count: XLA's `known_trip_count`, else read from its condition, `trip_count`),
so that a decode loop's traffic per iteration is the sum over the collectives inside it
(`bytes_per_iteration`; a loop is found by the `jax.named_scope` it was traced in, `while_op_names`);
those in a conditional's branches (run on some iterations only) are flagged. Operands are printed
without their types; they are looked up by name. Tuple operands (XLA combines all-reduces) add up.

What crosses devices is judged by size, not by opcode: XLA moves a gathered weight as an
`all-gather` or as an `all-reduce` of the whole weight depending on the mesh (seen for TPU
topologies of 4 and 64 chips). Pure Python, no JAX.
"""

import dataclasses
import math
import re
from collections import defaultdict

COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute",
               "ragged-all-to-all", "collective-broadcast")
# Bits an element of each HLO type takes in memory: sub-byte types packed (a TPU lays `s4` out as `E(4)`).
_BITS = {"pred": 8, "s2": 2, "u2": 2, "s4": 4, "u4": 4, "f4e2m1fn": 4, "s8": 8, "u8": 8, "f8e3m4": 8, "f8e4m3": 8,
         "f8e4m3fn": 8, "f8e4m3fnuz": 8, "f8e4m3b11fnuz": 8, "f8e5m2": 8, "f8e5m2fnuz": 8, "f8e8m0fnu": 8, "s16": 16,
         "u16": 16, "f16": 16, "bf16": 16, "s32": 32, "u32": 32, "f32": 32, "s64": 64, "u64": 64, "f64": 64, "c64": 64,
         "c128": 128}
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_COMPUTATION = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s+\(.*\)\s+->\s+.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s+=\s+(.*)$")
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"')


def array_bytes(dtype: str, shape) -> int | None:
  """Bytes of an HLO array of `dtype` ("bf16", "s4", ...) and `shape` (sub-byte types packed, rounded up); None
  for a type that holds no data in memory (`token`, `opaque`)."""
  bits = _BITS.get(dtype)
  return None if bits is None else -(-math.prod(shape) * bits // 8)


@dataclasses.dataclass(frozen=True)
class Collective:
  op: str  # "all-reduce", "all-gather", ... (the `-start` suffix dropped).
  name: str  # The instruction's name.
  operand_bytes: int  # Per device, every operand together.
  result_bytes: int  # Per device, the largest array of the result.
  shapes: tuple[str, ...]  # The operands' types, e.g. "f32[4,1,48]" (the result's when none is known).
  loops: tuple[tuple[str, int | None], ...]  # (while instruction, known trip count), outermost first.
  conditional: bool = False  # Inside a conditional's branch: runs on the iterations that take it.

  @property
  def moved(self) -> int:
    """Bytes per device it moves: the larger of its operands together and its result's largest array."""
    return max(self.operand_bytes, self.result_bytes)


def arrays(type_text: str) -> list[tuple[str, tuple[int, ...], int]]:
  """(dtype, dims, bytes) of every array in an HLO type, a tuple's included (layouts ignored)."""
  out = []
  for dtype, dims in _ARRAY.findall(type_text):
    shape = tuple(int(d) for d in dims.split(",") if d)
    if (size := array_bytes(dtype, shape)) is not None:
      out.append((dtype, shape, size))
  return out


def _split_type(rest: str) -> tuple[str, str]:
  """'TYPE opcode(...), attributes' -> (TYPE, 'opcode(...), attributes'); TYPE may be a nested tuple."""
  if rest.startswith("("):
    depth = 0
    for i, ch in enumerate(rest):
      depth += (ch == "(") - (ch == ")")
      if depth == 0:
        return rest[:i + 1], rest[i + 1:].lstrip()
  head, _, tail = rest.partition(" ")
  return head, tail


def _operands(body: str, opcode: str) -> list[str]:
  """The names inside the opcode's parentheses."""
  start, depth = len(opcode), 0
  for k in range(start, len(body)):
    depth += (body[k] == "(") - (body[k] == ")")
    if depth == 0:
      return re.findall(r"%([\w.\-]+)", body[start:k + 1])
  return []


def parse(text: str):
  """(entry computation, {computation: [(name, type, opcode, body)]}, {instruction name: type})."""
  computations, types, entry, current = {}, {}, None, None
  for line in text.splitlines():
    if m := _COMPUTATION.match(line):
      current = m.group(2)
      computations[current] = []
      entry = current if m.group(1) else entry
    elif line.rstrip() == "}":
      current = None
    elif current is not None and (m := _INSTRUCTION.match(line)):
      type_text, body = _split_type(m.group(2))
      opcode = re.match(r"[\w\-]*", body).group(0)
      types[m.group(1)] = type_text
      computations[current].append((m.group(1), type_text, opcode, body))
    elif current is not None and computations[current]:  # An attribute printed over lines (a kernel's config).
      name, type_text, opcode, body = computations[current][-1]
      computations[current][-1] = (name, type_text, opcode, body + "\n" + line)
  return entry, computations, types


def by_name(computations) -> dict[str, tuple[str, str, str]]:
  """Instruction name → (its computation, opcode, body)."""
  return {name: (comp, opcode, body) for comp, rows in computations.items() for name, _, opcode, body in rows}


def _constant(body: str) -> int | None:
  m = re.match(r"constant\((-?\d+)\)", body)
  return int(m.group(1)) if m else None


def _start(found: dict, tuple_name: str, k: int) -> int:
  """The constant a loop counter (element `k` of the while's operand tuple) starts at, traced through copies;
  0 where it cannot be traced (JAX's scans and fori_loops start there)."""
  _, op, body = found.get(tuple_name, (None, "", ""))
  if op != "tuple":
    return 0
  value = _operands(body, "tuple")[k]
  for _ in range(8):
    _, op, body = found.get(value, (None, "", ""))
    if op == "constant":
      return _constant(body) or 0
    if op not in ("copy", "bitcast", "copy-start", "copy-done"):
      return 0
    value = _operands(body, op)[0]
  return 0


def trip_count(computations, found: dict, body: str, condition: str, operand: str) -> int | None:
  """A while instruction's trips: XLA's `known_trip_count` when printed, else from its condition `counter <
  constant(N)` (`counter > ...` mirrored) with the counter's start (`_start`) and step (`_step`); None for any
  other condition (a loop that runs until its state says stop). `found`: `by_name(computations)`."""
  if m := _TRIPS.search(body):
    return int(m.group(1))
  rows = computations.get(condition, [])
  root = rows[-1] if rows else None  # XLA prints the ROOT last.
  direction = re.search(r"direction=(\w+)", root[3]) if root is not None and root[2] == "compare" else None
  if direction is None or direction.group(1) not in ("LT", "GT"):
    return None
  a, b = (_operands(root[3], "compare") + [None, None])[:2]
  local = {name: (op, text) for name, _, op, text in rows}
  counter, limit = (a, b) if direction.group(1) == "LT" else (b, a)
  if counter not in local or local[counter][0] != "get-tuple-element" or limit not in local \
      or (n := _constant(local[limit][1])) is None:
    return None
  k = int(re.search(r"index=(\d+)", local[counter][1]).group(1))
  step = _step(computations, found, body, k)
  return max(-(-(n - _start(found, operand, k)) // step), 0) if step > 0 else None


def _step(computations, found: dict, while_body: str, k: int) -> int:
  """What the loop's body adds to counter `k` each iteration (`counter + constant(c)`, through copies); 1 when
  it is written otherwise (JAX's loops count by one; the TPU compiler's windowed einsums by two)."""
  name = re.search(r"body=%([\w.\-]+)", while_body)
  rows = computations.get(name.group(1), []) if name else []
  if not rows or rows[-1][2] != "tuple":
    return 1
  value = _operands(rows[-1][3], "tuple")[k]
  for _ in range(8):
    _, op, text = found.get(value, (None, "", ""))
    if op in ("copy", "bitcast"):
      value = _operands(text, op)[0]
    elif op == "add":
      constants = [_constant(found.get(o, (None, "", ""))[2]) for o in _operands(text, "add")]
      return next((c for c in constants if c is not None), 1)
    else:
      return 1
  return 1


def collective(name: str, type_text: str, opcode: str, body: str, types: dict, loops=(), conditional=False
               ) -> Collective:
  """The `Collective` of one instruction (`types`: the module's instruction name → type text)."""
  operands = [a for o in _operands(body, opcode) for a in arrays(types.get(o, ""))]
  result = arrays(type_text)
  return Collective(opcode.removesuffix("-start"), name, sum(b for *_, b in operands),
                    max((b for *_, b in result), default=0),
                    tuple(f"{d}[{','.join(map(str, s))}]" for d, s, _ in operands or result), loops, conditional)


def collectives(text: str) -> list[Collective]:
  """Every collective of a compiled module (`compiled.as_text()`), with the while loops around it."""
  entry, computations, types = parse(text)
  found_by_name = by_name(computations)
  calls = defaultdict(list)  # computation -> (callee, (while name, trips) or None, via a conditional)
  for comp, instructions in computations.items():
    for name, _, opcode, body in instructions:
      for callee in re.findall(r"%([\w.\-]+)", body[len(opcode):]):
        if callee in computations and callee != comp:
          trips = None
          if opcode == "while":
            condition = re.search(r"condition=%([\w.\-]+)", body)
            trips = trip_count(computations, found_by_name, body, condition.group(1) if condition else "",
                               _operands(body, opcode)[0])
          loop = (name, trips) if opcode == "while" else None
          calls[comp].append((callee, loop, opcode == "conditional"))
  found = {}

  def visit(comp, loops, conditional, seen):
    for name, type_text, opcode, body in computations[comp]:
      op = opcode.removesuffix("-start")
      if op in COLLECTIVES and not opcode.endswith("-done"):
        found.setdefault((name, loops), collective(name, type_text, opcode, body, types, loops, conditional))
    for callee, loop, via_conditional in calls[comp]:
      if callee not in seen:
        visit(callee, loops + (loop,) if loop else loops, conditional or via_conditional, seen | {callee})

  if entry is not None:
    visit(entry, (), False, {entry})
  return list(found.values())


def while_op_names(text: str) -> dict[str, str]:
  """Every while instruction of a compiled module → its op_name metadata, which keeps the
  `jax.named_scope`s it was traced in (`jit(f)/decode_loop/while`): a loop found by its scope."""
  _, computations, _ = parse(text)
  names = {}
  for instructions in computations.values():
    for name, _, opcode, body in instructions:
      if opcode == "while":
        op_name = re.search(r'op_name="([^"]*)"', body)
        names[name] = op_name.group(1) if op_name else ""
  return names


def bytes_per_iteration(found: list[Collective], loop: str, *, branches: bool = True) -> int:
  """Operand bytes per device that one iteration of the while loop `loop` moves (loops nested in it
  counted once per known trip, once when unknown); `branches` False: only the collectives every
  iteration runs (none of a conditional's branches)."""
  total = 0
  for c in found:
    names = [name for name, _ in c.loops]
    if loop in names and (branches or not c.conditional):
      inner = c.loops[names.index(loop) + 1:]
      total += c.moved * math.prod(trips or 1 for _, trips in inner)
  return total
