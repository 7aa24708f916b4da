"""Evaluation: avg@k, unbiased pass@k and majority vote maj@k, overall and per source.

  make eval EXP=aime RESPONSES=responses.jsonl        # score saved responses
  make eval EXP=aime CKPT=/path/to/checkpoint         # generate k samples per problem, then score
  python -m vapo_jax.evaluate --exp aime --responses responses.jsonl [--out DIR] [field=value ...]

A responses file has one sample per line: `{"id": ..., "response": "..."}`, the id being a
problem id of the experiment's `eval.path`; a line may instead carry its own `"answer"` (and
`"source"`), and then no problem file is needed. Every sample is written with its extracted
answer and verdict to `<out>/samples.jsonl`, and the metrics to `<out>/summary.json`.

For problem i with n_i samples of which c_i are correct (P problems):
  avg@n  = (1/P) Σ_i c_i / n_i                             (the VAPO paper's AIME 2024 avg@32)
  pass@k = (1/P) Σ_i [1 − C(n_i − c_i, k) / C(n_i, k)]     (unbiased; Chen et al. 2021, eq. 1)
  maj@n  = (1/P) Σ_i 1[the most frequent extracted answer of problem i is correct]
Each problem weighs the same (with equal n_i, avg@n is the mean over all samples); when the
problems have different sample counts, n is written "min-max" and pass@k stops at the smallest.
maj@n is None (printed "n/a") when a user reward function (`reward.reward_fn`) scored the samples:
it gives a verdict per response, not an answer, so there is nothing to vote on.
"""

import collections
import json
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from vapo_jax import data
from vapo_jax.rewards import equivalence, extract, reward


class Sample(NamedTuple):
  """One scored response."""

  id: str  # Problem id.
  source: str  # The problem's dataset.
  index: int  # Sample number within its problem.
  response: str
  gold: str  # Reference answer.
  answer: str | None  # Extracted answer.
  form: str  # How it was found ("none": no answer).
  correct: bool
  status: str  # Verifier outcome: "ok", "timeout", "crash" or "error".


def pass_at_k(n: int, c: int, k: int) -> float:
  """Unbiased pass@k of one problem with `c` correct among `n` samples: 1 − C(n−c, k)/C(n, k).

  Computed as 1 − Π_{i=n−c+1}^{n} (1 − k/i), which avoids huge binomials (Chen et al. 2021).
  """
  if not 0 <= c <= n or not 1 <= k <= n:
    raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
  if n - c < k:
    return 1.0
  return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def answer_key(answer: str) -> str:
  """Answers that are the same for a majority vote get the same key (integers by value)."""
  value = equivalence.as_integer(answer)
  return str(value) if value is not None else equivalence.canonical(answer)


def majority_correct(answers: Sequence[str | None], correct: Sequence[bool]) -> bool:
  """Whether the most frequent extracted answer is correct; ties go to the earliest; no answer loses."""
  votes: dict[str, list[int]] = collections.defaultdict(list)
  for i, answer in enumerate(answers):
    if answer is not None:
      votes[answer_key(answer)].append(i)
  if not votes:
    return False
  winner = max(votes.values(), key=len)  # The first of equals: dicts keep insertion order.
  return bool(correct[winner[0]])


def pass_ks(n: int) -> list[int]:
  """k values reported for n samples: 1, 2, 4, ... up to n, and n itself."""
  return sorted({2 ** i for i in range(int(math.log2(n)) + 1)} | {n}) if n >= 1 else []


def summarize(samples: Sequence[Sample]) -> dict[str, float]:
  """avg@n, pass@k for k = 1, 2, 4, ... ≤ min n, maj@n and verifier counts of `samples`."""
  groups: dict[str, list[Sample]] = collections.defaultdict(list)
  for sample in samples:
    groups[sample.id].append(sample)
  counts = [len(g) for g in groups.values()]
  n_min, n_max = min(counts), max(counts)
  n = str(n_min) if n_min == n_max else f"{n_min}-{n_max}"
  summary: dict[str, float] = {"problems": len(groups), "samples": len(samples)}
  summary[f"avg@{n}"] = float(np.mean([np.mean([s.correct for s in g]) for g in groups.values()]))
  for k in pass_ks(n_min):
    summary[f"pass@{k}"] = float(np.mean([pass_at_k(len(g), sum(s.correct for s in g), k)
                                          for g in groups.values()]))
  votable = all(s.form != "user" for s in samples)  # A user reward function extracts no answers.
  summary[f"maj@{n}"] = float(np.mean([majority_correct([s.answer for s in g], [s.correct for s in g])
                                       for g in groups.values()])) if votable else None
  summary["no_answer_frac"] = float(np.mean([s.form == "none" for s in samples]))
  for status, name in (("timeout", "timeouts"), ("crash", "crashes"), ("error", "errors")):
    summary[f"verifier_{name}"] = sum(s.status == status for s in samples)
  return summary


