"""Rule-based rewards for math reasoning: answer extraction, equivalence, a time-out-safe pool.

  extract.py      final answer of a response (`\\boxed{}`, `Answer:` line, last number); pure, cheap
  equivalence.py  exact integers for AIME-style answers, math-verify for LaTeX and the rest
  pool.py         worker processes with a per-response time-out; hangs and crashes score incorrect
  reward.py       verifier reward, DAPO soft overlong penalty, format check, user functions
  accuracy.py     avg@k, unbiased pass@k and majority vote maj@k of verified samples, overall and per source
  _forkserver_init.py  imported only inside the verifier pool's fork server, which preloads it

Import the submodules (`from vapo_jax.rewards import reward`); this file imports nothing, so
that `vapo_jax.rewards.extract` (e.g. its `AnswerForm` type, for the config) does not pull in
sympy and math-verify.
"""
