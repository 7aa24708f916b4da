"""Decoder-only transformer (Qwen2 / Qwen2.5 / Llama) in Flax NNX: causal LM and value model.

Weights are named by role as in Hugging Face (`q_proj`, `gate_proj`, ...) so the checkpoint
mapping is a table. Kernels are stored in einsum-friendly shapes, e.g. q_proj `[D, N, H]`. A decoder layer's
seven kernels may instead hold an `Int8Kernel` (int8 values, a scale per output channel: the rollout's copy with
`rollout.weight_dtype="int8"`, models/int8_weights.py); the matmuls take either.

Decoder layers are stacked: every layer parameter carries a leading layer axis `[L, ...]` (logical
name `LAYER_AXIS`, which no sharding preset maps, so FSDP never splits it), built once by `nnx.vmap`.
The forward pass is a `lax.scan` over the stacked parameters (`scan_layers`, the default): every
program holds one layer, whatever the depth, so compile time and the loop's temporaries do not grow
with L; `remat` (a policy of models/remat.py) rematerialises each layer inside the scan. With
`scan_layers=False` a Python loop runs over the same stacked parameters (one copy of the layer per
depth): the equality oracle.

The KV cache (`models/kv_cache.py`: contiguous `KVCache` or paged `PagedKVCache`, one interface) is
carried whole through the layer scan: layer l writes its new tokens in place (`cache.write`) and a
one-token call reads only its own part (`cache.attend_one`), so no layer's cache is copied per step.

Inputs: token ids `[B, T]`, `positions` `[B, T]` (from `positions_from_mask` for left-padded
prompts) and `attention_mask` `[B, T]` (true on real tokens). Packed rows (several sequences end to
end, `train/packing.py`) pass `segment_ids` `[B, T]` (1, 2, ... per sequence, 0 on padding) instead
of the attention mask, with positions restarting at 0 per sequence: each token attends only within
its own sequence, for whole-sequence calls without a cache. With a `KVCache`, the new tokens'
keys and values are written at slots [cache.length, cache.length + T) and queries attend to every
valid earlier slot: prefill is a call with the prompt, decoding a call with one token. A cache may
instead hold one length per row (`[B]`, one-token calls only): row b then writes at its own slot,
which lets a rollout put a new sequence into a row whose sequence has ended (slot refill). A
`PagedKVCache` takes one token per row and call (decode), or a chunk of tokens per row (a prefill chunk,
each row reading its own pages: `PagedKVCache.attend_chunk`), its rows' tokens in pages (the refill engine's).
"""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from vapo_jax import kinds
from vapo_jax.models import collective_matmul, glu, int8_weights
from vapo_jax.models import remat as remat_lib
from vapo_jax.models.attention import attend, key_ranges, select
from vapo_jax.models.config import TransformerConfig
from vapo_jax.models.kv_cache import LAYER_AXIS, KVCache, PagedKVCache
from vapo_jax.models.sharding import constrain

Cache = KVCache | PagedKVCache

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def positions_from_mask(attention_mask: jax.Array) -> jax.Array:
  """Position ids for a left-padded batch: 0 at each row's first real token."""
  return jnp.maximum(jnp.cumsum(attention_mask.astype(jnp.int32), axis=-1) - 1, 0)


def _param(rngs: nnx.Rngs, shape, axes, cfg_dtype, scale=0.02, init="normal"):
  if init == "normal":
    value = scale * jax.random.normal(rngs.params(), shape, _DTYPES[cfg_dtype])
  elif init == "zeros":
    value = jnp.zeros(shape, _DTYPES[cfg_dtype])
  else:
    value = jnp.ones(shape, _DTYPES[cfg_dtype])
  return nnx.Param(value, logical_axes=axes)


_RESIDUAL = ("batch", "act_seq", "embed")  # The residual stream's logical axes (`sharding.PRESETS`).


