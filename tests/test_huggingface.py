"""Hugging Face checkpoints: export → reload exactness, transformers round trip, clear errors."""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from model_utils import FIXTURES, PARITY_MODELS, reference
from vapo_jax.models import hf_export, huggingface, safetensors_io, sharding
from vapo_jax.models.config import preset
from vapo_jax.models.transformer import CausalLM, ValueModel


def params(module):
  return {".".join(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(module, nnx.Param))}


def assert_same_params(a, b):
  pa, pb = params(a), params(b)
  assert pa.keys() == pb.keys()
  for key in pa:
    np.testing.assert_array_equal(pa[key], pb[key], err_msg=key)


@pytest.mark.parametrize("name", PARITY_MODELS)
def test_export_then_reload_is_exact(tmp_path, name):
  model = huggingface.load_causal_lm(str(FIXTURES / name))
  files = hf_export.export(model, str(tmp_path))
  assert files == ["model.safetensors", "config.json"]
  assert_same_params(model, huggingface.load_causal_lm(str(tmp_path)))
  saved = set(safetensors_io.SafetensorsFile(str(tmp_path / "model.safetensors")).keys())
  original = set(safetensors_io.SafetensorsFile(str(FIXTURES / name / "model.safetensors")).keys())
  assert saved == original  # Same tensor names as transformers writes (no lm_head when tied).


@pytest.mark.slow  # make test-slow (kept out of make test for time: CI runs make test in under 10 minutes)
def test_sharded_export_with_index(tmp_path):
  model = CausalLM(preset("tiny"), rngs=nnx.Rngs(1))
  files = hf_export.export(model, str(tmp_path), max_shard_bytes=40_000)
  assert "model.safetensors.index.json" in files and len(files) > 3
  index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
  assert set(index["weight_map"].values()) == {f for f in files if f.endswith(".safetensors")}
  assert_same_params(model, huggingface.load_causal_lm(str(tmp_path)))


def test_value_model_round_trip(tmp_path):
  critic = ValueModel(preset("tiny"), rngs=nnx.Rngs(2))
  critic.value_head[...] = jax.random.normal(jax.random.key(0), critic.value_head[...].shape)
  hf_export.export(critic, str(tmp_path))
  assert_same_params(critic, huggingface.load_value_model(str(tmp_path), from_policy=False))


def test_bfloat16_checkpoint_loads_into_float32(tmp_path):
  model = huggingface.load_causal_lm(str(FIXTURES / "qwen2_untied"))
  hf_export.export(model, str(tmp_path), dtype="bfloat16")
  assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"
  reloaded = huggingface.load_causal_lm(str(tmp_path))
  for key, value in params(reloaded).items():
    assert value.dtype == np.float32
    np.testing.assert_array_equal(value, params(model)[key].astype(jnp.bfloat16).astype(np.float32))


def test_transformers_loads_export(tmp_path):
  torch = pytest.importorskip("torch", reason="torch is a development-only dependency; not installed")
  import transformers
  for name in PARITY_MODELS:
    model = huggingface.load_causal_lm(str(FIXTURES / name))
    out = tmp_path / name
    hf_export.export(model, str(out), max_shard_bytes=60_000)  # Sharded, to test the index too.
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), attn_implementation="eager").eval()
    ref = reference(name)
    with torch.no_grad():
      logits = hf(input_ids=torch.tensor(ref["input_ids"]), attention_mask=torch.tensor(ref["attention_mask"]),
                  position_ids=torch.tensor(ref["position_ids"])).logits.numpy()
    valid = ref["attention_mask"] == 1
    np.testing.assert_allclose(logits[valid], ref["logits"][valid], atol=1e-4, rtol=1e-4)


