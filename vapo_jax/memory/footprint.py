"""Per-device memory of a model, before allocation: parameters and optimizer state, and activations.

`parameter_memory` traces the module abstractly (`nnx.eval_shape`: no memory), shards each
parameter's shape by its logical axes under a preset and mesh shape, and adds up the bytes each
device will hold.

`activation_memory` estimates the bytes one forward (and backward) pass of `transformer.py` holds
per device, from the shapes alone. It follows the code: flash attention (`models/attention.py`:
O(T) memory plus score tiles; the `reference` implementation's `[B, K, G, T, S]` float32 scores
when asked), log-probs from vocabulary blocks of the logits (`models/logprobs.py`: no
`[B, T, V]` tensor), and `remat` wrapping each decoder layer. Its coefficients are bytes per element
of the tensors XLA keeps, checked against XLA:CPU's buffer assignment for a small model
(`tests/test_memory_plan.py`); another backend fuses differently, so read it as an estimate good to
about ±50%.
"""

import dataclasses
import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Literal, NamedTuple

import jax.numpy as jnp
from flax import nnx

from vapo_jax.models import sharding
from vapo_jax.models.config import TransformerConfig


class MemoryReport(NamedTuple):
  num_parameters: int  # Total parameter count.
  param_bytes: int  # Per device.
  grad_bytes: int  # Per device (gradients in the parameter dtype).
  optimizer_bytes: int  # Per device (AdamW: two float32 moments).

  @property
  def total_bytes(self) -> int:
    return self.param_bytes + self.grad_bytes + self.optimizer_bytes

  def format(self, name: str = "model") -> str:
    gib = lambda b: f"{b / 2**30:8.2f} GiB"
    return (f"{name}: {self.num_parameters / 1e9:.3f} B parameters; per device: params {gib(self.param_bytes)}, "
            f"grads {gib(self.grad_bytes)}, AdamW state {gib(self.optimizer_bytes)}, "
            f"total {gib(self.total_bytes)}")


def parameter_memory(factory: Callable[[], nnx.Module], *, rules: dict, mesh_shape: Mapping[str, int],
                     optimizer_moments: int = 2, optimizer_dtype=jnp.float32) -> MemoryReport:
  """Memory per device of `factory()`'s parameters, gradients and optimizer state on a mesh."""
  state = nnx.state(nnx.eval_shape(factory), nnx.Param)
  count = params = optimizer = 0
  for _, variable in nnx.to_flat_state(state):
    value = variable.get_value()
    local = local_shape(value.shape, variable.get_metadata()["logical_axes"], rules, mesh_shape)
    numel = math.prod(local)
    count += math.prod(value.shape)
    params += numel * jnp.dtype(value.dtype).itemsize
    optimizer += numel * optimizer_moments * jnp.dtype(optimizer_dtype).itemsize
  return MemoryReport(count, params, params, optimizer)


def layered_parameter_memory(build: Callable[[TransformerConfig], nnx.Module], cfg: TransformerConfig, *,
                              rules: dict, mesh_shape: Mapping[str, int]) -> MemoryReport:
  """`parameter_memory` of `build(cfg)`, traced with one and two layers and extrapolated to L.

  Decoder layers are identical, so L-layer figures are exact: report(L) = report(1) + (L − 1) ·
  (report(2) − report(1)). A 64-layer model is traced in a fraction of a second this way.
  """
  if cfg.num_layers <= 2:
    return parameter_memory(lambda: build(cfg), rules=rules, mesh_shape=mesh_shape)
  one, two = (parameter_memory(lambda n=n: build(dataclasses.replace(cfg, num_layers=n)), rules=rules,
                               mesh_shape=mesh_shape) for n in (1, 2))
  return MemoryReport(*(a + (cfg.num_layers - 1) * (b - a) for a, b in zip(one, two)))


