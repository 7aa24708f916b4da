"""What one instruction of a compiled program is, read from its HLO text (`hlo_walk` prices it): its group, the
multiply-adds of a convolution, a collective's channel, and libtpu's asynchronous collective fusions
(`CONTINUATION`). Pure Python."""

import math
import re

import numpy as np

from vapo_jax.memory import hlo

# In the backend config of libtpu's asynchronous collective fusions (`--xla_tpu_enable_async_collective_fusion`):
# a collective fused with work that runs while it moves; one collective may be split over several such fusions
# (`--xla_tpu_enable_async_collective_fusion_multiple_steps`), each holding it under the same channel.
CONTINUATION = '"continuation_config"'
COLLECTIVES = frozenset(hlo.COLLECTIVES)
GROUPS = ("matmul", "collective", "Pallas kernel", "in-place update", "gather, slice", "copy, transpose",
          "reduction", "elementwise", "control", "other")


def group(opcode: str, inner: set[str], flops: float, body: str) -> str:
  """The instruction group of a top-level instruction (`GROUPS`), from its opcode, the opcodes fused into it
  (`inner`) and its matmul FLOPs: a collective (asynchronous ones by their start); a Pallas kernel; any
  fusion with a matmul; then by what it fuses: an in-place update (scatter, dynamic-update-slice), a gather
  or slice, only copies and transposes, a reduction, else elementwise work; `control` is a loop's or
  conditional's own instruction. A continuation fusion (`CONTINUATION`: libtpu's asynchronous collective
  fusion, a collective computed beside other work) is grouped by that work; the walk prices its collective."""
  ops = inner | {opcode}
  if CONTINUATION in body:  # An asynchronous collective fused with other work: grouped by that work.
    ops = {op for op in ops if op.removesuffix("-start") not in COLLECTIVES}
  elif any(op.removesuffix("-start") in COLLECTIVES for op in ops):
    return "collective"
  if opcode == "custom-call":
    return "Pallas kernel" if 'custom_call_target="tpu_custom_call"' in body else "other"
  if opcode in ("while", "conditional", "call"):
    return "control"
  if flops:
    return "matmul"
  if ops & {"scatter", "dynamic-update-slice"}:
    return "in-place update"
  if ops & {"gather", "dynamic-slice", "slice"}:
    return "gather, slice"
  if ops - {"fusion", "parameter", "bitcast", "tuple", "get-tuple-element"} <= {"copy", "copy-start", "transpose"}:
    return "copy, transpose"
  if ops & {"reduce", "reduce-window"}:
    return "reduction"
  if opcode == "fusion" or ops & {"add", "multiply", "convert", "select", "exponential", "divide"}:
    return "elementwise"
  return "other"


def channel(body: str) -> str:
  """A collective's `channel_id` ("" where it has none)."""
  return m.group(1) if (m := re.search(r"channel_id=(\d+)", body)) else ""


def convolution_macs(body: str, lhs: tuple, out: tuple) -> float:
  """Multiply-adds of a convolution (XLA writes many matmuls as one): for every output element, the input
  features of its group times the window taps that land inside the input (a tap on padding multiplies
  nothing), per spatial dimension counted exactly for the window's size, padding and stride."""
  labels = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", body)
  if labels is None:
    return 0.0
  lhs_labels, out_labels = labels.group(1), labels.group(3)
  groups = re.search(r"feature_group_count=(\d+)", body)
  features = lhs[lhs_labels.index("f")] // (int(groups.group(1)) if groups else 1)
  field = lambda key: (re.search(key + r"=([\d_x-]+)", body).group(1).split("x")
                       if re.search(key + r"=([\d_x-]+)", body) else None)
  sizes, pads, strides = field("size"), field("pad"), field("stride")
  spatial = sorted(c for c in lhs_labels if c.isdigit())
  macs = math.prod(d for d, c in zip(out, out_labels) if not c.isdigit()) * features
  for k, digit in enumerate(spatial):
    n, o = lhs[lhs_labels.index(digit)], out[out_labels.index(digit)]
    taps = int(sizes[k]) if sizes else 1
    low = int(pads[k].split("_")[0]) if pads else 0
    stride = int(strides[k]) if strides else 1
    index = np.arange(o)[:, None] * stride - low + np.arange(taps)[None, :]
    macs *= int(np.count_nonzero((index >= 0) & (index < n)))
  return float(macs)
