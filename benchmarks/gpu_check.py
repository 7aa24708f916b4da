"""One command for a machine with an NVIDIA GPU: the Pallas GPU kernels against the oracles, the update's
tokens/s and MFU, the paged decode against the gather, and XLA's memory verdict on the GPU's own devices.

  make gpu-check                                  (make's .venv, or the machine's python3 where none is)
  PYTHONPATH=. python3 -m benchmarks.gpu_check    (from the repository root, nothing installed: a lent GPU)
  ... --quick                                     (smaller shapes: a look in about a minute)

Needs jax with its CUDA plugin, flax, optax, orbax-checkpoint, transformers and numpy, nothing else; a missing
one is one line and exit 2, no GPU is one line ("no GPU") and exit 1. Each section prints as it ends, with
its seconds; a section that fails prints one line and the rest still run (exit 1).

  1 kernels  compiled for the GPU (not interpreted), on small shapes: the paged decode kernel
             (`paged_attention.attend(implementation="gpu_kernel")`) against the dense oracle, and the packed
             attention (`attention.attend(impl="pallas_gpu")`) against the dense reference, output and
             gradients; bfloat16 inputs, the oracles in float32 on the same values.
  2 update   one PPO update (plan, score, actor and critic updates; `benchmarks.packing_bench.LayoutBench`) of
             Qwen2.5-0.5B's shape (24 layers; --quick: 2), random weights, bfloat16, remat, attention "auto"
             (cuDNN on padded rows, the Pallas GPU kernel on packed ones): 64 sequences of 256 prompt + up to
             4,096 response tokens (mean/max 0.3), packed and padded, median of 2. MFU = the batch's model
             FLOPs (`model_flops`: real tokens only, no rematerialisation) / time / the chip's bfloat16 peak.
  3 decode   the paged refill engine (`rollout.sample`) with the GPU kernel against the gather at the same pool
             of pages (equal KV bytes): Qwen2.5-0.5B's shape, bfloat16, 64 prompts × 4 samples, a long tail of
             lengths up to 1,024 (--quick: 256); useful tokens/s of each, and whether the tokens agree.
  4 memory   `make memory EXP=tiny` on this machine's devices with bfloat16 compute: XLA's figures and verdict.
  5 rl step  one RL step of `math` (experiments/one_host.py: Qwen2.5-0.5B, 64 prompts × 8 samples of up to 4,096
             tokens; --quick: 16 prompts, 512 tokens) from random weights through the trainer, on every device:
             the step's seconds by phase and its MFU (the step's model FLOPs, `step_flops`, over the devices'
             bfloat16 peak). Random weights rarely stop: most responses run to the cap, the step's longest.
"""

import importlib.util
import os
import sys
import time
import traceback

NEEDED = ("jax", "flax", "optax", "orbax.checkpoint", "transformers", "numpy")
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "GH200": 989e12, "A100": 312e12, "L40S": 362e12, "B200": 2250e12}


def missing_packages() -> list[str]:
  found = []
  for name in NEEDED:
    try:
      spec = importlib.util.find_spec(name)
    except ModuleNotFoundError:
      spec = None
    if spec is None:
      found.append(name)
  return found


def peak_flops(device_kind: str) -> float | None:
  """The chip's dense bfloat16 FLOP/s from its name (None: not in `PEAK_BF16`)."""
  return next((peak for name, peak in PEAK_BF16.items() if name.lower() in device_kind.lower()), None)


def _close(got, want, *, rtol: float) -> tuple[float, bool]:
  """(max |got − want| / max |want|, within rtol)."""
  import numpy as np
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  err = float(np.max(np.abs(got - want)) / max(float(np.max(np.abs(want))), 1e-30))
  return err, bool(np.all(np.isfinite(got))) and err <= rtol


