"""Run logs a researcher can read: metrics.jsonl, TensorBoard, W&B, a progress line, collapse warnings,
and `fetch`, which brings a step's device metrics to the host as one vector."""

import contextlib
import json
import math
import netrc
import os
import secrets
import sys
import time
import urllib.parse
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from vapo_jax import files

WANDB_ID_FILE = "wandb_run_id"  # In the run directory: a resumed run continues the same W&B run.


class MetricsWriter:
  """Appends one JSON object per record to `<run_dir>/metrics.jsonl` and mirrors it to TensorBoard
  (and to Weights & Biases when `wandb` holds `wandb.init` arguments: see `wandb_init_args`).

  `keep_bytes` is how much of an existing metrics.jsonl to keep (a resumed run passes the length at
  its checkpoint, dropping records of steps it will run again), and `purge_step` makes TensorBoard
  drop events from that global step on, for the same reason. A fresh run passes 0: an earlier
  run's metrics.jsonl and tensorboard/ are then moved aside to `metrics.jsonl.N` and
  `tensorboard.N/` (the next free N), with a warning, never deleted. Every record starts on a line
  of its own, whatever the file held before.
  """

  def __init__(self, run_dir: str, *, enabled: bool = True, keep_bytes: int = 0,
               purge_step: int | None = None, wandb: dict | None = None):
    self.enabled, self.run_dir = enabled, run_dir
    self.path = os.path.join(run_dir, "metrics.jsonl")
    self._tb = self._wandb = None
    if enabled:
      with self._disk_full():
        os.makedirs(run_dir, exist_ok=True)
        if keep_bytes > 0:
          _keep_prefix(self.path, keep_bytes)
        else:
          _move_aside(run_dir)
          open(self.path, "a").close()
        from tensorboardX import SummaryWriter
        self._tb = SummaryWriter(os.path.join(run_dir, "tensorboard"), purge_step=purge_step)
      if wandb is not None:
        self._wandb = _start_wandb(run_dir, wandb, resume=keep_bytes > 0)

  def _disk_full(self):
    return files.reporting_write_failures(self.run_dir,
                                          "writing the run's logs (metrics.jsonl, tensorboard/)")

  def size(self) -> int:
    """Bytes written so far to metrics.jsonl (0 when disabled)."""
    return os.path.getsize(self.path) if self.enabled and os.path.exists(self.path) else 0

  def write(self, step: int, stage: str, metrics: dict[str, float], *, global_step: int | None = None,
            jsonl: bool = True) -> None:
    """One record; TensorBoard and W&B use `global_step` (monotonic over stages) when given, else
    `step`. `jsonl=False` writes TensorBoard only (re-adding what a resume purged)."""
    if not self.enabled:
      return
    clean = {k: float(v) for k, v in sorted(metrics.items())}
    x = step if global_step is None else global_step
    with self._disk_full():
      if jsonl:
        self._append({"step": step, "stage": stage, **clean})
      scalars = {(f"{stage}/{key}" if stage != "rl" else key): value for key, value in clean.items()
                 if math.isfinite(value)}
      for key, value in scalars.items():
        self._tb.add_scalar(key, value, x)
      self._tb.flush()
    if self._wandb is not None and jsonl:
      try:
        self._wandb.log({**scalars, "global_step": x})
      except Exception as e:  # noqa: BLE001  W&B failing never stops training; the other logs go on.
        warnings.warn(f"W&B logging failed, continuing without it: {type(e).__name__}: {e}", stacklevel=2)
        self._wandb = None

  def _append(self, record: dict) -> None:
    """One line of metrics.jsonl, opened per record: a crash loses at most the line in flight, and a
    write that fails (a full disk) is cut off again, so that no partial line is left."""
    end = None
    try:
      with open(self.path, "a+b") as f:
        end = f.seek(0, os.SEEK_END)
        fresh_line = end == 0 or (f.seek(-1, os.SEEK_END), f.read(1))[1] == b"\n"
        f.write((b"" if fresh_line else b"\n") + json.dumps(record).encode() + b"\n")
    except OSError:
      if end is not None:
        with contextlib.suppress(OSError):
          os.truncate(self.path, end)
      raise

  def write_summary(self, summary: dict, *, rerun: bool) -> dict:
    """Writes summary.json whole (a full disk: one line); a `rerun` of a finished run keeps (and
    returns) the summary it already has, its seconds those of the run that did the work."""
    path = os.path.join(self.run_dir, "summary.json")
    if not self.enabled:
      return summary
    if rerun and os.path.isfile(path):
      with contextlib.suppress(OSError, ValueError):
        with open(path, encoding="utf-8") as f:
          return json.load(f)
    with files.reporting_write_failures(self.run_dir, "writing summary.json"):
      files.write_atomically(path, json.dumps(summary, indent=2))
    return summary

  def close(self) -> None:
    tb, self._tb = self._tb, None
    try:
      if tb is not None:
        with self._disk_full():
          tb.close()
    finally:
      if self._wandb is not None:
        self._wandb.finish()
        self._wandb = None


