"""The Pallas GPU kernels JAX ships, in this package's layouts: paged decode and packed-row attention.

  paged_decode   `jax.experimental.pallas.ops.gpu.paged_attention` (split-K flash decoding over a block
                 table): the paged pool `[K, L, Q, Pq, Tg, H]` flattened to the kernel's `[K, L·Q·Pq, Tg, H]`
                 pages (a reshape, no copy) and each row's page ids offset to its layer and queue, as the
                 TPU kernel takes them (`paged_attention._kernel_local`). Each row reads its own pages up to
                 its own length: the page axis is cut into `k_splits` partitions, a partition past the row's
                 length is skipped, and the partitions' softmaxes are combined at the end.
  packed_attention  `jax.experimental.pallas.ops.gpu.attention.mha` (FlashAttention-2 forward, and its
                 backward by a custom VJP) with segment ids: packed rows `[B, T, N, H]`, several sequences end
                 to end per row, padding id 0 zeroed. The kernel takes as many kv heads as query heads, so
                 grouped kv heads are repeated (their gradients summed back by the repeat's VJP). It visits
                 every key block below the causal diagonal, whatever the segments (`flash.chunked` visits
                 only each segment's own).

Shape rules (`paged_rule`, `packed_rule`: None where the kernel takes the shape, else the reason): Triton's
tiles are powers of two of at least 16 on each side of a matmul.

`interpret()`: inside it both kernels run in the Pallas interpreter (any platform; the tests run the shipped
code paths on a CPU with it, as `pltpu.force_tpu_interpret_mode` runs the TPU kernels).
"""

import contextlib
import contextvars

import jax
import jax.numpy as jnp

_INTERPRET: contextvars.ContextVar[bool] = contextvars.ContextVar("vapo_jax_pallas_gpu_interpret",
                                                                  default=False)
MAX_K_SPLITS = 16  # The kernel's default split of the page axis.


@contextlib.contextmanager
def interpret():
  """Within this context the kernels are traced for the Pallas interpreter (module doc)."""
  token = _INTERPRET.set(True)
  try:
    yield
  finally:
    _INTERPRET.reset(token)


def interpreting() -> bool:
  """Whether the kernels are being traced inside `interpret()`."""
  return _INTERPRET.get()


def _power_of_two(n: int) -> bool:
  return n > 0 and not n & (n - 1)


def paged_rule(*, head_dim: int, page_tokens: int) -> str | None:
  """Why the GPU paged kernel cannot take pages of `page_tokens` tokens and heads of `head_dim` (None: it can)."""
  if not (_power_of_two(head_dim) and head_dim >= 16):
    return f"a head dim that is a power of two of at least 16 (here {head_dim})"
  if not (_power_of_two(page_tokens) and page_tokens >= 16):
    return f"pages of a power of two of at least 16 tokens (here {page_tokens})"
  return None


def k_splits(width: int, block_pages: int) -> int:
  """The most partitions (≤ `MAX_K_SPLITS`) of a row's `width` table entries that each hold whole blocks of
  `block_pages` pages (the kernel asks both divisions to be exact; `width` is a multiple of `block_pages`)."""
  return max(d for d in range(1, min(MAX_K_SPLITS, width) + 1) if not width % (d * block_pages))


def paged_decode(q, keys, values, table, lengths, layer, *, block_pages: int) -> jax.Array:
  """One device's rows: q `[r, N, H]`, pool keys and values `[k, L, q, Pq, Tg, H]`, table `[r, W]`, lengths
  `[r]` (the tokens each row's query sees), layer a scalar → `[r, N, H]` in q's dtype; 0 where a length is
  0."""
  from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention

  kv_heads, layers, queues, pages, tg, h = keys.shape
  rows, width = table.shape
  if width % block_pages:
    raise ValueError(f"the page table's width {width} is not a multiple of block_pages={block_pages}")
  flat = lambda pool: pool.reshape(kv_heads, layers * queues * pages, tg,
                                   h)  # (layer, queue, page) → one axis.
  queue = jnp.arange(rows, dtype=jnp.int32) // (rows // queues)
  ids = (layer * queues + queue[:, None]) * pages + jnp.minimum(table, pages - 1)
  scaled = (q * jnp.asarray(h ** -0.5,
                            q.dtype)).astype(keys.dtype)  # Unscaled logits; one dtype in its matmuls.
  out = paged_attention(scaled, flat(keys), flat(values), ids.astype(jnp.int32), lengths.astype(jnp.int32),
                        pages_per_compute_block=block_pages, k_splits=k_splits(width, block_pages),
                        interpret=interpreting())
  return out.astype(q.dtype)


def packed_rule(*, tokens: int) -> str | None:
  """Why `packed_attention` cannot take rows of `tokens` tokens (None: it can)."""
  if tokens % 16:
    return f"rows of a multiple of 16 tokens (here {tokens})"
  return None


def packed_attention(q, k, v, segment_ids, *, causal: bool = True, block: int = 64) -> jax.Array:
  """q `[B, T, N, H]`, k and v `[B, T, K, H]`, segment_ids `[B, T]` (0: padding) → `[B, T, N, H]`: each query
  sees the keys of its own segment (and, when causal, at or before it); padding rows are 0."""
  from jax.experimental.pallas.ops.gpu import attention as gpu_attention

  b, t, n, h = q.shape
  if reason := packed_rule(tokens=t):
    raise ValueError(f"the Pallas GPU attention needs {reason}")
  size = max(s for s in (block, 64, 32, 16) if s <= block and not t % s)
  sizes = gpu_attention.BlockSizes(block_q=size, block_k=size, block_q_dkv=size, block_kv_dkv=size,
                                   block_q_dq=size, block_kv_dq=size)
  groups = n // k.shape[2]
  spread = lambda x: jnp.repeat(x, groups, axis=2) if groups > 1 else x  # [B, T, N, H]
  ids = segment_ids.astype(jnp.int32)
  out = gpu_attention.mha(q, spread(k).astype(q.dtype), spread(v).astype(q.dtype), ids, sm_scale=h ** -0.5,
                          causal=causal, block_sizes=sizes, interpret=interpreting())
  return jnp.where((ids != 0)[:, :, None, None], out, 0).astype(q.dtype)
