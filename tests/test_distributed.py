"""Multi-process runs: 2 local processes × 4 CPU devices equal 1 process × 8 devices.

The workers are this file run as a script (`python tests/test_distributed.py worker OUT_DIR`),
started by `multiprocess_launch.launch`; each joins the run through `distributed.initialize()`
and computes a few sharded SGD steps of a tiny causal LM, whose gradients need collectives
across the two processes, and saves its parameters with Orbax as multi-process runs must.
"""

import dataclasses
import os
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

from multiprocess_launch import LaunchError, launch
from vapo_jax import distributed
from vapo_jax.models import sharding
from vapo_jax.models.config import preset
from vapo_jax.models.transformer import CausalLM, positions_from_mask

CFG = dataclasses.replace(preset("tiny"), vocab_size=262, num_layers=2)
MESH = dict(data=2, fsdp=4)  # Batch rows over both axes; parameters split over fsdp.
PRESET = "fsdp"
BATCH, LENGTH, STEPS, LR = 16, 11, 3, 0.5


def sgd_steps(mesh: jax.sharding.Mesh) -> dict:
  """`STEPS` SGD steps of next-token NLL on a fixed batch; host copies of the results."""
  rules = sharding.PRESETS[PRESET]
  model = sharding.create_sharded(lambda: CausalLM(CFG, rngs=nnx.Rngs(0)), mesh, rules)
  graphdef, params = nnx.split(model)
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, CFG.vocab_size, (BATCH, LENGTH)).astype(np.int32)
  mask = np.ones_like(tokens)
  mask[::2, :4] = 0  # Left padding on half the rows.
  rows = NamedSharding(mesh, sharding.partition_spec(("batch",), rules))
  tokens, mask = distributed.global_array(tokens, rows), distributed.global_array(mask, rows)

  def loss_fn(params, tokens, mask):
    logits, _ = nnx.merge(graphdef, params)(tokens, positions_from_mask(mask), mask)
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits[:, :-1]), tokens[:, 1:, None], axis=-1)[..., 0]
    return jnp.sum(nll * mask[:, 1:]) / jnp.sum(mask[:, 1:]), logits

  @jax.jit
  def step(params, tokens, mask):
    (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, tokens, mask)
    return optax.apply_updates(params, jax.tree.map(lambda g: -LR * g, grads)), loss, logits, grads

  losses = []
  with sharding.use_rules(mesh, rules):
    for _ in range(STEPS):
      params, loss, logits, grads = step(params, tokens, mask)
      losses.append(loss)
  return {"losses": jnp.stack(losses), "logits": logits, "params": by_path(params), "grads": by_path(grads),
          "_state": params}


def by_path(state) -> dict[str, jax.Array]:
  return {".".join(map(str, k)): v for k, v in nnx.to_flat_state(state)}


def checkpoint_state(params, mesh) -> dict:
  """Sharded parameters, and arrays that jit leaves on one local device (which Orbax refuses to
  save in a multi-process run unless `replicate_local` spreads them over the mesh first)."""
  local = {"count": jax.jit(lambda: jnp.int32(STEPS))(), "key": jax.random.key(7)}
  return {"params": params, "local": distributed.replicate_local(local, mesh)}


def save_and_restore(state, directory: str):
  """Orbax: every process calls save (each writes its shards, process 0 the metadata) and restore."""
  with ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(create=True)) as manager:
    manager.save(STEPS, args=ocp.args.StandardSave(state))
    manager.wait_until_finished()
  return restore(state, directory)


def restore(like, directory: str):
  with ocp.CheckpointManager(directory) as manager:
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
    return manager.restore(manager.latest_step(), args=ocp.args.StandardRestore(abstract))


def flatten(tree: dict) -> dict[str, np.ndarray]:
  """{"group/name": array} from {"group": {"name": array} or array}, for npz files."""
  out = {}
  for group, value in tree.items():
    out |= {f"{group}/{k}": v for k, v in value.items()} if isinstance(value, dict) else {group: value}
  return out


