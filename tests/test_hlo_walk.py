"""The HLO walk (`memory/hlo_walk.py`) against hand counts: on a hand-written module (each rule on its own:
a loop's trips read from its condition, an in-place update counted as its update, a fusion's gathered
operand as its rows, VMEM as nothing, a conditional as its costliest branch, a Pallas call set apart, the
compiler's cycles times the trips), and on a scan compiled for a v5p chip by the TPU compiler (skipped
without libtpu): its trip count read from the condition (the compiler prints none), and a 32 MiB buffer
updated in place one row an iteration counted as the rows it reads and writes."""

import jax
import jax.numpy as jnp
import pytest
from jax import lax

from vapo_jax.memory import hlo, hlo_walk, topologies

ALIAS = '"aliasing_operands":{"lists":[{"indices":["0","2"]}]}'
MODULE = """HloModule jit_f

%dus (a: f32[1024,256], u: f32[1,256]) -> f32[1024,256] {
  %a = f32[1024,256]{1,0} parameter(0)
  %u = f32[1,256]{1,0} parameter(1)
  %z = s32[] constant(0)
  ROOT %d = f32[1024,256]{1,0} dynamic-update-slice(%a, %u, %z, %z)
}

%take (t: f32[512,256], i: s32[]) -> f32[1,256] {
  %t = f32[512,256]{1,0} parameter(0)
  %i = s32[] parameter(1)
  %z = s32[] constant(0)
  ROOT %s = f32[1,256]{1,0} dynamic-slice(%t, %i, %z), dynamic_slice_sizes={1,256}
}

%cond (p: {T}) -> pred[] {
  %p = {T} parameter(0)
  %n = s32[] constant(9)
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%left (q: f32[64]) -> f32[64] {
  %q = f32[64]{0} parameter(0)
  ROOT %l = f32[64]{0} negate(%q)
}

%right (q: f32[64]) -> f32[64] {
  %q = f32[64]{0} parameter(0)
  %r0 = f32[64]{0} negate(%q)
  ROOT %r1 = f32[64]{0} negate(%r0)
}

%body (p: {T}) -> {T} {
  %p = {T} parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %a = f32[1024,256]{1,0} get-tuple-element(%p), index=1
  %t = f32[512,256]{1,0} get-tuple-element(%p), index=2
  %row = f32[1,256]{1,0:S(1)} fusion(%t, %i), kind=kLoop, calls=%take, backend_config={"estimated_cycles":"10"}
  %new = f32[1024,256]{1,0} fusion(%a, %row), kind=kLoop, calls=%dus, backend_config={ALIAS}
  %pick = pred[] constant(true)
  %small = f32[64]{0} broadcast(%row), dimensions={}
  %branch = f32[64]{0} conditional(%pick, %small, %small), branch_computations={%left, %right}
  %k = f32[8]{0} custom-call(%small), custom_call_target="tpu_custom_call", backend_config={"config":"{
"block": 512
}"}
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %out = {T} tuple(%next, %new, %t)
}

%forever (p: {T}) -> pred[] {
  %p = {T} parameter(0)
  ROOT %go = pred[] constant(true)
}

ENTRY %main (a0: f32[1024,256], t0: f32[512,256]) -> f32[1024,256] {
  %a0 = f32[1024,256]{1,0} parameter(0)
  %t0 = f32[512,256]{1,0} parameter(1)
  %two = s32[] constant(2)
  %start = s32[] copy(%two)
  %init = {T} tuple(%start, %a0, %t0)
  %loop = {T} while(%init), condition=%cond, body=%body, metadata={op_name="jit(f)/rows/while"}
  %again = {T} while(%init), condition=%forever, body=%body, metadata={op_name="jit(f)/open/while"}
  ROOT %r = f32[1024,256]{1,0} get-tuple-element(%loop), index=1
}
""".replace("{ALIAS}", ALIAS).replace("{T}", "(s32[], f32[1024,256], f32[512,256])")
ROW, SMALL = 256 * 4, 64 * 4


