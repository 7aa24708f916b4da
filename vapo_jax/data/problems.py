"""Problems for training and evaluation: `Record` rows from a file or a synthetic spec, and
their prompts (the instruction template, the chat template, the token limit) as token ids. One row
type (`Record`) from loading to scoring.

  prompt = format_prompt(records[0].prompt, template="dapo", tokenizer=tokenizer)
"""

import warnings
from collections.abc import Callable, Sequence
from typing import Any

from vapo_jax import kinds
from vapo_jax.config import ExperimentConfig
from vapo_jax.data import tasks
from vapo_jax.data.records import Record, answer_key, deduplicate, kept_for_dropped, load_records, problem_key
from vapo_jax.errors import DataError
from vapo_jax.kinds import Template

TEMPLATES: dict[str, str] = {
    "raw": "{problem}",
    # Qwen2.5-Math / SimpleRL's instruction.
    "boxed": "{problem}\nPlease reason step by step, and put your final answer within \\boxed{}.",
    # DAPO's (and VAPO's) prompt, as in DAPO's eval/aime-2024.parquet.
    "dapo": ("Solve the following math problem step by step. The last line of your response should "
             "be of the form Answer: $Answer (without quotes) where $Answer is the answer to the "
             "problem.\n\n{problem}\n\nRemember to put your answer on its own line after \"Answer:\"."),
}
kinds.check_table(Template, TEMPLATES, "data/problems.py TEMPLATES")


def load_problems(path: str, config: ExperimentConfig, tokenizer=None, *, dedup: bool | None = None,
                  unique_ids: bool = False) -> list[Record]:
  """The records of `path` (a jsonl / json / parquet file, `hf:NAME`, or `synthetic:...`). With a
  tokenizer, prompts over `rollout.max_prompt_tokens` are found now, not when a batch draws them:
  an error naming the row, or with `data.skip_bad_rows` left out and counted. `unique_ids`: see
  `records.make_ids_unique`."""
  d = config.data
  if tasks.is_spec(path):
    records = tasks.to_records(tasks.from_spec(path))
  else:
    records = load_records(path, schema=d.schema, prompt_field=d.prompt_field, answer_field=d.answer_field,
                                id_field=d.id_field, split=d.split, skip_bad_rows=d.skip_bad_rows,
                                dedup=d.dedup if dedup is None else dedup, unique_ids=unique_ids)
  if tokenizer is None:
    return records
  return check_prompt_lengths(records, tokenizer, max_prompt_tokens=config.rollout.max_prompt_tokens,
                                   template=d.template, chat_template=d.chat_template, path=path,
                                   skip_bad_rows=d.skip_bad_rows)


def training_problems(config: ExperimentConfig, tokenizer=None, eval_rows: Sequence[Record] = (), *,
                      path: str | None = None, dedup: bool | None = None, noun: str = "training problems",
                      say: Callable[[str], None] | None = None) -> list[Record]:
  """The training problems of `path` (default `data.train_path`; the warm start passes `sft.path` and calls
  them `noun`, "demonstrations"), loaded by `load_problems`, less those that are also evaluation problems
  (`eval_rows`, see `eval_overlap`) when `data.drop_eval_overlap`: the drop is said through `say` (a line of
  the run's log). Kept, they are warned about: the held-out accuracy then measures problems the run trained
  on."""
  path = path or config.data.train_path
  records = load_problems(path, config, tokenizer, dedup=dedup)
  shared = eval_overlap(records, eval_rows)
  if not shared:
    return records
  what = (f"{len(shared)} of {len(records)} {noun} ({path}) are also evaluation problems "
          f"({config.eval.path}), the same problem text and answer, e.g. id {records[shared[0]].id!r}")
  if not config.data.drop_eval_overlap:
    warnings.warn(f"{what}: the held-out accuracy then measures them as trained on; "
                  "data.drop_eval_overlap=true drops them", stacklevel=2)
    return records
  drop_at = set(shared)
  records = [r for i, r in enumerate(records) if i not in drop_at]
  if not records:
    raise DataError(f"{path}: every one of its {len(drop_at)} {noun} is an evaluation problem of "
                    f"{config.eval.path}, and data.drop_eval_overlap=true drops them all: use {noun} of "
                    "other problems")
  if say is not None:
    say(f"data: {what}; dropped from training (data.drop_eval_overlap=true)")
  return records


def eval_overlap(train: Sequence[Record], eval_rows: Sequence[Record]) -> list[int]:
  """Indices of the training records that are evaluation records: the same problem, its text (whitespace
  normalised, as deduplication compares it) and its answer. Ids never decide: two files of one source may each
  number their rows from 0 (verl's `extra_info.index`), and one file read as both has the same texts."""
  if not eval_rows:
    return []
  problems = {(problem_key(r.prompt), answer_key(r.answer)) for r in eval_rows}
  return [i for i, r in enumerate(train) if (problem_key(r.prompt), answer_key(r.answer)) in problems]


def eval_problems(config: ExperimentConfig, tokenizer=None) -> list[Record]:
  """The held-out problems of `eval.path` (the first `eval.max_problems`; none without a path), read
  as the training data is read (`data.schema`, the field settings, deduplication), with ids made
  unique (`records.make_ids_unique`): the trainer's evaluation and `make eval` both load them here."""
  return held_out_problems(config, tokenizer)[0]


