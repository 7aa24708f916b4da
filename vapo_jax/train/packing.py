"""Packed rows: sequences laid end to end in rows of a static token length, so compute follows real tokens.

A batch as the rollout returns it (`Rollout`, `updates.join`): left-padded prompts `[B, Tp]` and
right-padded responses `[B, Tr]` with their masks, spends B·(Tp + Tr) token slots on Σ_b n_b real
tokens (n_b = prompt length + response length of sequence b). Packed, sequence b occupies n_b
consecutive columns of one row of L = `row_tokens` slots:

  tokens       `[R, L]`  the prompt's real tokens, then the response's, sequence after sequence
  segment_ids  `[R, L]`  1, 2, ... for a row's sequences in column order; 0 on padding (row ends)
  positions    `[R, L]`  0 at each sequence's first real token, as `positions_from_mask` gives unpacked

Rows are filled by first-fit decreasing (`first_fit_decreasing`): at most 11/9·OPT + 6/9 rows
(Dósa 2007), with OPT the fewest rows that could hold the batch. The row count varies per batch;
`bucket_rows` rounds it up so that the number of compiled programs stays bounded.

Time index. As in `updates.response_values` and `models.logprobs.response_logprobs`, the outputs
at the token *before* response token t (its hidden state) predict o_t, and the critic's value there
is V(s_t). `reference_unpack_predictions` reads response token t's outputs from the column before its own,
which lies in the same segment: a packed sequence with a response has at least one prompt token.
`reference_unpack_tokens` reads the token's own column (the inverse of packing).

Host and device. `first_fit_decreasing` and `pack`'s index arithmetic run on the host in numpy (they need the
lengths: one device→host copy of the masks); the gathers (`to_rows`, `reference_unpack_tokens`,
`reference_unpack_predictions`) are jnp with static shapes, for use inside jitted programs. `pack` builds
every token's index on the host, which suits tests and small batches; the trainer sends only each sequence's
(row, offset), `place_groups`'s `[B]` arrays, and `row_layout` expands them on the device into the columns'
sequence, position and segment id (the same rows as `pack`'s: tests/test_packing.py).
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class Packed(NamedTuple):
  """A batch of B sequences in R packed rows of L tokens (module doc); every array int32 unless noted."""

  tokens: jax.Array  # [R, L] token ids (0 on padding).
  segment_ids: jax.Array  # [R, L] 1, 2, ... per sequence of a row in column order; 0 on padding.
  positions: jax.Array  # [R, L] 0 at each sequence's first token.
  source: jax.Array  # [R, L] flat index b·S + s of the column's token in the joined [B, S = Tp + Tr] batch.
  response_index: jax.Array  # [B, Tr] flat index r·L + c of response token t's column (0 where masked).
  response_mask: jax.Array  # [B, Tr] bool: the response's real tokens.


def first_fit_decreasing(lengths, row_tokens: int) -> tuple[np.ndarray, np.ndarray]:
  """(row, offset) `[n]` int64 of each sequence: lengths `[n]` placed longest first (ties by index)
  into the first row with room, a new row when none has. Rows are numbered in order of opening and a
  row's sequences lie in placement order. Empty sequences get row −1, offset 0. Deterministic.

  Raises ValueError if a sequence is longer than a row."""
  lengths = np.asarray(lengths, np.int64)
  if lengths.size and lengths.max() > row_tokens:
    b = int(np.argmax(lengths))
    raise ValueError(f"sequence {b} has {lengths[b]} tokens, more than a packed row holds "
                     f"(row_tokens={row_tokens}); raise row_tokens to at least {lengths[b]}")
  if lengths.size and lengths.min() < 0:
    raise ValueError(f"sequence lengths must be >= 0, got {lengths.min()}")
  rows, offsets = np.full(lengths.shape, -1), np.zeros(lengths.shape, np.int64)
  filled = np.zeros(max(int(np.count_nonzero(lengths)), 1), np.int64)  # Tokens in each opened row.
  opened = 0
  for b in np.argsort(-lengths, kind="stable"):
    if lengths[b] == 0:
      break
    fits = np.flatnonzero(filled[:opened] + lengths[b] <= row_tokens)
    row = int(fits[0]) if fits.size else opened
    opened = max(opened, row + 1)
    rows[b], offsets[b] = row, filled[row]
    filled[row] += lengths[b]
  return rows, offsets


def place_groups(lengths, groups, row_tokens: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """First-fit decreasing of each group of sequences into rows of its own.

  lengths `[B]`; groups `[G, n]` sequence ids (each in at most one group). Returns the row and offset
  `[B]` int32 of every sequence within its group's rows (−1 and 0: empty, or in no group) and the rows
  each group needs `[G]`."""
  lengths = np.asarray(lengths, np.int64)
  row, offset = np.full(lengths.shape, -1, np.int32), np.zeros(lengths.shape, np.int32)
  needed = np.zeros(len(groups), np.int64)
  for g, ids in enumerate(np.asarray(ids) for ids in groups):
    row[ids], offset[ids] = first_fit_decreasing(lengths[ids], row_tokens)
    needed[g] = int(row[ids].max(initial=-1)) + 1
  return row, offset, needed


class Cut(NamedTuple):
  """`cut_filled`'s runs: each one mini-batch, its sequences placed in rows of its own."""

  members: list  # [K] each run's sequence ids `[n_k]`, in the order's order.
  row: np.ndarray  # [B] int32 each sequence's row within its run's rows (−1: empty, or in no run).
  offset: np.ndarray  # [B] int32.
  needed: np.ndarray  # [K] rows each run fills.


