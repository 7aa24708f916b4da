"""The refill engine: decode slots that take the next sequence as soon as theirs ends (continuous batching).

  engine      its decode loop and device programs (`engine.generate_refill`, `engine.programs(plan, ...)`): each
              iteration preempts, prefills, admits, allocates pages and decodes one token a row
  slots       its state (`Slots`, `Prompts`) and the steps on it: pages taken back under pressure (`preempt`),
              sequences admitted when their prompt is resident (`admit`), pages handed out (`allocate`)
  prefill     prefill lanes: a prompt (or a carried prefix) filled into its pages chunk by chunk, in the loop
  queues      queues of sequences served by decode slots, outputs by sequence, the tail's shrinking
  pages       the pool's pages, handed out and taken back on the device
  resumed     a partial rollout's call: the run's sequences it continues, from where, and its decode budget
  replay      the engine replayed on the host (rows, prefill chunks and cache reads per iteration, preemptions):
              the roofline's schedule, with the kernels' own read counts

The engine over a contiguous KV cache, the reference the paged one is benchmarked against, is
`benchmarks/contiguous_refill.py`. Of the package above it, this folder imports only `common.py`.
"""