def held_out_problems(config: ExperimentConfig, tokenizer=None) -> tuple[list[Record], dict[str, Record]]:
  """`eval_problems`, and the id of every row deduplication dropped → the kept problem it repeats
  (`make eval` scores responses to a dropped duplicate as responses to that problem)."""
  if not config.eval.path:
    return [], {}
  rows = load_problems(config.eval.path, config, tokenizer, dedup=False, unique_ids=True)
  kept = deduplicate(rows)[0] if config.data.dedup else rows
  kept = kept[:config.eval.max_problems]
  return kept, kept_for_dropped(rows, kept)


def encode_prompt(record: Record, tokenizer, config: ExperimentConfig) -> list[int]:
  """Token ids of a problem's prompt; over `rollout.max_prompt_tokens` is an error naming the row."""
  d = config.data
  ids = tokenizer.encode(prompt_text(record.prompt, tokenizer, template=d.template,
                                     chat_template=d.chat_template))
  if len(ids) > config.rollout.max_prompt_tokens:
    raise DataError(f"prompt of problem id {record.id!r} ({record.source}) has {len(ids)} tokens, over "
                         f"rollout.max_prompt_tokens={config.rollout.max_prompt_tokens}")
  return ids


def format_prompt(problem: str, *, template: Template = "dapo", tokenizer: Any = None) -> str:
  """The problem in `template`; with a tokenizer, as a user turn in its chat template."""
  if template not in TEMPLATES:
    raise ValueError(f"unknown template {template!r}; known: {', '.join(TEMPLATES)}")
  text = TEMPLATES[template].replace("{problem}", problem)
  if tokenizer is None:
    return text
  return tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                       add_generation_prompt=True)


def prompt_text(problem: str, tokenizer: Any, *, template: Template, chat_template: bool) -> str:
  """The prompt the policy sees: `problem` in `template`, in the chat template of a transformers
  tokenizer (an `HFTokenizer`'s `.tokenizer`) when `chat_template`."""
  chat = getattr(tokenizer, "tokenizer", None) if chat_template else None
  return format_prompt(problem, template=template, tokenizer=chat)


def _problem_and_id(row: Any) -> tuple[str, str]:
  return (row.prompt, row.id) if isinstance(row, Record) else (row["problem"], str(row["id"]))


def check_prompt_lengths(rows: Sequence[Any], tokenizer: Any, *, max_prompt_tokens: int, template: Template,
                         chat_template: bool, path: str, skip_bad_rows: bool = False) -> list[Any]:
  """The rows whose prompt fits in `max_prompt_tokens` tokens; a longer one is a `DataError` naming
  the file, the problem id, its token count and the settings to change, or with `skip_bad_rows` it
  is left out and counted in one warning (none fitting is always an error).

  `rows` are `Record`s or dicts with "problem" and "id" (as the trainer keeps them); the prompt is
  made as `prompt_text` makes it. Only prompts longer in UTF-8 bytes than the limit are tokenised:
  a byte-level BPE token (Qwen2.5, Llama 3) or a byte tokenizer's covers at least one byte, so a
  shorter text cannot exceed it.
  """
  texts = [prompt_text(_problem_and_id(row)[0], tokenizer, template=template, chat_template=chat_template)
           for row in rows]
  long = [i for i, text in enumerate(texts) if len(text.encode("utf-8")) > max_prompt_tokens]
  counts = dict(zip(long, _token_counts([texts[i] for i in long], tokenizer)))
  over = [i for i in long if counts[i] > max_prompt_tokens]
  if not over:
    return list(rows)
  chat = " in the chat template" if chat_template and hasattr(tokenizer, "tokenizer") else ""
  first = (f"{path}, problem id {_problem_and_id(rows[over[0]])[1]!r}: the prompt (template "
           f"{template!r}{chat}) has {counts[over[0]]} tokens, over "
           f"rollout.max_prompt_tokens={max_prompt_tokens}")
  if not skip_bad_rows:
    raise DataError(f"{first}. Raise rollout.max_prompt_tokens, shorten the problem, or set "
                    f"data.skip_bad_rows=true to leave such problems out ({len(over)} of {len(rows)} are too "
                    "long)")
  if len(over) == len(rows):
    raise DataError(f"{path}: every prompt is over rollout.max_prompt_tokens={max_prompt_tokens}; first: "
                    f"{first}")
  warnings.warn(f"{path}: skipped {len(over)} of {len(rows)} problems whose prompt is over "
                f"rollout.max_prompt_tokens={max_prompt_tokens}; first: {first}", stacklevel=2)
  dropped = set(over)
  return [row for i, row in enumerate(rows) if i not in dropped]


def _token_counts(texts: list[str], tokenizer: Any) -> list[int]:
  """Token counts of `texts`, in one batched call for a transformers tokenizer."""
  if texts and hasattr(tokenizer, "tokenizer"):
    return [len(ids) for ids in tokenizer.tokenizer(texts, add_special_tokens=False)["input_ids"]]
  return [len(tokenizer.encode(text)) for text in texts]
