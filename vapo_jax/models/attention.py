"""Attention: one entry point, `attend`, over a pure-JAX flash attention and the platform kernels.

Shapes: queries `[B, T, N, H]`, keys and values `[B, S, K, H]`, `N = K·G` (G query heads share a kv
head: grouped-query attention, never repeating K/V). Query t sits at key slot `query_offset + t`:
0 for a whole sequence, the cache length when T new tokens are appended to a KV cache.

Validity comes in one of two forms, neither a dense mask:

  ranges    key slot s of row b holds a real token iff `key_start[b] ≤ s < key_end[b]` (left
            padding moves `key_start`, right padding `key_end`; an empty row has start = end). A
            query is real iff its slot is. Query t sees key s iff both are real and, when causal,
            s ≤ slot(t). Serves unpadded rows and the KV cache.
  segments  packed rows, whole-sequence calls only (T = S, query_offset 0): `segment_ids[b, t]`
            (int, 0 = padding) puts several sequences end to end in one row. Query t sees key s
            iff both carry the same nonzero id and, when causal, s ≤ t. Each id's tokens must be
            contiguous in its row (as `vapo_jax.packing` lays them out).

  out[b, t] = Σ_s softmax_s(q_t·k_s / √H) v_s   over the visible s;   0 where nothing is visible.

In both forms the keys that query t sees are one interval of slots, [lo, hi) (`key_intervals`);
`chunked` works on those intervals only.

Implementations (`impl`):
  reference  the dense einsum with a `[B, T, S]` mask: the oracle of the tests.
  chunked    flash attention in pure JAX (Dao et al. 2022; FlashAttention-2, Dao 2023): an online
             softmax over key blocks per query block, float32 accumulation, and a custom VJP that
             stores only the output and the log-sum-exp and recomputes scores block by block.
             Loops over blocks have dynamic trip counts: a query block visits only the key
             blocks that its queries' intervals (over every row) reach, so blocks above the
             causal diagonal, outside every row's real range, or before the query block's first
             segment are never visited: packed rows cost ∝ Σ length², not row length². Runs
             everywhere.
  cudnn      `jax.nn.dot_product_attention(implementation="cudnn")`: GPU, bfloat16/float16; ranges
             only (jax 0.10.2's public API takes no segment ids, so packed rows run `chunked`).
  splash     the Pallas TPU splash attention with a causal mask and segment ids: TPU.
  auto       splash on TPU, cudnn on GPU in bfloat16/float16, chunked otherwise.

The kernels serve whole-sequence calls (training and scoring); calls with a KV cache (queries
offset from the keys) always run `chunked`. When a kernel rejects a call, `auto` falls back to
`chunked` with one warning naming the reason; an explicit choice that cannot run raises
`ConfigError`.
"""

import functools
import warnings
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from vapo_jax.errors import ConfigError  # Also `vapo_jax.config.ConfigError`.

Implementation = Literal["auto", "chunked", "cudnn", "splash", "reference"]
IMPLEMENTATIONS = ("auto", "chunked", "cudnn", "splash", "reference")
BLOCK_Q = 256  # Default query block of `chunked` (tokens).
BLOCK_K = 256  # Default key/value block of `chunked` (tokens).
_HALF = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_WARNED: set[str] = set()


def attend(q, k, v, *, key_start=None, key_end=None, segment_ids=None, query_offset=0, causal: bool = True,
           impl: Implementation = "auto", platform: str | None = None, **chunked_options) -> jax.Array:
  """Attention of q `[B, T, N, H]` over k, v `[B, S, K, H]` → `[B, T, N, H]` (see the module doc).

  Either key_start, key_end: `[B]` int, each row's real key slots [start, end); or segment_ids
  `[B, T]` int (packed rows, whole-sequence calls). query_offset: slot of query 0 (a Python 0 for a
  whole sequence; with a KV cache, its length). platform: where the kernel choice is made for
  (default: JAX's backend). chunked_options: `block_q`, `block_k`, `skip_masked_blocks` of `chunked`."""
  validity = _validity(key_start, key_end, segment_ids)
  kernel = select(impl, q.dtype, platform)
  whole = isinstance(query_offset, int) and query_offset == 0 and q.shape[1] == k.shape[1]
  if segment_ids is not None and not whole:
    raise ValueError(f"segment_ids serve whole-sequence calls (T = S, query_offset 0), got q {q.shape}, "
                     f"k {k.shape}, query_offset {query_offset}")
  if kernel == "reference":
    return reference(q, k, v, **validity, query_offset=query_offset, causal=causal)
  if kernel in ("cudnn", "splash") and whole:
    try:
      if kernel == "cudnn":
        return cudnn(q, k, v, **validity, causal=causal)
      return splash(q, k, v, **validity, causal=causal)
    except (ValueError, TypeError, NotImplementedError, RuntimeError) as error:
      reason = f"{kernel} rejected q {q.shape} {q.dtype}, k {k.shape}: {error}"
      if impl != "auto":
        raise ConfigError(f"model.attention={impl!r} cannot run here: {reason}; use 'auto' or 'chunked'") from error
      if reason not in _WARNED:
        _WARNED.add(reason)
        warnings.warn(f"attention: {reason}; falling back to 'chunked'", stacklevel=2)
  return chunked(q, k, v, **validity, query_offset=query_offset, causal=causal, **chunked_options)


