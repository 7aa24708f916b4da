"""The compile report for a TPU topology (v5p:2x2x1, 4 chips), on this CPU machine through libtpu's
compile-only client: an FSDP decode's per-layer gathers under scanned layers are found, splash compiles for the
chips under shard_map, the HBM table is what the TPU compiler says, the paged kernel is opaque to cost analysis and
its cache write one scatter; in `make test-slow`, the smoke run's every phase fits, its decode loop moves no weight,
a layout that cannot fit is refused naming the phase (also by `make memory`'s entry point, exit 1), the roofline's
arithmetic holds (its engines and profiles: test_roofline_engines.py), and the shipped `aime` rollout at 64 layers
on v5p:8x8x4 fits within the memory margin.
Skipped without libtpu (`make test` installs it: `pip install -e ".[test,tpu]"`)."""

import dataclasses
import math
import os
import shutil

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding

import tpu_utils
from conftest import build_smoke_config
from experiments import get_experiment
from vapo_jax import compile_cache
from vapo_jax.cli import memory
from vapo_jax.memory import aot, hlo, topologies, tpu_said, xla_report, xla_report_text
from vapo_jax.models import attention, sharding
from vapo_jax.roofline import micro_batch_cost
from vapo_jax.roofline import step as roofline
from vapo_jax.roofline import text as roofline_text
from vapo_jax.train import packed_batch

pytestmark = pytest.mark.skipif(topologies.libtpu_missing() is not None, reason=str(topologies.libtpu_missing()))
TOPOLOGY = "v5p:2x2x1"
QUICK = {"eval.path": None}
# 4,096 sequences of 1M tokens: 128 GiB of KV cache per chip.
TOO_LONG = {"rollout.prompts_per_step": 1024, "rollout.max_response_tokens": 2**20, "rollout.kv_cache_budget_gib": 1e4}


# The smoke run's every phase compiled for the chips (47 s): its tests run in make test-slow. make test compiles for
# the chips an FSDP decode under scanned layers (its weight check), splash, the paged kernel and its cache write.
SMOKE_REPORT = pytest.mark.slow


@pytest.fixture(scope="module")
def smoke_report(tmp_path_factory):
  config = build_smoke_config(tmp_path_factory.mktemp("run"), QUICK)
  return xla_report.compile_run(config, topologies.named(TOPOLOGY))


@SMOKE_REPORT
def test_every_phase_of_the_smoke_run_fits(smoke_report):
  names = [p.name for p in smoke_report.phases]
  assert names == ["supervised warm start", "rollout", "value pretraining", "scoring", "update"]
  assert smoke_report.device_bytes == topologies.CHIPS["TPU v5"].hbm_bytes and not smoke_report.over()
  for phase in smoke_report.phases:
    for program in phase.programs:
      assert program.memory is not None and 0 < program.needs < 2**30, program.name
  assert xla_report_text.refusal(smoke_report) is None
  assert "fits (" in xla_report_text.table(smoke_report)


@SMOKE_REPORT
def test_the_decode_loop_moves_no_weight(smoke_report):
  """dp (the smoke run's preset) keeps whole weights on every chip. The next tests find fsdp's gathers inside
  the loop with the same check (it can fail)."""
  generate = smoke_report.program("generate")
  assert generate.decode is not None
  assert tpu_utils.weight_collectives(generate, smoke_report.weights) == []


@pytest.mark.slow  # make test covers it: test_the_weight_check_finds_an_fsdp_decodes_gathers_under_scanned_layers.
def test_the_weight_check_finds_an_fsdp_decodes_gathers(smoke_config):
  """fsdp gathers the micro model's weights inside the decode loop, which the check finds. make test covers
  the check's finding with the 4-layer scanned model (the next test)."""
  fsdp = smoke_config(QUICK | {"mesh.preset": "fsdp", "mesh.data": 1, "mesh.fsdp": 4})
  report = xla_report.compile_run(fsdp, topologies.named(TOPOLOGY), phases=("rollout",))
  moving = tpu_utils.weight_collectives(report.program("generate"), report.weights)
  assert moving and report.program("generate").decode.bytes >= max(max(c.operand_bytes, c.result_bytes) for c in moving)


