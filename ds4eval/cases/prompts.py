"""Prompt construction for evaluation cases (pure).

Contract: `system_prompt()` and `question_prompt(case)` return the two texts a backend sends
(as the system and user messages). The question prompt is the case question, its options as
"A. ...", and the instruction of the case's answer kind (its `answerkinds` record), which asks
the reply to end with an `Answer: ...` line in exactly the form the extractors read. The
think-close texts are what the engine backend injects when a case nears its budget while still
thinking.
It does not render chat templates or count tokens (backends do).
"""

from __future__ import annotations

from ds4eval.cases import answerkinds
from ds4eval.cases.case import Case

SYSTEM_PROMPT = (
    "You are a careful problem solver. Read the question, reason as much as you need, and "
    "finish your reply with one final line of the form \"Answer: ...\" exactly as instructed."
)

# Injected into a thinking block that is running out of budget.
THINK_SOFT_NUDGE = "\n\nI am running out of time, so I will stop here and give my final answer.\n"
THINK_HARD_CLOSE = "\n</think>\n\nAnswer:"


def system_prompt() -> str:
    return SYSTEM_PROMPT


def instruction(case: Case) -> str:
    return answerkinds.lookup(case.answer_kind).prompt_instruction(case.nchoices)


def question_prompt(case: Case) -> str:
    parts = [case.question.strip()]
    if case.choices:
        parts.append("\n".join(f"{chr(65 + i)}. {c}" for i, c in enumerate(case.choices)))
    parts.append(instruction(case))
    return "\n\n".join(parts)
