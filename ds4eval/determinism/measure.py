"""One determinism run from start to end: the conditions' requests, then the analysis.

`measure(target, prompts, plan, conditions, margin, progress) -> Result` runs the named
condition kinds through the target (`conditions.run_conditions`), analyses each prompt's group
(`analysis.analyze`) and returns the `Result` with the stack's description, the settings and
the notes the conditions left. It chooses no target and writes no file (the CLI does both).
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

from ds4eval.determinism.analysis import Prompt, Result, analyze
from ds4eval.determinism.conditions import Plan, RunContext, run_conditions
from ds4eval.determinism.targets import Target


def measure(target: Target, prompts: Sequence[Prompt], plan: Plan, conditions: Sequence[str], margin: float,
            progress: Callable[[str], None] = lambda line: None, notes: Sequence[str] = ()) -> Result:
    t0 = time.perf_counter()
    ctx = RunContext(target, prompts, plan, progress)
    groups = run_conditions(ctx, conditions)
    outcomes = tuple(analyze(g, margin) for g in groups)
    if any(o.unit == "word" for o in outcomes if o.completions):
        ctx.notes.append("completions without tokens were compared word by word; their divergences are unclassed")
    settings = {"prompts": len(prompts), "repeats": plan.repeats, "concurrency": list(plan.concurrency),
                "mixed_rounds": plan.mixed_rounds, "max_tokens": plan.max_tokens, "temperature": plan.temperature,
                "seed": plan.seed, "margin_nats": margin, "conditions": list(conditions)}
    return Result(target.describe(), settings, outcomes, (*notes, *ctx.notes), time.perf_counter() - t0)
