"""Log-probabilities and entropy of tokens from hidden states, without `[B, T, V]` logits.

Training needs from the policy's logits z_t = h_t·W (`[V]` per token) two numbers per token:

  log π(o_t) = z_t[o_t] − logsumexp(z_t)
  H_t        = logsumexp(z_t) − Σ_v softmax(z_t)_v · z_t,v      (the entropy, optional)

`token_logprobs_entropy` computes them from hidden states `[B, T, D]` and the output kernel with
at most B·`chunk`·V float32 logits alive at a time (matmuls accumulated in float32,
`preferred_element_type`). The logits are tiled along the vocabulary: V/Vb blocks of Vb =
⌈V·chunk/T⌉ columns, each `[B, T, Vb]`, reduced by an online logsumexp (running max m,
Σ e^(z−m), Σ e^(z−m)·z and the chosen token's logit). The gradient is a custom VJP that
recomputes each block's logits (remat: only logsumexp and H per token are kept between the
passes) and applies

  ∂ log π(o_t)/∂z_t,v = 1[v = o_t] − p_t,v          ∂H_t/∂z_t,v = −p_t,v · (log p_t,v + H_t)

then ∂h += ∂z·W_bᵀ (float32) and ∂W_b = hᵀ·∂z, which is complete once its block is done: summed
over every row and position at once, a float32 output of the loop over blocks laid out like the
parameter (so under FSDP each block is reduce-scattered once, as the dense gradient is), the
blocks put side by side after it and cast to the kernel's dtype. The cotangents are cast to the
compute dtype before the two matmuls, as autodiff of the dense path does. Cost: one extra logits matmul (the recompute).

Why vocabulary blocks and not sequence chunks of `[B, chunk, V]`: a sequence chunk contributes to
every column of ∂W, so each chunk re-reads the whole kernel and adds a full `[D, V]` partial
gradient (under FSDP, one more reduction of it per chunk). Measured on the 2-core CPU at T = 512,
V = 151,936, D = 896: sequence chunks of 128 took 1.4× the CPU time of the dense path, vocabulary
blocks of the same memory 1.0× (`benchmarks/logprob_bench.py` has the T = 2,048 figures).

`dense_token_logprobs_entropy` is the same quantity through full `[B, T, V]` logits and plain
autodiff: the oracle the tests compare against. `response_logprobs` is the model-level entry
point of scoring, the actor loss and SFT (see its docstring for the layout).
"""

import functools

import jax
import jax.numpy as jnp

from vapo_jax.models.sharding import constrain
from vapo_jax.models.transformer import positions_from_mask

_F32 = jnp.float32


