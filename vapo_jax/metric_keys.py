"""Every metric key a run logs (`metrics.jsonl`, TensorBoard, W&B), declared once with what it covers.

  metric_keys.declared("critic/value_bias_decile_3")   # True: an instance of "critic/value_bias_decile_{k}"
  metric_keys.current(record)                          # a record of an older run, read under today's names
  python -m vapo_jax.metric_keys                       # the table of docs/logs.md

`{k}` in a key stands for a number (a decile 0-9, or k of pass@k). Each stage logs the keys of its work: the
warm start `sft/` and `perf/`, value pretraining the rollout's, the verifier's and the critic's, an RL step
all of them, an evaluation `eval/`. A key means one thing, and no key is logged as a copy of another. Every
key a run logs is declared here (`tests/test_trainer.py` checks a run's). Keys that older runs logged and this
code does not are in `OLD_NAMES`: read through `current`, such runs still plot.
"""

import re

KEYS: dict[str, str] = {
    # The actor's update (means over the step's mini-batches and micro-batches).
    "actor/loss": "the actor's whole loss: policy gradient + μ·positive-example NLL (+ KL to the reference, "
                  "GRPO)",
    "actor/pg_loss": "the clipped policy-gradient loss, aggregated as the algorithm says (token or sequence "
                     "mean)",
    "actor/nll_loss": "the positive-example LM loss: NLL over the tokens of responses the verifier marked "
                      "correct",
    "actor/positive_tokens": "valid tokens of the correct responses the NLL loss averages over",
    "actor/ref_kl": "KL to the reference policy (k3 estimate, token mean; GRPO)",
    "actor/entropy": "the sampling policy's entropy on the batch trained on (nats per token, from scoring)",
    "actor/entropy_term": ("the loss's entropy term (algo.entropy_coef > 0): the updated policy's entropy, "
                           "aggregated as the loss"),
    "actor/approx_kl": "KL(π_old ‖ π) between the sampling and the updated policy (k3 estimate, token mean)",
    "actor/ratio_mean": "mean importance ratio π / π_old over valid tokens",
    "actor/clip_frac_low": "tokens clipped below: ratio < 1 − ε_low with Â < 0",
    "actor/clip_frac_high": "tokens clipped above: ratio > 1 + ε_high with Â > 0",
    "actor/dual_clip_frac": "tokens where the dual clip (Â < 0, ratio > c) bounds the loss",
    "actor/tis_weight_mean": "mean truncated importance weight min(π_old / π_sampler, algo.tis_cap) (with "
                             "TIS)",
    "actor/tis_clip_frac": "tokens whose π_old / π_sampler exceeds algo.tis_cap (with TIS)",
    "actor/grad_norm": "global norm of the actor's gradient, before clipping",
    "actor/lr": "the actor's learning rate at this update",
    "actor/skipped_frac": "fraction of the actor's updates skipped for a non-finite gradient",
    # Advantages, on the scored batch.
    "adv/mean_abs": "mean |Â| over valid tokens, before whitening",
    "adv/early_mean": "mean advantage over the first 10 % of each response's tokens, as the actor sees it "
                      "(whitened)",
    "adv/early_mean_unwhitened": "the same in reward units (0 in expectation under an unbiased critic)",
    "adv/lam_actor_mean": "mean λ_actor over the batch's sequences (length-adaptive: 1 − 1/(α·l))",
    "adv/lam_actor_min": "smallest λ_actor of the batch",
    "adv/lam_actor_max": "largest λ_actor of the batch",
    # The critic.
    "critic/value_loss": "the critic's loss (½ squared error to the λ_critic returns, clipped if configured)",
    "critic/clip_frac": "tokens whose value clipping took the larger, clipped error",
    "critic/explained_variance": ("1 − Var[G − V] / Var[G] over valid tokens, before the step's update "
                                   "(0 without a critic)"),
    "critic/value_mean": "mean value V over valid tokens, before the update (0 without a critic)",
    "critic/return_mean": "mean λ_critic return over valid tokens",
    "critic/value_bias_decile_{k}": ("the critic's bias V − G against the Monte-Carlo return over decile k "
                                     "(0-9) of each response"),
    "critic/grad_norm": "global norm of the critic's gradient, before clipping",
    "critic/lr": "the critic's learning rate at this update",
    "critic/skipped_frac": "fraction of the critic's updates skipped for a non-finite gradient",
    # The batch trained on (after dynamic sampling's filter).
    "rollout/reward_mean": "mean reward of the batch trained on",
    "rollout/accuracy": "fraction of the batch trained on that the verifier judged correct",
    "rollout/logprob_gap": "mean |sampler − scoring| log-probability of the sampled tokens (0 up to rounding)",
    "rollout/sampler_kl": "k3 estimate of KL(sampler ‖ trainer) over the sampled tokens: the sampler–trainer "
                          "gap",
    "rollout/response_len_mean": "mean response length of the batch trained on (tokens)",
    "rollout/response_len_min": "shortest response of the batch trained on",
    "rollout/prompt_len_mean": "mean prompt length of the batch trained on (tokens)",
    "rollout/truncated_frac": "responses of the batch trained on that reached rollout.max_response_tokens",
    # The sampling (under dynamic sampling: its last round).
    "rollout/response_len_p50": "median response length of the sampling",
    "rollout/response_len_p90": "90th percentile of the sampling's response lengths",
    "rollout/response_len_max": "longest response of the sampling",
    "rollout/finish_stop_frac": "responses that ended at a stop token",
    "rollout/finish_length_frac": "responses that ended at the length cap",
    "rollout/decode_steps": "decode steps the rollout ran",
    "rollout/slots": "rows decoded per step at the start (the refill engine shrinks them in the tail)",
    "rollout/slot_utilization": "response tokens / Σ rows × decode steps: the share of decoded rows that "
                                "were live",
    "rollout/preemptions": "sequences the paged engine preempted for want of pages and restarted",
    "rollout/recomputed_tokens": "tokens decoded again after preemptions",
    "rollout/prefills": ("prompts (and carried prefixes) the paged engine prefilled into their pages, again "
                         "after being given back too"),
    "rollout/prefill_chunks": "prefill chunks run (`rollout.prefill_chunk` tokens of one prompt each, at "
                              "most)",
    "rollout/prefill_tokens": "prompt and carried tokens prefilled into pages, counted again after a "
                              "preemption",
    "rollout/queue_pages": "pages of each queue's pool in the paged engine (`rollout.pages` is per group)",
    "rollout/queue_pages_peak": "the most pages any queue held at once",
    "rollout/queue_pages_free_after": "the fewest free pages any queue had at the end (all of them: nothing leaked)",
    "rollout/sampling_rounds": "sampling rounds this step (1 without dynamic sampling or partial rollouts)",
    "rollout/carried_sequences": ("partial rollouts: sequences still decoding when the step's rounds ended, "
                                  "continued next step"),
    "rollout/stale_token_frac": "partial rollouts: trained tokens sampled by an older policy version",
    "rollout/restarted_sequences": ("partial rollouts: sequences restarted from the prompt, older than "
                                    "rollout.max_staleness"),
    "rollout/mixed_group_frac": "dynamic sampling: fraction of the batch's groups with mixed verdicts",
    "rollout/unmixed_groups": "dynamic sampling: groups of all-equal verdicts that filled the batch at the "
                              "round cap",
    # The verifier, over every response sampled this step (every round).
    "reward/sampled_mean": ("dynamic sampling: mean reward of every response sampled this step, all "
                            "rounds, before the filter"),
    "reward/no_answer_frac": "responses with no answer found (verified, so the incorrect reward)",
    "reward/error_frac": "responses the verifier failed on (timeout, crash or error)",
    "reward/verifier_timeouts": "responses whose verification timed out",
    "reward/verifier_crashes": "responses whose verifier process crashed",
    "reward/verifier_errors": "responses whose verification raised",
    # Held-out evaluation.
    "eval/accuracy": "held-out avg@k: the mean verdict of every sample",
    "eval/accuracy_stderr": "avg@k's standard error over the held-out problems (their accuracies' spread / "
                            "√problems)",
    "eval/problems": "held-out problems evaluated",
    "eval/accuracy_level_{k}": ("avg@k on the held-out problems of level k: a file's `level` field (MATH's "
                                "1-5), the synthetic tasks' number of terms"),
    "eval/response_len_mean": "mean held-out response length (tokens)",
    "eval/no_answer_frac": "held-out responses with no answer found",
    "eval/error_frac": "held-out responses the verifier failed on",
    # The supervised warm start.
    "sft/nll": "the warm start's NLL per response token",
    "sft/grad_norm": "global norm of the warm start's gradient, before clipping",
    "sft/lr": "the warm start's learning rate",
    "sft/skipped_frac": "fraction of the warm start's updates skipped for a non-finite gradient",
    # Time (seconds of this step; the largest over processes).
    "time/rollout_s": "sampling: prefill and decode, all rounds, until the lengths reach the host",
    "time/verify_s": "the verifier, all rounds",
    "time/logprobs_values_s": "scoring: the log-probs and values pass (packing included)",
    "time/pack_s": "the host's part of scoring: placing packed rows",
    "time/update_s": "the critic's and actor's updates",
    "time/step_s": "the whole step",
    # Throughput and padding.
    "perf/tokens_per_s": "response tokens per second of the whole step",
    "perf/rollout_tokens_per_s": "response tokens per second of sampling",
    "perf/train_tokens_per_s": ("prompt + response tokens per second of scoring and the updates "
                                   "(warm start: its update)"),
    "perf/verify_responses_per_s": "responses verified per second",
    "perf/padding_frac_scoring": "padding's share of the token slots scoring computed",
    "perf/padding_frac_update": "padding's share of the token slots the updates computed",
    "perf/padding_frac_sft": "padding's share of the token slots the warm start computed",
    "perf/micro_batches": "micro-batches run per mini-batch",
    "perf/micro_batches_compiled": "packed: micro-batches the update program was compiled for",
    "perf/mini_batch_responses_min": "packing.fill_micro_batches: responses in the step's smallest mini-batch",
    "perf/mini_batch_responses_max": "packing.fill_micro_batches: responses in the step's largest mini-batch",
}