def test_the_weight_check_finds_an_fsdp_decodes_gathers_under_scanned_layers(smoke_config):
  """A scanned decode gathers one layer of each stacked `[L, ...]` weight per iteration: the check compares
  per-layer sizes, so a 4-layer FSDP decode's gathers are found (and each is one layer's, not the stack's)."""
  fsdp = smoke_config(QUICK | {"model.preset": "small", "mesh.preset": "fsdp", "mesh.data": 1, "mesh.fsdp": 4})
  report = xla_report.compile_run(fsdp, topologies.named(TOPOLOGY), phases=("rollout",))
  layers = report.architecture.num_layers
  assert fsdp.model.scan_layers and layers == 4
  moving = tpu_utils.weight_collectives(report.program("generate"), report.weights)
  elements = lambda shape: math.prod(int(d) for d in shape[shape.index("[") + 1:-1].split(",") if d)
  cfg = report.architecture
  stacks = {layers * cfg.hidden_size * cfg.intermediate_size, layers * cfg.hidden_size * cfg.num_heads * cfg.head_dim}
  assert moving and not any(elements(shape) in stacks for c in moving for shape in c.shapes)


@pytest.mark.slow  # For time (40 s): make test refuses through test_memory_margin.py and make train's refusal.
def test_a_layout_that_cannot_fit_is_refused_naming_the_phase(tmp_path, capsys, monkeypatch):
  """`make memory`'s entry point exits 1 naming the phase; the report it compiled (kept by a wrapper of
  `compile_run`: one compile) names the compiler's figure and the settings to change."""
  reports, compile_run = [], xla_report.compile_run
  monkeypatch.setattr(xla_report, "compile_run", lambda *a, **k: reports.append(compile_run(*a, **k)) or reports[-1])
  argv = ["--smoke", "--topology", TOPOLOGY, "--phases", "rollout", f"run_dir={tmp_path}", "eval.path=None"]
  assert memory.main(argv + [f"{k}={v}" for k, v in TOO_LONG.items()]) == 1
  out = capsys.readouterr().out
  assert "refused by the compiler" in out and "refused: the run does not fit v5p:2x2x1" in out
  report = reports[0]  # Then the fixes' compiles.
  assert report.config.rollout.max_response_tokens == TOO_LONG["rollout.max_response_tokens"]
  assert [p.name for p in report.over()] == ["rollout"]
  generate = report.program("generate")
  assert generate.memory is None and generate.refused_bytes > report.device_bytes  # The compiler's own figure.
  message = xla_report_text.refusal(report)
  assert message.splitlines()[1].startswith("  rollout needs ") and "(generate)" in message
  assert "rollout.pages" in message or "rollout.max_response_tokens" in message
  compiles = _counting_compiles(monkeypatch)  # The refusal is kept: compiled again, nothing compiles.
  again = xla_report.compile_run(report.config, topologies.named(TOPOLOGY), phases=("rollout",))
  assert not compiles and _timeless(again.phases) == _timeless(report.phases) and again.program("generate").kept


def _counting_compiles(monkeypatch) -> list:
  compiles, compile_lowered = [], jax.stages.Lowered.compile
  monkeypatch.setattr(jax.stages.Lowered, "compile",
                      lambda self, *a, **k: compiles.append(1) or compile_lowered(self, *a, **k))
  return compiles


def _timeless(phases) -> list:
  return [p._replace(lower_s=0.0, compile_s=0.0, kept=False) for phase in phases for p in phase.programs]


@SMOKE_REPORT
def test_a_second_compile_loads_what_the_tpu_compiler_said(smoke_report, monkeypatch):
  """Compiled again (the cache directory tests/conftest.py sets), the rollout and scoring (whose inputs
  are the rollout's outputs as compiled) compile nothing: the same figures, collectives and decode
  traffic, derived from what was kept. Another topology or other flags miss."""
  compiles = _counting_compiles(monkeypatch)
  again = xla_report.compile_run(smoke_report.config, topologies.named(TOPOLOGY), phases=("scoring",))
  assert not compiles and _timeless(again.phases) == _timeless(p for p in smoke_report.phases if p.name in
                                                                  ("rollout", "scoring"))
  assert [p.name for p in again.phases] == ["rollout", "scoring"] and again.program("generate").decode
  assert all(p.kept for phase in again.phases for p in phase.programs) and "loaded from" in xla_report_text.table(again)
  paths = set()
  for name, flags in ((TOPOLOGY, ""), (TOPOLOGY, " --xla_dump_to=/nonexistent"), ("v5p:2x2x2", "")):
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", "") + flags)
    with tpu_said.keeping(topologies.named(name)):
      paths.add(compile_cache.keyed_path(tpu_said.PREFIX, tpu_said._key("module @same {}")))
  assert len(paths) == 3 and None not in paths