def blocks(vocab: int, tokens: int, chunk: int) -> int:
  """Vocabulary block size Vb: B·T·Vb logits hold no more than B·chunk·V (at least one column)."""
  return min(vocab, max(1, -(-vocab * min(chunk, tokens) // tokens)))


def _block(kernel, start, size: int, transposed: bool):
  """Columns [start, start + size) of the kernel's vocabulary axis."""
  return jax.lax.dynamic_slice_in_dim(kernel, start, size, axis=0 if transposed else 1)


def _block_logits(hidden, kernel, j, size: int, transposed: bool):
  """Block j's logits `[B, T, Vb]` (float32), its vocabulary ids `[Vb]` and which of them are its own.

  Blocks start at j·Vb; the last one is shifted back to end at V and masks the columns it shares
  with the block before it, so every vocabulary entry belongs to exactly one block."""
  vocab = kernel.shape[0 if transposed else 1]
  start = jnp.minimum(j * size, vocab - size)
  ids = start + jnp.arange(size)
  spec = "BTD,VD->BTV" if transposed else "BTD,DV->BTV"
  logits = jnp.einsum(spec, hidden, _block(kernel, start, size, transposed), preferred_element_type=_F32)
  # Split over the devices that split the vocabulary (tensor parallelism): each computes its share of the
  # block's columns from the gathered kernel, and the reductions over them (max, sums) cross those devices.
  logits = constrain(logits, ("batch", "seq", "act_vocab"))
  return logits, ids, ids >= j * size, start


def _compute_kernel(kernel, hidden) -> jax.Array:
  """The kernel in the compute dtype, gathered whole on every device before the loop over its blocks
  (FSDP gathers it for the dense projection too; a vocabulary split by tensor parallelism is gathered
  as well, since slicing a sharded axis inside the loop would gather it once per block; each block's logits
  are then split over those devices again, `_block_logits`)."""
  return constrain(kernel.astype(hidden.dtype), (None, None))


def _whole_sequence(hidden) -> jax.Array:
  """`hidden` with its sequence whole on every device, gathered once before the loop over vocabulary blocks: a
  residual stream split along the sequence (sequence parallelism, `sharding.PRESETS`) would otherwise be
  gathered, and its gradient reduced, at every block."""
  return constrain(hidden, ("batch", "seq", "embed"))


def _forward(hidden, kernel, tokens, chunk: int, entropy: bool, transposed: bool):
  """(log π, H, logsumexp), each `[B, T]` float32 (H is zeros without `entropy`): an online
  logsumexp over vocabulary blocks (running max m, Σ e^(z−m), Σ e^(z−m)·z and the token's logit)."""
  hidden = _whole_sequence(hidden)
  compute = _compute_kernel(kernel, hidden)
  vocab = kernel.shape[0 if transposed else 1]
  size = blocks(vocab, hidden.shape[1], chunk)
  tokens = tokens.astype(jnp.int32)[..., None]

  def body(carry, j):
    top, total, weighted, picked = carry
    z, ids, own, _ = _block_logits(hidden, compute, j, size, transposed)
    z = jnp.where(own, z, -jnp.inf)
    new_top = jnp.maximum(top, jnp.max(z, axis=-1))
    rescale = jnp.exp(top - new_top)
    e = jnp.exp(z - new_top[..., None])
    total = total * rescale + jnp.sum(e, axis=-1)
    if entropy:
      weighted = weighted * rescale + jnp.sum(jnp.where(own, e * z, 0.0), axis=-1)
    picked = picked + jnp.sum(jnp.where(own & (ids == tokens), z, 0.0), axis=-1)
    return (new_top, total, weighted, picked), None

  zeros = jnp.zeros(hidden.shape[:2], _F32)
  init = (jnp.full(hidden.shape[:2], -jnp.inf, _F32), zeros, zeros, zeros)
  (top, total, weighted, picked), _ = jax.lax.scan(body, init, jnp.arange(-(-vocab // size)))
  lse = top + jnp.log(total)
  return picked - lse, (lse - weighted / total if entropy else zeros), lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _chunked(hidden, kernel, tokens, chunk, entropy, transposed):
  logprobs, ent, _ = _forward(hidden, kernel, tokens, chunk, entropy, transposed)
  return logprobs, ent


def _chunked_fwd(hidden, kernel, tokens, chunk, entropy, transposed):
  logprobs, ent, lse = _forward(hidden, kernel, tokens, chunk, entropy, transposed)
  return (logprobs, ent), (hidden, kernel, tokens, lse, ent)


def _chunked_bwd(chunk, entropy, transposed, residuals, cotangents):
  """Recomputes each block's logits; ∂z = 1[v = o]·ḡ_lp − p·(ḡ_lp + ḡ_H·(log p + H)); ∂h += ∂z·W_bᵀ,
  and the block's columns of ∂W = hᵀ·∂z are complete after it (summed over every row and position)."""
  hidden, kernel, tokens, lse, ent = residuals
  g_lp, g_ent = (g.astype(_F32)[..., None] for g in cotangents)
  lse, ent, tokens = lse[..., None], ent[..., None], tokens.astype(jnp.int32)[..., None]
  hidden = _whole_sequence(hidden)
  compute = _compute_kernel(kernel, hidden)
  vocab = kernel.shape[0 if transposed else 1]
  size = blocks(vocab, hidden.shape[1], chunk)

  def body(g_hidden, j):
    z, ids, own, start = _block_logits(hidden, compute, j, size, transposed)
    logp = z - lse
    p = jnp.exp(logp)
    coef = g_lp + g_ent * (logp + ent) if entropy else g_lp
    g_z = jnp.where(own, jnp.where(ids == tokens, g_lp, 0.0) - p * coef, 0.0).astype(hidden.dtype)
    w = _block(compute, start, size, transposed)
    g_hidden += jnp.einsum("BTV,VD->BTD" if transposed else "BTV,DV->BTD", g_z, w,
                           preferred_element_type=_F32)
    g_w = jnp.einsum("BTD,BTV->DV", hidden, g_z, preferred_element_type=_F32)  # [D, Vb] either way.
    # Laid out like the parameter along its width (fsdp), so each block's columns are reduce-scattered once,
    # and split along the vocabulary as the block's logits are (tensor parallelism).
    return g_hidden, constrain(g_w, ("embed", "act_vocab"))

  # Each block's columns are the scan's output, not an update of a `[D, V]` carry: the TPU compiler copied the
  # whole carried gradient (and zeroed one as large) at every block.
  g_hidden, g_blocks = jax.lax.scan(body, jnp.zeros(hidden.shape, _F32), jnp.arange(-(-vocab // size)))
  g_hidden = _whole_sequence(g_hidden)  # Summed over the blocks, then reduced once (not once a block).
  g_kernel = _assemble(g_blocks, vocab, size)
  return g_hidden.astype(hidden.dtype), (g_kernel.T if transposed else g_kernel).astype(kernel.dtype), None


def _assemble(g_blocks, vocab: int, size: int) -> jax.Array:
  """The kernel's gradient `[D, V]` from each block's `[n, D, Vb]`: block j's columns at j·Vb, and of the last
  block (shifted back to end at V) its own columns, those past the block before it."""
  n, d, _ = g_blocks.shape
  head = g_blocks[:n - 1].transpose(1, 0, 2).reshape(d, (n - 1) * size)
  full = jnp.concatenate([head, g_blocks[n - 1][:, (n - 1) * size - (vocab - size):]], axis=1)
  return constrain(full, ("embed", "vocab"))


_chunked.defvjp(_chunked_fwd, _chunked_bwd)


def token_logprobs_entropy(hidden: jax.Array, kernel: jax.Array, tokens: jax.Array, *, chunk: int,
                           entropy: bool = False,
                           transposed: bool = False) -> tuple[jax.Array, jax.Array | None]:
  """log π(tokens) and (with `entropy`) H per position, from hidden states, with at most
  B·`chunk`·V logits in memory at a time (see the module docstring).

  `hidden` `[B, T, D]`; `tokens` `[B, T]`, the token each position's logits score; `kernel` the
  output projection `[D, V]`, or with `transposed` a tied embedding `[V, D]` (any dtype: cast to
  `hidden`'s). Differentiable with respect to `hidden` and `kernel`; `tokens` are constants.
  Returns float32 `[B, T]` arrays; the entropy is None unless requested (then it is not computed).
  """
  if chunk < 1:
    raise ValueError(f"chunk must be >= 1, got {chunk}")
  logprobs, ent = _chunked(hidden, kernel, tokens, chunk, entropy, transposed)
  return logprobs, (ent if entropy else None)


def dense_token_logprobs_entropy(hidden, kernel, tokens, *, entropy: bool = False, transposed: bool = False):
  """The oracle: the same as `token_logprobs_entropy` through full `[B, T, V]` logits and autodiff."""
  spec = "BTD,VD->BTV" if transposed else "BTD,DV->BTV"
  logits = jnp.einsum(spec, hidden, kernel.astype(hidden.dtype), preferred_element_type=_F32)
  logits = constrain(logits, ("batch", "seq", "act_vocab"))
  logp = jax.nn.log_softmax(logits, axis=-1)
  logprobs = jnp.take_along_axis(logp, tokens[..., None].astype(jnp.int32), axis=-1)[..., 0]
  return logprobs, (-jnp.sum(jnp.exp(logp) * logp, axis=-1) if entropy else None)


def response_logprobs(model, tokens: jax.Array, attention_mask: jax.Array, response_len: int, *, chunk: int,
                      entropy: bool = False) -> tuple[jax.Array, jax.Array | None]:
  """log π(o_t) (and H_t) `[B, Tr]` of each row's response under the causal LM `model`.

  Layout as in `train/updates.py`: `tokens` `[B, S]` is a left-padded prompt followed by `Tr =
  response_len` response tokens; the hidden state at position S − Tr − 1 + t predicts response
  token t = tokens[:, S − Tr + t]. Only those Tr hidden states go through the output projection,
  with at most B·`chunk`·V logits at a time. Replaces `response_logits` + `token_logprobs` +
  `losses.reference_entropy_from_logits` without the `[B, Tr, V]` logits.
  """
  hidden, _ = model.hidden_states(tokens, positions_from_mask(attention_mask), attention_mask)
  prompt_len = tokens.shape[1] - response_len
  kernel, transposed = model.output_projection()
  return token_logprobs_entropy(hidden[:, prompt_len - 1:prompt_len - 1 + response_len], kernel,
                                tokens[:, prompt_len:], chunk=chunk, entropy=entropy, transposed=transposed)


def packed_token_logprobs(model, tokens: jax.Array, segment_ids: jax.Array, positions: jax.Array, *,
                          chunk: int, entropy: bool = False) -> tuple[jax.Array, jax.Array | None]:
  """log π (and H) `[R, L]` at every column of packed rows (`train.packing`): the log-probability of the
  next token of the column's own segment, from the column's hidden state (0's log-probability where
  the segment ends: callers mask it). The projection runs over all R·L columns (prompts included)."""
  hidden, _ = model.hidden_states(tokens, positions, None, segment_ids=segment_ids)
  same = segment_ids[:, 1:] == segment_ids[:, :-1]
  targets = jnp.pad(jnp.where(same, tokens[:, 1:], 0), ((0, 0), (0, 1)))
  kernel, transposed = model.output_projection()
  return token_logprobs_entropy(hidden, kernel, targets, chunk=chunk, entropy=entropy, transposed=transposed)
