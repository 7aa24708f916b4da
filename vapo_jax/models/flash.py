"""Flash attention in pure JAX: `chunked`, the implementation that runs everywhere (`models/attention.py`).

An online softmax over key blocks per query block, float32 accumulation, and a custom VJP that stores
only the output and the log-sum-exp (named `remat.ATTENTION_CONTEXT`, which `minimal` keeps) and
recomputes the scores block by block (Dao et al. 2022; FlashAttention-2, Dao 2023). Query t sees the key
slots of one interval [lo, hi) (`key_intervals`), from ranges (unpadded rows, the KV cache) or segment
ids (packed rows). Loops over blocks have dynamic trip counts, and the rows of a call run one after
another (`lax.map`), each with its own: a query block of a row visits only the key blocks that its own
queries' intervals reach, so blocks above the causal diagonal, outside the row's real range, or before
the query block's first segment are never visited, and no row pays for another's: a packed row costs ∝ Σ
length² of its own segments, not row length², and an empty row costs nothing. `visited_block_pairs`
counts the visited (row, query block, key block) triples (tests and benchmarks). On a mesh,
`attention.attend` runs `chunked` under `shard_map`, each device on its own rows. """

import contextlib
import contextvars
import functools
import types
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from vapo_jax.models import remat as remat_names

BLOCK_Q = 256  # Default query block of `chunked` (tokens).
BLOCK_K = 256  # Default key/value block of `chunked` (tokens).
_DEFAULTS = contextvars.ContextVar("vapo_jax_flash_defaults", default=types.MappingProxyType(
    dict(block_q=BLOCK_Q, block_k=BLOCK_K, per_row=True)))  # Read-only: `defaults` sets a new mapping.


@contextlib.contextmanager
def defaults(**options):
  """Within this context, the options of `chunked` calls that name none, as programs are traced:
  `block_q`, `block_k` (benchmarks that scale a shape down scale its blocks with it) and `per_row`
  (False: the rows of a call run together, every row over the union of the rows' key blocks: the
  layout that benchmarks compare against)."""
  token = _DEFAULTS.set(_DEFAULTS.get() | options)
  try:
    yield
  finally:
    _DEFAULTS.reset(token)


def validity(key_start, key_end, segment_ids) -> dict:
  """The keyword arguments of one validity form (module doc): ranges or segment ids, not both."""
  if segment_ids is None and (key_start is None or key_end is None):
    raise ValueError("attention needs key_start and key_end, or segment_ids")
  if segment_ids is not None and (key_start is not None or key_end is not None):
    raise ValueError("attention takes key_start/key_end or segment_ids, not both")
  return dict(segment_ids=segment_ids) if segment_ids is not None else dict(key_start=key_start,
                                                                            key_end=key_end)


def key_intervals(*, queries: int, keys: int, key_start=None, key_end=None, segment_ids=None, query_offset=0,
                  causal: bool = True) -> tuple[jax.Array, jax.Array]:
  """(lo, hi) `[B, T]` int32: query t sees exactly the key slots lo ≤ s < hi (nothing: lo = S, hi = 0).

  Ranges: [key_start, min(key_end, slot + 1)) for a real query. Segments (contiguous per id):
  [first slot of t's segment, t + 1), or to the segment's end when not causal."""
  if segment_ids is None:
    q_slot = query_offset + jnp.arange(queries)[None]
    start, end = key_start.astype(jnp.int32)[:, None], key_end.astype(jnp.int32)[:, None]
    real = (q_slot >= start) & (q_slot < end)
    lo, hi = start, jnp.minimum(end, q_slot + 1) if causal else end
  else:
    slot = jnp.arange(queries)[None]
    real = segment_ids != 0
    change = segment_ids[:, 1:] != segment_ids[:, :-1]  # [B, T - 1]: a segment starts at t + 1.
    first = jnp.pad(change, ((0, 0), (1, 0)), constant_values=True)
    last = jnp.pad(change, ((0, 0), (0, 1)), constant_values=True)
    lo = lax.cummax(jnp.where(first, slot, 0), axis=1)
    hi = slot + 1 if causal else lax.cummin(jnp.where(last, slot + 1, queries), axis=1, reverse=True)
  return (jnp.where(real, lo, keys).astype(jnp.int32), jnp.where(real, hi, 0).astype(jnp.int32))


class _Plan(NamedTuple):
  """Static block layout of one `chunked` call."""

  skip: bool  # Visit only blocks that the queries' key intervals reach (False: every block, for benchmarks).
  per_row: bool  # Each row's loops run their own trip counts (False: the union of the call's rows; `defaults`).
  bq: int  # Query block.
  bk: int  # Key block.
  nq: int
  nk: int
  queries: int  # T (the queries are padded to nq·bq).
  keys: int  # S (the last key block is shifted back to end at S, its repeated slots masked).
  scale: float