def _keep_prefix(path: str, keep_bytes: int) -> None:
  """Cuts metrics.jsonl back to a resumed checkpoint's `keep_bytes`, on a line boundary, so that
  the next record starts a line of its own; says what it had to do differently."""
  with open(path, "a+b") as f:
    f.seek(0)
    text = f.read()
    cut = min(keep_bytes, len(text))
    if len(text) < keep_bytes:
      warnings.warn(f"{path} has {len(text)} bytes, fewer than the {keep_bytes} its checkpoint recorded "
                    "(truncated or edited since?): records from before the checkpoint may be missing",
                    stacklevel=3)
    elif cut < len(text) and text[cut - 1:cut] != b"\n":
      end = text.find(b"\n", cut)
      cut = len(text) if end < 0 else end + 1
      warnings.warn(f"{path} changed since the checkpoint: byte {keep_bytes}, where its records end, is "
                    f"inside a line; kept the whole line (the file now ends at byte {cut})", stacklevel=3)
    lines = text[:cut].split(b"\n")
    tail = lines.pop()  # After the last newline: a partial line, or b"".
    if tail and _is_record(tail):
      f.truncate(cut)
      f.write(b"\n")  # A complete record without its newline: end it.
    else:
      f.truncate(cut - len(tail))
      if tail:
        warnings.warn(f"{path}: dropped a partial last line ({len(tail)} bytes: {tail[:80]!r}) so that the "
                      "next record starts on a line of its own", stacklevel=3)
  bad = [i for i, line in enumerate(lines, 1) if line.strip() and not _is_record(line)]
  if bad:
    warnings.warn(f"{path}: {len(bad)} lines are not JSON records (line{'s' * (len(bad) > 1)} "
                  f"{', '.join(map(str, bad[:5]))}{', ...' if len(bad) > 5 else ''}); they are kept, and "
                  "readers skip them (vapo_jax.cli.plots does)", stacklevel=3)


def _is_record(line: bytes) -> bool:
  try:
    return isinstance(json.loads(line), dict)
  except ValueError:
    return False


def _move_aside(run_dir: str) -> None:
  """Moves an earlier run's metrics.jsonl (when not empty) and tensorboard/ to `.N` names (the next free N)."""
  if not os.path.isfile(path := os.path.join(run_dir, "metrics.jsonl")) or os.path.getsize(path) == 0:
    return  # No records (TensorBoard's events then hold none either: the two are written together).
  names = [name for name in ("metrics.jsonl", "tensorboard") if os.path.exists(os.path.join(run_dir, name))]
  n = 1
  while any(os.path.exists(os.path.join(run_dir, f"{name}.{n}")) for name in ("metrics.jsonl",
                                                                              "tensorboard")):
    n += 1
  for name in names:
    os.rename(os.path.join(run_dir, name), os.path.join(run_dir, f"{name}.{n}"))
  warnings.warn(f"{run_dir} holds logs of an earlier run but no checkpoint to resume from: moved "
                f"{' and '.join(f'{name} to {name}.{n}' for name in names)}; this run starts new ones",
                stacklevel=3)


# ----------------------------------------------------------------------------- Weights & Biases
def wandb_init_args(log, *, name: str, config: dict | None = None) -> dict | None:
  """`wandb.init` arguments for a run's `LogConfig` (None when `log.wandb` is off), for
  `MetricsWriter(wandb=...)`. Raises `ConfigError` when the optional `wandb` package is missing.

  Mode: WANDB_MODE when set; else `log.wandb_mode`, whose "auto" is online when an API key is found
  (WANDB_API_KEY, or the netrc entry `wandb login` writes) and offline otherwise."""
  if not log.wandb:
    return None
  try:
    import wandb  # noqa: F401
  except ImportError:
    from vapo_jax.errors import ConfigError
    raise ConfigError('log.wandb=true needs the optional wandb package: pip install -e ".[wandb]" '
                      "(or pass log.wandb=false)") from None
  args = {"project": log.wandb_project, "entity": log.wandb_entity, "name": name, "config": config}
  if not os.environ.get("WANDB_MODE"):
    args["mode"] = log.wandb_mode if log.wandb_mode != "auto" else "online" if _wandb_key_found() else "offline"
    if log.wandb_mode == "auto" and args["mode"] == "offline":
      print("W&B: no API key found (WANDB_API_KEY or `wandb login`), so the run is logged offline into "
            "<run_dir>/wandb; upload it later with `wandb sync <run_dir>/wandb/offline-run-*`",
            file=sys.stderr)
  return args


def _wandb_key_found() -> bool:
  if os.environ.get("WANDB_API_KEY"):
    return True
  host = urllib.parse.urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
  try:
    return netrc.netrc(os.environ.get("NETRC")).authenticators(host) is not None
  except (OSError, netrc.NetrcParseError):
    return False


