"""Packed batches of the jitted programs (docs/packing.md): where each sequence sits in packed
rows (`RowPlan`, made on the host from the lengths), and the rows built from it on the device.

  plan = packed_batch.plan_rows(prompt_lengths, response_lengths, orders, row_tokens=L, micro_rows=m)  # host
  inputs, unpack = packed_batch.scoring_rows(tokens, lengths, row, offset, ...)                        # device
  mb = packed_batch.mini_batch(batch, sequences, lengths, row, offset, ...)                            # device

A group of sequences (scoring's whole batch, or one mini-batch) is placed by first-fit decreasing
(`packing.place_groups`) into R = M·m rows of L = `row_tokens` tokens, laid out `[M, m, L]`: micro-
batch i holds the rows i·m … i·m + m − 1 (split over the batch devices along m), so the rows that
first-fit decreasing fills come first and the micro-batches after them are empty: the programs skip
those (`lax.cond`), and R, the compiled size, is `packing.bucket_rows` of the rows the largest group
needs (a power of two times m: few programs). A sequence without a response is not placed. With
`packing.fill_micro_batches` each epoch's order is cut into mini-batches whose rows fill whole micro-batches
(`packing.cut_filled`: contiguous pieces of the order, each first-fit decreasing), and the programs take their ids
(`RowPlan.members`).

Time index. A loss's per-token arrays sit at each response token's prediction column, the column before its
own, whose outputs (log π of the next token of the segment, V(s_t)) are response token t's
(`packing.reference_unpack_predictions`); `RowBatch.response_mask` marks those columns. The host sends only
each sequence's (row, offset): `packing.row_layout` expands them here.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from vapo_jax.config import ExperimentConfig
from vapo_jax.errors import DataError
from vapo_jax.models.sharding import constrain
from vapo_jax.rollout.common import prompt_bucket
from vapo_jax.train import packing


def row_tokens(config: ExperimentConfig) -> int:
  """Tokens per packed row: `packing.row_tokens`, else the padded sequence's length (prompt bucket +
  the response-length cap)."""
  r = config.rollout
  return config.packing.row_tokens or prompt_bucket(r.max_prompt_tokens) + r.max_response_tokens


def micro_rows(config: ExperimentConfig, batch_devices: int) -> int:
  """Rows per micro-batch: `packing.micro_batch_rows`, else one per data-parallel device."""
  return config.packing.micro_batch_rows or batch_devices


class RowPlan(NamedTuple):
  """Where every sequence of a batch sits in packed rows, for scoring and each epoch's mini-batches."""

  placement: np.ndarray | jax.Array  # [1 + E, 2, B] int32: (row, offset) in scoring's rows, then per epoch.
  scoring_rows: int  # R of scoring (static).
  update_rows: int  # R of every mini-batch (static).
  scoring_metrics: dict[str, float]  # perf/padding_frac_scoring.
  # perf/padding_frac_<phase>, perf/micro_batches, perf/micro_batches_compiled.
  update_metrics: dict[str, float]
  # [E, K, n] int32: each epoch's mini-batches' sequence ids, −1 past a mini-batch's own (`fill`; n: 2^k × 2 ×
  # the equal mini-batch); None: the orders given.
  members: np.ndarray | jax.Array | None = None