class RMSNorm(nnx.Module):
  def __init__(self, dim: int, eps: float, *, param_dtype: str, rngs: nnx.Rngs):
    self.weight = _param(rngs, (dim,), ("norm",), param_dtype, init="ones")
    self.eps = eps

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32**2, axis=-1, keepdims=True) + self.eps)
    return self.weight[...].astype(x.dtype) * normed.astype(x.dtype)


def _rotate(x: jax.Array, cos: jax.Array, sin: jax.Array, *, by_matmul: bool = False) -> jax.Array:
  """Rotary embedding, half-split convention: x·cos + rotate_half(x)·sin, `x` `[B, T, *, H]`. by_matmul:
  rotate_half(x) as x times a signed permutation `[H, H]` (exact: each output one input, negated or not), which the
  TPU compiler prices at about half the slices and concatenation's cycles (docs/pod.md). Calls without a cache
  (training, scoring) take it; the rollout's keep the slices, so its log-probs stay bitwise as they were (on CPU
  the sum that follows fuses differently and rounds a few by one unit in the last place)."""
  half = x.shape[-1] // 2
  if by_matmul:
    turn = np.zeros((2 * half, 2 * half), np.float32)
    turn[half:, :half], turn[:half, half:] = -np.eye(half), np.eye(half)
    # Per head: a batched product, which `remat`'s policies do not keep (they keep q and k before it).
    turn = jnp.broadcast_to(jnp.asarray(turn, x.dtype), (x.shape[-2], *turn.shape))
    rotated = jnp.einsum("btnh,nhg->btng", x, turn, precision=jax.lax.Precision.HIGHEST)
  else:
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
  return x * cos[:, :, None, :] + rotated * sin[:, :, None, :]