def kernels() -> list[str]:
  """Section 1: each kernel against its oracle; raises where one disagrees."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from vapo_jax.models import attention, paged_attention

  rng = np.random.default_rng(0)
  kv_heads, heads, head_dim, pages, tg, rows, width = 2, 14, 64, 48, 16, 8, 8
  pool = lambda: jnp.asarray(rng.normal(size=(kv_heads, 2, 1, pages, tg, head_dim)), jnp.bfloat16)
  keys, values = pool(), pool()
  q = jnp.asarray(rng.normal(size=(rows, heads, head_dim)), jnp.bfloat16)
  table = jnp.asarray(rng.integers(0, pages, (rows, width)), jnp.int32)  # Out of order, some shared.
  lengths = jnp.asarray([0, 1, 16, 17, 64, 100, 127, 128], jnp.int32)
  paged = lambda impl, *a: paged_attention.attend(*a, layer=1, implementation=impl, block_pages=2)
  got = jax.jit(lambda *a: paged("gpu_kernel", *a))(q, keys, values, table, lengths)
  f32 = lambda *a: [x.astype(jnp.float32) for x in a]
  want = jax.jit(lambda *a: paged("reference", *a))(*f32(q, keys, values), table, lengths)
  lines, failed = [], []
  err, ok = _close(got, want, rtol=2e-2)
  lines.append(f"  paged decode (gpu_kernel vs dense oracle): max error {err:.2e} of the largest output "
               f"({'ok' if ok else 'DIFFERS'})")
  failed += [] if ok else ["paged decode"]

  b, t = 2, 256
  segments = np.zeros((b, t), np.int32)
  segments[0, :100], segments[0, 100:101], segments[0, 101:240] = 1, 2, 3
  segments[1, :256] = 1
  ids = jnp.asarray(segments)
  qkv = [jnp.asarray(rng.normal(size=(b, t, n, head_dim)), jnp.bfloat16) for n in (heads, kv_heads, kv_heads)]
  weights = jnp.asarray(rng.normal(size=(b, t, heads, head_dim)), jnp.float32)

  def out_and_grads(fn, *args):
    out, vjp = jax.vjp(fn, *args)
    return (out,) + vjp(weights.astype(out.dtype))

  kernel = jax.jit(lambda *a: out_and_grads(lambda *x: attention.attend(*x, segment_ids=ids,
                                                                        impl="pallas_gpu"), *a))
  oracle = jax.jit(lambda *a: out_and_grads(lambda *x: attention.reference(*x, segment_ids=ids), *a))
  for name, have, want in zip(("output", "dq", "dk", "dv"), kernel(*qkv), oracle(*f32(*qkv))):
    err, ok = _close(have, want, rtol=3e-2)
    lines.append(f"  packed attention {name} (pallas_gpu vs dense reference): max error {err:.2e} "
                 f"({'ok' if ok else 'DIFFERS'})")
    failed += [] if ok else [f"packed attention {name}"]
  if failed:
    raise AssertionError(f"the GPU kernels differ from their oracles: {', '.join(failed)}\n" + "\n".join(lines))
  return lines


def _forward_flops(cfg, prompt, lengths) -> tuple[float, float, float]:
  """(linear, attention, vocabulary head) FLOPs of one model's forward over sequences of `prompt` + `lengths`
  tokens: every linear layer over every token (2 FLOPs per weight), causal attention within each sequence, the
  output projection over every token."""
  import numpy as np
  d, f, n, k, h = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  totals = prompt + np.asarray(lengths, np.int64)
  linear = 2 * cfg.num_layers * (d * (n + 2 * k) * h + n * h * d + 3 * d * f) * float(totals.sum())
  attend = 2 * 2 * cfg.num_layers * n * h * float((totals * (totals + 1) / 2).sum())
  return linear, attend, 2.0 * d * cfg.vocab_size * float(totals.sum())


def model_flops(cfg, prompt: int, lengths, *, vocab_scored: bool = True) -> float:
  """FLOPs of one PPO update's model work on the real tokens (no padding, no rematerialisation): for the actor
  and the critic, a scoring forward (×1) and the update's forward and backward (×3) (`_forward_flops`), the
  vocabulary head the actor's only."""
  linear, attend, head = _forward_flops(cfg, prompt, lengths)
  return 4 * (2 * (linear + attend) + (head if vocab_scored else 0))


