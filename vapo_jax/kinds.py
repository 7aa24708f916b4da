"""Named choices shared by the pure math and the configs (a leaf: imports nothing of the package).

`config` declares fields of these types and `losses` takes them as arguments; keeping them here
lets `import vapo_jax.config` load no JAX.
"""

from typing import Literal

LossAggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
KLEstimator = Literal["k1", "k2", "k3"]
