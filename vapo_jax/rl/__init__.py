"""The pure math of the algorithms: advantage estimators, losses and masked statistics.

Functions of arrays only: no flax, no config, no models; arrays positional, hyperparameters
keyword-only, masks explicit. `train/algorithm.py` chooses which of them a config runs.

  masked      masked sum / mean / variance / whitening
  advantages  GAE as a reverse `lax.scan` over a per-sequence λ, decoupled and length-adaptive GAE,
              Monte-Carlo returns, group-normalised advantages, last-token rewards
  losses      the clipped policy loss (clip-higher, dual clip), loss aggregations, value loss,
              positive-example NLL, KL estimators, entropy, explained variance
  positions   batch statistics by relative position within each response (deciles)
"""