def worker(out_dir: str):
  assert distributed.initialize(initialization_timeout_s=60, shutdown_timeout_s=60)
  jax.config.update("jax_default_matmul_precision", "highest")  # As tests/conftest.py.
  assert distributed.initialize()  # Idempotent.
  assert (jax.process_count(), len(jax.local_devices()), len(jax.devices())) == (2, 4, 8)
  mesh = sharding.make_mesh(**MESH)
  results = sgd_steps(mesh)
  restored = save_and_restore(checkpoint_state(results.pop("_state"), mesh), os.path.join(out_dir, "ckpt"))
  assert int(restored["local"]["count"]) == STEPS
  np.testing.assert_array_equal(jax.random.key_data(restored["local"]["key"]), jax.random.key_data(jax.random.key(7)))
  rows = NamedSharding(mesh, sharding.partition_spec(("batch",), sharding.PRESETS[PRESET]))
  share = distributed.local_share(BATCH, rows)
  assert share == distributed.local_share(BATCH)
  everything = np.arange(BATCH * 3, dtype=np.float32).reshape(BATCH, 3)
  gathered = distributed.global_array_from_share(everything[share], rows, BATCH)
  multihost_utils.assert_equal(everything, "the host batch differs between processes")
  assert distributed.any_process(jax.process_index() == 1)
  assert not distributed.any_process(False)
  results |= {"restored": by_path(restored["params"]),
              "share": np.array([share.start, share.stop]), "gathered": gathered}
  host = distributed.to_host(results)  # Every process gathers; each writes its own copy to compare.
  np.savez(os.path.join(out_dir, f"process_{jax.process_index()}.npz"), **flatten(host))
  multihost_utils.sync_global_devices("written")
  print(f"process {jax.process_index()} done; main={distributed.is_main_process()}", flush=True)


# ------------------------------------------------------------------------------ the pytest side
@pytest.mark.slow  # 35-65 s on a 2-core CPU: two processes each compile the step.
def test_two_processes_equal_one_process(tmp_path):
  launch(__file__, ["worker", str(tmp_path)], num_processes=2, devices_per_process=4, timeout_s=300)
  expected = sgd_steps(sharding.make_mesh(**MESH))
  state = expected.pop("_state")
  expected = distributed.to_host(expected)
  for i in range(2):
    with np.load(tmp_path / f"process_{i}.npz") as f:
      actual = dict(f)
    for key, value in flatten(expected).items():
      np.testing.assert_allclose(actual[key], value, rtol=1e-6, atol=1e-6, err_msg=f"process {i}: {key}")
    for name in expected["params"]:  # The checkpoint the two processes wrote and read back.
      np.testing.assert_array_equal(actual[f"restored/{name}"], actual[f"params/{name}"], err_msg=name)
    assert actual["share"].tolist() == [8 * i, 8 * i + 8]
    np.testing.assert_array_equal(actual["gathered"], np.arange(BATCH * 3).reshape(BATCH, 3))
  assert np.all(np.diff(expected["losses"]) < 0)  # SGD on a fixed batch lowers its loss.
  # The 2-process checkpoint restores in this 8-device process, to its layout.
  mesh = sharding.make_mesh(**MESH)
  restored = restore(checkpoint_state(state, mesh), str(tmp_path / "ckpt"))
  assert int(restored["local"]["count"]) == STEPS
  for (path, a), (_, b) in zip(nnx.to_flat_state(restored["params"]), nnx.to_flat_state(state), strict=True):
    assert a.get_value().sharding == b.get_value().sharding, path
    np.testing.assert_allclose(a.get_value(), b.get_value(), rtol=1e-6, atol=1e-6, err_msg=str(path))


