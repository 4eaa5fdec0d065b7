"""Prompt construction for evaluation cases (pure).

Contract: `system_prompt()` and `question_prompt(case)` return the two texts a backend sends
(as the system and user messages). The question prompt is the case question, its options as
"A. ...", and a per-kind instruction that asks the reply to end with an `Answer: ...` line in
exactly the form the extractors read. The think-close texts are what the engine backend
injects when a case nears its budget while still thinking.
It does not render chat templates or count tokens (backends do).
"""

from __future__ import annotations

from ds4eval.cases import Case

SYSTEM_PROMPT = (
    "You are a careful problem solver. Read the question, reason as much as you need, and "
    "finish your reply with one final line of the form \"Answer: ...\" exactly as instructed."
)

_INSTRUCTIONS = {
    "choice": "Pick the single best option. End your reply with the line \"Answer: X\", where X is "
              "the letter of the option ({first}-{last}).",
    "integer": "End your reply with the line \"Answer: N\", where N is the final integer.",
    "rational": "Give the exact value. End your reply with the line \"Answer: p/q\" (a fraction in "
                "lowest terms, or an integer).",
    "exact_text": "End your reply with the line \"Answer: ...\" giving only the final answer.",
    "ordered_sequence": "End your reply with the line \"Answer: ...\" giving the answers in the order "
                        "asked, separated by commas.",
    "line_set": "End your reply with the line \"Answer: ...\" giving the line number (or a few "
                "comma-separated line numbers) of the problem, or \"Answer: 0\" if the code is safe.",
}

# Injected into a thinking block that is running out of budget.
THINK_SOFT_NUDGE = "\n\nI am running out of time, so I will stop here and give my final answer.\n"
THINK_HARD_CLOSE = "\n</think>\n\nAnswer:"


def system_prompt() -> str:
    return SYSTEM_PROMPT


def instruction(case: Case) -> str:
    text = _INSTRUCTIONS[case.answer_kind]
    if case.answer_kind == "choice":
        text = text.format(first="A", last=chr(64 + case.nchoices))
    return text


def question_prompt(case: Case) -> str:
    parts = [case.question.strip()]
    if case.choices:
        parts.append("\n".join(f"{chr(65 + i)}. {c}" for i, c in enumerate(case.choices)))
    parts.append(instruction(case))
    return "\n\n".join(parts)