# Keys of older runs: their name today, or None where nothing logged today carries them (said why).
OLD_NAMES: dict[str, str | None] = {
    "time/scoring_s": "time/verify_s",  # A copy of the verifier's time, plotted as "scoring".
    "reward/mean": None,  # The last sampling round's mean: rollout/reward_mean (trained) or reward/sampled_mean.
}

_PATTERNS = [re.compile(re.escape(key).replace(r"\{k\}", r"\d+") + "$") for key in KEYS if "{k}" in key]
_BOOKKEEPING = {"step", "stage", "global_step"}


def declared(key: str) -> bool:
  """Whether `key` is a declared metric (or one of a record's own fields: step, stage, global_step)."""
  return key in KEYS or key in _BOOKKEEPING or any(p.match(key) for p in _PATTERNS)


def current(record: dict) -> dict:
  """`record` (one line of a metrics.jsonl) under today's names: old keys renamed, or dropped where today's
  key is already there or nothing carries them."""
  out = {}
  for key, value in record.items():
    new = OLD_NAMES.get(key, key) if key not in KEYS else key
    if new is not None and new not in record:
      out[new] = value
    elif new == key:
      out[key] = value
  return out


def table() -> str:
  """The markdown table of `KEYS` that docs/logs.md holds."""
  return "\n".join(["| key | what it covers |", "|---|---|"] + [f"| `{k}` | {v} |" for k, v in KEYS.items()])


if __name__ == "__main__":
  print(table())
