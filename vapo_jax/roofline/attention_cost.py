"""What attention's Pallas kernel computes in scoring and the update of one RL step: the pairs of (query block, key
block) it visits on the packed rows that a response-length profile fills, times the products that the compiled
program's kernel calls run per pair.

  pairs = attention_cost.visited(report, profile, "update")       # per head and layer, one pass over the step
  per_pass = attention_cost.products(walked_cost.kernels)          # splash's products a pair, per pass (or None)
  flops = attention_cost.flops(report, profile, "update", walked_cost.kernels, chips)

The splash kernel (`models/splash.py`) visits a pair only when the two blocks share a segment, so a packed row
costs about the sum over its sequences of length², and its block edges, not row length²; padding visits only its
own blocks. Each visited pair is `splash.FORWARD_PRODUCTS` matmuls of `[block, H] × [H, block]` in the forward
kernel, 3 in the dq kernel and 4 in the dk/dv kernel (`splash.BACKWARD_PRODUCTS` the two): the backward computes
the scores again, 3.5 times the forward's products, where the definition's backward (the model FLOPs) is twice.
How many of each kernel run is read off the compiled program (`hlo_walk.Cost.kernels`): a remat policy that does
not keep attention's residuals runs the forward kernel twice per backward.
"""

import numpy as np

from vapo_jax.models import splash
from vapo_jax.rollout import common
from vapo_jax.roofline import micro_batch_cost, profiles
from vapo_jax.train import packed_batch

# The kernel names of splash's calls (`hlo_walk.Cost.kernels`, the compiled instruction's) and their products a pair.
PRODUCTS = {"splash_mha_fwd": splash.FORWARD_PRODUCTS, "splash_mha_dq": 3, "splash_mha_dkv": 4}
_VISITED: dict[tuple, int] = {}  # `visited`'s counts, by what they are counted from.


def products(kernels: dict[str, float]) -> float | None:
  """Splash's products per visited pair in one pass of a program over its rows (forward only: 2; the update's
  forward and backward, residuals kept: 2 + 7), from its kernel calls (`kernels`: name → calls run); None when it
  runs no splash kernel."""
  calls = {kind: sum(n for name, n in kernels.items() if name.startswith(kind + "_")) for kind in PRODUCTS}
  passes = calls["splash_mha_dq"] or calls["splash_mha_fwd"]  # One dq call a backward pass, else a forward.
  if not passes:
    return None
  return sum(PRODUCTS[kind] * n for kind, n in calls.items()) / passes


def _rows(report, profile: profiles.Profile, phase_name: str) -> list[np.ndarray]:
  """Each row's segment lengths, in column order, of one pass of `phase_name` over the step's sequences: the rows
  of the micro-batches that run, empty ones as []; unpacked, each sequence's real tokens as one segment after its
  prompt's left padding."""
  c = report.config
  tokens = micro_batch_cost.sequence_tokens(report, profile)
  if not c.packing.enabled:
    bucket = common.prompt_bucket(c.rollout.max_prompt_tokens)
    prompts = np.repeat(profile.prompts, c.rollout.samples_per_prompt)[:len(tokens)]
    return [np.array([bucket - p, n]) for p, n in zip(prompts, tokens)]  # Padding first: a segment of its own.
  m = packed_batch.micro_rows(c, report.mesh_shape["data"] * report.mesh_shape["fsdp"])
  members, row, offset, needed = micro_batch_cost.placement(c, tokens, m, phase_name)
  rows = []
  for part, rows_needed in zip(members, needed):
    part = np.asarray(part)
    used = row[part] >= 0
    mine = [[] for _ in range(-(-int(rows_needed) // m) * m)]
    for b in part[used][np.argsort(offset[part][used], kind="stable")]:
      mine[row[b]].append(tokens[b])
    rows += [np.asarray(x, np.int64) for x in mine]
  return rows


def _segment_ids(lengths: np.ndarray, row_tokens: int, padding_first: bool) -> np.ndarray:
  """The segment ids `[row_tokens]` (0: padding) of a row of `lengths` end to end (padding after, or first)."""
  ids = np.zeros(row_tokens, np.int64)
  if padding_first:
    ids[lengths[0]:lengths[0] + lengths[1]] = 1
  else:
    ids[:int(lengths.sum())] = np.repeat(np.arange(1, len(lengths) + 1), lengths)
  return ids


def visited(report, profile: profiles.Profile, phase_name: str) -> int:
  """Pairs of blocks the splash kernel visits per head and layer in one pass of `phase_name` (scoring, or one
  epoch of the update) over the step's sequences under `profile` (`splash.visited_blocks`); counted once per
  (config, mesh, profile, phase): a report's estimates for each engine share it."""
  key = (report.config, tuple(sorted(report.mesh_shape.items())), profile.responses.tobytes(),
         profile.prompts.tobytes(), phase_name)
  if key not in _VISITED:
    _VISITED[key] = _count(report, profile, phase_name)
  return _VISITED[key]


def _count(report, profile: profiles.Profile, phase_name: str) -> int:
  c = report.config
  row_tokens = packed_batch.row_tokens(c)
  return sum(splash.visited_blocks(_segment_ids(lengths, row_tokens, not c.packing.enabled)[None],
                                   splash.block_size(row_tokens)) for lengths in _rows(report, profile, phase_name))


def flops(report, profile: profiles.Profile, phase_name: str, kernels: dict[str, float], chips: int) -> float | None:
  """The splash kernel's FLOPs per chip in `phase_name` of one RL step (every model and epoch): `visited` pairs ×
  `products` × 2·block²·H, for every head and layer; None when the program runs no splash kernel."""
  per_pair = products(kernels)
  if per_pair is None:
    return None
  c, cfg = report.config, report.architecture
  block = splash.block_size(packed_batch.row_tokens(c))
  models = 1 + c.algo.uses_critic + (phase_name == "scoring" and c.algo.kl_coef > 0)
  epochs = 1 if phase_name == "scoring" else c.algo.ppo_epochs
  pairs = visited(report, profile, phase_name) * cfg.num_heads * cfg.num_layers * models * epochs
  return pairs * per_pair * 2.0 * block * block * cfg.head_dim / chips