def _plan(queries: int, keys: int, head_dim: int, block_q: int | None, block_k: int | None,
          skip: bool) -> _Plan:
  found = _DEFAULTS.get()
  bq, bk = min(block_q or found["block_q"], queries), min(block_k or found["block_k"], keys)
  return _Plan(skip, found["per_row"], bq, bk, -(-queries // bq), -(-keys // bk), queries, keys,
               head_dim ** -0.5)


def chunked(q, k, v, *, key_start=None, key_end=None, segment_ids=None, query_offset=0, causal: bool = True,
            block_q: int | None = None, block_k: int | None = None,
            skip_masked_blocks: bool = True) -> jax.Array:
  """Flash attention in pure JAX (see the module doc): memory O(T·H), not O(T·S).

  Forward+backward needs about seven float32 copies of q (7 · 4·B·T·N·H bytes: padded and
  transposed q and dO, out, dq, dk, dv) besides its inputs, and per block pair a few float32
  `[B, N, block_q, block_k]` tiles (benchmarks/long_seq_bench.py measures it)."""
  b, t, n, h = q.shape
  s, kv_heads = k.shape[1], k.shape[2]
  if segment_ids is not None and (t != s or not isinstance(query_offset, int) or query_offset):
    raise ValueError(f"segment_ids serve whole-sequence calls (T = S, query_offset 0), got T {t}, S {s}")
  plan = _plan(t, s, h, block_q, block_k, skip_masked_blocks)
  qh = q.reshape(b, t, kv_heads, n // kv_heads, h).transpose(0, 2, 3, 1, 4)  # [B, K, G, T, H]
  pad = plan.nq * plan.bq - t
  qh = jnp.pad(qh, ((0, 0), (0, 0), (0, 0), (0, pad), (0, 0)))
  kh, vh = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B, K, S, H]
  lo, hi = _padded_intervals(plan, **validity(key_start, key_end, segment_ids), query_offset=query_offset,
                             causal=causal)
  out = _flash(plan, qh, kh, vh, lo, hi)
  return out[:, :, :, :t].transpose(0, 3, 1, 2, 4).reshape(b, t, n, h)


def _padded_intervals(plan: _Plan, **validity):
  """`key_intervals` with the padding queries [T, nq·bq) seeing nothing."""
  lo, hi = key_intervals(queries=plan.queries, keys=plan.keys, **validity)
  pad = ((0, 0), (0, plan.nq * plan.bq - plan.queries))
  return jnp.pad(lo, pad, constant_values=plan.keys), jnp.pad(hi, pad)


def _by_row(fn, *arrays):
  """fn on each row of `arrays` (leading axis B) in turn, as a batch of one: each row's loops run
  their own trip counts (a vmapped loop would run every row's largest). A single row (a packed
  micro-batch's one row per device, under `shard_map`) is fn itself: no loop to compile around it."""
  if arrays[0].shape[0] == 1:
    return fn(*arrays)
  return lax.map(lambda row: jax.tree.map(lambda x: x[0], fn(*(x[None] for x in row))), arrays)


def _key_blocks(plan: _Plan, lo, hi):
  """`[nq]` each: the key blocks [first, end) that query block i of one row (lo, hi `[1, nq·bq]`; of
  every row given, without `per_row`) visits: the hull of its queries' intervals."""
  if not plan.skip:
    return jnp.zeros(plan.nq, jnp.int32), jnp.full(plan.nq, plan.nk, jnp.int32)
  blocks = lambda x: x.reshape(x.shape[0], plan.nq, plan.bq)
  empty = hi <= lo
  lo_slot = jnp.min(blocks(jnp.where(empty, plan.keys, lo)), axis=(0, 2))
  hi_slot = jnp.max(blocks(jnp.where(empty, 0, hi)), axis=(0, 2))
  some = hi_slot > lo_slot
  return jnp.where(some, lo_slot // plan.bk, 0), jnp.where(some, -(-hi_slot // plan.bk), 0)


def _query_blocks(plan: _Plan, first, end, j):
  """The query blocks [lo, hi) whose forward visits key block j: the backward visits the same pairs."""
  if not plan.skip:
    return 0, plan.nq
  hit = (first <= j) & (j < end)
  some = hit.any()
  lo, hi = jnp.argmax(hit), plan.nq - jnp.argmax(hit[::-1])
  return jnp.where(some, lo, 0), jnp.where(some, hi, 0)


def _key_block_span(plan: _Plan, first, end):
  """The key blocks [lo, hi) that some query block visits (the backward's outer loop)."""
  if not plan.skip:
    return 0, plan.nk
  some = end > first
  lo = jnp.min(jnp.where(some, first, plan.nk))
  return lo, jnp.maximum(lo, jnp.max(jnp.where(some, end, 0)))


def visited_block_pairs(queries: int, keys: int, *, key_start=None, key_end=None, segment_ids=None,
                        query_offset=0,
                        causal: bool = True, block_q: int | None = None, block_k: int | None = None,
                        skip_masked_blocks: bool = True) -> tuple[jax.Array, jax.Array]:
  """(forward, backward): how many (row, query block, key block) triples `chunked`'s loops visit for
  this validity, from the same trip counts the loops use: its cost model."""
  plan = _plan(queries, keys, 1, block_q, block_k, skip_masked_blocks)
  lo, hi = _padded_intervals(plan, **validity(key_start, key_end, segment_ids), query_offset=query_offset,
                             causal=causal)
  if not plan.per_row:
    return tuple(lo.shape[0] * x for x in _row_block_pairs(plan, lo, hi))
  forward, backward = jax.vmap(lambda lo, hi: _row_block_pairs(plan, lo[None], hi[None]))(lo, hi)
  return jnp.sum(forward), jnp.sum(backward)


def _row_block_pairs(plan: _Plan, lo, hi):
  """(forward, backward) block pairs that one row's loops visit."""
  first, end = _key_blocks(plan, lo, hi)
  span_lo, span_hi = _key_block_span(plan, first, end)
  j = jnp.arange(plan.nk)
  q_lo, q_hi = jax.vmap(lambda j: _query_blocks(plan, first, end, j))(j)
  backward = jnp.sum(jnp.where((j >= span_lo) & (j < span_hi), jnp.asarray(q_hi) - jnp.asarray(q_lo), 0))
  return jnp.sum(end - first), backward


def _key_block(plan: _Plan, j):
  """Nominal first slot of key block j, and where it is read from (the last block ends at S)."""
  nominal = j * plan.bk
  return nominal, jnp.minimum(nominal, plan.keys - plan.bk)


def _visible(plan: _Plan, lo_b, hi_b, k_nominal, k0):
  """`[B, 1, 1, bq, bk]`: queries with intervals lo_b, hi_b `[B, bq]` against the key block read from k0."""
  k_slot = (k0 + jnp.arange(plan.bk))[None, None]
  visible = (k_slot >= jnp.maximum(lo_b, k_nominal)[:, :, None]) & (k_slot < hi_b[:, :, None])
  return visible[:, None, None]


def _scores(plan: _Plan, qb, kb):
  return jnp.einsum("BKGTH,BKSH->BKGTS", qb, kb, preferred_element_type=jnp.float32) * plan.scale


def _forward(plan: _Plan, q, k, v, lo, hi):
  """(out, lse) of every row, one row at a time (`_by_row`)."""
  if not plan.per_row:
    return _row_forward(plan, q, k, v, lo, hi)
  return _by_row(functools.partial(_row_forward, plan), q, k, v, lo, hi)


def _row_forward(plan: _Plan, q, k, v, lo, hi):
  b, kv_heads, g, _, h = q.shape
  first, end = _key_blocks(plan, lo, hi)

  def query_block(_, i):
    q0 = i * plan.bq
    qb = lax.dynamic_slice_in_dim(q, q0, plan.bq, axis=3)
    lo_b, hi_b = (lax.dynamic_slice_in_dim(x, q0, plan.bq, axis=1) for x in (lo, hi))

    def key_block(j, carry):
      m, l, acc = carry
      nominal, k0 = _key_block(plan, j)
      kb = lax.dynamic_slice_in_dim(k, k0, plan.bk, axis=2)
      vb = lax.dynamic_slice_in_dim(v, k0, plan.bk, axis=2)
      s = jnp.where(_visible(plan, lo_b, hi_b, nominal, k0), _scores(plan, qb, kb), -jnp.inf)
      m_new = jnp.maximum(m, s.max(-1))
      m_ref = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # Rows with nothing visible yet stay at 0.
      p = jnp.exp(s - m_ref[..., None])
      alpha = jnp.exp(m - m_ref)
      pv = jnp.einsum("BKGTS,BKSH->BKGTH", p.astype(v.dtype), vb, preferred_element_type=jnp.float32)
      return m_new, alpha * l + p.sum(-1), alpha[..., None] * acc + pv

    rows = (b, kv_heads, g, plan.bq)
    init = (jnp.full(rows, -jnp.inf), jnp.zeros(rows), jnp.zeros(rows + (h,)))
    m, l, acc = lax.fori_loop(first[i], end[i], key_block, init)
    seen = l > 0
    safe_l = jnp.where(seen, l, 1.0)
    out = jnp.where(seen[..., None], acc / safe_l[..., None], 0.0).astype(q.dtype)
    return None, (out, jnp.where(seen, m + jnp.log(safe_l), 0.0))

  _, (out, lse) = lax.scan(query_block, None, jnp.arange(plan.nq))
  padded = plan.nq * plan.bq  # [nq, B, K, G, bq, ...] -> [B, K, G, nq·bq, ...]
  return (jnp.moveaxis(out, 0, 3).reshape(b, kv_heads, g, padded, h),
          jnp.moveaxis(lse, 0, 3).reshape(b, kv_heads, g, padded))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(plan, q, k, v, lo, hi):
  return _forward(plan, q, k, v, lo, hi)[0]


def _flash_fwd(plan, q, k, v, lo, hi):
  out, lse = _forward(plan, q, k, v, lo, hi)  # Named: a policy that keeps them runs no forward again.
  out, lse = (checkpoint_name(x, remat_names.ATTENTION_CONTEXT) for x in (out, lse))
  return out, (q, k, v, lo, hi, out, lse)


def _flash_bwd(plan, residuals, d_out):
  """dS = P ∘ (dO·Vᵀ − rowsum(dO ∘ O)), recomputing P = exp(S − lse) one block pair at a time, one row
  at a time (`_by_row`)."""
  q, k, v, lo, hi, out, lse = residuals
  row_backward = functools.partial(_row_backward, plan)
  dq, dk, dv = (row_backward if not plan.per_row else functools.partial(_by_row, row_backward))(
      q, k, v, lo, hi, out, lse, d_out)
  return dq, dk, dv, None, None


def _row_backward(plan: _Plan, q, k, v, lo, hi, out, lse, d_out):
  delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), -1)  # [B, K, G, T]
  first, end = _key_blocks(plan, lo, hi)

  def key_block(j, carry):
    dq, dk, dv = carry
    nominal, k0 = _key_block(plan, j)
    kb = lax.dynamic_slice_in_dim(k, k0, plan.bk, axis=2)
    vb = lax.dynamic_slice_in_dim(v, k0, plan.bk, axis=2)

    def query_block(i, inner):
      dq, dkb, dvb = inner
      q0 = i * plan.bq
      qb, dob = (lax.dynamic_slice_in_dim(x, q0, plan.bq, axis=3) for x in (q, d_out))
      lse_b, delta_b = (lax.dynamic_slice_in_dim(x, q0, plan.bq, axis=3) for x in (lse, delta))
      lo_b, hi_b = (lax.dynamic_slice_in_dim(x, q0, plan.bq, axis=1) for x in (lo, hi))
      visible = _visible(plan, lo_b, hi_b, nominal, k0)
      p = jnp.where(visible, jnp.exp(_scores(plan, qb, kb) - lse_b[..., None]), 0.0)
      dvb = dvb + jnp.einsum("BKGTS,BKGTH->BKSH", p.astype(dob.dtype), dob,
                             preferred_element_type=jnp.float32)
      dp = jnp.einsum("BKGTH,BKSH->BKGTS", dob, vb, preferred_element_type=jnp.float32)
      ds = p * (dp - delta_b[..., None]) * plan.scale
      dqb = jnp.einsum("BKGTS,BKSH->BKGTH", ds.astype(kb.dtype), kb, preferred_element_type=jnp.float32)
      dq = lax.dynamic_update_slice_in_dim(dq, lax.dynamic_slice_in_dim(dq, q0, plan.bq, axis=3) + dqb, q0,
                                           axis=3)
      dkb = dkb + jnp.einsum("BKGTS,BKGTH->BKSH", ds.astype(qb.dtype), qb, preferred_element_type=jnp.float32)
      return dq, dkb, dvb

    block = jnp.zeros(kb.shape, jnp.float32)
    dq, dkb, dvb = lax.fori_loop(*_query_blocks(plan, first, end, j), query_block, (dq, block, block))
    add = lambda acc, blk: lax.dynamic_update_slice_in_dim(
        acc, lax.dynamic_slice_in_dim(acc, k0, plan.bk, axis=2) + blk, k0, axis=2)
    return dq, add(dk, dkb), add(dv, dvb)

  zeros = lambda x: jnp.zeros(x.shape, jnp.float32)
  dq, dk, dv = lax.fori_loop(*_key_block_span(plan, first, end), key_block, (zeros(q), zeros(k), zeros(v)))
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


_flash.defvjp(_flash_fwd, _flash_bwd)
