"""ds4-bench: speed benchmarks of the embedded engine (`ds4-bench --help` lists them).

Subcommands, one module each:
  engine       load time, prefill and decode tokens/s, optionally side by side with
               llama.cpp (`ds4bench.engine_bench`, runners in `ds4bench.runners`)
  kvcache      time to first token of a long prompt through ds4-server, cold versus
               restored from the disk KV cache after a restart (`ds4bench.kvcache`)
  sessions     aggregate and per-session decode tokens/s of N sessions decoding together,
               in-process (`ds4bench.sessions`)
  serve        closed-loop and Poisson load on any OpenAI-compatible server: throughput,
               TTFT, ITL, TPOT, E2EL percentiles, goodput (`ds4bench.serve`)
  product      the engine's decode speed through ds4-eval and ds4-server, as ratios to the
               engine alone (`ds4bench.product`)
  kld          KL divergence, perplexity and argmax flips of a candidate stack against a stored
               reference over a text corpus (`ds4bench.kld`; statistics in kldstats, the
               base file in kldfile, the stacks in kldstacks, the corpus in corpus/)
  random-gguf  a GGUF shaped like a real one with random weights, for machines the real
               weights cannot reach (`ds4bench.random_gguf`)
Shared output helpers live in `ds4bench.csvfile`, the failure classes in
`ds4bench.errors`; the command line in `ds4bench.cli`.
It measures speed and numerical agreement (kld); answer quality is ds4-eval's job.
"""