class Attention(nnx.Module):
  def __init__(self, cfg: TransformerConfig, *, param_dtype: str, attention: kinds.Attention = "auto",
               rngs: nnx.Rngs):
    d, n, k, h = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    self.q_proj = _param(rngs, (d, n, h), ("embed", "heads", "head_dim"), param_dtype)
    self.k_proj = _param(rngs, (d, k, h), ("embed", "kv_heads", "head_dim"), param_dtype)
    self.v_proj = _param(rngs, (d, k, h), ("embed", "kv_heads", "head_dim"), param_dtype)
    self.o_proj = _param(rngs, (n, h, d), ("heads", "head_dim", "embed"), param_dtype)
    if cfg.qkv_bias:
      self.q_bias = _param(rngs, (n, h), ("heads", "head_dim"), param_dtype, init="zeros")
      self.k_bias = _param(rngs, (k, h), ("kv_heads", "head_dim"), param_dtype, init="zeros")
      self.v_bias = _param(rngs, (k, h), ("kv_heads", "head_dim"), param_dtype, init="zeros")
    self.qkv_bias = cfg.qkv_bias
    self.groups = n // k
    self.attention = attention  # models/attention.py implementation.

  def __call__(self, x, cos, sin, key_mask, query_slots, layer_cache, segment_ids=None, steps=None):
    """x `[B, T, D]`; key_mask `[B, S]` (None with a paged cache); query_slots `[T]` (`[B, 1]` with per-row
    cache lengths); layer_cache (the cache, this layer's index) or None; segment_ids `[B, T]` (packed rows, no
    cache: replaces key_mask) or None. Returns the output and the cache with this layer's new tokens written
    (without a cache: this call's (k, v), which the backbone drops). steps: the tensor axis x is split along the
    sequence over, gathered and reduced in steps around the matmuls (`collective_matmul.active`; no cache), or
    None: x whole along the sequence."""
    dtype = x.dtype
    triples = (("BTD,DNH->BTNH", self.q_proj.get_value(), ("embed", "heads", "head_dim")),
               ("BTD,DKH->BTKH", self.k_proj.get_value(), ("embed", "kv_heads", "head_dim")),
               ("BTD,DKH->BTKH", self.v_proj.get_value(), ("embed", "kv_heads", "head_dim")))
    if steps is not None:  # x split along the sequence: gathered in steps around the products.
      q, k, v = collective_matmul.gather_matmul(x, *triples, axis=steps)
    else:
      q, k, v = (int8_weights.einsum(spec, x, kernel) for spec, kernel, _ in triples)
    if self.qkv_bias:
      q, k, v = (t + b[...].astype(dtype) for t, b in ((q, self.q_bias), (k, self.k_bias), (v, self.v_bias)))
    q, k, v = (remat_lib.named(t, n) for t,
               n in ((q, remat_lib.QUERY), (k, remat_lib.KEY), (v, remat_lib.VALUE)))
    by_matmul = layer_cache is None
    q = constrain(_rotate(q, cos, sin, by_matmul=by_matmul), ("batch", "seq", "act_heads", None))
    k = _rotate(k, cos, sin, by_matmul=by_matmul)
    keys, values = new_cache = k, v  # Without a cache, (k, v) is returned as is (the backbone drops it).
    if layer_cache is not None:
      cache, layer = layer_cache
      new_cache = cache.write(layer, k, v)
      if x.shape[1] == 1:  # One-token decode: read only the filled part of this layer's cache.
        out = new_cache.attend_one(q[:, 0], layer, key_mask, query_slots)[:, None]
        return int8_weights.einsum("BTNH,NHD->BTD", out, self.o_proj.get_value()), new_cache
      if isinstance(new_cache, PagedKVCache):  # A prefill chunk into pages: each row reads its own pages.
        out = new_cache.attend_chunk(q, layer)
        return int8_weights.einsum("BTNH,NHD->BTD", out, self.o_proj.get_value()), new_cache
      keys, values = new_cache.layer_keys_values(layer)  # Several tokens (a prefill): `attend` reads [B, S, K, H].
    if segment_ids is not None:
      validity = dict(segment_ids=segment_ids)
    else:  # Each row's real tokens are contiguous (left-padded prompt, response, right padding): ranges.
      key_start, key_end = key_ranges(key_mask)
      validity = dict(key_start=key_start, key_end=key_end)
    offset = 0 if layer_cache is None else layer_cache[0].length  # Queries sit at [offset, offset + T).
    out = attend(q, keys.astype(dtype), values.astype(dtype), **validity, query_offset=offset, causal=True,
                 impl=self.attention)
    if steps is not None:
      out = collective_matmul.matmul_scatter(out, "BTNH,NHD->BTD", self.o_proj.get_value(),
                                             ("heads", "head_dim", "embed"), axis=steps)
    else:
      out = int8_weights.einsum("BTNH,NHD->BTD", out, self.o_proj.get_value())
    return remat_lib.named(out, remat_lib.OUT), new_cache


class MLP(nnx.Module):
  def __init__(self, cfg: TransformerConfig, *, param_dtype: str, rngs: nnx.Rngs):
    d, f = cfg.hidden_size, cfg.intermediate_size
    self.gate_proj = _param(rngs, (d, f), ("embed", "mlp"), param_dtype)
    self.up_proj = _param(rngs, (d, f), ("embed", "mlp"), param_dtype)
    self.down_proj = _param(rngs, (f, d), ("mlp", "embed"), param_dtype)
    if cfg.mlp_bias:
      self.gate_bias = _param(rngs, (f,), ("mlp",), param_dtype, init="zeros")
      self.up_bias = _param(rngs, (f,), ("mlp",), param_dtype, init="zeros")
      self.down_bias = _param(rngs, (d,), ("embed",), param_dtype, init="zeros")
    self.mlp_bias = cfg.mlp_bias

  def __call__(self, x, steps=None):
    """x `[B, T, D]`; steps: as `Attention`'s (x split along the sequence over that axis)."""
    dtype = x.dtype
    triples = (("BTD,DF->BTF", self.gate_proj.get_value(), ("embed", "mlp")),
               ("BTD,DF->BTF", self.up_proj.get_value(), ("embed", "mlp")))
    down = ("BTF,FD->BTD", self.down_proj.get_value(), ("mlp", "embed"))
    if steps is not None and not self.mlp_bias:  # Chunk by chunk, the middle never whole.
      return collective_matmul.gather_map_scatter(x, triples, glu.gated_silu, down, axis=steps)
    if steps is not None:
      raise ValueError("an MLP with biases takes its input whole along the sequence (steps=None)")
    gate, up = (int8_weights.einsum(spec, x, kernel) for spec, kernel, _ in triples)
    if self.mlp_bias:
      gate, up = gate + self.gate_bias[...].astype(dtype), up + self.up_bias[...].astype(dtype)
    hidden = constrain(glu.gated_silu(gate, up), ("batch", "seq", "act_mlp"))
    out = int8_weights.einsum(down[0], hidden, down[1])
    return out + self.down_bias[...].astype(dtype) if self.mlp_bias else out


