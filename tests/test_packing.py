"""Packing: first-fit decreasing by hand and as a property, `pack` by hand, round trips, errors."""

import pathlib
import subprocess
import sys

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vapo_jax.train import packing


def test_first_fit_decreasing_by_hand():
  # Longest first: 7 → row 0; 5 → row 1; 4 → row 1 (9); 3 → row 0 (10); 2 fits nowhere → row 2.
  rows, offsets = packing.first_fit_decreasing([3, 7, 5, 2, 4, 0], 10)
  np.testing.assert_array_equal(rows, [0, 0, 1, 2, 1, -1])
  np.testing.assert_array_equal(offsets, [7, 0, 0, 0, 5, 0])
  rows, _ = packing.first_fit_decreasing([4, 4, 4, 4], 8)  # Ties: by index.
  np.testing.assert_array_equal(rows, [0, 0, 1, 1])
  assert packing.first_fit_decreasing([], 8)[0].shape == (0,)


def test_a_sequence_longer_than_a_row_is_an_error():
  with pytest.raises(ValueError, match="sequence 1 has 9 tokens, more than a packed row holds \\(row_tokens=8\\)"):
    packing.first_fit_decreasing([3, 9, 2], 8)
  prompt = np.ones((2, 6), bool)
  with pytest.raises(ValueError, match="sequence 0 has 9 tokens"):
    packing.pack(prompt, prompt, np.ones((2, 3), int), np.array([[1, 1, 1], [0, 0, 0]], bool), row_tokens=8)


@hypothesis.settings(max_examples=60, deadline=None)
@hypothesis.given(st.lists(st.integers(0, 12), max_size=40), st.integers(12, 20))
def test_first_fit_decreasing_never_overfills_and_never_overlaps(lengths, row_tokens):
  rows, offsets = packing.first_fit_decreasing(lengths, row_tokens)
  lengths = np.asarray(lengths, int)
  assert np.all((rows >= 0) == (lengths > 0))
  used = rows[rows >= 0]
  if used.size:
    assert set(used.tolist()) == set(range(used.max() + 1))  # Rows numbered without gaps.
    # First fit leaves at most one row half full or less: rows ≤ ⌈2·Σ lengths / L⌉.
    assert used.max() + 1 <= -(-2 * lengths.sum() // row_tokens)
  for row in set(used.tolist()):
    spans = sorted((offsets[b], offsets[b] + lengths[b]) for b in np.flatnonzero(rows == row))
    assert spans[0][0] == 0 and spans[-1][1] <= row_tokens
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))  # End to end: no overlap, no gap.


@hypothesis.settings(max_examples=60, deadline=None)
@hypothesis.given(st.lists(st.integers(0, 16), min_size=1, max_size=48), st.integers(1, 6), st.integers(1, 3),
                  st.randoms(use_true_random=False))
