"""The Pallas GPU attention (`models/pallas_gpu.py`'s `packed_attention`, `attention.attend(impl="pallas_gpu")`)
run by the shipped code path in the Pallas interpreter against the dense reference, and the line a run prints of
the attention each platform chooses. (The paged GPU kernel: tests/test_paged_attention.py.)"""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from test_attention import _inputs, _out_and_grads, _segments
from vapo_jax.errors import ConfigError
from vapo_jax.models import attention, pallas_gpu, sharding
from vapo_jax.models.config import preset


def test_pallas_gpu_in_the_interpreter_equals_reference_on_one_device_and_under_shard_map():
  """The shipped GPU path (`attend` with impl="pallas_gpu", which "auto" picks for packed bfloat16 rows on a GPU:
  `mha` of jax.experimental.pallas.ops.gpu, here in the Pallas interpreter and float32): packed rows with several
  segments, one-token ones and padding, grouped kv heads; output and gradients, on one device and on a
  (data 2, fsdp 2, tensor 2) mesh under shard_map."""
  q, k, v, weights = _inputs(4, 32, 32, kv_heads=2, groups=2, seed=12)
  mask = dict(segment_ids=jnp.asarray(_segments([[10, 1, 1, 13], [32], [17], [3, 20]], 32)))
  expected = _out_and_grads(lambda *a: attention.reference(*a, **mask), q, k, v, weights)
  kernel = lambda *a: attention.attend(*a, **mask, impl="pallas_gpu", platform="gpu")
  mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
  with pallas_gpu.interpret():
    got = _out_and_grads(kernel, q, k, v, weights)
    with sharding.use_rules(mesh, sharding.PRESETS["fsdp_tp"]):
      sharded = _out_and_grads(kernel, q, k, v, weights)
  for want, have, split in zip(expected, got, sharded):
    np.testing.assert_allclose(have, want, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(split, want, atol=1e-5, rtol=1e-5)
  assert np.all(np.asarray(got[0])[2, 17:] == 0)  # Padding: nothing.


def test_each_platform_and_row_form_chooses_its_attention():
  assert attention.select("auto", jnp.bfloat16, "cpu", packed=True) == "chunked"
  assert attention.select("auto", jnp.bfloat16, "gpu") == "cudnn"  # Unpacked rows: cuDNN.
  assert attention.select("auto", jnp.bfloat16, "gpu", packed=True) == "pallas_gpu"  # Packed rows: Pallas GPU.
  assert attention.select("auto", jnp.float32, "gpu", packed=True) == "chunked"
  assert attention.select("auto", jnp.bfloat16, "tpu", packed=True) == "splash"
  assert attention.select("pallas_gpu", jnp.float32, "cuda") == "pallas_gpu"
  with pytest.raises(ConfigError, match="'pallas_gpu' needs an NVIDIA GPU, but JAX runs on 'tpu'"):
    attention.select("pallas_gpu", jnp.bfloat16, "tpu")


def test_the_run_says_which_attention_each_platform_runs():
  from experiments import tiny
  from vapo_jax.cli import preflight
  config = tiny.tiny()
  cfg = preset(config.model.preset)
  assert preflight.kernels(config, cfg, "cpu") == ("kernels on cpu: attention chunked; paged decode (refill engine) "
                                                   "gather")
  half = dataclasses.replace(config, model=dataclasses.replace(config.model, dtype="bfloat16"))
  big = dataclasses.replace(cfg, head_dim=128)
  assert preflight.kernels(half, big, "gpu") == ("kernels on gpu: attention cudnn (padded rows) and pallas_gpu "
                                                 "(packed rows); paged decode (refill engine) gpu_kernel")
  assert preflight.kernels(half, big, "tpu") == "kernels on tpu: attention splash; paged decode (refill engine) kernel"
