"""Attention: one entry point, `attend`, over a pure-JAX flash attention and the platform kernels.

Shapes: queries `[B, T, N, H]`, keys and values `[B, S, K, H]`, `N = K·G` (G query heads share a kv
head: grouped-query attention, never repeating K/V). Query t sits at key slot `query_offset + t`:
0 for a whole sequence, the cache length when T new tokens are appended to a KV cache.

Validity is a range per row, not a dense mask: key slot s of row b holds a real token iff
`key_start[b] ≤ s < key_end[b]` (left padding moves `key_start`, right padding `key_end`; an empty
row has start = end). A query is real iff its slot is. Query t sees key s iff both are real and,
when causal, s ≤ slot(t):

  out[b, t] = Σ_s softmax_s(q_t·k_s / √H) v_s   over the visible s;   0 where nothing is visible.

Implementations (`impl`):
  reference  the dense einsum with a `[B, T, S]` mask: the oracle of the tests.
  chunked    flash attention in pure JAX (Dao et al. 2022; FlashAttention-2, Dao 2023): an online
             softmax over key blocks per query block, float32 accumulation, and a custom VJP that
             stores only the output and the log-sum-exp and recomputes scores block by block.
             Loops over blocks have dynamic trip counts, so blocks above the causal diagonal, or
             outside every row's real range, are never visited. Runs everywhere.
  cudnn      `jax.nn.dot_product_attention(implementation="cudnn")`: GPU, bfloat16/float16.
  splash     the Pallas TPU splash attention with a causal mask and segment ids: TPU.
  auto       splash on TPU, cudnn on GPU in bfloat16/float16, chunked otherwise.

The kernels serve whole-sequence calls (training and scoring); calls with a KV cache (queries
offset from the keys) always run `chunked`. When a kernel rejects a call, `auto` falls back to
`chunked` with one warning naming the reason; an explicit choice that cannot run raises
`ConfigError`.
"""

import functools
import warnings
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from vapo_jax import kinds
from vapo_jax.errors import ConfigError
from vapo_jax.kinds import Attention

BLOCK_Q = 256  # Default query block of `chunked` (tokens).
BLOCK_K = 256  # Default key/value block of `chunked` (tokens).
_HALF = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_WARNED: set[str] = set()


def attend(q, k, v, *, key_start, key_end, query_offset=0, causal: bool = True,
           impl: Attention = "auto", platform: str | None = None, **chunked_options) -> jax.Array:
  """Attention of q `[B, T, N, H]` over k, v `[B, S, K, H]` → `[B, T, N, H]` (see the module doc).

  key_start, key_end: `[B]` int, each row's real key slots [start, end). query_offset: slot of
  query 0 (a Python 0 for a whole sequence; with a KV cache, its length). platform: where the
  kernel choice is made for (default: JAX's backend). chunked_options: `block_q`, `block_k`,
  `skip_masked_blocks` of `chunked`."""
  ranges = dict(key_start=key_start, key_end=key_end)
  kernel = select(impl, q.dtype, platform)
  whole = isinstance(query_offset, int) and query_offset == 0 and q.shape[1] == k.shape[1]
  if kernel == "reference":
    return reference(q, k, v, **ranges, query_offset=query_offset, causal=causal)
  if kernel in ("cudnn", "splash") and whole:
    try:
      if kernel == "cudnn":
        return cudnn(q, k, v, **ranges, causal=causal)
      return splash(q, k, v, **ranges, causal=causal)
    except (ValueError, TypeError, NotImplementedError, RuntimeError) as error:
      reason = f"{kernel} rejected q {q.shape} {q.dtype}, k {k.shape}: {error}"
      if impl != "auto":
        raise ConfigError(f"model.attention={impl!r} cannot run here: {reason}; use 'auto' or 'chunked'") from error
      if reason not in _WARNED:
        _WARNED.add(reason)
        warnings.warn(f"attention: {reason}; falling back to 'chunked'", stacklevel=2)
  return chunked(q, k, v, **ranges, query_offset=query_offset, causal=causal, **chunked_options)


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
  raise ConfigError(f"model.attention must be one of {kinds.names(Attention)}, got {impl!r}")


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