def summarize_by_source(samples: Sequence[Sample]) -> dict[str, Any]:
  by_source: dict[str, list[Sample]] = collections.defaultdict(list)
  for sample in samples:
    by_source[sample.source].append(sample)
  return {"overall": summarize(samples),
          "per_source": {source: summarize(group) for source, group in sorted(by_source.items())}}


def read_responses(path: str, problems: Sequence[data.Record] | None) -> list[tuple[data.Record, str]]:
  """`(problem, response)` pairs of a responses file; bad lines are errors naming line and field."""
  by_id = {r.id: r for r in problems or ()}
  pairs = []
  with open(path, encoding="utf-8") as f:
    for number, line in enumerate(f, 1):
      if not line.strip():
        continue
      where = f"{path}, line {number}"
      try:
        row = json.loads(line.rstrip("\r\n"))
      except json.JSONDecodeError as e:
        raise data.DataError(f"{where}, field (line): malformed JSON: {e.msg} at column {e.colno}") from None
      if not isinstance(row, dict):
        raise data.DataError(f"{where}, field (line): expected an object, got {type(row).__name__}")
      response = row.get("response")
      if not isinstance(response, str):
        raise data.DataError(f"{where}, field 'response': expected a string, got {type(response).__name__}")
      problem_id = str(row.get("id", ""))
      if "answer" in row:
        answer = data.answer_text(row["answer"])
        if not answer:
          raise data.DataError(f"{where}, field 'answer': expected a non-empty string or number")
        known = by_id.get(problem_id)
        source = str(row.get("source") or (known.source if known else Path(path).stem))
        problem = data.Record(str(row.get("prompt", known.prompt if known else "")), answer,
                              problem_id or str(number), source)
      elif problem_id in by_id:
        problem = by_id[problem_id]
      else:
        hint = "no problem file is set (eval.path)" if not by_id else "no problem has this id"
        raise data.DataError(f"{where}, field 'id': {problem_id!r}: {hint}, and the line has no 'answer'")
      pairs.append((problem, response))
  if not pairs:
    raise data.DataError(f"{path}: no responses")
  return pairs


def score(pairs: Sequence[tuple[data.Record, str]], pool, *,
          forms: tuple[extract.AnswerForm, ...] = extract.DEFAULT_FORMS) -> tuple[list[Sample], float]:
  """Verifies every response on `pool`; returns the samples and the verifier's responses/s."""
  batch = reward.compute_rewards(pool, [r for _, r in pairs], [p.answer for p, _ in pairs], forms=forms)
  seen: collections.Counter = collections.Counter()
  samples = []
  for i, (problem, response) in enumerate(pairs):
    samples.append(Sample(problem.id, problem.source, seen[problem.id], response, problem.answer,
                          batch.answers[i], batch.forms[i], bool(batch.correct[i]), batch.statuses[i]))
    seen[problem.id] += 1
  return samples, batch.metrics["perf/verify_responses_per_s"]


