"""Problems for training and evaluation: `data.Record` rows from a file or a synthetic spec, and
their prompts as token ids. One row type (`data.Record`) from loading to scoring."""

from vapo_jax import data, tasks
from vapo_jax.config import ExperimentConfig


def load_problems(path: str, config: ExperimentConfig, tokenizer=None, *, dedup: bool | None = None) -> list[data.Record]:
  """The records of `path` (a jsonl / json / parquet file, `hf:NAME`, or `synthetic:...`). With a
  tokenizer, prompts over `rollout.max_prompt_tokens` are found now, not when a batch draws them:
  an error naming the row, or with `data.skip_bad_rows` left out and counted."""
  d = config.data
  if tasks.is_spec(path):
    records = tasks.to_records(tasks.from_spec(path))
  else:
    records = data.load_records(path, schema=d.schema, prompt_field=d.prompt_field, answer_field=d.answer_field,
                                id_field=d.id_field, split=d.split, skip_bad_rows=d.skip_bad_rows,
                                dedup=d.dedup if dedup is None else dedup)
  if tokenizer is None:
    return records
  return data.check_prompt_lengths(records, tokenizer, max_prompt_tokens=config.rollout.max_prompt_tokens,
                                   template=d.template, chat_template=d.chat_template, path=path,
                                   skip_bad_rows=d.skip_bad_rows)


def encode_prompt(record: data.Record, tokenizer, config: ExperimentConfig) -> list[int]:
  """Token ids of a problem's prompt; over `rollout.max_prompt_tokens` is an error naming the row."""
  d = config.data
  ids = tokenizer.encode(data.prompt_text(record.prompt, tokenizer, template=d.template, chat_template=d.chat_template))
  if len(ids) > config.rollout.max_prompt_tokens:
    raise data.DataError(f"prompt of problem id {record.id!r} ({record.source}) has {len(ids)} tokens, over "
                         f"rollout.max_prompt_tokens={config.rollout.max_prompt_tokens}")
  return ids
