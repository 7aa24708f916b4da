"""The Pallas TPU splash kernel on one device's rows, visiting only the blocks whose queries and keys share a
segment (`attention.splash` runs it, under `shard_map` on a mesh).

Splash's mask is static: causal over the whole row. On a packed row it would compute every causal block of the
row, about T²/2 scores, whatever the row's segments; here each row's block masks (the forward's and the backward's
two) are narrowed at run time from its segment ids. A (query block, key block) pair runs only when some
query and some key of the two blocks share a segment, and every skipped entry's prefetch index points at the next
block that runs, so a skipped block is neither computed nor fetched. A packed row then costs about the sum over its
segments of length² (`visited_blocks` counts the pairs; the roofline prices them). Padding (segment 0) is a segment
of its own (`PADDING`) for the kernel, visited only in the blocks on the diagonal (each padding query sees itself),
and `attention.splash` zeroes its outputs.

The forward names its residuals, the output and the log-sum-exp (`remat.ATTENTION_CONTEXT`), so that a remat
policy that keeps them (`minimal`) does not run the forward kernel again in the backward pass. The backward runs as
splash's two kernels: dq (3 products a block: scores, dp, dq) and dk/dv (4: scores, dp, dv, dk), 3.5 times the
forward's 2 (`BACKWARD_PRODUCTS`). Splash's fused backward (5) writes a bfloat16 dq for every key block, `[T / block]`
copies of q summed afterwards: at 22,528 tokens and 512-token blocks 44 copies, whose bytes cost about what the
fusion saves, and a bfloat16 sum.

Block layout (`jax.experimental.pallas.ops.tpu.splash_attention`): a mask info's `block_mask[h, i, j]` is query
block i against key block j (0: skip, 1: partial, 2: full); the forward and dq kernels iterate j within i, the dk/dv
kernel i within j, and `data_next` holds, at each entry, the block that the next running entry along that
order reads.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from vapo_jax.models import remat

BLOCK = 512  # The kernel's default block (tokens).
PADDING = 2**30  # The kernel's segment id of padding (segment 0): above any packed row's own.
FORWARD_PRODUCTS, BACKWARD_PRODUCTS = 2, 7  # Matmuls of [block, head_dim] x [head_dim, block] per visited block.


def kernel_segments(segments: jax.Array) -> jax.Array:
  """The kernel's segment ids `[..., T]`: `segments`, with padding (0) as a segment of its own (`PADDING`)."""
  return jnp.where(segments == 0, PADDING, segments).astype(jnp.int32)


def _spans(ids, block: int):
  """(lowest, highest) real segment id `[n]` of each `block` of the kernel's `ids` `[T]` (numpy or jax); a block
  of padding alone spans nothing (lowest `PADDING`, highest −1)."""
  xp = jnp if isinstance(ids, jax.Array) else np
  blocks = ids.reshape(-1, block)
  return blocks.min(axis=1), xp.where(blocks == PADDING, -1, blocks).max(axis=1)


def shared_blocks(ids, block_q: int, block_k: int, *, causal: bool):
  """`[nq, nk]` bool: the pairs of query block i and key block j that the kernel computes, given the kernel's
  segment ids `ids` `[T]`: those holding a query and a key of one real segment (under `causal`, the key block
  starting no later than the query block ends), and the blocks over the same tokens (where padding sees itself:
  padding's outputs are zeroed and see nothing real). Segments need not be contiguous runs of increasing ids
  for this to keep every pair that attends (it compares id ranges); packed rows' are, so it keeps little more."""
  xp = jnp if isinstance(ids, jax.Array) else np
  q_lo, q_hi = _spans(ids, block_q)
  k_lo, k_hi = _spans(ids, block_k)
  shared = (q_lo[:, None] <= k_hi[None, :]) & (k_lo[None, :] <= q_hi[:, None])
  q_start, k_start = xp.arange(q_lo.shape[0])[:, None] * block_q, xp.arange(k_lo.shape[0])[None, :] * block_k
  if causal:
    shared = shared & (k_start < q_start + block_q)
  return shared | ((k_start < q_start + block_q) & (q_start < k_start + block_k))


