"""`make eval`: score saved responses, or sample them from a checkpoint first, with avg@k, pass@k
and maj@k overall and per source (`rewards/accuracy.py`).

  make eval EXP=aime RESPONSES=responses.jsonl        # score saved responses
  make eval EXP=aime CKPT=/path/to/checkpoint         # generate k samples per problem, then score
  python -m vapo_jax.cli.evaluate --exp aime --responses responses.jsonl [--out DIR] [field=value ...]

A responses file (.jsonl; .json and .parquet are read too) has one sample per line:
`{"id": ..., "response": "..."}`, the id being a problem id of the experiment's `eval.path`, whose
problems are read as the trainer reads them (`problems.held_out_problems`): the id of a row dropped
as a duplicate names the problem kept for it, and different problems sharing an id are renamed
`<id>@line<N>` with a warning. A line may instead carry its own `"answer"` (and `"source"`), and then
no problem file is needed; one id names one problem, so a second, different answer for it is an error.

Responses are scored as the trainer scores its rollouts (`reward.reward_fn`, `reward.correct`, the
check of `reward.max_error_frac`): every sample is written with its extracted answer, its verdict and,
if it failed to score, why (`error`) to `<out>/samples.jsonl`; the metrics and the failures' reasons to
`<out>/summary.json`. Exit status 0 when scored; 2 for a mistake in the input (one line naming the
file, line and field), a reward function failing on every response, or a full disk.
"""

import collections
import contextlib
import json
import os
import sys
import time
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from vapo_jax import files
from vapo_jax.cli import one_line_warnings, outlasting_output, resolve
from vapo_jax.config import RewardConfig
from vapo_jax.data.problems import held_out_problems
from vapo_jax.data.records import Record, answer_text
from vapo_jax.data.rows import read_rows
from vapo_jax.errors import USER_ERROR_EXIT_CODE, ConfigError, DataError, RewardFunctionError, UserError
from vapo_jax.rewards import accuracy, reward


class Response(NamedTuple):
  problem: Record  # The problem it answers.
  text: str  # The response.
  where: str  # "<file>, line N": where it was read.


def _problem_of(row: dict, where: str, by_id: dict[str, Record], aliases: dict[str, Record],
                inline: dict[str, tuple[str, str]], line: int, path: str) -> Record:
  """The problem a responses row answers: its own "answer", else its id's problem (a dropped duplicate's
  id: the kept problem). One id names one problem: a second answer for an id is an error."""
  problem_id = str(row.get("id", ""))
  known = by_id.get(problem_id) or aliases.get(problem_id)
  if "answer" not in row:
    if known is not None:
      return known
    renamed = [p.id for p in by_id.values() if p.id.startswith(f"{problem_id}@")]
    hint = ("no problem file is set (eval.path)" if not by_id else
            "the problem file's different problems with this id were renamed by their line when loaded: use "
            f"one of {', '.join(map(repr, renamed[:5]))}" if renamed else "no problem has this id")
    raise DataError(f"{where}, field 'id': {problem_id!r}: {hint}, and the line has no 'answer'")
  answer = answer_text(row["answer"])
  if not answer:
    raise DataError(f"{where}, field 'answer': expected a non-empty string or number")
  problem_id = known.id if known is not None else problem_id or str(line)
  given = (inline.setdefault(problem_id, (answer, where)) if known is None
           else (known.answer, "the problem file"))
  if accuracy.answer_key(given[0]) != accuracy.answer_key(answer):
    raise DataError(f"{where}, field 'answer': {answer!r}, but id {problem_id!r} has the answer {given[0]!r} "
                    f"in {given[1]}: one id names one problem; give this problem an id of its own")
  source = str(row.get("source") or (known.source if known else Path(path).stem))
  return Record(str(row.get("prompt", known.prompt if known else "")), answer, problem_id, source)


def read_responses(path: str, problems: Sequence[Record] | None,
                   aliases: dict[str, Record] | None = None) -> list[Response]:
  """The responses of a file (read as problem files are: `rows.read_rows`); every bad line is a
  `DataError` naming the file, the line and the field."""
  by_id, inline = {r.id: r for r in problems or ()}, {}
  rows, unit = read_rows(path)
  responses = []
  for number, row in rows:
    where = f"{path}, {unit} {number}"
    if isinstance(row, Exception):
      raise DataError(f"{where}, {row}")
    if not isinstance(row, dict):
      raise DataError(f"{where}, field ({unit}): expected an object, got {type(row).__name__}")
    if not isinstance(text := row.get("response"), str):
      raise DataError(f"{where}, field 'response': expected a string, got {type(text).__name__}")
    problem = _problem_of(row, where, by_id, aliases or {}, inline, number, path)
    responses.append(Response(problem, text, where))
  if not responses:
    raise DataError(f"{path}: no responses")
  return responses


