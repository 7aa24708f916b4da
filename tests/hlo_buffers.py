"""Which arrays a compiled program contains: to assert that no `[B, Tr, V]` logits tensor exists.

`vocab_arrays(compiled, vocab)` lists every array shape in the optimised HLO (materialised buffers
and the values inside fusions alike, so it errs on the strict side) that has a dimension of size
`vocab` and at least `min_elements` elements. A training or scoring step is free of full-vocabulary
logits when `vocab_arrays(step, V, min_elements=B·Tr·V)` is empty; chunked log-probs leave only
`[B, chunk, V]` values and the `[D, V]` kernel and its gradient. Choose test sizes where V differs
from every other dimension and B·Tr·V exceeds D·V.
"""

import math
import re

_SHAPE = re.compile(r"\b(pred|[su](?:4|8|16|32|64)|bf16|f16|f32|f64)\[([0-9,]*)\]")


def array_shapes(compiled) -> set[tuple[str, tuple[int, ...]]]:
  """Every (dtype, shape) in the optimised HLO of `compiled` (a `jax.stages.Compiled`, or its text)."""
  text = compiled if isinstance(compiled, str) else compiled.as_text()
  return {(dtype, tuple(int(d) for d in dims.split(",") if d)) for dtype, dims in _SHAPE.findall(text)}


def vocab_arrays(compiled, vocab: int, *, min_elements: int) -> list[tuple[str, tuple[int, ...]]]:
  """The arrays with a `vocab`-sized dimension and at least `min_elements` elements, largest first."""
  found = [(dtype, shape) for dtype, shape in array_shapes(compiled)
           if vocab in shape and math.prod(shape) >= min_elements]
  return sorted(found, key=lambda x: -math.prod(x[1]))