def _start_wandb(run_dir: str, args: dict, *, resume: bool):
  """A W&B run logging into `<run_dir>/wandb`; a resumed run continues the run its first start made."""
  import wandb

  id_path = os.path.join(run_dir, WANDB_ID_FILE)
  run_id = open(id_path).read().strip() if resume and os.path.exists(id_path) else None
  if not run_id:
    run_id = secrets.token_hex(6)  # W&B run ids: letters, digits, '-' and '_'.
    with open(id_path, "w") as f:
      f.write(run_id + "\n")
  try:
    run = wandb.init(dir=run_dir, id=run_id, resume="allow", settings=wandb.Settings(console="off"), **args)
  except Exception as e:  # noqa: BLE001  wandb raises many types (network, auth, settings).
    from vapo_jax.errors import ConfigError
    raise ConfigError(f"W&B could not start a run ({type(e).__name__}: {e}); pass log.wandb_mode=offline "
                      "(no network needed) or log.wandb=false") from e
  # Stages share one x axis: a resume re-logs the steps after its checkpoint, which W&B's own
  # monotonic step would drop.
  run.define_metric("global_step")
  run.define_metric("*", step_metric="global_step")
  return run


class ProgressLine:
  """One console line per step: step, reward, accuracy, response length, ETA."""

  def __init__(self, stage: str, total: int, stream=sys.stdout):
    self.stage, self.total, self.stream = stage, total, stream
    self.start = time.perf_counter()

  def update(self, step: int, metrics: dict[str, float], keys: dict[str, str]) -> None:
    done = step + 1
    elapsed = time.perf_counter() - self.start
    eta = elapsed / done * (self.total - done)
    fields = " | ".join(f"{label} {metrics[k]:.3g}" for label, k in keys.items() if k in metrics)
    print(f"[{self.stage}] {done:>4}/{self.total} | {fields} | {elapsed:5.0f}s elapsed, ETA {eta:4.0f}s",
          file=self.stream, flush=True)


class CollapseMonitor:
  """Warns when the response length or the entropy collapses (what VAPO exists to prevent)."""

  def __init__(self, *, length_frac: float, min_entropy: float):
    self.length_frac, self.min_entropy = length_frac, min_entropy
    self.first_length = None
    self.warned = set()

  def state_dict(self) -> dict:
    return {"first_length": self.first_length, "warned": sorted(self.warned)}

  def load_state_dict(self, state: dict) -> None:
    self.first_length, self.warned = state["first_length"], set(state["warned"])

  def check(self, step: int, response_len: float, entropy: float) -> list[str]:
    messages = []
    if self.first_length is None:
      self.first_length = response_len
    if response_len < self.length_frac * self.first_length and "length" not in self.warned:
      messages.append(f"step {step}: mean response length {response_len:.1f} fell below "
                      f"{self.length_frac:.0%} of its first value {self.first_length:.1f} (length collapse)")
      self.warned.add("length")
    if entropy < self.min_entropy and "entropy" not in self.warned:
      messages.append(f"step {step}: mean token entropy {entropy:.3f} fell below {self.min_entropy} "
                      "(entropy collapse)")
      self.warned.add("entropy")
    for message in messages:
      warnings.warn(message, stacklevel=2)
    return messages


def fetch(metrics: dict) -> dict[str, float]:
  """A step's metrics as host floats, the device scalars fetched together as one vector."""
  on_device = [k for k, v in metrics.items() if isinstance(v, jax.Array)]
  values = np.asarray(jnp.stack([metrics[k].astype(jnp.float32) for k in on_device])) if on_device else []
  return {k: float(v) for k,
          v in metrics.items() if k not in on_device} | dict(zip(on_device, map(float, values)))


class Diverged(RuntimeError):
  """Updates kept failing on non-finite losses or gradients (`optim.max_nonfinite_steps` steps in a row)."""


def check_finite(stage: str, step: int, m: dict, progress, limit: int) -> None:
  """Counts in `progress.nonfinite_steps` the steps in a row whose updates were skipped for non-finite losses
  or gradients (`m`: this step's metrics), warns of each, and raises `Diverged` at `limit`
  (`optim.max_nonfinite_steps`)."""
  skipped = {k.split("/")[0]: v for k, v in m.items() if k.endswith("/skipped_frac") and v > 0}
  progress.nonfinite_steps = progress.nonfinite_steps + 1 if skipped else 0
  if not skipped:
    return
  which = ", ".join(f"{name} {frac:.0%}" for name, frac in sorted(skipped.items()))
  message = (f"{stage} step {step}: non-finite loss or gradient, updates skipped ({which}; parameters "
             f"unchanged by them), {progress.nonfinite_steps} step(s) in a row")
  warnings.warn(message, stacklevel=2)
  if progress.nonfinite_steps >= limit:
    raise Diverged(f"{message}: stopping (optim.max_nonfinite_steps={limit}). Lower the learning rate, check the "
                   "data and the last metrics in metrics.jsonl, and resume from the newest checkpoint (its "
                   "parameters are finite) with the same command")