def cut_filled(lengths, order, runs: int, row_tokens: int, micro_rows: int) -> Cut:
  """`order` `[n]` (sequence ids, shuffled) cut into `runs` contiguous runs whose rows fill whole
  micro-batches of `micro_rows` rows: each run gets ⌊T/K⌋ or ⌈T/K⌉ micro-batches of the T in all and takes the
  longest piece of the order, from where the previous run ended, whose sequences first-fit decreasing fill at
  most its share of rows and whose tokens before its last sequence stay short of its share of the order's
  (share / T); the last run takes the rest, first-fit decreasing. T is the least from ⌈Σ lengths / (m·L)⌉ up
  that leaves the last run within its share; where that cut runs no fewer micro-batches than `runs` equal
  pieces of the order do (each first-fit decreasing, as `place_groups` places them), or no T up to K more
  closes, the equal pieces. Each run is a contiguous piece of the order: as random as the order, with a number
  of sequences that follows their lengths. (First-fit decreasing packs a piece nearly as tightly as its tokens
  allow: under `aime`'s long-tailed profile B, T = ⌈Σ / (m·L)⌉ closes where first fit in the order's order
  needed one micro-batch more, docs/packing.md.)"""
  lengths, order = np.asarray(lengths, np.int64), np.asarray(order, np.int64)
  if lengths[order].max(initial=0) > row_tokens:
    first_fit_decreasing(lengths[order], row_tokens)  # Raises, naming the sequence.
  unit = micro_rows * row_tokens
  least = max(runs, -(-int(lengths[order].sum()) // unit))
  best = _equal(lengths, order, runs, row_tokens)
  best_run = int(np.sum(-(-best.needed // micro_rows)))
  for total in range(least, least + runs + 1):
    cut, closes = _cut(lengths, order, [total // runs + (k < total % runs) for k in range(runs)], row_tokens,
                       micro_rows)
    if closes:
      return cut if int(np.sum(-(-cut.needed // micro_rows))) < best_run else best
  return best


def _equal(lengths, order, runs: int, row_tokens: int) -> Cut:
  """`runs` equal pieces of the order, each first-fit decreasing into rows of its own."""
  members = np.array_split(order, runs)
  row, offset, needed = place_groups(lengths, members, row_tokens)
  return Cut(members, row, offset, needed)


def _cut(lengths, order, shares: list[int], row_tokens: int, micro_rows: int) -> tuple[Cut, bool]:
  """`cut_filled` at one share of micro-batches per run; and whether the last run fits its share."""
  row, offset = np.full(lengths.shape, -1, np.int32), np.zeros(lengths.shape, np.int32)
  rows = lambda ids: int(np.max(first_fit_decreasing(lengths[ids], row_tokens)[0], initial=-1)) + 1
  members, needed, start = [], np.zeros(len(shares), np.int64), 0
  before = np.cumsum(lengths[order]) - lengths[order]  # Tokens of the order before each sequence.
  targets = lengths[order].sum() * np.cumsum(shares) / sum(shares)  # Where each run's share of the tokens ends.
  for k, share in enumerate(shares[:-1]):
    # The longest piece order[start:end] within the tokens' target whose rows fit (`_longest`): at least one
    # sequence (one fits a row) and leaving one for each run after it, so that no mini-batch is empty.
    last = order.size - (len(shares) - 1 - k)  # The end that leaves one sequence for each later run.
    least = max(start, min(start + 1, last))
    end = _longest(lambda j: rows(order[start:j]) <= share * micro_rows, least,
                   max(least, min(int(np.searchsorted(before, targets[k], side="left")), last)))
    members.append(order[start:end])
    start = end
  members.append(order[start:])
  for k, ids in enumerate(members):
    row[ids], offset[ids] = first_fit_decreasing(lengths[ids], row_tokens)
    needed[k] = int(row[ids].max(initial=-1)) + 1
  return Cut(members, row, offset, needed), needed[-1] <= shares[-1] * micro_rows


def _longest(fits, least: int, most: int) -> int:
  """The largest j in [least, most] where `fits(j)`, given `fits(least)`: tried from `most` down in growing steps
  (the token target usually fits, or a sequence or two below it), then bisected."""
  fail, step = most + 1, 1
  while fail - step > least and not fits(fail - step):
    fail, step = fail - step, 2 * step
  low = max(least, fail - step)
  while fail - low > 1:  # fits(low), not fits(fail).
    middle = (low + fail) // 2
    low, fail = (middle, fail) if fits(middle) else (low, middle)
  return low


def bucket_rows(needed: int, *, multiple: int = 1, geometric: bool = True) -> int:
  """The row count to compile for a batch that needs `needed` rows: the smallest multiple·2^k ≥ needed
  (geometric), or the smallest multiple of `multiple` ≥ needed, and at least `multiple`.

  `multiple` is the rows of one micro-batch, so every bucket splits into whole micro-batches. Up to
  `max_rows`, geometric buckets compile at most ⌈log₂(max_rows / multiple)⌉ + 1 programs at the cost
  of up to 2× padding rows; linear buckets compile up to max_rows / multiple programs and pad fewer
  than `multiple` rows."""
  if multiple < 1:
    raise ValueError(f"multiple must be >= 1, got {multiple}")
  units = max(1, -(-needed // multiple))
  return multiple * (1 << (units - 1).bit_length() if geometric else units)


def _lengths(prompt_mask: np.ndarray, response_mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """Prompt and response lengths `[B]`, checking the padding: left-padded prompts, right-padded responses."""
  prompt_len, response_len = prompt_mask.sum(-1), response_mask.sum(-1)
  tp, tr = prompt_mask.shape[1], response_mask.shape[1]
  if np.any(prompt_mask != (np.arange(tp)[None] >= tp - prompt_len[:, None])):
    raise ValueError("pack needs left-padded prompts (a prompt mask false then true)")
  if np.any(response_mask != (np.arange(tr)[None] < response_len[:, None])):
    raise ValueError("pack needs right-padded responses (a response mask true then false)")
  if np.any((prompt_len == 0) & (response_len > 0)):
    raise ValueError(f"sequences {np.flatnonzero((prompt_len == 0) & (response_len > 0)).tolist()} have a "
                     "response but no prompt token: nothing would predict their first response token")
  return prompt_len, response_len


def pack(prompt_tokens, prompt_mask, response_tokens, response_mask, *, row_tokens: int,
         rows: int | None = None) -> Packed:
  """Packs a batch as the rollout returns it (module doc) into `rows` rows of `row_tokens` slots.

  prompt_tokens, prompt_mask `[B, Tp]` left-padded; response_tokens, response_mask `[B, Tr]`
  right-padded. rows: the static row count (e.g. `bucket_rows` of the rows needed); default: as
  many as first-fit decreasing needs (at least one). The index arrays are numpy, the tokens jnp.
  Raises ValueError if a sequence is longer than a row, or the rows are too few."""
  prompt_mask, response_mask = np.asarray(prompt_mask, bool), np.asarray(response_mask, bool)
  prompt_len, response_len = _lengths(prompt_mask, response_mask)
  lengths = prompt_len + response_len
  row_of, offset = first_fit_decreasing(lengths, row_tokens)
  needed = int(row_of.max(initial=-1)) + 1
  rows = max(needed, 1) if rows is None else rows
  if rows < needed:
    raise ValueError(f"the batch needs {needed} packed rows of {row_tokens} tokens, got rows={rows}")
  (b, tp), tr = prompt_mask.shape, response_mask.shape[1]
  # Token j of sequence `seq` (one entry per real token): its packed row and column.
  seq = np.repeat(np.arange(b), lengths)
  j = np.arange(seq.size) - np.repeat(np.cumsum(lengths) - lengths, lengths)
  row, column = row_of[seq], offset[seq] + j
  # Segment ids: 1 + the sequence's rank by offset within its row.
  order = np.lexsort((offset, row_of))
  placed = order[row_of[order] >= 0]
  first_in_row = np.searchsorted(row_of[placed], row_of[placed])
  segment = np.zeros(b, np.int64)
  segment[placed] = np.arange(placed.size) - first_in_row + 1
  where = np.zeros((3, rows, row_tokens), np.int32)  # segment_ids, positions, source.
  where[:, row, column] = segment[seq], j, seq * (tp + tr) + tp - prompt_len[seq] + j
  t = np.arange(tr)[None]
  response_index = np.where(response_mask, (row_of * row_tokens + offset + prompt_len)[:, None] + t, 0)
  joined = jnp.concatenate([jnp.asarray(prompt_tokens), jnp.asarray(response_tokens)], axis=1)
  tokens = to_rows(joined, where[2], where[0]).astype(jnp.int32)
  return Packed(tokens, where[0], where[1], where[2], response_index.astype(np.int32), response_mask)


def to_rows(joined: jax.Array, source: jax.Array, segment_ids: jax.Array) -> jax.Array:
  """Per-token values `[B, S, ...]` joined (prompt then response) → packed `[R, L, ...]`
  (0 on padding), by a `Packed`'s `source` and `segment_ids`."""
  flat = joined.reshape((-1,) + joined.shape[2:])
  values = jnp.take(flat, jnp.asarray(source), axis=0)
  real = (jnp.asarray(segment_ids) != 0).reshape(source.shape + (1,) * (joined.ndim - 2))
  return jnp.where(real, values, jnp.zeros((), values.dtype))


def _take_columns(values: jax.Array, index, mask) -> jax.Array:
  """values `[R, L, ...]` at flat column indices `[B, Tr]` → `[B, Tr, ...]`, 0 where not `mask`."""
  flat = values.reshape((-1,) + values.shape[2:])
  out = jnp.take(flat, jnp.asarray(index), axis=0)
  mask = jnp.asarray(mask).reshape(mask.shape + (1,) * (values.ndim - 2))
  return jnp.where(mask, out, jnp.zeros((), out.dtype))


def reference_unpack_tokens(values: jax.Array, packed: Packed) -> jax.Array:
  """Per-token values `[R, L, ...]` at each response token's own column → `[B, Tr, ...]` (0 where
  masked): the inverse of packing for the response (`reference_unpack_tokens(packed.tokens, packed)` gives the
  response tokens back)."""
  return _take_columns(values, packed.response_index, packed.response_mask)


def reference_unpack_predictions(values: jax.Array, packed: Packed) -> jax.Array:
  """Per-position outputs `[R, L, ...]` (log-probs of the next token, values, entropy) at the column
  before each response token → `[B, Tr, ...]` (0 where masked): output t is the one that predicts
  response token t, and the value there is V(s_t) (module doc, time index)."""
  index = jnp.maximum(jnp.asarray(packed.response_index) - 1, 0)
  return _take_columns(values, index, packed.response_mask)


class RowLayout(NamedTuple):
  """Packed rows `[R, L]` on the device, from each sequence's (row, offset) (`row_layout`)."""

  sequence: jax.Array  # [R, L] int32 index of the column's sequence among those given; −1 on padding.
  position: jax.Array  # [R, L] int32 j: the column holds token j of its sequence (0 on padding).
  segment_ids: jax.Array  # [R, L] int32 1, 2, ... per sequence of a row in column order; 0 on padding.


def row_layout(row, offset, lengths, *, rows: int, row_tokens: int) -> RowLayout:
  """jnp, static shapes: which sequence and which of its tokens each column of `rows` × `row_tokens`
  holds, from the sequences' row, offset and length `[n]` (row −1 or length 0: not placed). Each
  sequence start marks its column with the sequence's index; a running maximum of the start columns
  along the row gives every column the start of its segment, hence its sequence and position."""
  row, offset, lengths = (jnp.asarray(x, jnp.int32) for x in (row, offset, lengths))
  placed = (row >= 0) & (lengths > 0)
  start = jnp.where(placed, row * row_tokens + offset, rows * row_tokens)  # Off the end: dropped.
  owner = jnp.full(rows * row_tokens, -1, jnp.int32).at[start].set(jnp.arange(row.shape[0], dtype=jnp.int32),
                                                                    mode="drop").reshape(rows, row_tokens)
  column = jnp.arange(row_tokens, dtype=jnp.int32)[None]
  first = jax.lax.cummax(jnp.where(owner >= 0, column, -1), axis=1)  # Start column of the segment; −1: none.
  sequence = jnp.take_along_axis(owner, jnp.maximum(first, 0), axis=1)
  position = column - first
  real = (first >= 0) & (position < lengths[jnp.maximum(sequence, 0)])
  segment_ids = jnp.cumsum(owner >= 0, axis=1, dtype=jnp.int32)
  return RowLayout(jnp.where(real, sequence, -1), jnp.where(real, position, 0),
                   jnp.where(real, segment_ids, 0))