def test_an_unwritable_damaged_or_swapped_kept_file_costs_a_compile(tmp_path, monkeypatch):
  said = tpu_said.Said((1, 2, 3, 4), {"flops": 5.0}, "HloModule m", (), None)
  monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", "/proc/self")  # Read-only, for root too.
  with tpu_said.keeping(topologies.named(TOPOLOGY)):
    tpu_said.store("module @m {}", said)  # Unwritable: nothing kept, nothing raised.
    assert tpu_said.load("module @m {}") is None
  monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path))
  with tpu_said.keeping(topologies.named(TOPOLOGY)):
    tpu_said.store("module @m {}", said)
    assert tpu_said.load("module @m {}") == said
    path = lambda text: compile_cache.keyed_path(tpu_said.PREFIX, tpu_said._key(text))
    other = said._replace(cost={"flops": 6.0})
    tpu_said.store("module @other {}", other)
    shutil.copyfile(path("module @other {}"), path("module @m {}"))  # Another program's file under m's name:
    assert tpu_said.load("module @m {}") is None  # a miss (its key is inside),
    tpu_said.store("module @m {}", said)  # which the compile that follows rewrites.
    assert tpu_said.load("module @m {}") == said and tpu_said.load("module @other {}") == other
    with open(path("module @m {}"), "r+b") as f:
      f.truncate(20)  # A file cut short (a full disk, a killed process): read as absent.
    assert tpu_said.load("module @m {}") is None


def test_bad_topologies_are_user_errors(capsys):
  assert memory.main(["--smoke", "--topology", "v5p-8"]) == 2
  assert "is not a TPU topology name" in capsys.readouterr().err
  assert memory.main(["--smoke", "--topology", "v4:3x3x3x3"]) == 2  # A generation without a slice table here.
  assert "libtpu refused it" in capsys.readouterr().err


@pytest.mark.parametrize("name,near", [("v5p:8x8x5", "4x8x8 (256 chips), 8x8x8 (512 chips)"),
                                       ("v5p:3x3x3x3", "4x4x4 (64 chips)"), ("v6e:16x32", "16x16 (256 chips)")])
def test_a_topology_that_is_not_a_slice_is_refused_in_one_line_before_compiling(capsys, name, near):
  """libtpu builds a 320-chip v5p:8x8x5, whose programs then fail deep in the compiler: refused from
  Cloud TPU's slice tables first, naming the nearest slices."""
  assert memory.main(["--smoke", "--topology", name]) == 2
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1 and f"not a {name.split(':')[0]} slice" in err and near in err, err
  for valid in ("v5p:2x2x1", "v5p:8x8x4", "v5p:4x8x8", "v6e:16x16", "v5e:2x4"):
    topologies.check_slice(valid)


def test_splash_compiles_for_the_chips_under_shard_map():
  """auto picks splash on a TPU mesh; the Mosaic kernel compiles per device, rows and heads split, with
  no collective (forward and backward)."""
  target = topologies.named(TOPOLOGY)
  mesh = sharding.make_mesh(data=1, fsdp=2, tensor=2, devices=list(target.devices))
  rules = sharding.PRESETS["fsdp_tp"]
  spec = lambda *axes: NamedSharding(mesh, jax.sharding.PartitionSpec(*axes))
  q = jax.ShapeDtypeStruct((4, 256, 8, 128), jnp.bfloat16, sharding=spec(("data", "fsdp"), None, "tensor"))
  kv = jax.ShapeDtypeStruct((4, 256, 2, 128), jnp.bfloat16, sharding=spec(("data", "fsdp"), None, "tensor"))
  ends = jax.ShapeDtypeStruct((4,), jnp.int32, sharding=spec(("data", "fsdp")))

  def loss(q, k, v, start, end):
    out = attention.attend(q, k, v, key_start=start, key_end=end, impl="auto")
    return jnp.sum(out.astype(jnp.float32) ** 2)

  program = sharding.jit(jax.grad(loss, (0, 1, 2)), mesh, rules)
  # conftest's "highest" matmul precision asks Mosaic for float32 contractions of bfloat16 operands,
  # which it refuses ("Bad lhs type"); a run keeps JAX's default.
  with jax.default_matmul_precision("default"), topologies.persistent_cache_for(target):
    found, _ = aot.compile_program("splash", program, (q, kv, kv, ends, ends))
    text = program.lower(q, kv, kv, ends, ends).compile().as_text()
  assert found.attention == ("splash",) and found.memory is not None
  assert "tpu_custom_call" in text and not hlo.collectives(text)