def visited_blocks(segments: np.ndarray, block: int, *, causal: bool = True) -> int:
  """How many (query block, key block) pairs the kernel computes per head on rows `[B, T]` of segment ids
  (0: padding), blocks of `block` tokens: `shared_blocks` summed over the rows."""
  segments = np.asarray(segments)
  ids = np.where(segments == 0, PADDING, segments)
  return int(sum(shared_blocks(row, block, block, causal=causal).sum() for row in ids))


def _narrow(info, shared: jax.Array, *, keys_inner: bool):
  """`info` (a splash `MaskInfo` over the whole grid) with its blocks outside `shared` `[nq, nk]` skipped and its
  prefetch indices following the blocks that still run; `keys_inner`: the forward's order (key blocks within a
  query block), else the key and value pass's (query blocks within a key block)."""
  static = info.block_mask
  if static is None or static.shape[0] != 1 or static.shape[1:] != shared.shape:
    raise ValueError(f"splash's mask info is not one head's whole grid {tuple(shared.shape)}: "
                     f"{None if static is None else static.shape}")
  block_mask = jnp.where(shared[None], jnp.asarray(static, jnp.int32), 0)
  ordered = block_mask[0] if keys_inner else block_mask[0].T  # [outer, inner] in the kernel's order.
  inner = ordered.shape[1]
  position = jnp.arange(ordered.size, dtype=jnp.int32)
  runs = ordered.reshape(-1) > 0
  following = lax.cummin(jnp.where(runs, position, ordered.size), axis=0, reverse=True)
  last = jnp.max(jnp.where(runs, position, 0))  # Past the last block that runs: stay on it (no new fetch).
  data_next = (jnp.where(following < ordered.size, following, last) % inner).reshape(ordered.shape)
  data_next = data_next if keys_inner else data_next.T
  return info._replace(block_mask=block_mask.astype(static.dtype),
                       data_next=data_next[None].astype(info.data_next.dtype))


def block_size(tokens: int, block: int = BLOCK) -> int:
  """The kernel's block (query and key) on rows of `tokens`: the largest of `block`, 512, 256 and 128 that is at
  most `block` and divides `tokens` (128 where none does: splash needs rows of a multiple of 128)."""
  return max((d for d in (block, 512, 256, 128) if d <= min(block, tokens) and tokens % d == 0), default=128)


def attend(q, k, v, segments, *, causal: bool, block: int, interpret: bool) -> jax.Array:
  """Splash on one device's q `[B, N, T, H]` (scaled), k, v `[B, K, T, H]`, the kernel's segment ids `[B, T]`
  (`kernel_segments`): `[B, N, T, H]`. Rows run one after another, each with its own block masks."""
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as kernels
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

  n, t = q.shape[1], q.shape[2]
  size = block_size(t, block)
  head_mask = masks.CausalMask((t, t)) if causal else masks.FullMask((t, t))
  sizes = kernels.BlockSizes(block_q=size, block_kv=size, block_kv_compute=size, block_q_dkv=size,
                             block_kv_dkv=size, block_kv_dkv_compute=size, block_q_dq=size, block_kv_dq=size)
  kernel = kernels.make_splash_mha(masks.MultiHeadMask([head_mask] * n), block_sizes=sizes, head_shards=1,
                                   q_seq_shards=1, residual_checkpoint_name=remat.ATTENTION_CONTEXT,
                                   interpret=interpret)

  def row(args):
    q, k, v, ids = args
    shared = shared_blocks(ids, size, size, causal=causal)
    narrowed = kernels.SplashAttentionKernel(_narrow(kernel.fwd_mask_info, shared, keys_inner=True),
                                             _narrow(kernel.dq_mask_info, shared, keys_inner=True),
                                             _narrow(kernel.dkv_mask_info, shared, keys_inner=False),
                                             **kernel.kwargs)
    return narrowed(q, k, v, segment_ids=kernels.SegmentIds(ids, ids))
  return lax.map(row, (q, k, v, segments))
