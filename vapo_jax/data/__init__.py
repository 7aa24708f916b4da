"""Problems and their prompts, from files or a synthetic task, to token ids.

  rows            a data file's rows by number: jsonl (line by line), json, parquet, Hugging Face datasets
  records         problem files' rows → `Record`s: schemas, validation with the file, row and field named,
                  de-duplication
  tasks           the synthetic step-by-step arithmetic of the CPU experiments
  problems        training and held-out problems as a config reads them, and their prompts (templates,
                  chat template, the prompt token limit)
  prompt_iterator the prompt sampler: endless, resumable, reshuffled batches of problems
  tokenizer       a Hugging Face tokenizer from a checkpoint directory, or the byte tokenizer
"""