def reference(q, k, v, *, key_start, key_end, query_offset=0, causal: bool = True) -> jax.Array:
  """Dense attention: float32 scores `[B, K, G, T, S]` under the mask of `visibility`."""
  b, t, n, h = q.shape
  dtype = q.dtype
  q = q.reshape(b, t, k.shape[2], n // k.shape[2], h)  # [B, T, K, G, H]
  scores = jnp.einsum("BTKGH,BSKH->BKGTS", q, k.astype(dtype)).astype(jnp.float32) * (h ** -0.5)
  visible = visibility(key_start, key_end, queries=t, keys=k.shape[1], query_offset=query_offset,
                       causal=causal)
  scores = jnp.where(visible[:, None, None], scores, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(scores, axis=-1).astype(dtype)
  out = jnp.einsum("BKGTS,BSKH->BTKGH", probs, v.astype(dtype)).reshape(b, t, n, h)
  return jnp.where(visible.any(-1)[:, :, None, None], out, 0).astype(dtype)


# ----------------------------------------------------------------------------- chunked (flash)

class _Plan(NamedTuple):
  """Static block layout of one `chunked` call."""

  causal: bool
  skip: bool  # Visit only blocks that hold a visible pair (False: every block, for benchmarks).
  bq: int  # Query block.
  bk: int  # Key block.
  nq: int
  nk: int
  queries: int  # T (the queries are padded to nq·bq).
  keys: int  # S (the last key block is shifted back to end at S, its repeated slots masked).
  scale: float


def chunked(q, k, v, *, key_start, key_end, query_offset=0, causal: bool = True,
            block_q: int = BLOCK_Q, block_k: int = BLOCK_K, skip_masked_blocks: bool = True) -> jax.Array:
  """Flash attention in pure JAX (see the module doc): memory O(T·H), not O(T·S).

  Forward+backward needs about seven float32 copies of q (7 · 4·B·T·N·H bytes: padded and
  transposed q and dO, out, dq, dk, dv) besides its inputs, and per block pair a few float32
  `[B, N, block_q, block_k]` tiles (benchmarks/long_seq_bench.py measures it)."""
  b, t, n, h = q.shape
  s, kv_heads = k.shape[1], k.shape[2]
  bq, bk = min(block_q, t), min(block_k, s)
  plan = _Plan(causal, skip_masked_blocks, bq, bk, -(-t // bq), -(-s // bk), t, s, h ** -0.5)
  qh = q.reshape(b, t, kv_heads, n // kv_heads, h).transpose(0, 2, 3, 1, 4)  # [B, K, G, T, H]
  qh = jnp.pad(qh, ((0, 0), (0, 0), (0, 0), (0, plan.nq * bq - t), (0, 0)))
  kh, vh = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B, K, S, H]
  offset = jnp.asarray(query_offset, jnp.int32)
  out = _flash(plan, qh, kh, vh, key_start.astype(jnp.int32), key_end.astype(jnp.int32), offset)
  return out[:, :, :, :t].transpose(0, 3, 1, 2, 4).reshape(b, t, n, h)


def _span(start, end, keys):
  """The slots [lo, hi) that hold a real token in some row (lo ≥ hi: none)."""
  some = end > start
  return jnp.min(jnp.where(some, start, keys)), jnp.max(jnp.where(some, end, 0))


def _key_block(plan: _Plan, j):
  """Nominal first slot of key block j, and where it is read from (the last block ends at S)."""
  nominal = j * plan.bk
  return nominal, jnp.minimum(nominal, plan.keys - plan.bk)


def _visible(plan: _Plan, start, end, offset, q0, k_nominal, k0):
  """`[B, 1, 1, bq, bk]`: query block at local row q0 against the key block read from slot k0."""
  q_local = q0 + jnp.arange(plan.bq)
  q_slot = offset + q_local
  k_slot = k0 + jnp.arange(plan.bk)
  real_q = (q_local < plan.queries)[None] & (q_slot[None] >= start[:, None]) & (q_slot[None] < end[:, None])
  real_k = (k_slot >= k_nominal)[None] & (k_slot[None] >= start[:, None]) & (k_slot[None] < end[:, None])
  visible = real_q[:, :, None] & real_k[:, None, :]
  if plan.causal:
    visible = visible & (k_slot[None, :] <= q_slot[:, None])[None]
  return visible[:, None, None]


def _key_blocks(plan: _Plan, start, end, offset, q0):
  """Key blocks [lo, hi) that query block q0 must visit."""
  if not plan.skip:
    return 0, plan.nk
  lo_slot, real_end = _span(start, end, plan.keys)
  q_first, q_end = offset + q0, offset + jnp.minimum(q0 + plan.bq, plan.queries)
  hi_slot = jnp.minimum(real_end, q_end) if plan.causal else real_end
  empty = (q_end <= lo_slot) | (q_first >= real_end) | (hi_slot <= lo_slot)
  lo = lo_slot // plan.bk
  return lo, jnp.where(empty, lo, -(-hi_slot // plan.bk))


def _query_blocks(plan: _Plan, start, end, offset, k_nominal):
  """Query blocks [lo, hi) that see some key of the block starting at slot k_nominal."""
  if not plan.skip:
    return 0, plan.nq
  lo_slot, hi_slot = _span(start, end, plan.keys)
  if plan.causal:
    lo_slot = jnp.maximum(lo_slot, k_nominal)
  lo = jnp.clip(lo_slot - offset, 0, plan.queries) // plan.bq
  hi = -(-jnp.clip(hi_slot - offset, 0, plan.queries) // plan.bq)
  return lo, jnp.maximum(lo, hi)


def _scores(plan: _Plan, qb, kb):
  return jnp.einsum("BKGTH,BKSH->BKGTS", qb, kb, preferred_element_type=jnp.float32) * plan.scale


def _forward(plan: _Plan, q, k, v, start, end, offset):
  b, kv_heads, g, _, h = q.shape

  def query_block(_, i):
    q0 = i * plan.bq
    qb = lax.dynamic_slice_in_dim(q, q0, plan.bq, axis=3)

    def key_block(j, carry):
      m, l, acc = carry
      nominal, k0 = _key_block(plan, j)
      kb = lax.dynamic_slice_in_dim(k, k0, plan.bk, axis=2)
      vb = lax.dynamic_slice_in_dim(v, k0, plan.bk, axis=2)
      s = jnp.where(_visible(plan, start, end, offset, q0, nominal, k0), _scores(plan, qb, kb), -jnp.inf)
      m_new = jnp.maximum(m, s.max(-1))
      m_ref = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # Rows with nothing visible yet stay at 0.
      p = jnp.exp(s - m_ref[..., None])
      alpha = jnp.exp(m - m_ref)
      pv = jnp.einsum("BKGTS,BKSH->BKGTH", p.astype(v.dtype), vb, preferred_element_type=jnp.float32)
      return m_new, alpha * l + p.sum(-1), alpha[..., None] * acc + pv

    rows = (b, kv_heads, g, plan.bq)
    init = (jnp.full(rows, -jnp.inf), jnp.zeros(rows), jnp.zeros(rows + (h,)))
    m, l, acc = lax.fori_loop(*_key_blocks(plan, start, end, offset, q0), key_block, init)
    seen = l > 0
    safe_l = jnp.where(seen, l, 1.0)
    out = jnp.where(seen[..., None], acc / safe_l[..., None], 0.0).astype(q.dtype)
    return None, (out, jnp.where(seen, m + jnp.log(safe_l), 0.0))

  _, (out, lse) = lax.scan(query_block, None, jnp.arange(plan.nq))
  padded = plan.nq * plan.bq  # [nq, B, K, G, bq, ...] -> [B, K, G, nq·bq, ...]
  return (jnp.moveaxis(out, 0, 3).reshape(b, kv_heads, g, padded, h),
          jnp.moveaxis(lse, 0, 3).reshape(b, kv_heads, g, padded))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(plan, q, k, v, start, end, offset):
  return _forward(plan, q, k, v, start, end, offset)[0]


def _flash_fwd(plan, q, k, v, start, end, offset):
  out, lse = _forward(plan, q, k, v, start, end, offset)
  return out, (q, k, v, start, end, offset, out, lse)


def _flash_bwd(plan, residuals, d_out):
  """dS = P ∘ (dO·Vᵀ − rowsum(dO ∘ O)), recomputing P = exp(S − lse) one block pair at a time."""
  q, k, v, start, end, offset, out, lse = residuals
  delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), -1)  # [B, K, G, T]

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
      visible = _visible(plan, start, end, offset, q0, nominal, k0)
      p = jnp.where(visible, jnp.exp(_scores(plan, qb, kb) - lse_b[..., None]), 0.0)
      dvb = dvb + jnp.einsum("BKGTS,BKGTH->BKSH", p.astype(dob.dtype), dob, preferred_element_type=jnp.float32)
      dp = jnp.einsum("BKGTH,BKSH->BKGTS", dob, vb, preferred_element_type=jnp.float32)
      ds = p * (dp - delta_b[..., None]) * plan.scale
      dqb = jnp.einsum("BKGTS,BKSH->BKGTH", ds.astype(kb.dtype), kb, preferred_element_type=jnp.float32)
      dq = lax.dynamic_update_slice_in_dim(dq, lax.dynamic_slice_in_dim(dq, q0, plan.bq, axis=3) + dqb, q0, axis=3)
      dkb = dkb + jnp.einsum("BKGTS,BKGTH->BKSH", ds.astype(qb.dtype), qb, preferred_element_type=jnp.float32)
      return dq, dkb, dvb

    block = jnp.zeros(kb.shape, jnp.float32)
    dq, dkb, dvb = lax.fori_loop(*_query_blocks(plan, start, end, offset, nominal), query_block,
                                 (dq, block, block))
    add = lambda acc, blk: lax.dynamic_update_slice_in_dim(
        acc, lax.dynamic_slice_in_dim(acc, k0, plan.bk, axis=2) + blk, k0, axis=2)
    return dq, add(dk, dkb), add(dv, dvb)

  if plan.skip:
    lo_slot, hi_slot = _span(start, end, plan.keys)
    if plan.causal:
      hi_slot = jnp.minimum(hi_slot, offset + plan.queries)
    lo, hi = lo_slot // plan.bk, -(-hi_slot // plan.bk)
    bounds = (lo, jnp.maximum(lo, hi))
  else:
    bounds = (0, plan.nk)
  zeros = lambda x: jnp.zeros(x.shape, jnp.float32)
  dq, dk, dv = lax.fori_loop(*bounds, key_block, (zeros(q), zeros(k), zeros(v)))
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


# ----------------------------------------------------------------------------- platform kernels

def _real(start, end, slots: int):
  """`[B, T]`: which slots hold a real token."""
  slot = jnp.arange(slots)[None]
  return (slot >= start[:, None]) & (slot < end[:, None])


def cudnn(q, k, v, *, key_start, key_end, causal: bool = True, implementation: str = "cudnn") -> jax.Array:
  """Whole-sequence attention (T = S) by `jax.nn.dot_product_attention`.

  cuDNN's masks know sequence lengths, not starts: each row is rotated so that its real tokens
  begin at slot 0 (a gather, O(T)), attended with lengths end − start, and rotated back.
  `implementation="xla"` runs the same path on any platform (tests)."""
  t = q.shape[1]
  forward = (jnp.arange(t)[None] + key_start[:, None]) % t  # [B, T]: slot read into slot i.
  backward = (jnp.arange(t)[None] - key_start[:, None]) % t
  gather = lambda x, index: jnp.take_along_axis(x, index[:, :, None, None], axis=1)
  lengths = jnp.maximum(key_end - key_start, 1).astype(jnp.int32)  # Empty rows: zeroed below.
  out = jax.nn.dot_product_attention(
      gather(q, forward), gather(k, forward), gather(v, forward), is_causal=causal,
      query_seq_lengths=lengths, key_value_seq_lengths=lengths, implementation=implementation)
  return jnp.where(_real(key_start, key_end, t)[:, :, None, None], gather(out, backward), 0).astype(q.dtype)


def splash(q, k, v, *, key_start, key_end, causal: bool = True, block: int = 512,
           interpret: bool = False) -> jax.Array:
  """Whole-sequence attention (T = S, a multiple of 128) by the Pallas TPU splash kernel.

  Real tokens are segment 1 and padding segment 0, so padding never mixes with real tokens;
  padding rows are zeroed. `interpret=True` runs the kernel in the Pallas interpreter (tests).
  One device only: a Mosaic kernel is not partitioned by XLA, so several devices are refused."""
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
  real = _real(key_start, key_end, t)
  heads_first = lambda x: x.transpose(0, 2, 1, 3)  # [B, N|K, T, H]
  segments = real.astype(jnp.int32)
  out = jax.vmap(lambda q, k, v, ids: kernel(q, k, v, segment_ids=kernels.SegmentIds(ids, ids)))(
      heads_first(q * jnp.asarray(h ** -0.5, q.dtype)), heads_first(k), heads_first(v), segments)
  return jnp.where(real[:, :, None, None], heads_first(out), 0).astype(q.dtype)
