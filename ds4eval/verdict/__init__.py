"""What runs say side by side: paired comparison of two runs, the statistics behind it, repeat
classes (pass@k, flaky cases) and regrading a trace from its stored outputs.

Pure over trace records and summaries; rendering them is `ds4eval.reports`.
"""
