"""A partial rollout's call of the refill engine (`rollout/partial.py`): which run sequences it continues,
from where, and until how many decode iterations; and what each sequence holds when the call stops."""

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from vapo_jax.rollout import common
from vapo_jax.rollout.refill import queues as q_lib


class Resumed(NamedTuple):
  """A partial rollout's call (`rollout/partial.py`): sequence n of the call is sequence `ids[n]` of the run,
  continued after its first `offsets[n]` tokens (which end its prompt), and the decode stops at `budget`
  iterations. Sequence `ids[n]` samples its token t with `fold_in(fold_in(key, ids[n]), t)`, as if never
  stopped."""

  ids: jax.Array  # [N] int32.
  offsets: jax.Array  # [N] int32.
  budget: jax.Array  # [] int32 decode iterations.


def progress(s) -> jax.Array:
  """`[N]` int32 the tokens each sequence of the refill engine's `Slots` holds: its length where it ended, its
  step where it is live, 0 where it waits to start or to restart (its pages are gone)."""
  n, queues, rows = s.outputs.lengths.shape[0], s.queued.shape[0], s.live.shape[0]
  local = jnp.clip(s.sequence - q_lib.first_sequence(rows, n, queues), 0, n // queues - 1)
  at = jnp.where(s.live, local, n // queues)  # n / Q: dropped.
  live_steps = q_lib.scatter(jnp.zeros_like(s.outputs.lengths), at, s.step, queues)
  return jnp.where(s.outputs.lengths > 0, s.outputs.lengths, live_steps)


@functools.lru_cache(maxsize=8)
def progress_program(jit: Callable) -> Callable:
  return jit(progress)


@functools.lru_cache(maxsize=8)
def unfinished_program(jit: Callable) -> Callable:
  """`(rollout, ended lengths [N]) -> rollout` with the sequences not ended (length 0) `FINISH_UNFINISHED`."""
  return jit(lambda out, ended: out._replace(
      finish_reason=jnp.where(ended > 0, out.finish_reason, common.FINISH_UNFINISHED).astype(jnp.int32)))
