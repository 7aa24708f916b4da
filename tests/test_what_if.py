"""The what-if solver (`memory/what_if.py`) against a phase whose figure is a known function of a setting: the
value it names is the largest valid one under the allowed bytes, found with two compiles (the second value and
the check), and a refuted line or a setting that lowers nothing says so or names nothing."""

import dataclasses

import pytest

from vapo_jax.memory import what_if

ALLOWED = 1000


@dataclasses.dataclass
class _Phase:
  name: str
  needs: float


@dataclasses.dataclass
class _Report:
  phases: tuple
  allowed: int = ALLOWED


@dataclasses.dataclass
class _Program:
  memory: object = None  # The compiler refused it.


def _solve(monkeypatch, figure, now, values, refused=lambda v: False):
  """`what_if.search` on a phase needing `figure(value)` bytes, the compiler refusing the values `refused`
  says; (its answer, the values it compiled)."""
  compiled = []
  monkeypatch.setattr(what_if, "needs", lambda report, phase, changes: compiled.append(changes["f"])
                      or (figure(changes["f"]), refused(changes["f"])))
  phase = _Phase("update", figure(now))
  phase.programs = [_Program()] if refused(now) else []
  return what_if.search(_Report((phase,)), "update", "f", now, values), compiled


def test_an_affine_figure_is_solved_with_two_compiles(monkeypatch):
  answer, compiled = _solve(monkeypatch, lambda v: 200 + 10 * v, 128, list(range(127, 0, -1)))
  assert answer == "set f=80 (compiled: update needs 1000 B)" and compiled == [64, 80]  # 200 + 10·80 = 1000.
  answer, compiled = _solve(monkeypatch, lambda v: 200 + 10 * v, 128, list(range(120, 0, -8)))  # Multiples of 8.
  assert answer.startswith("set f=80 ") and compiled == [64, 80]


def test_where_the_second_value_fits_but_the_line_aims_too_high_the_second_value_is_named(monkeypatch):
  figure = lambda v: 200 + 10 * v if v <= 64 else 2000  # A step: the line through 128 and 64 aims at 72.8.
  answer, compiled = _solve(monkeypatch, figure, 128, list(range(127, 0, -1)))
  assert compiled == [64, 72] and answer == "set f=64 (compiled: update needs 840 B)"


def test_a_refuted_line_is_said_and_a_setting_that_lowers_nothing_names_nothing(monkeypatch):
  figure = lambda v: 700 + 5 * v if v >= 64 else 1200  # The line through 128 and 64 aims at 60, which is over.
  answer, compiled = _solve(monkeypatch, figure, 128, list(range(127, 0, -1)))
  assert compiled == [64, 60] and answer.startswith("f below 60 (compiled: update needs 1.17 KiB; "), answer
  answer, compiled = _solve(monkeypatch, lambda v: 2000, 128, list(range(127, 0, -1)))
  assert answer is None and compiled == [64]  # Lowering it lowers nothing: no second compile.
  answer, compiled = _solve(monkeypatch, lambda v: 1100 + v, 128, list(range(127, 100, -1)))
  assert answer is None and compiled == [101]  # The line's aim (-100) is below every valid value.


def test_a_choice_is_compiled_value_by_value_until_one_fits(monkeypatch):
  compiled, figures = [], {"save_dot_except_mlp": 1100, "save_qkv_proj": 900, "offload_qkv_proj": 800, "full": 700}
  monkeypatch.setattr(what_if, "needs", lambda report, phase, changes: compiled.append(changes["model.remat"]) or (
      figures[changes["model.remat"]], False))
  report = _Report((_Phase("update", 1200),))
  assert what_if.search(report, "update", "model.remat", "minimal", list(figures)) == \
      "set model.remat=save_qkv_proj (compiled: update needs 900 B)"
  assert compiled == ["save_dot_except_mlp", "save_qkv_proj"]  # Least recomputation first; none after a fit.
  compiled.clear()
  assert what_if.search(report, "update", "model.remat", "minimal", ["save_dot_except_mlp"]) is None


def test_the_remat_table_names_the_least_recomputation_that_fits():
  from vapo_jax.memory import xla_report_text
  rows = [("none", 2000.0, 3e12), ("minimal", 1500.0, 3.5e12), ("save_dot_except_mlp", 900.0, 4e12),
          ("save_qkv_proj", None, None), ("full", 700.0, 5e12)]
  assert what_if.least_recomputation(rows, 1000) == "save_dot_except_mlp"
  assert what_if.least_recomputation(rows, 500) is None
  text = xla_report_text.remat_table(rows, 1000)
  assert text.splitlines()[-1] == "least recomputation that fits: model.remat=save_dot_except_mlp"
  assert "save_qkv_proj        not a valid config" in text and "over" in text.splitlines()[1]


def test_where_the_compiler_refused_the_current_value_the_line_runs_through_two_measured_figures(monkeypatch):
  """The refusal's 23,000 is what the compiler tried to allocate: a line through it would aim far too low."""
  figure = lambda v: 23000 if v > 100 else 200 + 10 * v
  answer, compiled = _solve(monkeypatch, figure, 128, list(range(127, 0, -1)), refused=lambda v: v > 100)
  assert compiled == [64, 32, 80] and answer == "set f=80 (compiled: update needs 1000 B)"
  answer, compiled = _solve(monkeypatch, lambda v: 23000, 128, list(range(127, 0, -1)), refused=lambda v: True)
  assert answer is None and compiled == [64]  # Refused at half as well: no line to draw.


@pytest.mark.parametrize("figure", [lambda v: 1500 - v, lambda v: 900 + 0 * v])
def test_the_search_never_names_a_value_it_did_not_compile_under_the_allowed_bytes(monkeypatch, figure):
  answer, compiled = _solve(monkeypatch, figure, 128, list(range(127, 0, -1)))
  if answer and answer.startswith("set "):
    value = int(answer.split("=")[1].split()[0])
    assert value in compiled and figure(value) <= ALLOWED


def test_remat_policies_compile_the_update_under_every_other_policy(monkeypatch):
  import types

  from vapo_jax.config import ExperimentConfig
  compiled, figure = [], dict(zip(what_if.REMAT, (2000, 1600, 1500, 1200, 1100, 800, 700)))

  def compile_run(config, target, *, layers, phases, log):
    assert phases == ("update",) and layers == 2
    compiled.append(config.model.remat)
    phase = _Phase("update", figure[config.model.remat])
    phase.programs = [types.SimpleNamespace(flops=1e12 * len(compiled))]
    return types.SimpleNamespace(phases=[phase])

  monkeypatch.setattr(what_if.xla_report, "compile_run", compile_run)
  own = _Phase("update", 700)
  own.programs = [types.SimpleNamespace(flops=9e12)]
  report = types.SimpleNamespace(config=ExperimentConfig(name="x"), target=None, layers=2, phases=(own,))
  rows = what_if.remat_policies(report)
  assert compiled == list(what_if.REMAT[:-1])  # The report's own policy ("full") is read from it.
  assert [r[0] for r in rows] == list(what_if.REMAT) and rows[-1] == ("full", 700, 9e12)
  assert rows[0] == ("none", 2000, 1e12) and what_if.least_recomputation(rows, 1150) == "save_qkv_proj"