def local_shape(shape: Sequence[int], logical_axes: Sequence[str | None], rules: dict,
                mesh_shape: Mapping[str, int]) -> tuple[int, ...]:
  """The per-device shape of an array with these logical axes (an indivisible axis is replicated)."""
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # `partition_spec` warns about replicated axes; here it is a count.
    spec = sharding.partition_spec(logical_axes, rules, mesh_shape, shape)
  split = [1] * len(shape)
  for i, axes in enumerate(spec):
    if axes is not None:
      split[i] = math.prod(mesh_shape[a] for a in ((axes,) if isinstance(axes, str) else axes))
  return tuple(math.ceil(n / s) for n, s in zip(shape, split))


def layer_weight_count(cfg: TransformerConfig) -> int:
  """Parameters of one decoder layer (what FSDP gathers before computing it)."""
  d, h = cfg.hidden_size, cfg.head_dim
  return d * h * (2 * cfg.num_heads + 2 * cfg.num_kv_heads) + 3 * d * cfg.intermediate_size


class ActivationMemory(NamedTuple):
  """Bytes per device of one pass of the model over a batch (see `activation_memory`)."""

  stored: int  # Kept from the forward pass for the backward: every layer's tensors, or (remat) its input.
  layer: int  # Working set of the one layer being computed (and, under remat, recomputed) and differentiated.
  head: int  # Log-probs from logit blocks and their gradients (policy); the values (critic); last logits.

  @property
  def total(self) -> int:
    """The peak: the head's buffers are freed before the layers' backward pass needs its own."""
    return self.stored + max(self.layer, self.head)


Head = Literal["logprobs", "values", "last_logits"]


