"""GAE benchmark: the jitted decoupled GAE against the formulations it replaces.

  make bench        (or: python -m benchmarks.gae_bench [--quick])

For B=512 sequences of T ∈ {1024, 4096} tokens with per-sequence λ_actor and λ_critic = 1, times:
  vapo_jax        `advantages.decoupled_gae` (one time-major reverse lax.scan), jitted
  unroll=U        the same with lax.scan unrolled U steps
  vmap-row-scan   a straightforward vmapped per-row lax.scan of the same math (two λs)
  assoc-scan      the same linear recurrences with jax.lax.associative_scan (time-major)
  numpy-loop      a vectorised numpy reverse loop over time
  python-O(T²)    the textbook per-trajectory sum Â_t = Σ_k (γλ)^k δ_{t+k}, timed on a few short
                  rows and extrapolated as B·T²
Prints medians and ratios to vapo_jax; every variant is first checked against vapo_jax.
"""

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from vapo_jax.rl import advantages as adv


def make_batch(batch, steps, seed=0):
  rng = np.random.default_rng(seed)
  lengths = rng.integers(1, steps + 1, batch)
  mask = np.arange(steps)[None] < lengths[:, None]
  rewards = np.where(np.arange(steps)[None] == lengths[:, None] - 1, rng.choice([-1.0, 1.0], (batch, 1)), 0.0)
  values = rng.normal(size=(batch, steps)) * mask
  lam = np.asarray(adv.length_adaptive_lambda(lengths, alpha=0.05))
  return rewards.astype(np.float32), values.astype(np.float32), mask, lam.astype(np.float32)


def median_seconds(fn, *args, repeats=15):
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return float(np.median(times))


def vapo_jax_gae(unroll=1):
  return jax.jit(lambda r, v, m, lam: adv.decoupled_gae(r, v, m, gamma=1.0, lam_actor=lam,
                                                        lam_critic=1.0, unroll=unroll))


@jax.jit
def vmap_row_scan(rewards, values, mask, lam):
  def row(r, v, m, lam_actor):
    def step(carry, xs):
      next_value, a_actor, a_critic = carry
      reward, value, valid = xs
      delta = reward + next_value - value
      a_actor = jnp.where(valid, delta + lam_actor * a_actor, a_actor)
      a_critic = jnp.where(valid, delta + a_critic, a_critic)
      next_value = jnp.where(valid, value, next_value)
      return (next_value, a_actor, a_critic), (jnp.where(valid, a_actor, 0.0), jnp.where(valid, a_critic + value, 0.0))
    _, out = jax.lax.scan(step, (0.0, 0.0, 0.0), (r, v, m), reverse=True)
    return out
  return jax.vmap(row)(rewards, values, mask, lam)


@jax.jit
def associative_scan_gae(rewards, values, mask, lam):
  # Both recurrences are affine, x_t = c_t·x_{t+1} + d_t; compose (c, d) pairs in log depth.
  compose = lambda later, earlier: (later[0] * earlier[0], earlier[1] + earlier[0] * later[1])
  r, v, valid = rewards.T, values.T, mask.T
  m = valid.astype(jnp.float32)
  batch = r.shape[1]
  # Value at the next valid position: nv_t = m_{t+1}·v_{t+1} + (1 − m_{t+1})·nv_{t+1}.
  c_next = jnp.concatenate([1.0 - m[1:], jnp.ones((1, batch))])
  d_next = jnp.concatenate([m[1:] * v[1:], jnp.zeros((1, batch))])
  _, next_value = jax.lax.associative_scan(compose, (c_next, d_next), reverse=True, axis=0)
  delta = m * (r + next_value - v)
  rho = jnp.stack([lam, jnp.ones_like(lam)])[None]  # [1, 2, B]
  c = jnp.where(valid[:, None], rho, 1.0)
  _, a = jax.lax.associative_scan(compose, (c, jnp.broadcast_to(delta[:, None], c.shape)), reverse=True, axis=0)
  a = jnp.where(valid[:, None], a, 0.0)
  return a[:, 0].T, jnp.where(mask, a[:, 1].T + values, 0.0)


