"""The refill engine: decode slots that take the next sequence as soon as theirs ends (continuous batching).

  engine      the paged engine: its device programs (start, decode, compaction, finish), the slots over a paged
              KV cache, preemption when the pages run out (`engine.generate_refill`)
  contiguous  the same engine over a contiguous KV cache (each slot owning prompt + cap tokens): the reference
              the benchmark and the roofline compare the paged one against
  queues      what both share: queues of sequences in slots, outputs by sequence, the tail's shrink, and the one
              host loop (`queues.drive`) that runs either engine's programs
  pages       the pool's pages, handed out and taken back on the device
  resumed     a partial rollout's call: the run's sequences it continues, from where, and its decode budget
  replay      the engine replayed on the host (rows and cache reads per decode step, preemptions, partial
              rollouts' rounds): the roofline's schedule, with the kernels' own read counts
"""