def test_load_into_mesh(tmp_path):
  mesh = sharding.make_mesh(data=1, fsdp=4, tensor=2)
  rules = sharding.PRESETS["fsdp_tp"]
  sharding._REPLICATED.clear()  # Said once a process: a test before this one in the process may have said it.
  with pytest.warns(UserWarning, match="'vocab' of size 97 is not divisible .* replicating it"):
    model = huggingface.load_causal_lm(str(FIXTURES / "qwen2_untied"), mesh=mesh, rules=rules)
  assert model.lm_head[...].sharding.spec == jax.sharding.PartitionSpec("fsdp")
  q = model.model.layers.self_attn.q_proj[...]  # [L, D, N, H]: the layer axis never split.
  assert q.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor")
  assert q.addressable_shards[0].data.shape == (2, 10, 2, 10)
  ref = reference("qwen2_untied")
  with sharding.use_rules(mesh, rules), pytest.warns(UserWarning, match="'act_vocab'"):
    logits, _ = jax.jit(lambda m, *a: m(*a))(model, ref["input_ids"], ref["position_ids"], ref["attention_mask"])
  valid = ref["attention_mask"] == 1
  np.testing.assert_allclose(np.asarray(logits)[valid], ref["logits"][valid], atol=1e-4, rtol=1e-4)


def copy_fixture(tmp_path, name="qwen2_untied"):
  target = tmp_path / name
  shutil.copytree(FIXTURES / name, target)
  return target


def rewrite(directory, edit):
  file = safetensors_io.SafetensorsFile(str(directory / "model.safetensors"))
  tensors = edit({name: np.array(file.get(name)) for name in file.keys()})
  del file
  safetensors_io.write(str(directory / "model.safetensors"), list(tensors.items()))


def test_missing_directory():
  with pytest.raises(FileNotFoundError, match="checkpoint directory '/no/such/dir' does not exist"):
    huggingface.load_causal_lm("/no/such/dir")


def test_directory_without_weights(tmp_path):
  (tmp_path / "config.json").write_text((FIXTURES / "qwen2_untied" / "config.json").read_text())
  with pytest.raises(FileNotFoundError, match=r"no \*.safetensors files"):
    huggingface.load_causal_lm(str(tmp_path))


def test_missing_tensor_is_named(tmp_path):
  directory = copy_fixture(tmp_path)
  rewrite(directory, lambda t: {k: v for k, v in t.items() if k != "model.layers.1.self_attn.k_proj.bias"})
  with pytest.raises(huggingface.CheckpointError, match=r"missing tensors \['model.layers.1.self_attn.k_proj.bias'\]"):
    huggingface.load_causal_lm(str(directory))


def test_unexpected_tensor_is_named(tmp_path):
  directory = copy_fixture(tmp_path)
  rewrite(directory, lambda t: t | {"model.layers.0.self_attn.rotary.inv_freq": np.ones(3, np.float32)})
  with pytest.raises(huggingface.CheckpointError,
                     match=r"unexpected tensors \['model.layers.0.self_attn.rotary.inv_freq'\]"):
    huggingface.load_causal_lm(str(directory))


def test_shape_mismatch_is_named(tmp_path):
  directory = copy_fixture(tmp_path)
  rewrite(directory, lambda t: t | {"model.layers.0.mlp.up_proj.weight": np.ones((70, 40), np.float32)})
  with pytest.raises(huggingface.CheckpointError,
                     match=r"tensor 'model.layers.0.mlp.up_proj.weight' has shape \(70, 40\)"):
    huggingface.load_causal_lm(str(directory))


def test_corrupt_file(tmp_path):
  directory = copy_fixture(tmp_path)
  (directory / "model.safetensors").write_bytes(b"\x10\x00")
  with pytest.raises(ValueError, match="not a safetensors file"):
    huggingface.load_causal_lm(str(directory))


def test_export_copies_the_tokenizer_files_beside_the_weights(tmp_path):
  from vapo_jax.data.tokenizer import load_tokenizer
  from vapo_jax.paths import DATA_DIR
  qwen = DATA_DIR / "qwen2.5_tokenizer"
  model = huggingface.load_causal_lm(str(FIXTURES / PARITY_MODELS[0]))
  files = hf_export.export(model, str(tmp_path), tokenizer_dir=str(qwen))
  assert {"vocab.json", "merges.txt", "tokenizer_config.json"} <= set(files)
  assert_same_params(model, huggingface.load_causal_lm(str(tmp_path)))
  text = "Find $x$ if $x^2 = 4$. <|im_end|>"
  assert load_tokenizer(str(tmp_path)).encode(text) == load_tokenizer(str(qwen)).encode(text)