def step_flops(cfg, prompt: int, lengths) -> float:
  """FLOPs of one RL step's model work with a critic: the rollout's forward of the policy over every prompt and
  response token (prefill and decode; the vocabulary head on the tokens it samples from: the responses'), and
  the update's (`model_flops`)."""
  import numpy as np
  linear, attend, _ = _forward_flops(cfg, prompt, lengths)
  sampled = 2.0 * cfg.hidden_size * cfg.vocab_size * float(np.sum(lengths))
  return linear + attend + sampled + model_flops(cfg, prompt, lengths)


def update(quick: bool) -> list[str]:
  """Section 2: one PPO update, packed and padded, tokens/s and MFU."""
  import dataclasses

  import jax

  from benchmarks import packing_bench
  from vapo_jax.models.config import preset

  cfg = dataclasses.replace(preset("qwen2.5-0.5b"), num_layers=2 if quick else 24,
                            max_position_embeddings=packing_bench.PROMPT + packing_bench.RESPONSE)
  model = dict(dtype="bfloat16", attention="auto")
  lengths = packing_bench.response_lengths(0.3, 1)
  layouts = {"padded": packing_bench.LayoutBench(cfg, False, 1, model),
             "packed": packing_bench.LayoutBench(cfg, True, 1, model)}
  found = packing_bench.measure(layouts, lengths, repeats=2)
  useful, peak = model_flops(cfg, packing_bench.PROMPT, lengths), peak_flops(jax.devices()[0].device_kind)
  lines = []
  for name, r in found.items():
    mfu = f", MFU {useful / r['wall'] / peak:.1%}" if peak else ", MFU n/a (chip not in PEAK_BF16)"
    lines.append(f"  update {name}: {r['wall']:.2f} s (best {r['best']:.2f}), {r['tokens_per_s']:,.0f} real "
                 f"tokens/s{mfu}")
  lines.append(f"  packed / padded: {found['packed']['tokens_per_s'] / found['padded']['tokens_per_s']:.2f}x "
               f"({cfg.num_layers} layers, {lengths.size} sequences, {useful / 1e12:.1f} TFLOP of model work)")
  return lines