def test_each_rule_of_the_walk_on_a_hand_written_module():
  walked = hlo_walk.walk(MODULE)
  rows, forever = walked.loop("rows"), walked.loop("open")
  assert rows.trips == 9 - 2 and forever.trips is None  # From 2 (a copied constant) while < 9; an open loop: None.
  # One iteration: the row gathered (one row of the table and its index read, written to VMEM: nothing), the
  # update written in place (one row, not the 1 MiB buffer), the broadcast's 64 floats written, the costlier
  # branch (two negates, each reading and writing), the kernel's operand and result, the counter's add (three
  # scalars); the condition's compare (two scalars read, a predicate written).
  kernel = SMALL + 8 * 4
  body = (ROW + 4) + ROW + SMALL + 2 * 2 * SMALL + kernel + 3 * 4
  condition = 4 + 4 + 1
  assert rows.iteration.bytes == body + condition and rows.iteration.kernel_bytes == kernel
  assert rows.iteration.cycles == 10
  assert walked.bytes == 7 * (body + condition) + body + (4 + 4)  # The open loop once; the start's copy.
  assert walked.cycles == 8 * 10 and walked.kernel_bytes == 8 * kernel


def test_a_counter_that_steps_by_two_runs_half_the_trips():
  walked = hlo_walk.walk(MODULE.replace("%one = s32[] constant(1)", "%one = s32[] constant(2)"))
  assert walked.loop("rows").trips == 4  # 2, 4, 6, 8 < 9.


def test_the_matmuls_flops_equal_cost_analysiss_on_a_program_without_loops():
  """Dots and convolutions (XLA's form of a sharded einsum: windows over heads, padded taps that multiply nothing)
  on a (fsdp 2, tensor 2) mesh compiled for v5p, forward and backward: the walk's FLOPs within 1% of XLA's."""
  pytest.importorskip("libtpu")
  import numpy as np
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P

  mesh = Mesh(np.array(topologies.named("v5p:2x2x1").devices).reshape(2, 2), ("fsdp", "tensor"))
  on = lambda shape, *spec: jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=NamedSharding(mesh, P(*spec)))

  def f(x, wq, wo, w1):
    a = jnp.einsum("btnh,nhd->btd", jnp.einsum("btd,dnh->btnh", x, wq), wo)
    return jnp.sum(jnp.einsum("btd,df->btf", a, w1).astype(jnp.float32) ** 2)
  args = (on((4, 512, 256), "fsdp"), on((256, 8, 32), "fsdp", "tensor"), on((8, 32, 256), "tensor", None, "fsdp"),
          on((256, 1024), "fsdp", "tensor"))
  for fn in (f, jax.grad(f, argnums=(1, 2, 3))):
    compiled = jax.jit(fn).lower(*args).compile()
    cost = compiled.cost_analysis()
    xla = (cost[0] if isinstance(cost, list) else cost)["flops"]
    assert hlo_walk.walk(compiled.as_text()).flops == pytest.approx(xla, rel=0.01)


def test_collectives_in_a_loop_carry_the_trips_read_from_its_condition():
  module = MODULE.replace("%k = f32[8]{0} custom-call", "%g = f32[256]{0} all-gather(%small), dimensions={0}\n  %k = "
                                                          "f32[8]{0} custom-call")
  found = {c.loops[0][0]: c for c in hlo.collectives(module)}
  assert found["loop"].loops == (("loop", 7),) and found["again"].loops == (("again", None),)


@pytest.mark.skipif(topologies.libtpu_missing() is not None, reason=str(topologies.libtpu_missing()))
def test_a_scan_compiled_for_a_v5p_chip_is_walked_by_its_trips_and_its_updates():
  device = topologies.named("v5p:2x2x1").devices[0]
  on_chip = lambda shape: jax.ShapeDtypeStruct(shape, jnp.float32, sharding=jax.sharding.SingleDeviceSharding(device))

  def f(buffer, table, ids, x):
    def body(carry, i):
      buffer, x = carry
      row = jnp.take(table, ids[i], axis=0)  # A gather: one row of the 16 MiB table.
      return (lax.dynamic_update_slice(buffer, (row * x)[None], (i, 0)), x + 1.0), None  # One row of 32 MiB.
    return lax.scan(body, (buffer, x), jnp.arange(7))[0]

  compiled = jax.jit(f, donate_argnums=0).lower(on_chip((8192, 1024)), on_chip((4096, 1024)),
                                                jax.ShapeDtypeStruct((7,), jnp.int32, sharding=on_chip((1,)).sharding),
                                                on_chip((1024,))).compile()
  text = compiled.as_text()
  walked = hlo_walk.walk(text)
  assert "known_trip_count" not in text and [x.trips for x in walked.loops] == [7]
  row = 1024 * 4
  # Per iteration: the table's row read, x read and written, the row written into the buffer; scalars besides.
  iteration = walked.loops[0].iteration.bytes
  assert 4 * row <= iteration <= 4 * row + 512
  assert 7 * iteration <= walked.bytes <= 7 * iteration + 4 * row  # x copied in and out around the loop.