def test_the_hbm_table_is_the_compilers():
  target = topologies.named(TOPOLOGY)
  assert target.device_kind == "TPU v5" and len(target.devices) == 4
  assert abs(tpu_utils.probe_hbm_bytes(target) - target.chip.hbm_bytes) < 0.01 * 2**30


@SMOKE_REPORT
def test_the_smoke_runs_compile_time_is_reported(smoke_report):
  seconds = [p.lower_s + p.compile_s for phase in smoke_report.phases for p in phase.programs]
  assert all(s > 0 for s in seconds)
  assert dataclasses.asdict(smoke_report.config.model)["preset"] == "micro"


@SMOKE_REPORT
def test_the_roofline_of_the_smoke_run(smoke_report):
  """Each per-step phase at the slower of compute and memory, the loops' trips counted (packed: the
  micro-batches of the rows compiled), an MFU that is a fraction."""
  step = roofline.estimate(smoke_report)
  c = smoke_report.config
  assert [p.phase for p in step.phases] == ["rollout", "scoring", "update"]
  chip = topologies.CHIPS["TPU v5"]
  for p in step.phases:
    assert p.compute_s == p.flops / chip.peak_flops and p.collective_s == p.collective_bytes / chip.ici_bandwidth
    assert 0 < step.phase_mfu(p.phase) < 1 and p.model_flops > 0 and p.flops > 0 and p.bytes > 0, p.phase
    if p.phase != "rollout":  # Walked: each instruction at its slower side, one after another; collectives on ICI,
      # less the asynchronous ones' time under the core's work (at most all of it).
      assert p.groups and p.seconds == p.instructions_s + p.collective_s - min(p.hidden_s, p.collective_s), p.phase
      assert 0 <= p.hidden_s <= p.collective_s * 1.000001 and 0 <= p.hidden_cycles_s <= p.collective_s * 1.000001
      assert p.instructions_s == pytest.approx(sum(g[3] for name, g in p.groups.items() if name != "collective"))
      for name, (_, flops, bytes_, bound, _) in p.groups.items():
        sides = flops / chip.peak_flops, bytes_ / chip.hbm_bandwidth
        assert name == "collective" or max(sides) * 0.999999 <= bound <= sum(sides) * 1.000001, (p.phase, name)
      assert p.compiler_s == p.cycles_s + p.kernels_s + p.collective_s - min(p.hidden_cycles_s, p.collective_s)
  # The rollout's decode steps are priced one by one (each the slower of its FLOPs and bytes): at least the
  # sums' slower, at most both.
  rollout = step.phase("rollout")
  assert max(rollout.compute_s, rollout.memory_s) <= rollout.seconds - rollout.collective_s * 0.999999
  assert rollout.seconds <= (rollout.compute_s + rollout.memory_s + rollout.collective_s) * 1.000001
  d = step.decode  # Itemised: the bytes of every step are weights, KV read, KV written and the rest.
  assert d.engine == "static" and d.steps == step.decode_steps
  assert d.bytes == pytest.approx(d.steps * (d.weights + d.kv_read + d.kv_written + d.rest), rel=1e-6)
  assert 0 < d.floor_s <= d.seconds  # The rest left out: a bound from below.
  assert step.decode_steps >= c.rollout.max_response_tokens and 0 < step.mfu < 1 and 0 < step.rollout_share < 1
  assert step.model_flops == sum(p.model_flops for p in step.phases)
  text = roofline_text.format_estimate(step, "TPU v5")
  assert f"{step.rollout_share:.0%} of it" in text
  assert f"one program: {step.phase_mfu('update'):.1%})" in text
  assert ("update MFU" in text and "bound by" in text) == (step.phase_mfu("update") < roofline.MFU_FLOOR)
  assert (f"packing.micro_batch_rows={step.fitting_rows} pads at most" in text) == (
      step.fitting_rows > 0 and 1 - step.update_fill > micro_batch_cost.MAX_PADDING)
  assert c.packing.enabled
  m = packed_batch.micro_rows(c, smoke_report.mesh_shape["data"] * smoke_report.mesh_shape["fsdp"])
  assert micro_batch_cost.trips(smoke_report, "scoring") == -(-c.rollout.responses_per_step // m)  # A row each.
  assert f"MFU {step.mfu:.1%}" in roofline_text.format_estimate(step, "TPU v5")
  assert f"one RL step {step.compiler_seconds:.0f} s, MFU {step.compiler_mfu:.1%} (by the bound: {step.mfu:.1%})" \
      in text and "update by instruction group" in text and "scoring by instruction group" in text
  assert "the run's RL" not in text and (f"the run's RL: 100 steps x {step.seconds:.0f} s = "
                                          f"{100 * step.seconds / 3600:.1f} h") in roofline_text.format_estimate(
                                              step, "TPU v5", 100)


@pytest.mark.slow  # make test-slow: the rollout's programs at 64 layers, minutes of compiling.
def test_the_shipped_aime_rollout_fits_a_v5p_pod_within_the_margin():
  """Every rollout program of `aime` as shipped, at full depth on 256 v5p chips (v5p:8x8x4), needs at most
  92 % of the chip's HBM (`mesh.memory_margin`): a change to the model, the KV cache or the config that
  would not fit the pod fails here, on CPU. The tail's compaction is the peak, 0.69 GiB more per refill
  slot per group (docs/pod.md)."""
  config = get_experiment("aime")
  report = xla_report.compile_run(config, topologies.named("v5p:8x8x4"), phases=("rollout",))
  assert report.layers is None and report.architecture.num_layers == 64 and config.mesh.memory_margin == 0.08
  assert report.allowed == int(0.92 * topologies.CHIPS["TPU v5"].hbm_bytes) and report.refill
  for program in report.phases[0].programs:
    assert program.memory is not None and program.needs <= report.allowed, xla_report_text.refusal(report)
  assert not report.over()



def test_the_paged_kernel_is_opaque_to_cost_analysis():
  """What `cost_analysis` counts of the Pallas paged kernel does not grow with the pool (it sees none of the
  pages a row reads: roofline/decode_cost.py counts them from the schedule), while the gather's does: one
  chip of the topology, a head dim of 128, pools of 256 and 1,024 pages."""
  from vapo_jax.models import paged_attention

  device = topologies.named(TOPOLOGY).devices[0]
  on_chip = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=jax.sharding.SingleDeviceSharding(device))
  counted = {}
  for pages in (256, 1024):
    for implementation in ("kernel", "gather"):
      fn = jax.jit(lambda q, k, v, table, lengths, implementation=implementation: paged_attention.attend(
          q, k, v, table, lengths, 2, implementation=implementation, block_pages=4))
      pool = on_chip((1, 4, 1, pages, 128, 128), jnp.bfloat16)
      compiled = fn.lower(on_chip((64, 5, 128), jnp.bfloat16), pool, pool, on_chip((64, 16), jnp.int32),
                          on_chip((64,), jnp.int32)).compile()
      cost = compiled.cost_analysis()
      counted[implementation, pages] = (cost[0] if isinstance(cost, list) else cost)["bytes accessed"]
  assert counted["kernel", 256] == counted["kernel", 1024] < 2**21  # The queries, output and table: about 1 MiB.
  assert counted["gather", 256] > 10 * counted["kernel", 256]