def _validity(key_start, key_end, segment_ids) -> dict:
  """The keyword arguments of one validity form (module doc): ranges or segment ids, not both."""
  if segment_ids is None and (key_start is None or key_end is None):
    raise ValueError("attention needs key_start and key_end, or segment_ids")
  if segment_ids is not None and (key_start is not None or key_end is not None):
    raise ValueError("attention takes key_start/key_end or segment_ids, not both")
  return dict(segment_ids=segment_ids) if segment_ids is not None else dict(key_start=key_start, key_end=key_end)


def select(impl: str, dtype, platform: str | None = None) -> str:
  """The implementation `impl` resolves to on `platform` (default: JAX's) for compute `dtype`.

  Raises ConfigError when an explicit choice cannot run there."""
  platform = platform or jax.default_backend()
  half = jnp.dtype(dtype) in _HALF
  match impl:
    case "auto":
      return "splash" if platform == "tpu" else "cudnn" if platform in ("gpu", "cuda") and half else "chunked"
    case "cudnn" if platform not in ("gpu", "cuda"):
      raise ConfigError(f"model.attention='cudnn' needs an NVIDIA GPU, but JAX runs on {platform!r}; "
                        "use 'auto' or 'chunked'")
    case "cudnn" if not half:
      raise ConfigError(f"model.attention='cudnn' needs bfloat16 or float16 compute, got {jnp.dtype(dtype)}; "
                        "set model.dtype='bfloat16' or use 'auto'")
    case "splash" if platform != "tpu":
      raise ConfigError(f"model.attention='splash' needs a TPU, but JAX runs on {platform!r}; "
                        "use 'auto' or 'chunked'")
    case "chunked" | "reference" | "cudnn" | "splash":
      return impl
  raise ConfigError(f"model.attention must be one of {IMPLEMENTATIONS}, got {impl!r}")