def _head_bytes(cfg: TransformerConfig, head: Head, *, rows: int, tokens: int, scored_tokens: int, dtype_bytes: int,
                backward: bool, logits_chunk: int, embed: int) -> int:
  """The head's bytes of `activation_memory` (its docstring: policy head, last logits, critic head)."""
  e, d, v, t, tr = dtype_bytes, cfg.hidden_size, cfg.vocab_size, tokens, scored_tokens
  block = tr * min(v, -(-v * min(logits_chunk, tr) // tr)) if tr else 0  # Tr·Vb logits per sequence.
  per_row, fixed = {
      "values": (t * (2 * e * d + 8), 0),
      "last_logits": (v * (e + 4), 0),
      "logprobs": ((8 + e) * block + (e + 4) * tr * d, 4 * embed * v) if backward else (8 * block + e * tr * d, 0),
  }[head]
  return rows * per_row + fixed


def _layer_bytes(t: int, e: int, d: int, h: int, n: int, k: int, f: int, *, attention_block: tuple[int, int],
                 dense_attention: bool) -> tuple[int, int, int, int]:
  """One sequence's (kept, backward extra, scanned extra) bytes of one layer without score tiles, and one
  float32 score tile (0 with dense attention), as `activation_memory`'s docstring counts them (T = t
  tokens, D = d, H = h, N = n, K = k, F = f)."""
  per_token = 3 * e * f + (8 + 2 * e) * d + 2 * e * h * (n + k)
  gradients = t * (2 * e * f + 8 * d)  # The MLP's and norms' gradients.
  if dense_attention:
    return 8 * n * t * t + t * per_token, 4 * n * t * t + gradients, gradients, 0
  tile = 4 * n * min(attention_block[0], t) * min(attention_block[1], t)
  # Forward: scores and probabilities; backward: those two and their gradients.
  return t * (per_token + 4 * n), gradients + t * 28 * n * h, gradients + t * 28 * n * h, tile


def activation_memory(cfg: TransformerConfig, *, rows: int, tokens: int, scored_tokens: int, dtype_bytes: int,
                      remat: bool, scan_layers: bool = True, backward: bool = True, head: Head = "logprobs",
                      dense_attention: bool = False,
                      attention_block: tuple[int, int] = (256, 256), logits_chunk: int = 512,
                      heads: int | None = None, kv_heads: int | None = None, mlp: int | None = None,
                      embed: int | None = None) -> ActivationMemory:
  """Activation bytes of `rows` sequences of `tokens` positions on one device.

  `scored_tokens` (Tr) positions get log-probs (the response); `dtype_bytes` (e) is the compute
  dtype's size; `heads`, `kv_heads`, `mlp` are the per-device sizes of those axes (tensor
  parallelism) and `embed` the width of the output kernel's gradient on a device (FSDP), the
  model's own by default. Per sequence, with c = 3eF + (8 + 2e)D + 2eH(N + K) bytes per token:

    kept per layer  T·(c + 4N)                  gate, up, silu·up; two float32 norm inputs and two
                    residual values; q, k, v and the attention output; the attention's float32
                    log-sum-exp per query and head
    backward extra  T·(2eF + 8D + 28NH)         MLP and norm gradients; the flash backward's float32
                    copies of q, dO, out, dq, dk, dv (`models/flash.chunked`)
      + 4·4·N·bq·bk                             float32 tiles of one block pair (`attention_block`):
                                                scores, probabilities and their gradients (forward: 2),
                                                once per call: rows run one at a time (`flash`)
    policy head     (forward) 8·B·Tr·Vb + e·Tr·D   float32 logits of one vocabulary block and their
                    exponentials (`models/logprobs`: Vb = ⌈V·chunk/Tr⌉, so B·Tr·Vb ≈ B·chunk·V), the
                    response's hidden states;  (backward) (8 + e)·B·Tr·Vb + (e + 4)·Tr·D, plus the
                    float32 kernel gradient 4·D·V per device (split by FSDP along D)
    last logits     V·(e + 4)                   the prefill's last-position logits
    critic head     T·(2eD + 8)

  With `dense_attention` (the `reference` implementation) the float32 `[N, T, T]` scores are kept
  too: 8·N·T² per layer (masked scores and softmax output) and 4·N·T² more in the backward (their
  gradient), and no tiles or log-sum-exp.

  Without remat every layer's tensors are stored and the layer being differentiated adds its
  backward extra. Scanned (`scan_layers`, the model's default) a layer stores kept + the extra's
  per-token part, T·(2eF + 8D + 28NH): the scan's backward body reads every residual from the
  stacked scan outputs, so XLA cannot fuse the float32 copies away as it does in an unrolled
  program, which stores L × kept. With remat each layer stores only its input (L·T·D·e) and the
  layer being differentiated holds its kept tensors and its backward extra: unrolled, all of it;
  scanned, the MLP and norm gradients, T·(2eF + 8D), and two tiles (measured: XLA fuses the
  recomputed layer's attention backward). The head's buffers are freed before the layers'
  backward starts, so the peak is stored + max(layer, head). A forward pass alone
  (`backward=False`) holds one layer's kept tensors and tiles, or the head, whichever is larger.
  """
  e, d, t = dtype_bytes, cfg.hidden_size, tokens
  kept, extra, scanned_extra, tile = _layer_bytes(
      t, e, d, cfg.head_dim, heads or cfg.num_heads, kv_heads or cfg.num_kv_heads, mlp or cfg.intermediate_size,
      attention_block=attention_block, dense_attention=dense_attention)
  head_bytes = _head_bytes(cfg, head, rows=rows, tokens=t, scored_tokens=scored_tokens, dtype_bytes=e,
                           backward=backward, logits_chunk=logits_chunk, embed=embed or d)
  if not backward:
    return ActivationMemory(0, rows * kept + 2 * tile, head_bytes)
  if remat:  # Scanned: the MLP and norm gradients and two tiles; unrolled: the whole backward extra.
    layer = rows * (kept + (t * (2 * e * (mlp or cfg.intermediate_size) + 8 * d) if scan_layers else extra))
    return ActivationMemory(rows * cfg.num_layers * t * d * e, layer + (2 if scan_layers else 4) * tile, head_bytes)
  stored = kept + (scanned_extra if scan_layers else 0)
  return ActivationMemory(rows * cfg.num_layers * stored, rows * extra + 4 * tile, head_bytes)