@pytest.mark.slow  # make test-slow: four compiles of a small decode step for a v5p chip.
def test_what_cost_analysis_counts_of_a_decode_step(capsys):
  """One decode step of a small unrolled model (head dim 128, 64 rows, 4,096 cached tokens a row) compiled for
  one v5p chip at 1 and 2 layers: each layer adds to `cost_analysis`'s bytes its weights and about twice its
  whole cache slice, for the contiguous cache and the paged pool alike (the in-place write of one token a row is
  counted as the cache it updates), and nothing of the pages the kernel reads. So the corrected figure of the
  scanned program (`roofline.every_layer`) already held about 2x the cache per step, which the roofline before
  `roofline/decode_cost.py` then counted again as the whole-cache read; `decode_cost` counts the reads from the
  schedule, the writes as one token a row, and takes the rest from the program at a pool that does not
  change it (the decode loop of the refill engine: tests/test_compile_tpu.py's opaque kernel, docs/pod.md)."""
  from flax import nnx

  from vapo_jax.models.config import preset
  from vapo_jax.models.kv_cache import KVCache, PagedKVCache
  from vapo_jax.models.transformer import CausalLM

  device = topologies.named(TOPOLOGY).devices[0]
  rows, slots = 64, 4096

  def counted(layers: int, kind: str) -> float:
    cfg = dataclasses.replace(preset("tiny"), hidden_size=256, intermediate_size=512, num_heads=2, num_kv_heads=1,
                              head_dim=128, num_layers=layers, vocab_size=1024)
    model = CausalLM(cfg, scan_layers=False, dtype="bfloat16", param_dtype="bfloat16", rngs=nnx.Rngs(0))
    cache = (PagedKVCache.zeros(cfg, rows=rows, queues=1, pages=rows * slots // 128, page_tokens=128,
                                table_pages=slots // 128, dtype=jnp.bfloat16, implementation="kernel", block_pages=4)
             if kind == "paged" else KVCache.zeros(cfg, rows, slots, jnp.bfloat16, decode_block=512).replace(
                 length=jnp.zeros((rows,), jnp.int32)))
    on_chip = jax.sharding.SingleDeviceSharding(device)
    inputs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=on_chip), (nnx.state(model), cache))
    graph = nnx.graphdef(model)
    step = jax.jit(lambda state, cache: nnx.merge(graph, state)(
        jnp.zeros((rows, 1), jnp.int32), jnp.zeros((rows, 1), jnp.int32), jnp.ones((rows, 1), bool), cache))
    cost = step.lower(*inputs).compile().cost_analysis()
    return (cost[0] if isinstance(cost, list) else cost)["bytes accessed"]

  layer_cache = rows * slots * 2 * 128 * 2  # Keys and values of one layer: 1 KV head of 128, bfloat16.
  layer_weights = (256 * 2 * 128 + 2 * 256 * 128 + 2 * 128 * 256 + 3 * 256 * 512) * 2
  for kind in ("contiguous", "paged"):
    per_layer = counted(2, kind) - counted(1, kind)
    with capsys.disabled():
      print(f"\n{kind}: a layer adds {per_layer / 2**20:.1f} MiB to cost_analysis's bytes: its weights "
            f"{layer_weights / 2**20:.2f} MiB, its cache slice {layer_cache / 2**20:.1f} MiB")
    assert 1.5 * layer_cache < per_layer - layer_weights < 2.5 * layer_cache, kind


def test_the_kernels_cache_write_compiles_to_one_scatter():
  """The paged cache's write in the kernel's layout (one token a row, rows of the pool flattened to token slots)
  compiles for a v5p chip to one scatter and no loop; the write batched over queues is expanded by the TPU
  compiler into a loop over the rows (one iteration a row, per layer and step)."""
  from vapo_jax.models import paged_attention

  device = topologies.named(TOPOLOGY).devices[0]
  on_chip = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=jax.sharding.SingleDeviceSharding(device))
  args = (on_chip((1, 4, 1, 512, 128, 128), jnp.bfloat16), on_chip((256, 1, 128), jnp.bfloat16),
          on_chip((256,), jnp.int32), on_chip((256,), jnp.int32))
  texts = {}
  for implementation in ("kernel", "gather"):
    fn = jax.jit(lambda *a, implementation=implementation: paged_attention.write(*a, 2, implementation=implementation),
                 donate_argnums=0)
    texts[implementation] = fn.lower(*args).compile().as_text()
  assert " while(" not in texts["kernel"] and "scatter(" in texts["kernel"]
  assert " while(" in texts["gather"]
