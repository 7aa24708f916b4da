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
            contiguous in its row (as `train/packing.py` lays them out).

  out[b, t] = Σ_s softmax_s(q_t·k_s / √H) v_s   over the visible s;   0 where nothing is visible.

In both forms the keys that query t sees are one interval of slots, [lo, hi) (`flash.key_intervals`);
`chunked` (`models/flash.py`) works on those intervals only.

Implementations (`impl`):
  reference  the dense einsum with a `[B, T, S]` mask: the oracle of the tests.
  chunked    flash attention in pure JAX (Dao et al. 2022; FlashAttention-2, Dao 2023): an online
             softmax over key blocks per query block, float32 accumulation, and a custom VJP that
             stores only the output and the log-sum-exp and recomputes scores block by block.
             Loops over blocks have dynamic trip counts, each row its own: a query block of a
             row visits only the key blocks that its own queries' intervals reach, so blocks
             above the causal diagonal, outside the row's real range, or before the query
             block's first segment are never visited: a packed row costs ∝ Σ length² of its
             segments, not row length². On a mesh it runs under `jax.shard_map`, each device on
             its rows. Runs everywhere.
  cudnn      `jax.nn.dot_product_attention(implementation="cudnn")`: GPU, bfloat16/float16; ranges
             only (jax 0.10.2's public API takes no segment ids, so packed rows run `chunked`).
  splash     the Pallas TPU splash attention with a causal mask and segment ids: TPU; on a mesh under
             `jax.shard_map` over the batch and head axes.
  pallas_gpu the Pallas GPU flash attention with segment ids (`pallas_gpu.packed_attention`, forward and
             backward): GPU, packed rows (and ranges, as segment ids 1 / 0); on a mesh under `jax.shard_map`
             as splash. Rows of a multiple of 16 tokens.
  auto       splash on TPU; on GPU in bfloat16/float16, cudnn for unpacked rows (ranges) and pallas_gpu for
             packed ones (segment ids); chunked otherwise.

The kernels serve whole-sequence calls (training and scoring); calls with a KV cache (queries
offset from the keys) always run `chunked`. When a kernel rejects a call, `auto` falls back to
`chunked` with one warning naming the reason; an explicit choice that cannot run raises
`ConfigError`.
"""

import contextlib
import contextvars
import functools
import math
import warnings

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from vapo_jax import kinds
from vapo_jax.errors import ConfigError
from vapo_jax.kinds import Attention
from vapo_jax.models import flash, pallas_gpu, sharding
from vapo_jax.models import splash as splash_kernel
from vapo_jax.models.flash import chunked

_HALF = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_WARNED: set[str] = set()
_TRACED: contextvars.ContextVar[set[str] | None] = contextvars.ContextVar("vapo_jax_attention_traced",
                                                                          default=None)


@contextlib.contextmanager
def recording():
  """Within this context, the yielded set collects the implementations attention is traced with
  ("chunked", "splash", ..., and "decode" for one-token calls on a KV cache): what a program compiled with."""
  token = _TRACED.set(found := set())
  try:
    yield found
  finally:
    _TRACED.reset(token)


def note(implementation: str) -> None:
  """Adds `implementation` to the enclosing `recording()`, if any."""
  if (found := _TRACED.get()) is not None:
    found.add(implementation)


def attend(q, k, v, *, key_start=None, key_end=None, segment_ids=None, query_offset=0, causal: bool = True,
           impl: Attention = "auto", platform: str | None = None, **chunked_options) -> jax.Array:
  """Attention of q `[B, T, N, H]` over k, v `[B, S, K, H]` → `[B, T, N, H]` (see the module doc).

  Either key_start, key_end: `[B]` int, each row's real key slots [start, end); or segment_ids
  `[B, T]` int (packed rows, whole-sequence calls). query_offset: slot of query 0 (a Python 0 for a
  whole sequence; with a KV cache, its length). platform: where the kernel choice is made for
  (default: JAX's backend). chunked_options: `block_q`, `block_k`, `skip_masked_blocks` of `chunked`."""
  given = flash.validity(key_start, key_end, segment_ids)
  kernel = select(impl, q.dtype, platform, packed=segment_ids is not None)
  whole = isinstance(query_offset, int) and query_offset == 0 and q.shape[1] == k.shape[1]
  if segment_ids is not None and not whole:
    raise ValueError(f"segment_ids serve whole-sequence calls (T = S, query_offset 0), got q {q.shape}, "
                     f"k {k.shape}, query_offset {query_offset}")
  if kernel == "reference":
    note("reference")
    return reference(q, k, v, **given, query_offset=query_offset, causal=causal)
  if kernel in KERNELS and whole:
    try:
      out = KERNELS[kernel](q, k, v, **given, causal=causal)
      note(kernel)
      return out
    except (ValueError, TypeError, NotImplementedError, RuntimeError) as error:  # The kernels' refusals.
      reason = f"{kernel} rejected q {q.shape} {q.dtype}, k {k.shape}: {error}"
      if impl != "auto":
        raise ConfigError(f"model.attention={impl!r} cannot run here: {reason}; use 'auto' or 'chunked'") from error
      if reason not in _WARNED:
        _WARNED.add(reason)
        warnings.warn(f"attention: {reason}; falling back to 'chunked'", stacklevel=2)
  note("chunked")
  return _chunked_by_device(q, k, v, given, query_offset=query_offset, causal=causal, **chunked_options)


def _chunked_by_device(q, k, v, given: dict, *, query_offset, causal: bool, **options) -> jax.Array:
  """`chunked`; on a mesh (`sharding.use_rules`) under `jax.shard_map`, each device on its own rows and,
  as splash (`_splash_specs`), its heads: `chunked` bounds each row's block loops by the row's own
  tokens, so a device loops over its rows only, not over the union of every device's."""
  found = sharding.context()
  if found is None or found[0].size == 1:
    return chunked(q, k, v, **given, query_offset=query_offset, causal=causal, **options)
  heads, rows = _splash_specs(*found, batch=q.shape[0], heads=q.shape[2], kv_heads=k.shape[2])
  specs = {name: rows if name == "segment_ids" else PartitionSpec(*rows[:1]) for name in given}
  static = isinstance(query_offset, int)
  local = lambda q, k, v, given, offset: chunked(q, k, v, **given,
                                                 query_offset=query_offset if static else offset,
                                                 causal=causal, **options)
  return jax.shard_map(local, mesh=found[0], in_specs=(heads, heads, heads, specs, PartitionSpec()),
                       out_specs=heads, check_vma=False)(q, k, v, given, jnp.asarray(query_offset))


def select(impl: str, dtype, platform: str | None = None, *, packed: bool = False) -> str:
  """The implementation `impl` resolves to on `platform` (default: the platform being traced for,
  `sharding.platform()`) for compute `dtype`, for packed rows (segment ids) or not.

  Raises ConfigError when an explicit choice cannot run there."""
  platform = platform or sharding.platform()
  half, gpu = jnp.dtype(dtype) in _HALF, platform in ("gpu", "cuda")
  match impl:
    case "auto":
      return "splash" if platform == "tpu" else ("pallas_gpu" if packed else "cudnn") if gpu and half else "chunked"
    case "cudnn" | "pallas_gpu" if not gpu:
      raise ConfigError(f"model.attention={impl!r} needs an NVIDIA GPU, but JAX runs on {platform!r}; "
                        "use 'auto' or 'chunked'")
    case "cudnn" if not half:
      raise ConfigError(f"model.attention='cudnn' needs bfloat16 or float16 compute, got {jnp.dtype(dtype)}; "
                        "set model.dtype='bfloat16' or use 'auto'")
    case "splash" if platform != "tpu":
      raise ConfigError(f"model.attention='splash' needs a TPU, but JAX runs on {platform!r}; "
                        "use 'auto' or 'chunked'")
    case "chunked" | "reference" | "cudnn" | "splash" | "pallas_gpu":
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
    visible = visibility(key_start, key_end, queries=t, keys=k.shape[1], query_offset=query_offset,
                         causal=causal)
  else:
    visible = segment_visibility(segment_ids, causal=causal)
  scores = jnp.where(visible[:, None, None], scores, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(scores, axis=-1).astype(dtype)
  out = jnp.einsum("BKGTS,BSKH->BTKGH", probs, v.astype(dtype)).reshape(b, t, n, h)
  return jnp.where(visible.any(-1)[:, :, None, None], out, 0).astype(dtype)


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
  (ValueError; `attend` then falls back to `chunked`): jax 0.10.2's `jax.nn.dot_product_attention`
  has no packed-sequence input (cuDNN's packed layout, `q_offsets`, is reachable only through a
  private JAX module)."""
  if segment_ids is not None:
    raise ValueError("cudnn attention takes no segment ids (packed rows): jax.nn.dot_product_attention has "
                     "no packed-sequence input")
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
  `interpret=True` runs the kernel in the Pallas interpreter (tests). A Mosaic kernel is not
  partitioned by XLA, so on a mesh (`sharding.use_rules`, as every program of a run is traced) it
  runs under `jax.shard_map`, each device on its rows (the "batch" axes) and, when the heads divide
  evenly (whole groups of query heads per kv head), its heads (the "act_heads" axes): no
  communication. Outside a mesh, several devices are refused."""
  b, t, n, h = q.shape
  if t % 128:
    raise ValueError(f"splash needs a sequence length that is a multiple of 128, got {t}")
  segments = (_real(key_start, key_end, t) if segment_ids is None else segment_ids).astype(jnp.int32)
  local = functools.partial(_splash_local, causal=causal, block=block, interpret=interpret)
  return _kernel_by_device(local, q, k, v, segments, name="splash, a Mosaic kernel,", interpret=interpret)


def pallas_gpu_attention(q, k, v, *, key_start=None, key_end=None, segment_ids=None, causal: bool = True):
  """Whole-sequence attention (T = S, a multiple of 16) by the Pallas GPU flash attention
  (`pallas_gpu.packed_attention`): packed rows' segment ids, or with ranges 1 on real tokens and 0 on padding;
  on a mesh under `jax.shard_map` as `splash`."""
  if reason := pallas_gpu.packed_rule(tokens=q.shape[1]):
    raise ValueError(f"pallas_gpu needs {reason}")
  segments = (_real(key_start, key_end, q.shape[1]) if segment_ids is None else segment_ids).astype(jnp.int32)
  local = functools.partial(pallas_gpu.packed_attention, causal=causal)
  return _kernel_by_device(local, q, k, v, segments, name="the Pallas GPU attention, a Triton kernel,",
                           interpret=pallas_gpu.interpreting())


KERNELS = {"cudnn": cudnn, "splash": splash, "pallas_gpu": pallas_gpu_attention}


def _kernel_by_device(local, q, k, v, segments, *, name: str, interpret: bool) -> jax.Array:
  """`local(q, k, v, segments)`, a kernel that XLA does not partition: on a mesh (`sharding.use_rules`, as
  every program of a run is traced) under `jax.shard_map` over `_splash_specs`; outside a mesh, several
  devices are refused."""
  found = sharding.context()
  if found is None or found[0].size == 1:
    if jax.device_count() > 1 and not interpret and found is None:
      raise ValueError(f"{name} cannot be partitioned by XLA over {jax.device_count()} devices; it runs "
                       "under shard_map on a mesh (sharding.use_rules / sharding.jit)")
    return local(q, k, v, segments)
  heads, rows = _splash_specs(*found, batch=q.shape[0], heads=q.shape[2], kv_heads=k.shape[2])
  return jax.shard_map(local, mesh=found[0], in_specs=(heads, heads, heads, rows), out_specs=heads,
                       check_vma=False)(q, k, v, segments)


def _splash_specs(mesh, rules, *, batch: int, heads: int,
                  kv_heads: int) -> tuple[PartitionSpec, PartitionSpec]:
  """(q / k / v / output spec `[B, T, N|K, H]`, segment ids spec `[B, T]`) of splash's shard_map: rows
  over the rules' batch axes, heads over their "act_heads" axes when both N and K divide evenly."""
  rows = sharding.partition_spec(("batch",), rules, mesh.shape, (batch,))
  row_axes = rows[0] if len(rows) else None
  used = set((row_axes,) if isinstance(row_axes, str) else row_axes or ())
  axes = rules.get("act_heads")
  axes = tuple(a for a in ((axes,) if isinstance(axes, str) else axes or ()) if a not in used)
  size = math.prod(mesh.shape[a] for a in axes)
  head_axes = (axes[0] if len(axes) == 1 else axes) if axes and not heads % size and not kv_heads % size else None
  return PartitionSpec(row_axes, None, head_axes, None), PartitionSpec(row_axes, None)


def _splash_local(q, k, v, segments, *, causal: bool, block: int, interpret: bool) -> jax.Array:
  """The splash kernel on one device's q `[B, T, N, H]`, k, v `[B, T, K, H]`, segment ids `[B, T]` (`splash.attend`:
  only the blocks whose queries and keys share a segment)."""
  h = q.shape[-1]
  heads_first = lambda x: x.transpose(0, 2, 1, 3)  # [B, N|K, T, H]
  out = splash_kernel.attend(heads_first(q * jnp.asarray(h ** -0.5, q.dtype)), heads_first(k), heads_first(v),
                             splash_kernel.kernel_segments(segments), causal=causal, block=block,
                             interpret=interpret)
  return jnp.where((segments != 0)[:, :, None, None], heads_first(out), 0).astype(q.dtype)
