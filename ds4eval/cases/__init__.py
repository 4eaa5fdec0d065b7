"""Cases and their judging: the Case record, suite manifests and data, prompts, answer kinds,
extraction, grading and the extractors' self-tests.

Everything here is pure apart from reading manifests and data files; nothing here runs a model,
talks to a server or writes a trace (that is `ds4eval.run`).
"""