def numpy_loop(rewards, values, mask, lam):
  batch, steps = rewards.shape
  next_value, a_actor, a_critic = np.zeros(batch, np.float32), np.zeros(batch, np.float32), np.zeros(batch, np.float32)
  out_actor, out_critic = np.zeros_like(rewards), np.zeros_like(rewards)
  for t in range(steps - 1, -1, -1):
    valid = mask[:, t]
    delta = rewards[:, t] + next_value - values[:, t]
    a_actor = np.where(valid, delta + lam * a_actor, a_actor)
    a_critic = np.where(valid, delta + a_critic, a_critic)
    next_value = np.where(valid, values[:, t], next_value)
    out_actor[:, t] = np.where(valid, a_actor, 0.0)
    out_critic[:, t] = np.where(valid, a_critic + values[:, t], 0.0)
  return out_actor, out_critic


def python_quadratic_row(r, v, m, lam):
  """Textbook per-trajectory GAE of one row: every advantage summed term by term."""
  steps = [t for t in range(len(r)) if m[t]]
  deltas = [r[t] + (v[steps[i + 1]] if i + 1 < len(steps) else 0.0) - v[t] for i, t in enumerate(steps)]
  out = [0.0] * len(r)
  for i, t in enumerate(steps):
    total, decay = 0.0, 1.0
    for k in range(i, len(steps)):
      total += decay * deltas[k]
      decay *= lam
    out[t] = total
  return out


def bench(batch, steps, quick):
  rewards, values, mask, lam = make_batch(batch, steps)
  args = tuple(jnp.asarray(x) for x in (rewards, values, mask, lam))
  reference = vapo_jax_gae()(*args)
  rows = []
  variants = [("vapo_jax", vapo_jax_gae())]
  variants += [(f"unroll={u}", vapo_jax_gae(u)) for u in (4, 16)]
  variants += [("vmap-row-scan", vmap_row_scan), ("assoc-scan", associative_scan_gae)]
  for name, fn in variants:
    out = fn(*args)
    np.testing.assert_allclose(out[0], reference[0], atol=2e-3, rtol=1e-4)
    np.testing.assert_allclose(out[1], reference[1], atol=2e-3, rtol=1e-4)
    rows.append((name, median_seconds(fn, *args, repeats=5 if quick else 15), ""))
  start = time.perf_counter()
  out = numpy_loop(rewards, values, mask, lam)
  rows.append(("numpy-loop", time.perf_counter() - start, ""))
  np.testing.assert_allclose(out[0], reference[0], atol=2e-3, rtol=1e-4)
  # The quadratic Python loop: time a few rows of a short length, extrapolate as B·T².
  short = 256
  sample = make_batch(4, short, seed=1)
  start = time.perf_counter()
  for b in range(4):
    python_quadratic_row(*(x[b].tolist() if x.ndim > 1 else float(x[b]) for x in sample))
  per_row_t2 = (time.perf_counter() - start) / 4 / short**2
  rows.append(("python-O(T²)", per_row_t2 * batch * steps**2, f"extrapolated from 4×{short}"))
  base = rows[0][1]
  print(f"\nGAE, decoupled, per-sequence λ: B={batch}, T={steps}  ({jax.devices()[0].platform}, "
        f"{jax.device_count()} device)")
  print(f"  {'variant':<15} {'median':>12} {'× vapo_jax time':>16}")
  for name, seconds, note in rows:
    print(f"  {name:<15} {seconds * 1e3:>9.2f} ms {seconds / base:>16.2f}  {note}")
  return dict((name, seconds) for name, seconds, _ in rows)


def main(argv):
  quick = "--quick" in argv
  results = {steps: bench(512, steps, quick) for steps in (1024, 4096)}
  t1, t4 = results[1024]["vapo_jax"], results[4096]["vapo_jax"]
  print(f"\nscaling: T 1024 → 4096 (×4) takes ×{t4 / t1:.2f} the time (O(T) would be ×4)")
  print(f"target B=512, T=4096 under 10 ms: {t4 * 1e3:.1f} ms "
        f"({'met' if t4 < 0.010 else 'NOT met'}); vs vmap-row-scan: "
        f"{results[4096]['vmap-row-scan'] / t4:.2f}× "
        f"({'met' if results[4096]['vmap-row-scan'] / t4 >= 2 else 'NOT met'} ≥ 2×)")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