def key_ranges(key_mask: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(key_start, key_end) `[B]` int32 from a `[B, S]` mask whose true slots are contiguous per row.

  Left-padded prompt + response + right padding is contiguous; an all-false row gives (0, 0)."""
  mask = key_mask.astype(bool)
  slots = mask.shape[-1]
  some = mask.any(-1)
  start = jnp.where(some, jnp.argmax(mask, -1), 0)
  end = jnp.where(some, slots - jnp.argmax(mask[:, ::-1], -1), 0)
  return start.astype(jnp.int32), end.astype(jnp.int32)


def visibility(key_start, key_end, *, queries: int, keys: int, query_offset=0, causal: bool = True):
  """The dense `[B, T, S]` mask of who sees whom (for the reference and tests only)."""
  q_slot = query_offset + jnp.arange(queries)
  k_slot = jnp.arange(keys)
  real = lambda slot: (slot[None] >= key_start[:, None]) & (slot[None] < key_end[:, None])
  visible = real(q_slot)[:, :, None] & real(k_slot)[:, None, :]
  return visible & (k_slot[None, :] <= q_slot[:, None])[None] if causal else visible


def segment_visibility(segment_ids, *, causal: bool = True):
  """The dense `[B, T, T]` mask of packed rows: same nonzero segment and, when causal, s ≤ t
  (for the reference and tests only)."""
  same = (segment_ids[:, :, None] == segment_ids[:, None, :]) & (segment_ids != 0)[:, :, None]
  t = segment_ids.shape[1]
  return same & jnp.tril(jnp.ones((t, t), bool))[None] if causal else same


def reference(q, k, v, *, key_start=None, key_end=None, segment_ids=None, query_offset=0,
              causal: bool = True) -> jax.Array:
  """Dense attention: float32 scores `[B, K, G, T, S]` under the mask of `visibility` (ranges) or
  `segment_visibility` (segment ids)."""
  b, t, n, h = q.shape
  dtype = q.dtype
  q = q.reshape(b, t, k.shape[2], n // k.shape[2], h)  # [B, T, K, G, H]
  scores = jnp.einsum("BTKGH,BSKH->BKGTS", q, k.astype(dtype)).astype(jnp.float32) * (h ** -0.5)
  if segment_ids is None:
    visible = visibility(key_start, key_end, queries=t, keys=k.shape[1], query_offset=query_offset, causal=causal)
  else:
    visible = segment_visibility(segment_ids, causal=causal)
  scores = jnp.where(visible[:, None, None], scores, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(scores, axis=-1).astype(dtype)
  out = jnp.einsum("BKGTS,BSKH->BTKGH", probs, v.astype(dtype)).reshape(b, t, n, h)
  return jnp.where(visible.any(-1)[:, :, None, None], out, 0).astype(dtype)


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


# ----------------------------------------------------------------------------- chunked (flash)

class _Plan(NamedTuple):
  """Static block layout of one `chunked` call."""

  skip: bool  # Visit only blocks that the queries' key intervals reach (False: every block, for benchmarks).
  bq: int  # Query block.
  bk: int  # Key block.
  nq: int
  nk: int
  queries: int  # T (the queries are padded to nq·bq).
  keys: int  # S (the last key block is shifted back to end at S, its repeated slots masked).
  scale: float


def _plan(queries: int, keys: int, head_dim: int, block_q: int, block_k: int, skip: bool) -> _Plan:
  bq, bk = min(block_q, queries), min(block_k, keys)
  return _Plan(skip, bq, bk, -(-queries // bq), -(-keys // bk), queries, keys, head_dim ** -0.5)


def chunked(q, k, v, *, key_start=None, key_end=None, segment_ids=None, query_offset=0, causal: bool = True,
            block_q: int = BLOCK_Q, block_k: int = BLOCK_K, skip_masked_blocks: bool = True) -> jax.Array:
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
  lo, hi = _padded_intervals(plan, **_validity(key_start, key_end, segment_ids), query_offset=query_offset,
                             causal=causal)
  out = _flash(plan, qh, kh, vh, lo, hi)
  return out[:, :, :, :t].transpose(0, 3, 1, 2, 4).reshape(b, t, n, h)


def _padded_intervals(plan: _Plan, **validity):
  """`key_intervals` with the padding queries [T, nq·bq) seeing nothing."""
  lo, hi = key_intervals(queries=plan.queries, keys=plan.keys, **validity)
  pad = ((0, 0), (0, plan.nq * plan.bq - plan.queries))
  return jnp.pad(lo, pad, constant_values=plan.keys), jnp.pad(hi, pad)


def _key_blocks(plan: _Plan, lo, hi):
  """`[nq]` each: the key blocks [first, end) that query block i visits (the union of its queries'
  intervals over every row; the loops share one trip count across the batch)."""
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


def visited_block_pairs(queries: int, keys: int, *, key_start=None, key_end=None, segment_ids=None, query_offset=0,
                        causal: bool = True, block_q: int = BLOCK_Q, block_k: int = BLOCK_K,
                        skip_masked_blocks: bool = True) -> tuple[jax.Array, jax.Array]:
  """(forward, backward): how many (query block, key block) pairs `chunked`'s loops visit for this
  validity, from the same trip counts the loops use: its cost model."""
  plan = _plan(queries, keys, 1, block_q, block_k, skip_masked_blocks)
  lo, hi = _padded_intervals(plan, **_validity(key_start, key_end, segment_ids), query_offset=query_offset,
                             causal=causal)
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
  out, lse = _forward(plan, q, k, v, lo, hi)
  return out, (q, k, v, lo, hi, out, lse)


def _flash_bwd(plan, residuals, d_out):
  """dS = P ∘ (dO·Vᵀ − rowsum(dO ∘ O)), recomputing P = exp(S − lse) one block pair at a time."""
  q, k, v, lo, hi, out, lse = residuals
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
      dvb = dvb + jnp.einsum("BKGTS,BKGTH->BKSH", p.astype(dob.dtype), dob, preferred_element_type=jnp.float32)
      dp = jnp.einsum("BKGTH,BKSH->BKGTS", dob, vb, preferred_element_type=jnp.float32)
      ds = p * (dp - delta_b[..., None]) * plan.scale
      dqb = jnp.einsum("BKGTS,BKSH->BKGTH", ds.astype(kb.dtype), kb, preferred_element_type=jnp.float32)
      dq = lax.dynamic_update_slice_in_dim(dq, lax.dynamic_slice_in_dim(dq, q0, plan.bq, axis=3) + dqb, q0, axis=3)
      dkb = dkb + jnp.einsum("BKGTS,BKGTH->BKSH", ds.astype(qb.dtype), qb, preferred_element_type=jnp.float32)
      return dq, dkb, dvb

    block = jnp.zeros(kb.shape, jnp.float32)
    dq, dkb, dvb = lax.fori_loop(*_query_blocks(plan, first, end, j), query_block, (dq, block, block))
    add = lambda acc, blk: lax.dynamic_update_slice_in_dim(
        acc, lax.dynamic_slice_in_dim(acc, k0, plan.bk, axis=2) + blk, k0, axis=2)
    return dq, add(dk, dkb), add(dv, dvb)

  zeros = lambda x: jnp.zeros(x.shape, jnp.float32)
  dq, dk, dv = lax.fori_loop(*_key_block_span(plan, first, end), key_block, (zeros(q), zeros(k), zeros(v)))
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


# ----------------------------------------------------------------------------- platform kernels

def _real(start, end, slots: int):
  """`[B, T]`: which slots hold a real token."""
  slot = jnp.arange(slots)[None]
  return (slot >= start[:, None]) & (slot < end[:, None])


def cudnn(q, k, v, *, key_start=None, key_end=None, segment_ids=None, causal: bool = True,
          implementation: str = "cudnn") -> jax.Array:
  """Whole-sequence attention (T = S) by `jax.nn.dot_product_attention`.

  cuDNN's masks know sequence lengths, not starts: each row is rotated so that its real tokens
  begin at slot 0 (a gather, O(T)), attended with lengths end − start, and rotated back.
  `implementation="xla"` runs the same path on any platform (tests). Segment ids are refused
  (NotImplementedError): jax 0.10.2's `jax.nn.dot_product_attention` has no packed-sequence input
  (cuDNN's packed layout, `q_offsets`, is reachable only through a private JAX module)."""
  if segment_ids is not None:
    raise NotImplementedError("jax.nn.dot_product_attention takes no segment ids (packed rows)")
  t = q.shape[1]
  forward = (jnp.arange(t)[None] + key_start[:, None]) % t  # [B, T]: slot read into slot i.
  backward = (jnp.arange(t)[None] - key_start[:, None]) % t
  gather = lambda x, index: jnp.take_along_axis(x, index[:, :, None, None], axis=1)
  lengths = jnp.maximum(key_end - key_start, 1).astype(jnp.int32)  # Empty rows: zeroed below.
  out = jax.nn.dot_product_attention(
      gather(q, forward), gather(k, forward), gather(v, forward), is_causal=causal,
      query_seq_lengths=lengths, key_value_seq_lengths=lengths, implementation=implementation)
  return jnp.where(_real(key_start, key_end, t)[:, :, None, None], gather(out, backward), 0).astype(q.dtype)


def splash(q, k, v, *, key_start=None, key_end=None, segment_ids=None, causal: bool = True, block: int = 512,
           interpret: bool = False) -> jax.Array:
  """Whole-sequence attention (T = S, a multiple of 128) by the Pallas TPU splash kernel.

  The kernel's segment ids are the packed rows' `segment_ids`, or with ranges 1 on real tokens and
  0 on padding: padding (0) never mixes with real tokens, and padding rows are zeroed.
  `interpret=True` runs the kernel in the Pallas interpreter (tests). One device only: a Mosaic
  kernel is not partitioned by XLA, so several devices are refused."""
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as kernels
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

  b, t, n, h = q.shape
  if t % 128:
    raise ValueError(f"splash needs a sequence length that is a multiple of 128, got {t}")
  if jax.device_count() > 1 and not interpret:
    raise ValueError(f"splash is a Mosaic kernel that XLA cannot partition over {jax.device_count()} devices "
                     "(it needs a shard_map over the batch, not wired here)")
  size = max(d for d in (block, 256, 128) if t % d == 0 and d <= t)
  head_mask = masks.CausalMask((t, t)) if causal else masks.FullMask((t, t))
  sizes = kernels.BlockSizes(block_q=size, block_kv=size, block_kv_compute=size, block_q_dkv=size,
                             block_kv_dkv=size, block_kv_dkv_compute=size, block_q_dq=size, block_kv_dq=size)
  kernel = kernels.make_splash_mha(masks.MultiHeadMask([head_mask] * n), block_sizes=sizes, head_shards=1,
                                   q_seq_shards=1, interpret=interpret)
  segments = (_real(key_start, key_end, t) if segment_ids is None else segment_ids).astype(jnp.int32)
  real = segments != 0
  heads_first = lambda x: x.transpose(0, 2, 1, 3)  # [B, N|K, T, H]
  out = jax.vmap(lambda q, k, v, ids: kernel(q, k, v, segment_ids=kernels.SegmentIds(ids, ids)))(
      heads_first(q * jnp.asarray(h ** -0.5, q.dtype)), heads_first(k), heads_first(v), segments)
  return jnp.where(real[:, :, None, None], heads_first(out), 0).astype(q.dtype)
