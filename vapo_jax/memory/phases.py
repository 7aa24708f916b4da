"""A phase of the compile report: programs that run one after another, each compiled into it with what the run
holds beside it (`add`)."""

import dataclasses
from collections.abc import Callable

from vapo_jax.memory.aot import Program, compile_program
from vapo_jax.memory.topologies import GIB


@dataclasses.dataclass
class CompiledPhase:
  """Programs that run one after another; a device needs the largest of them."""

  name: str  # "rollout", "scoring", ...
  detail: str  # What it processes, in words.
  programs: list[Program] = dataclasses.field(default_factory=list)
  skipped: str = ""  # Programs of the phase not compiled, and why.

  @property
  def needs(self) -> float:
    return max((p.needs for p in self.programs), default=0.0)

  @property
  def worst(self) -> Program:
    return max(self.programs, key=lambda p: p.needs)


def add(phase: CompiledPhase, log: Callable, name: str, fn, args: tuple, *, resident: int = 0, fallback=None,
         outputs_resident: bool = False):
  """Compiles one program into `phase`; its outputs (abstract), counted once if `outputs_resident`."""
  program, outputs = compile_program(name, fn, args, resident=resident, fallback=fallback)
  if outputs_resident and program.memory:
    program = program._replace(resident=program.resident - program.memory.outputs)
  phase.programs.append(program)
  own = (f"{program.memory.total / GIB:.2f} GiB own ({program.memory.temporaries / GIB:.2f} temporaries)"
         if program.memory else f"refused by the compiler: {program.refused_bytes / GIB:.2f} GiB")
  log(f"  {phase.name}: {name} {'loaded (compiled before)' if program.kept else 'compiled'} in "
      f"{program.lower_s + program.compile_s:.1f} s: needs {program.needs / GIB:.2f} GiB per device, {own}")
  return outputs
