"""Quality testing: reference logits, golden outputs and release gates for the engine.

Modules (run the scripts with `python -m quality_testing.<name>` from the repository root):
  refset                  the reference-set manifest, prompt files and reference files (format)
  metrics                 pure comparisons of two logit vectors
  longtext                deterministic generator of the long-context prompts
  render_references       reference logits from transformers (float32) on the same GGUF
  compare_frontier_logits the engine against the stored references; non-zero exit past a threshold
  golden                  greedy 64-token continuations with each step's top-8 log-probs, checked teacher-forced
  validate_scores         scorer coverage of every suite's answer kinds and cases
  gate_speed              engine speed of the working tree against a git ref, interleaved
  gate_quality            the greedy sanity suite case by case against the baseline trace (ds4eval.verdict.compare)
This package judges the engine and the scorers from outside; neither imports it.
"""