def test_launch_kills_every_process_when_one_fails(tmp_path):
  script = tmp_path / "fails.py"
  script.write_text(textwrap.dedent("""
      import jax
      from jax.experimental import multihost_utils
      from vapo_jax import distributed
      distributed.initialize(initialization_timeout_s=60)
      if jax.process_index() == 1:
        raise RuntimeError("process 1 fails")
      multihost_utils.sync_global_devices("never reached by process 1")  # Would wait 30 s or more for process 1.
      """))
  start = time.monotonic()
  with pytest.raises(LaunchError, match="process 1 exited with 1") as info:
    launch(str(script), timeout_s=120)
  assert [r.returncode for r in info.value.results] == [-9, 1]
  assert "RuntimeError: process 1 fails" in info.value.results[1].stderr
  assert time.monotonic() - start < 20


def test_launch_time_out(tmp_path):
  script = tmp_path / "sleeps.py"
  script.write_text("import time\n\ndef wait():\n  time.sleep(60)\n\nwait()\n")
  start = time.monotonic()
  with pytest.raises(LaunchError, match="time-out after 1 s") as info:
    launch(str(script), timeout_s=1)
  assert [r.returncode for r in info.value.results] == [-6, -6]  # SIGABRT: a stack dump, then the end.
  assert all('line 4 in wait' in r.stderr for r in info.value.results)
  assert time.monotonic() - start < 10


# ------------------------------------------------------------------------ one process, 8 devices
@pytest.fixture
def rows():
  return NamedSharding(sharding.make_mesh(data=2, fsdp=4), PartitionSpec(("data", "fsdp")))


def test_single_process_defaults():
  assert not distributed.initialize(environ={})
  assert (jax.process_index(), jax.process_count(), distributed.is_main_process()) == (0, 1, True)
  assert distributed.any_process(True) and not distributed.any_process(False)


def test_global_array_and_to_host(rows):
  x = np.arange(16 * 3, dtype=np.float32).reshape(16, 3)
  a = distributed.global_array(x, rows)
  assert a.sharding == rows and a.addressable_shards[1].data.shape == (2, 3)
  np.testing.assert_array_equal(a.addressable_shards[1].data, x[2:4])
  scalar = distributed.global_array(np.float32(2.5), NamedSharding(rows.mesh, PartitionSpec()))
  host = distributed.to_host({"a": a, "scalar": scalar, "numpy": x[:2], "jax": jnp.ones(2)})
  assert all(isinstance(v, np.ndarray) for v in host.values())
  np.testing.assert_array_equal(host["a"], x)
  assert host["scalar"] == 2.5


def test_replicate_local(rows):
  local = {"count": jax.jit(lambda: jnp.int32(3))(), "key": jax.random.key(5), "host": np.ones(2)}
  spread = {"w": distributed.global_array(np.ones((16, 2)), rows)}
  out = distributed.replicate_local(local | spread, rows.mesh)
  assert out["w"] is spread["w"]
  for name in local:
    assert out[name].sharding == NamedSharding(rows.mesh, PartitionSpec()), name
  np.testing.assert_array_equal(jax.random.key_data(out["key"]), jax.random.key_data(local["key"]))
  assert int(out["count"]) == 3 and distributed.any_process(True) and not distributed.any_process(False)


def test_local_share(rows):
  assert distributed.local_share(16) == slice(0, 16)
  assert distributed.local_share(16, rows) == slice(0, 16)
  replicated = NamedSharding(rows.mesh, PartitionSpec(None, "fsdp"))
  assert distributed.local_share(5, replicated) == slice(0, 5)
  x = np.arange(16 * 2).reshape(16, 2)
  np.testing.assert_array_equal(distributed.to_host(distributed.global_array_from_share(x, rows, 16)), x)