class DecoderLayer(nnx.Module):
  def __init__(self, cfg: TransformerConfig, *, param_dtype: str, attention: kinds.Attention = "auto",
               rngs: nnx.Rngs):
    self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=param_dtype, rngs=rngs)
    self.self_attn = Attention(cfg, param_dtype=param_dtype, attention=attention, rngs=rngs)
    self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=param_dtype,
                                            rngs=rngs)
    self.mlp = MLP(cfg, param_dtype=param_dtype, rngs=rngs)

  def __call__(self, x, cos, sin, key_mask, query_slots, layer_cache, segment_ids=None):
    # The residual stream is split along the sequence where the rules map "act_seq" (sequence parallelism): each
    # block's normed input is gathered for its matmuls (named: a remat policy may keep it), its output reduced
    # over the tensor group into that split; under collective matmuls (`steps`), both in steps around the
    # matmuls' chunks, the input named as split.
    attn, mlp = self.self_attn, self.mlp
    steps = None
    if layer_cache is None and collective_matmul.active(x.shape[1]):  # Then every kernel is an array.
      steps = collective_matmul.active(x.shape[1], *(v.get_value().shape[1] for v in (
          attn.q_proj, attn.k_proj, mlp.gate_proj)))
    mlp_steps = None if mlp.mlp_bias else steps  # The steps add no gate or up bias: such an MLP gathers whole.
    block_input = lambda h, name, split: remat_lib.named(
        constrain(h, _RESIDUAL if split is not None else ("batch", "seq", "embed")), name)
    attended, new_cache = attn(block_input(self.input_layernorm(x), remat_lib.ATTENTION_IN, steps), cos, sin,
                               key_mask, query_slots, layer_cache, segment_ids, steps=steps)
    x = x + constrain(attended, _RESIDUAL)
    mlp_input = block_input(self.post_attention_layernorm(x), remat_lib.MLP_IN, mlp_steps)
    x = x + constrain(mlp(mlp_input, steps=mlp_steps), _RESIDUAL)
    return constrain(x, _RESIDUAL), new_cache


def stacked_layers(cfg: TransformerConfig, *, param_dtype: str, attention: kinds.Attention,
                   rngs: nnx.Rngs) -> DecoderLayer:
  """L decoder layers as one module whose parameters are stacked `[L, ...]` (`nnx.vmap` over split
  keys: one layer's initialisation traced, whatever the depth), each parameter's `logical_axes`
  prefixed with `LAYER_AXIS` (vmap does not add it: without it FSDP would split the layer axis)."""

  @nnx.split_rngs(splits=cfg.num_layers)
  @nnx.vmap(in_axes=(0,), out_axes=0)
  def make(layer_rngs):
    return DecoderLayer(cfg, param_dtype=param_dtype, attention=attention, rngs=layer_rngs)

  layers = make(rngs)
  for _, variable in nnx.iter_graph(layers):
    if isinstance(variable, nnx.Param):
      variable.set_metadata(logical_axes=(LAYER_AXIS,) + tuple(variable.get_metadata()["logical_axes"]))
  return layers