def write_results(samples: Sequence[accuracy.Sample], summary: dict[str, Any], out_dir: str) -> None:
  """samples.jsonl and summary.json, each written whole or not at all; a full disk is one line."""
  with files.reporting_write_failures(out_dir, "writing the evaluation's results", elsewhere="--out=",
                                 after="then run make eval again"):
    os.makedirs(out_dir, exist_ok=True)
    files.write_atomically(os.path.join(out_dir, "samples.jsonl"),
                           "".join(json.dumps(s._asdict(), ensure_ascii=False) + "\n" for s in samples))
    files.write_atomically(os.path.join(out_dir, "summary.json"), json.dumps(summary, indent=2) + "\n")


def evaluate_responses(responses_path: str, *, problems: Sequence[Record] | None, out_dir: str,
                       reward_config: RewardConfig = RewardConfig(),
                       aliases: dict[str, Record] | None = None) -> dict:
  """Scores a responses file as the trainer scores its rollouts (`accuracy.score`, then
  `reward.check_errors`) and writes samples.jsonl (each sample with why it failed to score, if it did)
  and summary.json (with the failures' reasons) to `out_dir`. A reward function failing on every
  response is a `RewardFunctionError`, raised after the results are written."""
  responses, c = read_responses(responses_path, problems, aliases), reward_config
  with reward.make_pool(reward_fn=c.reward_fn, workers=c.verifier_workers, timeout_s=c.verifier_timeout_s,
                        memory_limit_mb=c.verifier_memory_mb) as pool:
    samples, batch = accuracy.score([(r.problem, r.text) for r in responses], pool, forms=c.answer_forms,
                                    correct_reward=c.correct, incorrect_reward=c.incorrect)
  failed = [i for i, s in enumerate(samples) if s.error is not None]
  if failed:
    first = samples[failed[0]]
    batch = batch._replace(first_error=f"{responses[failed[0]].where} (id {first.id!r}): {first.error}")
  summary = accuracy.summarize_by_source(samples) | {
      "responses": responses_path, "verify_responses_per_s": batch.metrics["perf/verify_responses_per_s"],
      "failed_to_score": {"responses": len(failed), "first": batch.first_error,
                          "reasons": accuracy.failures(samples)}}
  write_results(samples, summary, out_dir)
  if warning := unanswered_warning(samples):
    warnings.warn(f"{warning}; see the samples with form 'none' in {out_dir}/samples.jsonl", stacklevel=2)
  try:
    reward.check_errors(batch, pool, max_error_frac=c.max_error_frac,
                        counted_in="summary.json's failed_to_score (each sample's reason: "
                                   "samples.jsonl 'error')")
  except RewardFunctionError as e:
    raise RewardFunctionError(f"{e} Each response's reason is in {out_dir}/samples.jsonl (field 'error').") from None
  return summary


NO_ANSWER_WARNING_FRAC = 0.2  # Above this fraction of responses with no answer found, `make eval` warns.


def unanswered_warning(samples: Sequence[accuracy.Sample],
                       threshold: float = NO_ANSWER_WARNING_FRAC) -> str | None:
  """A warning naming the most common ending (last line, 40 characters at most) of the responses in which
  no answer form was found, when they are more than `threshold` of `samples`: an answer written in a form
  the extraction does not know is then noticed, not only scored as wrong."""
  unanswered = [s for s in samples if s.form == "none" and s.status == "ok"]
  if not samples or len(unanswered) <= threshold * len(samples):
    return None
  endings = collections.Counter((s.response.strip().splitlines() or [""])[-1].strip()[-40:] for s in unanswered)
  ending, count = endings.most_common(1)[0]
  return (f"no answer was found in {len(unanswered)} of {len(samples)} responses "
          f"({len(unanswered) / len(samples):.0%}); "
          f"the most common ending of those ({count}): {ending!r}. If it gives an answer, its form is not "
          "one of reward.answer_forms' (rewards/extract.py lists the forms)")