def write_results(samples: Sequence[Sample], summary: dict[str, Any], out_dir: str) -> None:
  out = Path(out_dir)
  out.mkdir(parents=True, exist_ok=True)
  with open(out / "samples.jsonl", "w", encoding="utf-8") as f:
    for sample in samples:
      f.write(json.dumps(sample._asdict(), ensure_ascii=False) + "\n")
  (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")


def evaluate_responses(responses_path: str, *, problems: Sequence[data.Record] | None, out_dir: str,
                       forms: tuple[extract.AnswerForm, ...] = extract.DEFAULT_FORMS,
                       workers: int = 0, timeout_s: float = 10.0, reward_fn: str | None = None,
                       memory_limit_mb: int | None = 4096) -> dict:
  """Scores a responses file and writes samples.jsonl and summary.json to `out_dir`."""
  pairs = read_responses(responses_path, problems)
  with reward.make_pool(reward_fn=reward_fn, workers=workers, timeout_s=timeout_s,
                        memory_limit_mb=memory_limit_mb) as pool:
    samples, per_s = score(pairs, pool, forms=forms)
  summary = summarize_by_source(samples) | {"responses": responses_path, "verify_responses_per_s": per_s}
  write_results(samples, summary, out_dir)
  return summary


def generate_responses(config, checkpoint_dir: str, path: str, *, prompts_per_call: int = 16) -> str:
  """Samples `eval.samples_per_problem` responses per problem of `eval.path` from a checkpoint with
  the rollout engine (eval temperature and top-p), and writes them as a responses file."""
  import jax
  import jax.numpy as jnp
  from vapo_jax import generation, problems, rollout, tokenizer as tok_lib
  from vapo_jax.models import checkpoint

  e, r = config.eval, config.rollout
  if not e.path:
    raise data.DataError("generating evaluation samples needs eval.path (the problems)")
  model = checkpoint.load_causal_lm(checkpoint_dir, dtype=config.model.dtype, param_dtype=config.model.param_dtype,
                                    attention=config.model.attention)
  tokenizer = tok_lib.load(config.model.tokenizer or checkpoint_dir)
  tok_lib.check_tokenizer_matches(model.cfg, tokenizer, checkpoint_dir)
  rows = problems.load_problems(e.path, config, tokenizer)[:e.max_problems]
  sampling = rollout.Sampling(max_new_tokens=r.max_response_tokens,
                              stop_token_ids=tuple(sorted({tokenizer.eos_token_id, *r.stop_token_ids})),
                              temperature=e.temperature, top_p=e.top_p)
  key, dtype = jax.random.key(config.seed), jnp.dtype(config.model.dtype)
  Path(path).parent.mkdir(parents=True, exist_ok=True)
  with open(path, "w") as f:
    for start in range(0, len(rows), prompts_per_call):
      chunk = rows[start:start + prompts_per_call]
      tokens, mask = rollout.pad_prompts([problems.encode_prompt(row, tokenizer, config) for row in chunk],
                                         pad_id=tokenizer.pad_token_id)
      engine = generation.engine_for(r, model.cfg, sequences=len(chunk) * e.samples_per_problem,
                                     prompt_tokens=tokens.shape[1], dtype=dtype, devices=1)
      out, _ = generation.sample(model, tokens, mask, jax.random.fold_in(key, start), sampling=sampling,
                                 samples_per_prompt=e.samples_per_problem, engine=engine,
                                 pad_id=tokenizer.pad_token_id, cache_dtype=dtype)
      out = jax.device_get(out)
      for b, (ids, n) in enumerate(zip(out.response_tokens, out.response_lengths)):
        row = chunk[b // e.samples_per_problem]
        f.write(json.dumps({"id": str(row.id), "answer": row.answer, "source": row.source,
                            "response": tokenizer.decode(ids[:n])}) + "\n")
      print(f"generated {min(start + prompts_per_call, len(rows))}/{len(rows)} problems", flush=True)
  return path


def _print_summary(summary: dict[str, Any]) -> None:
  for name, metrics in [("overall", summary["overall"]), *summary["per_source"].items()]:
    print(f"{name}: " + "  ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {'n/a' if v is None else v}"
                                  for k, v in metrics.items()))


def main(argv: list[str]) -> int:
  from vapo_jax import cli  # Experiment resolution and overrides, shared with `make train`.
  from vapo_jax.errors import UserError

  own, rest, args = {"--ckpt": None, "--responses": None, "--out": None}, [], iter(argv)
  for arg in args:
    key, sep, value = arg.partition("=")
    if key in own:
      own[key] = value if sep else next(args, None)
    else:
      rest.append(arg)
  try:
    config, want_help = cli.resolve(rest)
  except UserError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  if want_help or not (own["--ckpt"] or own["--responses"]):
    print(__doc__, file=sys.stdout if want_help else sys.stderr)
    return 0 if want_help else 2
  reward_config, data_config = config.reward, config.data
  problems = None
  if config.eval.path:
    from vapo_jax import tasks
    if tasks.is_spec(config.eval.path):
      problems = tasks.to_records(tasks.from_spec(config.eval.path))
    else:
      problems = data.load_records(config.eval.path, skip_bad_rows=data_config.skip_bad_rows)
  responses = own["--responses"]
  out_dir = own["--out"] or str(Path(config.run_dir) / config.name / "eval" /
                                (Path(responses).stem if responses else Path(own["--ckpt"]).name))
  if responses is None:
    try:
      responses = generate_responses(config, own["--ckpt"], str(Path(out_dir) / "responses.jsonl"))
    except UserError as e:
      print(f"error: {e}", file=sys.stderr)
      return 2
  start = time.perf_counter()
  try:
    summary = evaluate_responses(
        responses, problems=problems, out_dir=out_dir,
        forms=reward_config.answer_forms, workers=reward_config.verifier_workers,
        timeout_s=reward_config.verifier_timeout_s, reward_fn=reward_config.reward_fn,
        memory_limit_mb=reward_config.verifier_memory_mb)
  except UserError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  _print_summary(summary)
  print(f"{summary['overall']['samples']} samples scored in {time.perf_counter() - start:.1f}s; "
        f"written to {out_dir}/samples.jsonl and summary.json")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
