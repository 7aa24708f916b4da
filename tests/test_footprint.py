"""Parameter/gradient/optimizer memory per device, computed before allocation."""

from flax import nnx

from vapo_jax.memory import footprint
from vapo_jax.models import sharding
from vapo_jax.models.config import preset
from vapo_jax.models.transformer import CausalLM


def test_replicated_memory_is_the_whole_model():
  cfg = preset("tiny")
  report = footprint.parameter_memory(lambda: CausalLM(cfg, rngs=nnx.Rngs(0)), rules=sharding.PRESETS["dp"],
                                   mesh_shape={"data": 8, "fsdp": 1, "tensor": 1})
  assert report.num_parameters == cfg.num_parameters()
  assert report.param_bytes == report.grad_bytes == 4 * cfg.num_parameters()
  assert report.optimizer_bytes == 8 * cfg.num_parameters()


def test_fsdp_divides_every_width_sharded_parameter():
  cfg = preset("tiny")  # hidden_size 48: every matrix has an "embed" axis; norms are replicated.
  report = footprint.parameter_memory(lambda: CausalLM(cfg, rngs=nnx.Rngs(0)), rules=sharding.PRESETS["fsdp"],
                                   mesh_shape={"data": 1, "fsdp": 8, "tensor": 1})
  norms = (2 * cfg.num_layers + 1) * cfg.hidden_size
  biases = cfg.num_layers * (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim  # No embed axis.
  sharded = cfg.num_parameters() - norms - biases
  assert report.param_bytes == 4 * (sharded // 8 + norms + biases)


def test_32b_on_256_chips_fits_easily():
  cfg = preset("qwen2.5-32b")
  report = footprint.parameter_memory(lambda: CausalLM(cfg, rngs=nnx.Rngs(0)), rules=sharding.PRESETS["fsdp"],
                                   mesh_shape={"data": 1, "fsdp": 256, "tensor": 1})
  assert 1.8 * 2**30 < report.total_bytes < 2.0 * 2**30  # 16 bytes/param / 256 ≈ 1.92 GiB
  assert "32.764 B parameters" in report.format()
