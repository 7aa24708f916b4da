"""The HLO reader (`memory/hlo.py`) as the compile report reads decode loops: collectives in a
conditional's branch flagged, loops found by their `jax.named_scope` (op_name), a loop's traffic per
iteration with and without branches (`aot.decode_traffic`); on a hand-written module and on programs
compiled for the 8 CPU devices. (tests/test_layout.py tests the reader's sizes and loops.)"""

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from vapo_jax.memory import aot, hlo

MODULE = """HloModule jit_f, entry_computation_layout={(f32[8,256]{1,0})->f32[8,256]{1,0}}

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %sum = f32[] add(%x, %y)
}

%insert (p: (s32[], bf16[64,256])) -> (s32[], bf16[64,256]) {
  %p = (s32[], bf16[64,256]) parameter(0)
  %w = bf16[64,256]{1,0:T(8,128)(2,1)} get-tuple-element(%p), index=1
  %gathered = bf16[256,256]{1,0} all-gather(%w), channel_id=9, replica_groups={{0,1,2,3}}, dimensions={0}
  ROOT %t = (s32[], bf16[64,256]) tuple(%i, %w)
}

%body (c: (s32[], f32[8,256], bf16[64,256])) -> (s32[], f32[8,256], bf16[64,256]) {
  %c = (s32[], f32[8,256], bf16[64,256]) parameter(0)
  %h = f32[8,256]{1,0} get-tuple-element(%c), index=1
  %s = f32[8]{0} reduce(%h, %zero), dimensions={1}, to_apply=%add
  %r = f32[8,256]{1,0} all-reduce(%h), channel_id=2, replica_groups=[1,4]<=[4], to_apply=%add, \
metadata={op_name="jit(f)/decode_loop/while/body/dot_general"}
  %a = (f32[8,256]{1,0}, f32[8]{0}) all-reduce-start(%r, %s), channel_id=3, to_apply=%add
  %d = (f32[8,256]{1,0}, f32[8]{0}) all-reduce-done(%a)
  %inner = (s32[], f32[8,256]) while(%t2), condition=%inner_cond, body=%inner_body, \
backend_config={"known_trip_count":{"n":"3"}}
  %k = (s32[], bf16[64,256]) conditional(%pred, %t3, %t3), branch_computations={%insert, %keep}
  ROOT %out = (s32[], f32[8,256], bf16[64,256]) tuple(%i, %r, %w)
}

%inner_body (q: (s32[], f32[8,256])) -> (s32[], f32[8,256]) {
  %q = (s32[], f32[8,256]) parameter(0)
  %v = f32[8,256]{1,0} get-tuple-element(%q), index=1
  %p1 = f32[8,256]{1,0} collective-permute(%v), channel_id=5, source_target_pairs={{0,1},{1,0}}
  ROOT %o = (s32[], f32[8,256]) tuple(%j, %p1)
}

%inner_cond (q: (s32[], f32[8,256])) -> pred[] {
  ROOT %lt = pred[] compare(%j, %n), direction=LT
}

%keep (p: (s32[], bf16[64,256])) -> (s32[], bf16[64,256]) {
  ROOT %p = (s32[], bf16[64,256]) parameter(0)
}

%cond (c: (s32[], f32[8,256], bf16[64,256])) -> pred[] {
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

ENTRY %main (x: f32[8,256], w: bf16[64,256]) -> f32[8,256] {
  %x = f32[8,256]{1,0} parameter(0)
  %w0 = bf16[64,256]{1,0} parameter(1)
  %full = bf16[256,256]{1,0} all-gather(%w0), channel_id=1, replica_groups={{0,1,2,3}}, dimensions={0}
  %loop = (s32[], f32[8,256], bf16[64,256]) while(%init), condition=%cond, body=%body, \
metadata={op_name="jit(f)/decode_loop/while"}
  ROOT %y = f32[8,256]{1,0} get-tuple-element(%loop), index=1
}
"""