def plan_rows(prompt_lengths, response_lengths, orders, *, row_tokens: int, micro_rows: int,
              phase: str = "update", fill: bool = False) -> RowPlan:
  """The host's packing of a batch: `orders` `[E, K, n]` are the sequence ids of the K mini-batches of
  each of E epochs. Padding fractions count the micro-batches that run (compiled ones past the rows a
  group needs are skipped); `phase` names the update's metric ("update", "sft"). `fill`
  (`packing.fill_micro_batches`): each epoch's order is cut anew into K mini-batches whose rows fill whole
  micro-batches (`packing.cut_filled`), returned as `members`."""
  response_lengths, prompt_lengths = np.asarray(response_lengths, np.int64), np.asarray(prompt_lengths,
                                                                                        np.int64)
  unprompted = np.flatnonzero((response_lengths > 0) & (prompt_lengths <= 0))
  if unprompted.size:  # Response token 0 would be predicted from the previous segment's last column.
    raise DataError(f"sequence {int(unprompted[0])} of the batch ({unprompted.size} in all) has a response "
                    f"of {int(response_lengths[unprompted[0]])} tokens and no prompt token: a packed row "
                    "predicts a response's first token from its prompt's last; give every problem a prompt "
                    "token (a non-empty problem text or template), or set packing.enabled=false")
  lengths = np.where(response_lengths > 0, prompt_lengths + response_lengths, 0)
  orders = np.asarray(orders)
  scoring = packing.place_groups(lengths, np.arange(lengths.size)[None], row_tokens)
  if fill:
    cuts = [packing.cut_filled(lengths, order.reshape(-1), order.shape[0], row_tokens, micro_rows)
            for order in orders]
    epochs = [(cut.row, cut.offset, cut.needed) for cut in cuts]
    sizes = [m.size for cut in cuts for m in cut.members]
    # At least 2× the equal mini-batch, whatever this step's cut: one update program from step to step (and the
    # compile report's), not one for a step whose cut keeps the equal pieces and another for the next.
    width = packing.bucket_rows(max(sizes), multiple=2 * orders.shape[2])
    members = np.full(orders.shape[:2] + (width,), -1, np.int32)
    for e, cut in enumerate(cuts):
      for k, ids in enumerate(cut.members):
        members[e, k, :ids.size] = ids
    spread = {"perf/mini_batch_responses_min": float(min(sizes)),
              "perf/mini_batch_responses_max": float(max(sizes))}
  else:
    epochs, members, spread = [packing.place_groups(lengths, order, row_tokens) for order in orders], None, {}
  placement = np.stack([np.stack([row, offset]) for row, offset, _ in [scoring] + epochs]).astype(np.int32)
  run = lambda needed: -(-np.asarray(needed) // micro_rows) * micro_rows  # Rows of the micro-batches run.
  scoring_needed, update_needed = scoring[2], np.concatenate([p[2] for p in epochs])
  bucket = lambda needed: packing.bucket_rows(int(np.max(needed, initial=0)), multiple=micro_rows)
  padding = lambda real, needed: 1.0 - real / max(1, int(np.sum(run(needed))) * row_tokens)
  return RowPlan(placement, bucket(scoring_needed), bucket(update_needed),
                 {"perf/padding_frac_scoring": padding(lengths.sum(), scoring_needed)},
                 {f"perf/padding_frac_{phase}": padding(lengths[orders].sum(), update_needed),
                  "perf/micro_batches": float(np.mean(run(update_needed))) / micro_rows,
                  "perf/micro_batches_compiled": bucket(update_needed) / micro_rows} | spread, members)


class Lengths(NamedTuple):
  """Per-sequence token counts `[B]` int32 (device)."""

  prompt: jax.Array
  response: jax.Array

  @classmethod
  def of(cls, attention_mask, response_mask) -> "Lengths":
    """From the joined attention mask `[B, S]` (prompt, then response) and the response mask `[B, Tr]`."""
    response = jnp.sum(response_mask, axis=-1, dtype=jnp.int32)
    return cls(jnp.sum(attention_mask, axis=-1, dtype=jnp.int32) - response, response)

  @property
  def packed(self) -> jax.Array:
    """Tokens a sequence occupies in a row: prompt and response, or none without a response."""
    return jnp.where(self.response > 0, self.prompt + self.response, 0)


class RowBatch(NamedTuple):
  """Packed rows `[..., L]`: the model's inputs and the losses' per-token arrays at the prediction
  columns (module doc). Fields a program does not use are None."""

  tokens: jax.Array  # Token ids (0 on padding).
  segment_ids: jax.Array  # 1, 2, ... per sequence of a row; 0 on padding.
  positions: jax.Array  # 0 at each sequence's first token.
  response_mask: jax.Array  # bool: the column predicts a response token.
  is_positive: jax.Array | None = None  # bool: ... of a response the verifier judged correct.
  returns: jax.Array | None = None
  old_values: jax.Array | None = None
  old_logprobs: jax.Array | None = None
  advantages: jax.Array | None = None
  ref_logprobs: jax.Array | None = None
  value_mask: jax.Array | None = None  # bool: the value loss fits this column (None: every response column).
  sampler_logprobs: jax.Array | None = None


class PackedBatch(NamedTuple):
  """A mini-batch of n sequences packed into `[M, m, L]` rows, and per-sequence data for its
  denominators."""

  rows: RowBatch  # [M, m, L] each: M micro-batches of m rows.
  response_lengths: jax.Array  # [n] int32.
  is_positive: jax.Array  # [n] bool.


def split_rows(tree, micro_rows: int):
  """`[R, ...]` → `[M, m, ...]` micro-batches of m = `micro_rows` rows, each split over the batch devices."""
  return jax.tree.map(lambda x: constrain(x.reshape((-1, micro_rows) + x.shape[1:]),
                                          (None, "batch") + (None,) * (x.ndim - 1)), tree)


def _rows(tokens, response_len: int, lengths: Lengths, sequences, row, offset, *, rows: int, row_tokens: int):
  """(global sequence id, row layout, token ids), each `[R, L]`, of `sequences` placed at their (row, offset);
  an id −1 (a shorter mini-batch's end, `RowPlan.members`) places nothing."""
  lay = packing.row_layout(jnp.where(sequences >= 0, row[sequences], -1), offset[sequences],
                           lengths.packed[sequences], rows=rows, row_tokens=row_tokens)
  seq = sequences[jnp.maximum(lay.sequence, 0)]
  width = tokens.shape[1]
  source = seq * width + (width - response_len - lengths.prompt[seq]) + lay.position
  return seq, lay, jnp.where(lay.segment_ids > 0, tokens.reshape(-1)[source], 0)


def scoring_rows(tokens, lengths: Lengths, row, offset, *, response_len: int, rows: int, micro_rows: int,
                 row_tokens: int):
  """Scoring's rows of the whole batch, `RowBatch` of its model inputs `[M, m, L]`, and
  `unpack(x [M, m, L]) -> [B, Tr]`: each response token's prediction column (0 where masked)."""
  sequences = jnp.arange(tokens.shape[0], dtype=jnp.int32)
  _, lay, packed = _rows(tokens, response_len, lengths, sequences, row, offset, rows=rows,
                         row_tokens=row_tokens)
  inputs = split_rows(RowBatch(packed, lay.segment_ids, lay.position, lay.segment_ids > 0), micro_rows)
  t = jnp.arange(response_len, dtype=jnp.int32)[None]
  valid = (t < lengths.response[:, None]) & (row[:, None] >= 0)
  index = jnp.where(valid, (row * row_tokens + offset + lengths.prompt)[:, None] + t - 1, 0)
  return inputs, lambda x: jnp.where(valid, x.reshape(-1)[index], jnp.zeros((), x.dtype))


def mini_batch(batch, sequences, lengths: Lengths, row, offset, *, rows: int, micro_rows: int,
               row_tokens: int) -> PackedBatch:
  """The mini-batch `sequences` `[n]` of a scored `steps.TrainBatch`, packed at their (row, offset)
  `[B]`: per-token arrays `[B, Tr]` gathered to the prediction columns. Ids −1 (past a shorter mini-batch's
  sequences) are no sequence: no row, no length, no verdict."""
  response_len = batch.response_mask.shape[1]
  seq, lay, tokens = _rows(batch.tokens, response_len, lengths, sequences, row, offset, rows=rows,
                           row_tokens=row_tokens)
  t = lay.position + 1 - lengths.prompt[seq]  # The response token this column predicts.
  predicts = (lay.segment_ids > 0) & (t >= 0) & (t < lengths.response[seq])
  index = jnp.where(predicts, seq * response_len + t, 0)
  at = lambda x: None if x is None else jnp.where(predicts, x.reshape(-1)[index], jnp.zeros((), x.dtype))
  packed = RowBatch(tokens, lay.segment_ids, lay.position, predicts, predicts & batch.is_positive[seq],
                    at(batch.returns), at(batch.old_values), at(batch.old_logprobs), at(batch.advantages),
                    at(batch.ref_logprobs), at(batch.value_mask), at(batch.sampler_logprobs))
  given = sequences >= 0
  return PackedBatch(split_rows(packed, micro_rows), jnp.where(given, lengths.response[sequences], 0),
                     given & batch.is_positive[sequences])
