"""`make eval`: score saved responses, or sample them from a checkpoint first, with avg@k, pass@k
and maj@k overall and per source (`rewards/accuracy.py`).

  make eval EXP=aime RESPONSES=responses.jsonl        # score saved responses
  make eval EXP=aime CKPT=/path/to/checkpoint         # generate k samples per problem, then score
  python -m vapo_jax.cli.evaluate --exp aime --responses responses.jsonl [--out DIR] [field=value ...]

A responses file has one sample per line: `{"id": ..., "response": "..."}`, the id being a
problem id of the experiment's `eval.path`; a line may instead carry its own `"answer"` (and
`"source"`), and then no problem file is needed. Every sample is written with its extracted
answer and verdict to `<out>/samples.jsonl`, and the metrics to `<out>/summary.json`.
"""

import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vapo_jax.cli import resolve
from vapo_jax.data.problems import eval_problems
from vapo_jax.data.records import Record, answer_text
from vapo_jax.errors import DataError, UserError
from vapo_jax.kinds import AnswerForm
from vapo_jax.rewards import accuracy, reward
from vapo_jax.rewards.extract import DEFAULT_FORMS


def read_responses(path: str, problems: Sequence[Record] | None) -> list[tuple[Record, str]]:
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
        raise DataError(f"{where}, field (line): malformed JSON: {e.msg} at column {e.colno}") from None
      if not isinstance(row, dict):
        raise DataError(f"{where}, field (line): expected an object, got {type(row).__name__}")
      response = row.get("response")
      if not isinstance(response, str):
        raise DataError(f"{where}, field 'response': expected a string, got {type(response).__name__}")
      problem_id = str(row.get("id", ""))
      if "answer" in row:
        answer = answer_text(row["answer"])
        if not answer:
          raise DataError(f"{where}, field 'answer': expected a non-empty string or number")
        known = by_id.get(problem_id)
        source = str(row.get("source") or (known.source if known else Path(path).stem))
        problem = Record(str(row.get("prompt", known.prompt if known else "")), answer,
                              problem_id or str(number), source)
      elif problem_id in by_id:
        problem = by_id[problem_id]
      else:
        hint = "no problem file is set (eval.path)" if not by_id else "no problem has this id"
        raise DataError(f"{where}, field 'id': {problem_id!r}: {hint}, and the line has no 'answer'")
      pairs.append((problem, response))
  if not pairs:
    raise DataError(f"{path}: no responses")
  return pairs


def write_results(samples: Sequence[accuracy.Sample], summary: dict[str, Any], out_dir: str) -> None:
  out = Path(out_dir)
  out.mkdir(parents=True, exist_ok=True)
  with open(out / "samples.jsonl", "w", encoding="utf-8") as f:
    for sample in samples:
      f.write(json.dumps(sample._asdict(), ensure_ascii=False) + "\n")
  (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")


def evaluate_responses(responses_path: str, *, problems: Sequence[Record] | None, out_dir: str,
                       forms: tuple[AnswerForm, ...] = DEFAULT_FORMS,
                       workers: int = 0, timeout_s: float = 10.0, reward_fn: str | None = None,
                       memory_limit_mb: int | None = 4096) -> dict:
  """Scores a responses file and writes samples.jsonl and summary.json to `out_dir`."""
  pairs = read_responses(responses_path, problems)
  with reward.make_pool(reward_fn=reward_fn, workers=workers, timeout_s=timeout_s,
                        memory_limit_mb=memory_limit_mb) as pool:
    samples, per_s = accuracy.score(pairs, pool, forms=forms)
  summary = accuracy.summarize_by_source(samples) | {"responses": responses_path, "verify_responses_per_s": per_s}
  write_results(samples, summary, out_dir)
  return summary


def generate_responses(config, checkpoint_dir: str, path: str, *, prompts_per_call: int = 16) -> str:
  """Samples `eval.samples_per_problem` responses per held-out problem from a checkpoint, at the eval
  temperature and top-p, through the trainer's own path (`problems.eval_problems` and
  `experience.generate`), and writes them as a responses file."""
  import jax

  from vapo_jax.data import problems, tokenizer as tok_lib
  from vapo_jax.models import huggingface
  from vapo_jax.train import experience

  e = config.eval
  if not e.path:
    raise DataError("generating evaluation samples needs eval.path (the problems)")
  model = huggingface.load_causal_lm(checkpoint_dir, dtype=config.model.dtype, param_dtype=config.model.param_dtype,
                                     attention=config.model.attention)
  tokenizer = tok_lib.load(config.model.tokenizer or checkpoint_dir)
  tok_lib.check_tokenizer_matches(model.cfg, tokenizer, checkpoint_dir)
  rows, key = problems.eval_problems(config, tokenizer), jax.random.key(config.seed)
  Path(path).parent.mkdir(parents=True, exist_ok=True)
  with open(path, "w") as f:
    for start in range(0, len(rows), prompts_per_call):
      chunk = rows[start:start + prompts_per_call]
      out, _ = experience.generate(model, chunk, jax.random.fold_in(key, start), config=config, tokenizer=tokenizer,
                                   group=e.samples_per_problem, temperature=e.temperature, top_p=e.top_p)
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
  own, rest, args = {"--ckpt": None, "--responses": None, "--out": None}, [], iter(argv)
  for arg in args:
    key, sep, value = arg.partition("=")
    if key in own:
      own[key] = value if sep else next(args, None)
    else:
      rest.append(arg)
  try:
    config, want_help = resolve.resolve(rest)
  except UserError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  if want_help or not (own["--ckpt"] or own["--responses"]):
    print(__doc__, file=sys.stdout if want_help else sys.stderr)
    return 0 if want_help else 2
  reward_config = config.reward
  try:
    problems = eval_problems(config) or None  # Read as the trainer reads them (schema, fields, dedup).
  except UserError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  responses = own["--responses"]
  out_dir = own["--out"] or str(Path(config.run_directory) / "eval" /
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