def test_collectives_of_a_hand_written_module():
  found = {c.name: c for c in hlo.collectives(MODULE)}
  assert set(found) == {"full", "r", "a", "p1", "gathered"}  # "-done" is not counted again.
  assert found["full"].loops == () and found["full"].op == "all-gather" and not found["full"].conditional
  assert found["full"].result_bytes == 256 * 256 * 2 and found["full"].operand_bytes == 64 * 256 * 2
  assert found["r"].loops == (("loop", None),) and not found["r"].conditional
  assert found["a"].op == "all-reduce" and found["a"].operand_bytes == 8 * 256 * 4 + 8 * 4  # A combined tuple.
  assert found["p1"].loops == (("loop", None), ("inner", 3))
  assert found["gathered"].conditional and found["gathered"].loops == (("loop", None),)
  assert hlo.while_op_names(MODULE) == {"inner": "", "loop": "jit(f)/decode_loop/while"}


def test_decode_traffic_per_iteration():
  found = hlo.collectives(MODULE)
  every = 8 * 256 * 4 + (8 * 256 * 4 + 8 * 4) + 3 * 8 * 256 * 4  # r, a, and p1 on each of 3 inner trips.
  assert hlo.bytes_per_iteration(found, "loop", branches=False) == every
  assert hlo.bytes_per_iteration(found, "loop") == every + 256 * 256 * 2  # With the conditional's all-gather.
  assert aot.decode_traffic(found, hlo.while_op_names(MODULE)) == aot.DecodeTraffic(
      "loop", every, 3, 256 * 256 * 2, 256 * 256 * 2)
  assert aot.decode_traffic(found, {"loop": "jit(f)/while"}) is None  # No loop traced under decode_loop.


def _mesh():
  return Mesh(np.asarray(jax.devices()[:8]), ("x",))


def test_compiled_loop_of_an_all_reduce_on_8_cpu_devices():
  """A sharded matmul inside a named loop: XLA's all-reduce is found inside it, each step's bytes."""
  mesh = _mesh()

  def f(w, x):
    with jax.named_scope("decode_loop"):
      return lax.while_loop(lambda c: c[0] < jnp.sum(c[1]).astype(jnp.int32), lambda c: (c[0] + 1, jnp.tanh(c[1] @ w)),
                            (0, x))[1]

  w = jax.ShapeDtypeStruct((256, 256), jnp.float32, sharding=NamedSharding(mesh, P("x")))
  x = jax.ShapeDtypeStruct((4, 256), jnp.float32, sharding=NamedSharding(mesh, P(None, "x")))
  text = jax.jit(f, out_shardings=NamedSharding(mesh, P(None, "x"))).lower(w, x).compile().as_text()
  found = hlo.collectives(text)
  traffic = aot.decode_traffic(found, hlo.while_op_names(text))
  assert traffic is not None and traffic.count >= 1 and traffic.bytes > 0
  assert any(c.op in ("all-reduce", "reduce-scatter") and c.loops for c in found)
  assert 4 * 256 * 4 // 8 <= traffic.largest <= 4 * 256 * 4 + 4  # A [4, 256] partial sum, not the [256, 256] weight.


def test_weight_gather_outside_the_loop_is_not_counted_in_it():
  mesh = _mesh()

  def f(w, x):
    w = jax.lax.with_sharding_constraint(w, NamedSharding(mesh, P()))  # Gathered once, before the loop.
    with jax.named_scope("decode_loop"):
      return lax.fori_loop(0, x.shape[0], lambda i, h: jnp.tanh(h @ w), x)

  w = jax.ShapeDtypeStruct((128, 128), jnp.float32, sharding=NamedSharding(mesh, P("x")))
  x = jax.ShapeDtypeStruct((8, 128), jnp.float32, sharding=NamedSharding(mesh, P()))
  text = jax.jit(f).lower(w, x).compile().as_text()
  found = hlo.collectives(text)
  gathers = [c for c in found if max(c.operand_bytes, c.result_bytes) >= 128 * 128 * 4]
  assert gathers and all(not c.loops for c in gathers)
  assert aot.decode_traffic(found, hlo.while_op_names(text)).bytes < 128 * 128 * 4