def test_groups_add_up_to_the_walk_and_each_instruction_is_bound_by_its_slower_side():
  walked = hlo_walk.walk(MODULE, ridge=10.0)
  groups = walked.groups
  for i, total in ((1, walked.flops), (2, walked.bytes), (3, walked.cycles)):
    assert sum(g[i] for g in groups.values()) == total
  assert groups["gather, slice"][0] == 8 and groups["gather, slice"][3] == 8 * 10  # The row's fusion, 7 + 1 runs.
  assert groups["in-place update"][2] == 8 * ROW and groups["Pallas kernel"][2] == walked.kernel_bytes
  # A matmul (compute-bound at a ridge of 10 FLOPs a byte) and an elementwise fusion after it: one after the
  # other, each at its slower side; the phase-wide max would hide the second's bytes under the first's FLOPs.
  module = """HloModule m

%mm (x: f32[128,256], w: f32[256,512]) -> f32[128,512] {
  %x = f32[128,256]{1,0} parameter(0)
  %w = f32[256,512]{1,0} parameter(1)
  ROOT %d = f32[128,512]{1,0} dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%ew (y: f32[128,512]) -> f32[128,512] {
  %y = f32[128,512]{1,0} parameter(0)
  ROOT %n = f32[128,512]{1,0} negate(%y)
}

ENTRY %main (x0: f32[128,256], w0: f32[256,512]) -> f32[128,512] {
  %x0 = f32[128,256]{1,0} parameter(0)
  %w0 = f32[256,512]{1,0} parameter(1)
  %d0 = f32[128,512]{1,0} fusion(%x0, %w0), kind=kOutput, calls=%mm
  ROOT %e0 = f32[128,512]{1,0} fusion(%d0), kind=kLoop, calls=%ew
}
"""
  walked = hlo_walk.walk(module, ridge=10.0)
  flops, dot_bytes, ew_bytes = 2 * 128 * 512 * 256, (128 * 256 + 256 * 512 + 128 * 512) * 4, 2 * 128 * 512 * 4
  assert walked.groups["matmul"] == [1, flops, dot_bytes, 0, flops / 10]  # Compute-bound: FLOPs over the ridge.
  assert walked.groups["elementwise"] == [1, 0, ew_bytes, 0, ew_bytes]
  assert flops / 10 + ew_bytes > max(walked.flops / 10, walked.bytes)
  assert hlo_walk.walk(module).groups["matmul"][4] == dot_bytes  # No ridge: bytes.


def test_a_copy_into_its_own_buffer_before_a_slice_moves_nothing():
  """The TPU compiler puts a copy between an int8 pool and the fusion that slices it, only renaming its tiling
  (T(32,128)(4,1) → T(8,128)(4,1): the same bytes), aliased to its operand: the slice still counts its row, not
  the table. The same copy not aliased is a real copy: the whole table is read."""
  def retiled(alias: str) -> str:
    return MODULE.replace("""  ROOT %s = f32[1,256]{1,0} dynamic-slice(%t, %i, %z), dynamic_slice_sizes={1,256}
}""", f"""  %r = f32[512,256]{{1,0}} fusion(%t), kind=kLoop, {alias}calls=%retile
  ROOT %s = f32[1,256]{{1,0}} dynamic-slice(%r, %i, %z), dynamic_slice_sizes={{1,256}}
}}

%retile (x: f32[512,256]) -> f32[512,256] {{
  %x = f32[512,256]{{1,0}} parameter(0)
  ROOT %c = f32[512,256]{{1,0}} copy(%x)
}}""")
  plain = hlo_walk.walk(MODULE).loop("rows").iteration.bytes
  assert hlo_walk.walk(retiled("output_to_operand_aliasing={{}: (0, {})}, ")).loop("rows").iteration.bytes == plain
  assert hlo_walk.walk(retiled("")).loop("rows").iteration.bytes == plain - ROW + 512 * ROW