@pytest.mark.parametrize("environ, message", [
    ({"VAPO_COORDINATOR": "localhost:1234"}, "VAPO_COORDINATOR set but VAPO_NUM_PROCESSES, VAPO_PROCESS_ID not"),
    ({"VAPO_COORDINATOR": "localhost", "VAPO_NUM_PROCESSES": "2", "VAPO_PROCESS_ID": "0"}, "must be host:port"),
    ({"VAPO_COORDINATOR": "h:1", "VAPO_NUM_PROCESSES": "two", "VAPO_PROCESS_ID": "0"},
     "VAPO_NUM_PROCESSES='two' must be an integer"),
    ({"VAPO_COORDINATOR": "h:1", "VAPO_NUM_PROCESSES": "0", "VAPO_PROCESS_ID": "0"}, "VAPO_NUM_PROCESSES=0 must be at"),
    ({"VAPO_COORDINATOR": "h:1", "VAPO_NUM_PROCESSES": "2", "VAPO_PROCESS_ID": "2"},
     r"VAPO_PROCESS_ID=2 must be in 0 .. 1 \(VAPO_NUM_PROCESSES=2\)"),
    ({"VAPO_DISTRIBUTED": "yes"}, "VAPO_DISTRIBUTED='yes' must be 1"),
    ({"VAPO_LOCAL_DEVICES": "-4"}, "VAPO_LOCAL_DEVICES=-4 must be at least 1"),
])
def test_initialize_errors_name_the_variable(environ, message):
  with pytest.raises(ValueError, match=message):
    distributed.initialize(environ=environ)


def test_initialize_is_a_no_op_for_one_process():
  assert not distributed.initialize(environ={"VAPO_COORDINATOR": "h:1", "VAPO_NUM_PROCESSES": "1",
                                             "VAPO_PROCESS_ID": "0", "VAPO_DISTRIBUTED": "0"})
  assert not distributed.initialize(environ={"TPU_WORKER_HOSTNAMES": "only-one-host"})
  assert jax.device_count() == 8  # JAX runs (on the tests' 8 devices) before the call, whichever test came first.
  with pytest.raises(RuntimeError, match="VAPO_LOCAL_DEVICES=3 needs distributed.initialize"):
    distributed.initialize(environ={"VAPO_LOCAL_DEVICES": "3"})



# XLA_FLAGS' count in make test-slow, for time (3 s): the same order of precedence.
@pytest.mark.parametrize("xla_flags, expected", [("", 2), pytest.param("--xla_force_host_platform_device_count=3", 3,
                                                                       marks=pytest.mark.slow)])
def test_a_configs_cpu_devices_apply_where_nothing_else_says_how_many(xla_flags, expected):
  """`mesh.cpu_devices` makes that many CPU devices in a fresh process; XLA_FLAGS' count comes first."""
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "VAPO_LOCAL_DEVICES")}
  code = ("from vapo_jax import distributed; import jax; distributed.initialize(cpu_devices=2); "
          "print(jax.device_count())")
  out = subprocess.run([sys.executable, "-c", code], env=env | {"XLA_FLAGS": xla_flags, "JAX_PLATFORMS": "cpu"},
                       capture_output=True, text=True, check=True, timeout=120)
  assert out.stdout.split()[-1] == str(expected)


def test_a_started_process_keeps_its_devices():
  assert jax.device_count() == 8  # JAX runs before the call, whichever test came first.
  assert not distributed.initialize(environ={}, cpu_devices=2)
  assert jax.device_count() == 8

if __name__ == "__main__":
  worker(sys.argv[2])


def test_a_mesh_without_windowed_einsums_adds_libtpus_flags_once():
  from vapo_jax.config import MeshConfig

  environ = {"LIBTPU_INIT_ARGS": "--xla_tpu_scoped_vmem_limit_kib=98304"}
  distributed.tpu_compiler_flags(MeshConfig(), environ)
  assert environ == {"LIBTPU_INIT_ARGS": "--xla_tpu_scoped_vmem_limit_kib=98304"}
  for _ in range(2):
    distributed.tpu_compiler_flags(MeshConfig(windowed_einsum=False), environ)
  assert environ["LIBTPU_INIT_ARGS"].split() == ["--xla_tpu_scoped_vmem_limit_kib=98304",
                                                 *distributed.WINDOWED_EINSUM_OFF]
