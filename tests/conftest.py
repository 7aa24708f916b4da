"""Test setup: 8 virtual CPU devices, set before JAX is first imported; one XLA compilation cache (the
clone's `.jax_cache/` under `make test`, else a temporary one for this run) shared by the test processes
and the runs their tests start, so tests that build the same programs (the trainer tests' models,
samplers and updates) compile each of them once; the one builder of the trainer tests' configs
(`smoke_config`); and the order `make test` hands test files out in.

`make test` sets `--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false` (the Makefile;
`tests/test_optimisation_level.py` bounds what they change); `make test-slow` compiles at the defaults,
where 1 device against 8 agrees within the 1e-6 of `test_one_and_eight_devices_...` (at level 0 they differ
by 1.6e-6 in one parameter)."""

import atexit
import collections
import json
import os
import pathlib
import resource
import shutil
import tempfile

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ["JAX_PLATFORMS"] = "cpu"
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="vapo_jax_xla_cache_")
  atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"

if "PYTEST_XDIST_WORKER" not in os.environ:  # The controller, or a run without xdist: once per run.
  from vapo_jax import compile_cache  # noqa: E402  (imports no JAX)
  compile_cache.bound()
import jax  # noqa: E402  (must come after the environment is set)
import pytest  # noqa: E402

from vapo_jax import compile_cache  # noqa: E402

compile_cache.install()  # The run's: each kept program checked against its key, a read-only cache said once.

import experiments  # noqa: E402
from experiments import variants  # noqa: E402
from experiments.smoke import smoke  # noqa: E402
from vapo_jax.config import ExperimentConfig, overrides  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(params=[False, True], ids=["eager", "jit"])
def maybe_jit(request):
  """Runs a function as is, or under `jax.jit` (static keyword arguments closed over). `make test` runs
  the eager variant of a test's first case only (`_one_eager_case`: eager ops compile one program
  each); `make test-slow` runs the others."""
  if not request.param:
    return lambda f, **static: (lambda *a: f(*a, **static))
  return lambda f, **static: jax.jit(lambda *a: f(*a, **static))


def build_smoke_config(run_dir, fields: dict | None = None, *, algorithm: str = "vapo",
                       name: str = "test") -> ExperimentConfig:
  """The default experiment (`tiny`) as `algorithm` ("vapo", or a baseline of experiments/variants.py:
  "ppo", "grpo", "dapo"), at smoke-test size (experiments/smoke.py, as `--smoke` makes it), run in
  `run_dir`, with `fields` ({"algo.eps_high": 0.3, ...}: the overrides' syntax) applied."""
  base = experiments.get_experiment("tiny")
  if algorithm != "vapo":
    base = getattr(variants, algorithm)(base, name=name)
  return overrides.replace_fields(smoke(base), {"name": name, "run_dir": str(run_dir)} | (fields or {}))


@pytest.fixture(scope="module")
def model():
  """The untied Qwen2 parity checkpoint (tests/fixtures/parity/qwen2_untied) as a `CausalLM`, once per module."""
  from model_utils import FIXTURES
  from vapo_jax.models import huggingface
  return huggingface.load_causal_lm(str(FIXTURES / "qwen2_untied"))


@pytest.fixture
def smoke_config(tmp_path):
  """`build_smoke_config` in the test's `tmp_path` (or `run_dir=`): the one builder of the trainer tests."""
  def build(fields: dict | None = None, *, run_dir=None, **options) -> ExperimentConfig:
    return build_smoke_config(tmp_path if run_dir is None else run_dir, fields, **options)
  return build


# ----------------------------------------------------------------------------------- test order
# `make test` hands whole files to its two processes in collection order (`--dist loadfile`); starting
# with the longest keeps one process from running a long file alone at the end (longest-first
# scheduling). Each file's CPU seconds (user + system, of the test process and the runs it waited for)
# are measured, as they do not depend on the machine's load as wall time does: `--record-durations`
# writes them, per marker expression, to tests/durations.json (committed, so CI orders its run the same way).
DURATIONS = pathlib.Path(__file__).with_name("durations.json")
_seconds: collections.Counter = collections.Counter()
_CPU_START = pytest.StashKey[float]()


def pytest_addoption(parser):
  parser.addoption("--record-durations", action="store_true",
                   help="write each test file's CPU seconds to tests/durations.json (the order of make test)")


def _measured(config) -> dict[str, float]:
  table = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
  return table.get(config.getoption("markexpr") or "all", {})


def _one_eager_case(items) -> None:
  """Marks `slow` every eager `maybe_jit` case of a test function but its first."""
  seen = set()
  for item in items:
    params = getattr(getattr(item, "callspec", None), "params", {})
    if params.get("maybe_jit") is False:
      if (item.path, item.originalname) in seen:
        item.add_marker(pytest.mark.slow)
      seen.add((item.path, item.originalname))


@pytest.hookimpl(tryfirst=True)  # Before pytest's own -m selection reads the markers.
def pytest_collection_modifyitems(config, items):
  _one_eager_case(items)
  measured = _measured(config)
  new = max(measured.values(), default=0.0)  # A file not measured yet goes first: it may be long.
  items.sort(key=lambda item: -measured.get(item.path.name, new))  # Stable: file order otherwise kept.


def _cpu_seconds() -> float:
  own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
  return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
  item.stash[_CPU_START] = _cpu_seconds()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
  report = (yield).get_result()
  if call.when == "teardown" and _CPU_START in item.stash:  # Travels to xdist's controller with the report.
    report.user_properties.append(("cpu_s", _cpu_seconds() - item.stash[_CPU_START]))


def pytest_runtest_logreport(report):
  _seconds[pathlib.Path(report.location[0]).name] += dict(report.user_properties).get("cpu_s", 0.0)


def pytest_sessionfinish(session):
  config = session.config
  if not config.getoption("record_durations") or hasattr(config, "workerinput"):  # The controller records.
    return
  table = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
  key = config.getoption("markexpr") or "all"
  table[key] = dict(sorted(({**table.get(key, {}), **{k: round(v, 1) for k, v in _seconds.items()}}).items()))
  DURATIONS.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