def test_an_asynchronous_collective_overlaps_what_runs_between_its_start_and_done():
  """On a chip (`walk(..., chip=)`): a collective-permute whose start and done bracket a matmul runs under it (the
  compiler's schedule is the text's order), at the chip's ICI bandwidth, up to the matmul's time at its bound and
  at its cycles; one after the matmul's done, or synchronous, runs under nothing; two in flight share the link."""
  chip = topologies.Chip(hbm_bytes=0, peak_flops=1e12, hbm_bandwidth=1e10, ici_bandwidth=1e9, clock_hz=1e9)
  send = "(f32[1000]{0}, f32[1000]{0}, u32[]{:S(2)}, u32[]{:S(2)})"  # 4,000 bytes: 4 µs over ICI.

  def module(between: str, cycles: int) -> str:
    return f"""HloModule m, is_scheduled=true

%mm (x: f32[100,100], w: f32[100,100]) -> f32[100,100] {{
  %x = f32[100,100]{{1,0}} parameter(0)
  %w = f32[100,100]{{1,0}} parameter(1)
  ROOT %d = f32[100,100]{{1,0}} dot(%x, %w), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}
}}

ENTRY %main (a: f32[1000], x0: f32[100,100]) -> f32[100,100] {{
  %a = f32[1000]{{0}} parameter(0)
  %x0 = f32[100,100]{{1,0}} parameter(1)
  %s = {send} collective-permute-start(%a), source_target_pairs={{{{0,1}},{{1,0}}}}
  {between}
  %r = f32[1000]{{0}} collective-permute-done(%s)
  ROOT %m = f32[100,100]{{1,0}} fusion(%x0, %x0), kind=kOutput, calls=%mm,
    backend_config={{"estimated_cycles":"{cycles}"}}
}}
"""
  # The matmul: 2e6 FLOPs (2 µs at peak), 120 kB (12 µs at the HBM's bandwidth): bound 12 µs; 3,000 cycles: 3 µs.
  inside = ('%n = f32[100,100]{1,0} fusion(%x0, %x0), kind=kOutput, calls=%mm, '
            'backend_config={"estimated_cycles":"3000"}')
  walked = hlo_walk.walk(module(inside, 3000), chip=chip)
  assert walked.collective_s == pytest.approx(4e-6)
  assert walked.hidden_s == pytest.approx(4e-6) and walked.hidden_cycles_s == pytest.approx(3e-6)
  alone = hlo_walk.walk(module("", 3000), chip=chip)  # Nothing between its start and done.
  assert alone.collective_s == pytest.approx(4e-6) and alone.hidden_s == 0 and alone.hidden_cycles_s == 0
  second = f"%s2 = {send} collective-permute-start(%a), source_target_pairs={{{{0,1}},{{1,0}}}}\n  {inside}\n" \
      "  %r2 = f32[1000]{0} collective-permute-done(%s2)"
  both = hlo_walk.walk(module(second, 3000), chip=chip)  # In flight together: the second after the first, 4-8 µs.
  assert both.collective_s == pytest.approx(8e-6) and both.hidden_s == pytest.approx(8e-6)
  assert both.hidden_cycles_s == pytest.approx(3e-6)  # The 3-µs matmul hides 3 of the 8 µs.
  synchronous = inside + "\n  %g = f32[2000]{0} all-gather(%a), dimensions={0}"
  assert hlo_walk.walk(module(synchronous, 3000), chip=chip).hidden_s == pytest.approx(4e-6)  # The permute's only.
  assert hlo_walk.walk(module(inside, 3000)).hidden_s == 0  # Without a chip: nothing priced.