def sample_from_checkpoint(config, checkpoint_dir: str, path: str, *, prompts_per_call: int = 16) -> str:
  """Samples `eval.samples_per_problem` responses per held-out problem from a checkpoint, at the eval
  temperature and top-p, through the trainer's own path (`problems.eval_problems` and
  `responses.generate_responses`), and writes them as a responses file."""
  import jax

  from vapo_jax.data import problems
  from vapo_jax.data import tokenizer as tok_lib
  from vapo_jax.models import huggingface
  from vapo_jax.train import responses

  e = config.eval
  if not e.path:
    raise DataError("generating evaluation samples needs eval.path (the problems)")
  run_export = os.path.join(checkpoint_dir, "export")
  if os.path.isdir(run_export) and not any(name.endswith(".safetensors") for name in os.listdir(checkpoint_dir)):
    raise ConfigError(f"{checkpoint_dir} is a run directory, not a Hugging Face checkpoint: pass its "
                      f"exported policy, CKPT={run_export}")
  model = huggingface.load_causal_lm(checkpoint_dir, dtype=config.model.dtype,
                                     param_dtype=config.model.param_dtype,
                                     attention=config.model.attention, scan_layers=config.model.scan_layers,
                                     scan_unroll=config.model.scan_unroll)
  tokenizer = tok_lib.load(config.model.tokenizer or checkpoint_dir)
  tok_lib.check_tokenizer_matches(model.cfg, tokenizer, checkpoint_dir)
  rows, key = problems.eval_problems(config, tokenizer), jax.random.key(config.seed)
  with _written_whole(path) as f:
    for start in range(0, len(rows), prompts_per_call):
      chunk = rows[start:start + prompts_per_call]
      out, _ = responses.generate_responses(model, chunk, jax.random.fold_in(key, start), config=config,
                                             tokenizer=tokenizer, samples_per_prompt=e.samples_per_problem,
                                             temperature=e.temperature, top_p=e.top_p)
      out = jax.device_get(out)
      for b, (ids, n) in enumerate(zip(out.response_tokens, out.response_lengths)):
        row = chunk[b // e.samples_per_problem]
        f.write(json.dumps({"id": str(row.id), "answer": row.answer, "source": row.source,
                            "response": tokenizer.decode(ids[:n])}) + "\n")
      print(f"generated {min(start + prompts_per_call, len(rows))}/{len(rows)} problems", flush=True)
  return path


@contextlib.contextmanager
def _written_whole(path: str) -> Iterator[Any]:
  """A text file written to `path.tmp-<pid>` and renamed when the block ends; removed if it fails."""
  directory, tmp = os.path.dirname(path) or ".", f"{path}.tmp-{os.getpid()}"
  with files.reporting_write_failures(directory, "writing the generated responses", elsewhere="--out=",
                                 after="then run make eval again"):
    try:
      os.makedirs(directory, exist_ok=True)
      with open(tmp, "w", encoding="utf-8") as f:
        yield f
      os.replace(tmp, path)
    finally:
      files.remove_quietly(tmp)


def _print_summary(summary: dict[str, Any]) -> None:
  for name, metrics in [("overall", summary["overall"]), *summary["per_source"].items()]:
    print(f"{name}: " + "  ".join(f"{k} {v:.4g}" if isinstance(v,
                                                               float) else f"{k} {'n/a' if v is None else v}"
                                  for k, v in metrics.items()))


def main(argv: list[str]) -> int:
  parser = resolve.parser("vapo_jax.cli.evaluate", __doc__)
  parser.add_argument("--responses", metavar="FILE",
                      help="saved responses to score (.jsonl, .json, .parquet)")
  parser.add_argument("--ckpt", metavar="DIR", help="a checkpoint to sample the responses from first")
  parser.add_argument("--out", metavar="DIR", help="where samples.jsonl and summary.json go "
                      "(default <run_dir>/eval/<responses' or checkpoint's name>)")
  with one_line_warnings(), outlasting_output():
    try:
      config, args = resolve.resolve(argv, parser)
      if args.help:
        print(resolve.usage(parser, config))
        return 0
      if not (args.ckpt or args.responses):
        parser.error("give --responses FILE (saved responses) or --ckpt DIR (a checkpoint to sample from)")
      return _evaluate(config, args)
    except UserError as e:
      print(f"error: {e}", file=sys.stderr)
      return USER_ERROR_EXIT_CODE


def _evaluate(config, args) -> int:
  problems, aliases = held_out_problems(config)  # Read as the trainer reads them (schema, fields, dedup).
  responses = args.responses
  out_dir = args.out or str(Path(config.run_directory) / "eval" /
                            (Path(responses).stem if responses else Path(args.ckpt).name))
  if responses is None:
    from vapo_jax import compile_cache
    compile_cache.bound()
    compile_cache.install()  # Before anything compiles: each kept program checked against its key, as make train.
    responses = sample_from_checkpoint(config, args.ckpt, str(Path(out_dir) / "responses.jsonl"))
  start = time.perf_counter()
  summary = evaluate_responses(responses, problems=problems or None, aliases=aliases, out_dir=out_dir,
                               reward_config=config.reward)
  _print_summary(summary)
  failed = summary["failed_to_score"]
  if failed["responses"]:
    print(f"{failed['responses']} of {summary['overall']['samples']} responses failed to score (they count "
          f"as incorrect); the first: {failed['first']}")
  print(f"{summary['overall']['samples']} samples scored in {time.perf_counter() - start:.1f}s; "
        f"written to {out_dir}/samples.jsonl and summary.json")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