class Backbone(nnx.Module):
  """Embedding, decoder layers (stacked, scanned: module doc) and final norm: `[B, T]` ids to `[B, T, D]`."""

  def __init__(self, cfg: TransformerConfig, *, dtype: str = "float32", param_dtype: str = "float32",
               remat: kinds.Remat | bool = "none", attention: kinds.Attention = "auto",
               scan_layers: bool = True,
               scan_unroll: int = 1, rngs: nnx.Rngs):
    select(attention, _DTYPES[dtype])  # An implementation that cannot run here fails now, not at compile.
    self.cfg = cfg
    self.embed_tokens = _param(rngs, (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), param_dtype)
    self.layers = stacked_layers(cfg, param_dtype=param_dtype, attention=attention, rngs=rngs)
    self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=param_dtype, rngs=rngs)
    self.dtype = _DTYPES[dtype]
    self.remat = remat_lib.policy_name(remat)  # models/remat.py; a bool is the older form (true: "full").
    self.scan_layers = scan_layers  # False: a Python loop over the stacked layers (the oracle).
    self.scan_unroll = scan_unroll  # Layers per scan iteration (`lax.scan`'s unroll).

  def __call__(self, tokens, positions, attention_mask, cache: Cache | None = None, *, segment_ids=None):
    """Hidden states `[B, T, D]` and the updated cache (None without one). segment_ids: packed rows
    (module doc), with attention_mask None and no cache."""
    if segment_ids is not None and (attention_mask is not None or cache is not None):
      raise ValueError("packed rows (segment_ids) take no attention_mask (pass None) and no KV cache")
    x = constrain(self.embed_tokens[...].astype(self.dtype)[tokens], _RESIDUAL)
    inv_freq = jnp.asarray(self.cfg.inv_frequencies())  # A trace-time constant, not a parameter.
    angles = positions[..., None].astype(jnp.float32) * inv_freq  # [B, T, H/2]
    angles = jnp.concatenate([angles, angles], axis=-1)
    cos, sin = jnp.cos(angles).astype(self.dtype), jnp.sin(angles).astype(self.dtype)
    attention_mask = segment_ids != 0 if segment_ids is not None else attention_mask.astype(bool)
    steps = tokens.shape[1]
    if cache is None:
      key_mask, query_slots = attention_mask, jnp.arange(steps)
    else:
      cache, key_mask, query_slots = cache.prepare(attention_mask, steps)
    graphdef, stacked = nnx.split(self.layers)

    def layer_step(x, cache, params, index):
      """One decoder layer: its parameters `params` (one slice of the stack), the cache or None."""
      layer_cache = None if cache is None else (cache, index)
      x, new_cache = nnx.merge(graphdef, params)(x, cos, sin, key_mask, query_slots, layer_cache, segment_ids)
      return x, None if cache is None else new_cache

    # Without a backward pass (a cache: prefill and decode) rematerialisation only costs time.
    if cache is None:
      layer_step = remat_lib.wrap(layer_step, self.remat, prevent_cse=not self.scan_layers)
    if self.scan_layers:
      def body(carry, xs):  # Returns no parameters: the scan's outputs are empty (no second weight stack).
        return layer_step(*carry, *xs), None
      indices = jnp.arange(self.cfg.num_layers, dtype=jnp.int32)
      (x, cache), _ = jax.lax.scan(body, (x, cache), (stacked, indices), unroll=self.scan_unroll)
    else:
      for i in range(self.cfg.num_layers):
        x, cache = layer_step(x, cache, jax.tree.map(lambda p, i=i: p[i], stacked), i)
    x = self.norm(x)
    if cache is None:
      return x, None
    return x, cache.advance(key_mask, steps)