def test_a_packed_int4_array_is_half_an_int8_ones_bytes():
  """Sub-byte types count their packed bytes (a TPU lays `s4` out two to a byte, `E(4)`), not none: an int4
  weight compiled for a v5p chip into a matmul moves half the int8 weight's bytes."""
  assert hlo.arrays("s4[5120,3456]{1,0:T(8,128)(8,1)E(4)}") == [("s4", (5120, 3456), 5120 * 3456 // 2)]
  assert hlo.arrays("(u4[3], f4e2m1fn[5], token[])") == [("u4", (3,), 2), ("f4e2m1fn", (5,), 3)]
  assert hlo_walk.hbm_bytes("s4[5120,3456]{1,0:T(8,128)(8,1)E(4)}") == 5120 * 3456 // 2
  device = topologies.named("v5p:2x2x1").devices[0]
  on_chip = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=jax.sharding.SingleDeviceSharding(device))
  walked = {dtype: hlo_walk.walk(jax.jit(lambda x, w: x @ w.astype(jnp.bfloat16)).lower(
      on_chip((8, 4096), jnp.bfloat16), on_chip((4096, 2048), dtype)).compile().as_text()).bytes
            for dtype in (jnp.int8, jnp.int4)}
  # The weight passes (a relayout copy, then the matmul's read) move 2 bytes an element at int8, 1 at int4; the
  # activations are the same.
  assert walked[jnp.int8] - walked[jnp.int4] == 4096 * 2048


def test_a_continuation_fusion_moves_its_collective_while_its_own_work_runs():
  """libtpu's asynchronous collective fusion (`continuation_config`): a fusion computing a matmul beside an
  all-gather is grouped as a matmul, and its all-gather's bytes cross ICI while the matmul runs (up to the
  matmul's time at its bound and at its cycles); a collective split over two such fusions (one channel) counts
  half in each. Priced as a lone collective instead, the matmul's cycles went to the collective group and every
  operand of the fusion crossed ICI."""
  chip = topologies.Chip(hbm_bytes=0, peak_flops=1e12, hbm_bandwidth=1e10, ici_bandwidth=1e9, clock_hz=1e9)

  def module(fusions: int) -> str:
    calls = "\n".join(
        f'  %f{k} = (f32[100,100]{{1,0}}, f32[2000]{{0}}) fusion(%x0, %a), kind=kOutput, calls=%acf, '
        f'backend_config={{"estimated_cycles":"3000","continuation_config":{{"output_tuple_original_start":"0"}}}}'
        for k in range(fusions))
    return f"""HloModule m, is_scheduled=true

%acf (x: f32[100,100], g: f32[1000]) -> (f32[100,100], f32[2000]) {{
  %x = f32[100,100]{{1,0}} parameter(0)
  %g = f32[1000]{{0}} parameter(1)
  %d = f32[100,100]{{1,0}} dot(%x, %x), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}
  %ag = f32[2000]{{0}} all-gather(%g), channel_id=7, replica_groups={{{{0,1}}}}, dimensions={{0}}
  ROOT %t = (f32[100,100]{{1,0}}, f32[2000]{{0}}) tuple(%d, %ag)
}}

ENTRY %main (a: f32[1000], x0: f32[100,100]) -> f32[100,100] {{
  %a = f32[1000]{{0}} parameter(0)
  %x0 = f32[100,100]{{1,0}} parameter(1)
{calls}
  ROOT %m = f32[100,100]{{1,0}} get-tuple-element(%f0), index=0
}}
"""
  # The matmul: 2e6 FLOPs, 80 kB read and 88 kB written (16.8 µs at its bound), 3 µs of cycles; the gather's
  # 8,000 bytes: 8 µs over ICI.
  one = hlo_walk.walk(module(1), chip=chip)
  assert set(one.groups) == {"matmul"} and one.flops == 2e6
  assert one.collective_s == pytest.approx(8e-6)
  assert one.hidden_s == pytest.approx(8e-6) and one.hidden_cycles_s == pytest.approx(3e-6)
  two = hlo_walk.walk(module(2), chip=chip)  # One gather in two steps: 4 µs beside each matmul.
  assert two.collective_s == pytest.approx(8e-6)
  assert two.hidden_s == pytest.approx(8e-6) and two.hidden_cycles_s == pytest.approx(6e-6)