def decode(quick: bool) -> list[str]:
  """Section 3: the paged refill engine with the GPU kernel against the gather, equal pools."""
  import dataclasses

  import jax
  import numpy as np
  from flax import nnx

  from benchmarks.rollout_bench import timed
  from vapo_jax import rollout
  from vapo_jax.config import RolloutConfig
  from vapo_jax.models.config import preset
  from vapo_jax.models.transformer import CausalLM
  from vapo_jax.rollout import common

  prompts, samples_per_prompt, cap, page_tokens, slots = 64, 4, 256 if quick else 1024, 16, 128
  cfg = dataclasses.replace(preset("qwen2.5-0.5b"), num_layers=4 if quick else 24)
  model = CausalLM(cfg, dtype="bfloat16", param_dtype="bfloat16", rngs=nnx.Rngs(0))
  rng = np.random.default_rng(5)
  tokens, mask = common.pad_prompts([list(rng.integers(3, cfg.vocab_size, rng.integers(16, 65)))
                                     for _ in range(prompts)], pad_id=0)
  drawn = rng.lognormal(0.0, 0.8, size=prompts * samples_per_prompt)
  limits = np.clip(np.round(drawn / drawn.max() * cap), 1, cap).astype(np.int32)
  pages = slots * (common.sequence_pages(cap, page_tokens) + -(-tokens.shape[1] // page_tokens))
  spec = common.Sampling(max_response_tokens=cap, stop_token_ids=(), temperature=1.0)
  results = {}
  for impl in ("gpu_kernel", "gather"):
    config = RolloutConfig(slots=slots, decode_steps_per_call=256, pages=pages, page_tokens=page_tokens,
                           max_response_tokens=cap)
    plan = dataclasses.replace(rollout.plan_rollout(config, model.cfg, prompts=prompts,
                                                    samples_per_prompt=samples_per_prompt,
                                                    prompt_tokens=tokens.shape[1], dtype=jax.numpy.bfloat16,
                                                    devices=1), attention=impl)
    run = lambda i, plan=plan: rollout.sample(model, tokens, mask, jax.random.key(0), sampling=spec,
                                              plan=plan, length_limits=limits, cache_dtype=jax.numpy.bfloat16)
    run(0)  # Compiles.
    seconds, runs, (out, _) = timed(run, repeats=2, budget_s=60)
    results[impl] = seconds, runs, np.asarray(out.response_tokens)
  useful = float(limits.sum())
  lines = [f"  decode {impl}: {s:.2f} s (median of {n}), {useful / s:,.0f} useful tokens/s"
           for impl, (s, n, _) in results.items()]
  same = float(np.mean(results["gpu_kernel"][2] == results["gather"][2]))
  lines.append(f"  gpu_kernel / gather: {results['gather'][0] / results['gpu_kernel'][0]:.2f}x at equal KV "
               f"bytes ({pages} pages of {page_tokens} tokens, {slots} slots); tokens equal: {same:.1%} "
               "(bfloat16 sums in another order may tip a sample)")
  return lines


def _installed(name: str) -> bool:
  return importlib.util.find_spec(name) is not None


def rl_step_config(quick: bool, devices: int, run_dir: str, *, installed=_installed):
  """`math` (experiments/one_host.py) as section 5 runs it: random weights, the Qwen2.5 tokenizer in `data/`, no
  held-out evaluation, the rollout's tensor-parallel groups as large as the devices allow; --quick: 16 prompts ×
  8 samples of up to 512 tokens. Where this Python cannot read the training parquet (no pyarrow), MATH-500's
  jsonl is the training set; without jinja2 (the chat template), the prompts are plain. Returns (the config,
  what differs from the experiment for want of a package)."""
  import math

  import experiments
  from vapo_jax import paths
  from vapo_jax.config import overrides

  config = experiments.get_experiment("math")
  changes = [f"run_dir={run_dir}", "model.random_init=true", f"model.tokenizer={paths.data_path('qwen2.5_tokenizer')}",
             "eval.path=None", "data.drop_eval_overlap=false",
             f"rollout.tensor_parallel={math.gcd(config.rollout.tensor_parallel, devices)}"]
  if quick:
    changes += ["rollout.prompts_per_step=16", "rollout.max_response_tokens=512"]
  notes = []
  if not installed("pyarrow"):
    changes.append(f"data.train_path={paths.data_path('math500/test.jsonl')}")
    notes.append("MATH-500's problems (no pyarrow to read the training parquet)")
  if not installed("jinja2"):
    changes.append("data.chat_template=false")
    notes.append("plain prompts (no jinja2 for the chat template)")
  return overrides.apply_overrides(config, changes), notes


def rl_step(quick: bool, *, shrink=None) -> list[str]:
  """Section 5: two RL steps of `math` (`rl_step_config`) through the trainer (`Trainer.step`: rollout,
  verifier, scoring, critic and actor updates); the first compiles, the second is timed. MFU = the step's model
  FLOPs (`step_flops` at the step's mean prompt and response lengths: its attention a lower bound) / time /
  (the chip's bfloat16 peak × devices). `shrink`: a function of the config applied last (the tests' CPU
  run)."""
  import tempfile

  import jax
  import numpy as np

  from vapo_jax.train.trainer import Trainer

  devices = jax.devices()
  with tempfile.TemporaryDirectory() as run_dir:
    config, notes = rl_step_config(quick, len(devices), run_dir)
    config = shrink(config) if shrink else config
    trainer = Trainer(config, write_logs=False, verbose=False)
    try:
      state, first = trainer.step(trainer.state)
      _, second = trainer.step(state)
    finally:
      trainer.close()
  r, cfg = config.rollout, trainer.model_cfg
  n, prompt, response = r.prompts_per_step * r.samples_per_prompt, second["rollout/prompt_len_mean"], second[
      "rollout/response_len_mean"]
  flops, seconds = step_flops(cfg, prompt, np.full(n, response)), second["time/step_s"]
  peak, kind = peak_flops(devices[0].device_kind), devices[0].device_kind
  mfu = f"MFU {flops / seconds / (peak * len(devices)):.1%}" if peak else "MFU n/a (chip not in PEAK_BF16)"
  layers = f"{cfg.num_layers} layer{'s' if cfg.num_layers != 1 else ''}"
  return [f"  math ({config.model.preset}, {layers}, random weights, {config.model.dtype}): "
          f"{r.prompts_per_step} prompts x {r.samples_per_prompt} samples, responses up to "
          f"{r.max_response_tokens:,} tokens{''.join('; ' + note for note in notes)}",
          f"  first step {first['time/step_s']:.1f} s (with its compiles); second {seconds:.1f} s: rollout "
          f"{second['time/rollout_s']:.1f}, scoring {second['time/logprobs_values_s']:.1f}, update "
          f"{second['time/update_s']:.1f}",
          f"  {n} responses of {response:,.0f} tokens on average ({second['rollout/truncated_frac']:.0%} at the "
          f"cap) after {prompt:,.0f}-token prompts: {flops / 1e12:,.1f} TFLOP of model work, {mfu} over "
          f"{len(devices)} x {kind}"]


def memory() -> list[str]:
  """Section 4: `make memory EXP=tiny` on this machine's devices, bfloat16 compute."""
  from vapo_jax.cli import memory as memory_cli
  status = memory_cli.main(["--exp", "tiny", "model.dtype=bfloat16"])
  if status not in (0, 1):
    raise RuntimeError(f"make memory exited {status}")
  return [f"  make memory EXP=tiny on this GPU: exit {status} ({'fits' if status == 0 else 'does NOT fit'})"]


def main(argv: list[str]) -> int:
  if missing := missing_packages():
    print(f"gpu_check: missing {', '.join(missing)}: install jax with its CUDA plugin, flax, optax, "
          "orbax-checkpoint, transformers and numpy", file=sys.stderr)
    return 2
  if not os.environ.get("JAX_PLATFORMS"):
    os.environ["JAX_PLATFORMS"] = "cuda"  # Nothing but the GPU: no other backend starts or prints.
  import jax
  try:
    devices = jax.devices()
  except (RuntimeError, AssertionError) as e:  # JAX asserts where the CUDA plugin is not installed.
    reason = str(e).strip().splitlines()[0] if str(e).strip() else "no CUDA backend installed"
    print(f"gpu_check: no GPU (JAX_PLATFORMS={os.environ['JAX_PLATFORMS']}: {reason})", file=sys.stderr)
    return 1
  if devices[0].platform != "gpu":
    print(f"gpu_check: no GPU (JAX's devices are {devices[0].platform})", file=sys.stderr)
    return 1
  quick = "--quick" in argv
  print(f"gpu_check: {len(devices)} x {devices[0].device_kind}, jax "
        f"{jax.__version__}{', quick' if quick else ''}")
  sections = (("1 kernels", kernels), ("2 update", lambda: update(quick)),
              ("3 decode", lambda: decode(quick)), ("4 memory", memory), ("5 rl step", lambda: rl_step(quick)))
  failed, start = [], time.perf_counter()
  for name, section in sections:
    began = time.perf_counter()
    try:
      lines = section()
      print(f"{name} ({time.perf_counter() - began:.0f} s)\n" + "\n".join(lines), flush=True)
    except Exception as e:  # One line each; the next section still runs.
      failed.append(name)
      print(f"{name} FAILED ({time.perf_counter() - began:.0f} s): {type(e).__name__}: {e}", flush=True)
      traceback.print_exc(limit=-3, file=sys.stderr)
  print(f"gpu_check: {len(sections) - len(failed)} of {len(sections)} sections passed in "
        f"{time.perf_counter() - start:.0f} s")
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