class CausalLM(nnx.Module):
  """The policy: backbone and output projection to `[B, T, V]` logits (float32)."""

  def __init__(self, cfg: TransformerConfig, *, dtype: str = "float32", param_dtype: str = "float32",
               remat: kinds.Remat | bool = "none", attention: kinds.Attention = "auto",
               scan_layers: bool = True,
               scan_unroll: int = 1, rngs: nnx.Rngs):
    self.model = Backbone(cfg, dtype=dtype, param_dtype=param_dtype, remat=remat, attention=attention,
                          scan_layers=scan_layers, scan_unroll=scan_unroll, rngs=rngs)
    if not cfg.tie_word_embeddings:
      self.lm_head = _param(rngs, (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"), param_dtype)
    self.tied = cfg.tie_word_embeddings

  @property
  def cfg(self) -> TransformerConfig:
    return self.model.cfg

  def __call__(self, tokens, positions, attention_mask, cache: Cache | None = None, *, segment_ids=None):
    hidden, cache = self.model(tokens, positions, attention_mask, cache, segment_ids=segment_ids)
    if self.tied:
      kernel = self.model.embed_tokens[...].astype(hidden.dtype)
      logits = jnp.einsum("BTD,VD->BTV", hidden, kernel)
    else:
      logits = jnp.einsum("BTD,DV->BTV", hidden, self.lm_head[...].astype(hidden.dtype))
    return constrain(logits.astype(jnp.float32), ("batch", "seq", "act_vocab")), cache

  def hidden_states(self, tokens, positions, attention_mask, cache: Cache | None = None, *, segment_ids=None):
    """The final-norm hidden states `[B, T, D]` (compute dtype) without the output projection, and the cache."""
    return self.model(tokens, positions, attention_mask, cache, segment_ids=segment_ids)

  def output_projection(self) -> tuple[jax.Array, bool]:
    """(kernel, transposed): the `[D, V]` lm_head, or the tied embedding `[V, D]` (transposed), as stored."""
    return (self.model.embed_tokens[...], True) if self.tied else (self.lm_head[...], False)

  def last_logits(self, tokens, positions, attention_mask, cache: Cache | None = None):
    """Logits `[B, V]` (float32) at the last position only, and the cache: the rollout's prefill.

    Equal to `self(...)[0][:, -1]` without the `[B, T, V]` logits of every prompt position."""
    hidden, cache = self.model(tokens, positions, attention_mask, cache)
    return self.project(hidden[:, -1]), cache

  def project(self, hidden: jax.Array) -> jax.Array:
    """Logits `[B, V]` (float32) of hidden states `[B, D]` (one position per row)."""
    kernel, transposed = self.output_projection()
    logits = jnp.einsum("BD,VD->BV" if transposed else "BD,DV->BV", hidden, kernel.astype(hidden.dtype))
    return constrain(logits.astype(jnp.float32), ("batch", "act_vocab"))


class ValueModel(nnx.Module):
  """The critic: the same backbone with a scalar head, `[B, T]` values V(s_t) (float32)."""

  def __init__(self, cfg: TransformerConfig, *, dtype: str = "float32", param_dtype: str = "float32",
               remat: kinds.Remat | bool = "none", attention: kinds.Attention = "auto",
               scan_layers: bool = True,
               scan_unroll: int = 1, rngs: nnx.Rngs):
    self.model = Backbone(cfg, dtype=dtype, param_dtype=param_dtype, remat=remat, attention=attention,
                          scan_layers=scan_layers, scan_unroll=scan_unroll, rngs=rngs)
    self.value_head = _param(rngs, (cfg.hidden_size, 1), ("embed", None), param_dtype, init="zeros")

  @property
  def cfg(self) -> TransformerConfig:
    return self.model.cfg

  def __call__(self, tokens, positions, attention_mask, cache: Cache | None = None, *, segment_ids=None):
    hidden, cache = self.model(tokens, positions, attention_mask, cache, segment_ids=segment_ids)
    values = jnp.einsum("BTD,DO->BTO", hidden, self.value_head[...].astype(hidden.dtype))[..., 0]
    return values.astype(jnp.float32), cache