def test_cut_filled_cuts_the_order_into_runs_that_never_run_more_micro_batches(lengths, runs, micro_rows, rnd):
  """Contiguous pieces of the order, each sequence once, every run's rows end to end and within a row; no run
  empty while there are sequences for each; never more micro-batches than equal pieces (first-fit decreasing
  each)."""
  row_tokens, order = 16, np.array(rnd.sample(range(len(lengths)), len(lengths)))
  lengths = np.asarray(lengths)
  cut = packing.cut_filled(lengths, order, runs, row_tokens, micro_rows)
  assert len(cut.members) == runs
  np.testing.assert_array_equal(np.concatenate(cut.members), order)
  assert len(order) < runs or all(ids.size for ids in cut.members)
  for ids, needed in zip(cut.members, cut.needed):
    real = ids[lengths[ids] > 0]
    assert np.all(cut.row[ids[lengths[ids] == 0]] == -1) and np.all(cut.row[real] >= 0)
    assert needed == cut.row[real].max(initial=-1) + 1
    for row in range(needed):
      spans = sorted((cut.offset[b], cut.offset[b] + lengths[b]) for b in real[cut.row[real] == row])
      assert spans[0][0] == 0 and spans[-1][1] <= row_tokens
      assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
  pieces = np.array_split(order, runs)
  equal = sum(-(-packing.place_groups(lengths, [p], row_tokens)[2][0] // micro_rows) for p in pieces)
  assert np.sum(-(-cut.needed // micro_rows)) <= equal


@hypothesis.settings(max_examples=200, deadline=None)
@hypothesis.given(st.integers(0, 6), st.lists(st.booleans(), min_size=1, max_size=40), st.booleans())
def test_the_longest_fitting_piece_is_found_from_the_top(least, fits, monotone):
  """`packing._longest` (how far a run reaches): some j in [least, most] that fits, given that least does; the
  largest when fitting is monotone (every piece shorter than one that fits fits too)."""
  most = least + len(fits) - 1
  table = [True] * least + list(fits)
  table[least] = True
  if monotone:
    table = [all(table[:i + 1]) for i in range(len(table))]
  j = packing._longest(lambda i: table[i], least, most)
  assert least <= j <= most and table[j]
  if monotone:
    assert j == max(i for i in range(least, most + 1) if table[i])


def test_cut_filled_by_hand():
  """Rows of 10 tokens, micro-batches of one row, 2 runs.

  [6, 6, 4, 4, 6, 4]: equal pieces [6, 6, 4] and [4, 6, 4] need 2 rows each. T = 3 (⌈30 / 10⌉): shares 2, 1,
  the first run's share of the tokens 20: it takes 6, 6, 4, 4 (rows 6 + 4, 6 + 4; 20 tokens reached), the
  last 6, 4 in one row, its share: 3 rows.

  [9, 2, 8, 1]: equal pieces [9, 2] and [8, 1] need 2 + 1 rows. T = 2 (shares 1, 1): the first run takes 9
  (9 and 2 need 2 rows), the last needs 2 rows; T = 3 (shares 2, 1; 13.3 tokens): 9 | 8 + 2, then 1 alone: 3
  rows, no fewer than the equal pieces, which are kept.

  [4, 4, 6, 5, 8]: T = 3 (⌈27 / 10⌉; shares 2, 1; 18 tokens): the first run's 4, 4, 6, 5 first-fit decreasing
  fill 2 rows (6 + 4, 5 + 4), the last 8 alone: 3 rows. In the order's order 5 fits neither 4 + 4 nor 6, so
  first fit that way stops at 4, 4, 6 and leaves 5, 8 two rows; equal pieces [4, 4, 6] and [5, 8] need 4."""
  cut = packing.cut_filled(np.array([6, 6, 4, 4, 6, 4]), np.arange(6), 2, 10, 1)
  assert [m.tolist() for m in cut.members] == [[0, 1, 2, 3], [4, 5]] and cut.needed.tolist() == [2, 1]
  assert cut.row.tolist() == [0, 1, 0, 1, 0, 0] and cut.offset.tolist() == [0, 0, 6, 6, 0, 6]
  cut = packing.cut_filled(np.array([9, 2, 8, 1]), np.arange(4), 2, 10, 1)
  assert [m.tolist() for m in cut.members] == [[0, 1], [2, 3]] and cut.needed.tolist() == [2, 1]
  cut = packing.cut_filled(np.array([4, 4, 6, 5, 8]), np.arange(5), 2, 10, 1)
  assert [m.tolist() for m in cut.members] == [[0, 1, 2, 3], [4]] and cut.needed.tolist() == [2, 1]
  assert cut.row.tolist() == [0, 1, 0, 1, 0] and cut.offset.tolist() == [6, 5, 0, 0, 0]


def test_bucket_rows():
  assert [packing.bucket_rows(n, multiple=4) for n in (0, 1, 4, 5, 8, 9, 17)] == [4, 4, 4, 8, 8, 16, 32]
  assert [packing.bucket_rows(n, multiple=4, geometric=False) for n in (0, 5, 9, 17)] == [4, 8, 12, 20]
  assert packing.bucket_rows(5) == 8
  with pytest.raises(ValueError, match="multiple"):
    packing.bucket_rows(3, multiple=0)


def _batch():
  """Three sequences (prompt | response): (11 12 | 13 14), (21 22 23 24 | 25), (31 | 32 33 34)."""
  prompt = np.array([[0, 0, 11, 12], [21, 22, 23, 24], [0, 0, 0, 31]])
  response = np.array([[13, 14, 0], [25, 0, 0], [32, 33, 34]])
  return prompt, prompt > 0, response, response > 0


def test_pack_by_hand():
  packed = packing.pack(*_batch(), row_tokens=8)  # Lengths 4, 5, 4: the 5 first, then 4 + 4.
  np.testing.assert_array_equal(packed.tokens, [[21, 22, 23, 24, 25, 0, 0, 0], [11, 12, 13, 14, 31, 32, 33, 34]])
  np.testing.assert_array_equal(packed.segment_ids, [[1, 1, 1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 2, 2, 2, 2]])
  np.testing.assert_array_equal(packed.positions, [[0, 1, 2, 3, 4, 0, 0, 0], [0, 1, 2, 3, 0, 1, 2, 3]])
  np.testing.assert_array_equal(packed.response_index, [[10, 11, 0], [4, 0, 0], [13, 14, 15]])
  np.testing.assert_array_equal(packing.reference_unpack_tokens(packed.tokens, packed), _batch()[2])
  # Each response token's prediction column holds the token before it.
  np.testing.assert_array_equal(packing.reference_unpack_predictions(packed.tokens, packed), [[12, 13, 0], [24, 0, 0],
                                                                                    [31, 32, 33]])
  assert packing.pack(*_batch(), row_tokens=8, rows=4).tokens.shape == (4, 8)
  with pytest.raises(ValueError, match="needs 2 packed rows of 8 tokens, got rows=1"):
    packing.pack(*_batch(), row_tokens=8, rows=1)


def test_pack_refuses_other_layouts():
  prompt, prompt_mask, response, response_mask = _batch()
  with pytest.raises(ValueError, match="left-padded prompts"):
    packing.pack(prompt, prompt_mask[:, ::-1], response, response_mask, row_tokens=8)
  with pytest.raises(ValueError, match="right-padded responses"):
    packing.pack(prompt, prompt_mask, response, response_mask[:, ::-1], row_tokens=8)
  with pytest.raises(ValueError, match=r"sequences \[2\] have a response but no prompt token"):
    packing.pack(prompt, prompt_mask & (np.arange(3) < 2)[:, None], response, response_mask, row_tokens=8)


@st.composite
def _batches(draw):
  # One shape (the jitted round trips below compile once per row length), many layouts: the lengths vary
  # in the masks, from empty to the whole prompt bucket and response budget.
  b, tp, tr = 5, 4, 5
  prompt_len = np.array(draw(st.lists(st.integers(0, tp), min_size=b, max_size=b)))
  response_len = np.array(draw(st.lists(st.integers(0, tr), min_size=b, max_size=b))) * (prompt_len > 0)
  prompt_mask = np.arange(tp)[None] >= tp - prompt_len[:, None]
  response_mask = np.arange(tr)[None] < response_len[:, None]
  tokens = np.arange(1, b * (tp + tr) + 1).reshape(b, tp + tr)  # Distinct ids: a misplaced token shows.
  row_tokens = draw(st.sampled_from([tp + tr, tp + tr + 5]))
  return tokens[:, :tp] * prompt_mask, prompt_mask, tokens[:, tp:] * response_mask, response_mask, row_tokens


_to_rows = jax.jit(packing.to_rows)
_unpack_tokens = jax.jit(packing.reference_unpack_tokens)
_unpack_predictions = jax.jit(packing.reference_unpack_predictions)
_layout = jax.jit(packing.row_layout, static_argnames=("rows", "row_tokens"))


@hypothesis.settings(max_examples=30, deadline=None)
@hypothesis.given(_batches())
def test_pack_round_trips(batch):
  prompt, prompt_mask, response, response_mask, row_tokens = batch
  b = prompt.shape[0]  # B rows always suffice; a static count keeps the shapes few.
  packed = packing.pack(prompt, prompt_mask, response, response_mask, row_tokens=row_tokens, rows=b)
  joined = np.concatenate([prompt, response], 1)
  joined_mask = np.concatenate([prompt_mask, response_mask], 1)
  tokens, segments, positions = (np.asarray(x) for x in packed[:3])
  # Every real token exactly once, in order, each sequence in one segment, positions from 0.
  assert np.sort(tokens[segments > 0]).tolist() == np.sort(joined[joined_mask]).tolist()
  assert not np.any(tokens[segments == 0])
  for row_ids, row_tokens_, row_pos in zip(segments, tokens, positions):
    real = row_ids > 0
    assert not np.any(real[real.sum():]), "padding only at the row's end"
    assert np.all(np.diff(row_ids[real]) >= 0) and set(row_ids[real].tolist()) == set(range(1, row_ids.max() + 1))
    for segment in set(row_ids[real].tolist()):
      sequence = row_tokens_[row_ids == segment]
      seq = int(np.flatnonzero((joined == sequence[0]).any(1))[0])
      np.testing.assert_array_equal(sequence, joined[seq][joined_mask[seq]])
      np.testing.assert_array_equal(row_pos[row_ids == segment], np.arange(sequence.size))
  np.testing.assert_array_equal(_to_rows(jnp.asarray(joined), packed.source, packed.segment_ids), tokens)
  np.testing.assert_array_equal(_unpack_tokens(packed.tokens, packed), response)
  before = joined[:, prompt.shape[1] - 1:-1] * response_mask  # The token before each response token.
  np.testing.assert_array_equal(_unpack_predictions(packed.tokens, packed), before)


def test_packing_is_pure():
  """numpy and jax only: no flax, no config, no model (arrays in, arrays out)."""
  code = "import sys, vapo_jax.train.packing; print(' '.join(sorted(sys.modules)))"
  loaded = set(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                              cwd=pathlib.Path(__file__).resolve().parents[1]).stdout.split())
  assert "flax" not in loaded and "vapo_jax.config" not in loaded and "vapo_jax.models" not in loaded


@hypothesis.settings(max_examples=30, deadline=None)
@hypothesis.given(_batches())
def test_layout_on_the_device_equals_pack(batch):
  """`layout` expands each sequence's (row, offset) into the rows `pack` builds on the host."""
  prompt, prompt_mask, response, response_mask, row_tokens = batch
  b = prompt.shape[0]
  packed = packing.pack(prompt, prompt_mask, response, response_mask, row_tokens=row_tokens, rows=b)
  lengths = prompt_mask.sum(1) + response_mask.sum(1)
  row, offset, needed = packing.place_groups(lengths, np.arange(b)[None], row_tokens)
  assert needed.tolist() == [int(row.max(initial=-1)) + 1]
  lay = _layout(row, offset, lengths, rows=b, row_tokens=row_tokens)
  np.testing.assert_array_equal(lay.segment_ids, packed.segment_ids)
  np.testing.assert_array_equal(lay.position, packed.positions)
  sequence = np.asarray(lay.sequence)
  np.testing.assert_array_equal(np.where(sequence >= 0, sequence, 0),
                                packed.source // (prompt.shape[1] + response.shape[1]))
  assert np.all((sequence >= 0) == (packed.segment_ids > 0))


def test_place_groups_packs_each_group_into_rows_of_its_own():
  lengths = np.array([3, 7, 5, 2, 4, 0])
  row, offset, needed = packing.place_groups(lengths, np.array([[1, 3, 5], [0, 2, 4]]), 10)
  # Group 0: 7 → row 0, 2 → row 0 (offset 7), the empty one unplaced; group 1: 5 → 0, 4 → 0 (5), 3 → 1.
  np.testing.assert_array_equal(row, [1, 0, 0, 0, 0, -1])
  np.testing.assert_array_equal(offset, [0, 0, 0, 7, 5, 0])
  np.testing.assert_array_equal(needed, [1, 2])
  # Placed back by `layout`, group 1's rows hold 5 | 4 and 3.
  lay = packing.row_layout(row[[0, 2, 4]], offset[[0, 2, 4]], lengths[[0, 2, 4]], rows=2, row_tokens=10)
  np.testing.assert_array_equal(lay.sequence, [[1] * 5 + [2] * 4 + [-1], [0] * 3 + [-1] * 7])
  np.testing.assert_array_equal(lay.segment_ids, [[1] * 5 + [2] * 4 + [0], [1] * 3 + [0] * 7])


def test_a_sequence_with_a_response_and_no_prompt_token_is_refused_by_the_plan():
  """The device path read the previous segment's column (or column −1, wrapping) as its first token's
  prediction, and dropped that token from the loss where padded rows keep it: the host plan refuses it."""
  from vapo_jax.errors import DataError
  from vapo_jax.train import packed_batch
  orders = np.arange(4)[None, None]
  # No response: unplaced.
  fine = packed_batch.plan_rows([3, 2, 0, 1], [4, 5, 0, 2], orders, row_tokens=16, micro_rows=2)
  assert fine.scoring_rows >= 2
  with pytest.raises(DataError, match=r"^sequence 2 of the batch \(1 in all\) has a response of 3 tokens and no "
                                      r"prompt token"):
    packed_batch.plan_rows([3, 2, 0, 1], [4, 5, 3, 2], orders, row_tokens=16, micro_rows=2)
