"""The prompts a determinism run sends: the project's own set, or a suite's cases.

Contract
- `OWN_PROMPTS`: 24 open-ended requests of different lengths, written for this project, each
  asking for a few sentences, so a greedy completion runs its whole budget and short and long
  prompts sit side by side in a batch. `own_prompts(n)` takes the first n (a ConfigError-free
  helper: the caller checks n).
- `suite_prompts(cases, n)`: the first n cases as `ds4-eval run` sends them (the same system
  prompt and question prompt), keyed "source/id", so a determinism run over a suite measures
  the very cases a comparison of two runs of that suite judges.
- `PREFIX_TEXT`: the long shared context of the prefix condition (about 500 tokens of neutral
  reference prose), put in the system message after a per-run salt so that no earlier request
  can have left it in a cache.
It sends nothing and reads no file.
"""

from __future__ import annotations

from typing import Sequence

from ds4eval.cases import prompts as case_prompts
from ds4eval.cases.case import Case
from ds4eval.determinism.analysis import Prompt

OWN_SYSTEM = "You are a helpful assistant. Answer in plain prose."

OWN_PROMPTS: tuple[str, ...] = (
    "Explain in a few sentences why the sky looks blue during the day.",
    "Describe how a bicycle stays upright while it is moving.",
    "What is the difference between weather and climate? Answer briefly.",
    "Write a short paragraph about the history of the printing press.",
    "Give three tips for keeping a small vegetable garden healthy, and explain each.",
    "How does a refrigerator keep food cold? Explain the main steps.",
    "Summarize what photosynthesis does for a plant, in simple words.",
    "Why do we have seasons on Earth? Explain for a curious ten-year-old.",
    "Describe a quiet morning in a mountain village.",
    "What makes a good password, and why does length matter so much?",
    "Explain what a prime number is and give a few examples, with a sentence on why they matter "
    "in computing.",
    "Write a polite email asking a colleague to move a meeting from Tuesday to Thursday.",
    "How do bees make honey? Describe the process from flower to hive.",
    "Compare trains and airplanes for a trip of about five hundred kilometers: time, cost and comfort.",
    "Explain how a compass works and why it points north.",
    "Tell a very short story about a lost umbrella that finds its way home.",
    "What happens to water when it freezes, and why does ice float?",
    "Describe the rules of tic-tac-toe and one simple strategy to avoid losing.",
    "Why is regular sleep important for learning? Give the main reasons.",
    "Explain what a map scale is and how to use one to measure a distance between two towns, "
    "taking into account that roads are rarely straight lines.",
    "List a few ways to save energy at home and say how much each one helps.",
    "How does a library organize its books so that readers can find them?",
    "Describe how bread rises, from mixing the dough to baking.",
    "What is an echo, and why do we hear one in a large empty hall but not in a small furnished room?",
)

PREFIX_TEXT = (
    "Reference notes for this conversation. The notes describe a fictional town called Lindmoor "
    "and are shared by every question in the session; the questions themselves may or may not "
    "refer to them. Lindmoor lies in a wide river valley between two ranges of low hills. Its "
    "old town sits on the eastern bank, where a stone bridge of seven arches crosses the river; "
    "the newer districts spread over the western bank and up the slopes behind it. The town "
    "has about forty thousand inhabitants. Most of them work in the hospital, the two schools, "
    "the university's agricultural institute, the furniture workshops along the canal and the "
    "shops of the market square. The market is held on Wednesdays and Saturdays; on Saturdays "
    "farmers from the upper valley bring cheese, apples, honey and wool. The town hall, built "
    "of red brick, faces the square from the north; its clock tower strikes every quarter hour "
    "and can be climbed on Sunday afternoons. A tram line runs from the railway station on the "
    "western bank across the new bridge to the hospital on the eastern hills, with eleven stops "
    "and a tram every twelve minutes during the day. The railway connects Lindmoor with the "
    "capital in two hours and with the coast in three. Winters are cold and often foggy in the "
    "valley bottom, while the hills above the fog line stay sunny; summers are warm, with "
    "thunderstorms in the late afternoon. The river floods in early spring when the snow melts "
    "in the upper valley, which is why the old houses along the water stand on raised stone "
    "platforms and why the meadows north of the town are kept free of buildings. The town's "
    "library holds about two hundred thousand books and a collection of old maps of the valley. "
    "The museum in the former salt warehouse tells the story of the salt road that made the town "
    "rich five centuries ago, when carts crossed the bridge on their way from the mines in the "
    "south to the cities of the plain. Every autumn the town celebrates the end of the harvest "
    "with a lantern procession across the old bridge, music in the square and a long table of "
    "shared food set up in the main street. The local newspaper appears twice a week. The "
    "football club plays in the third division. The hills to the east are crossed by marked "
    "walking paths, the longest of which follows the ridge for twenty kilometers to the ruins of "
    "a castle that once guarded the valley. "
)


def own_prompts(n: int) -> list[Prompt]:
    return [Prompt(f"p{i + 1:02d}", OWN_SYSTEM, text) for i, text in enumerate(OWN_PROMPTS[:n])]


def suite_prompts(cases: Sequence[Case], n: int) -> list[Prompt]:
    return [Prompt(f"{c.source}/{c.id}", case_prompts.system_prompt(), case_prompts.question_prompt(c))
            for c in cases[:n]]


def salted_system(prompt: Prompt, salt: str) -> str:
    """The prefix condition's system message: a salt no cache has seen, the shared notes, then
    the prompt's own system text."""
    return f"Session {salt}.\n\n{PREFIX_TEXT}\n\n{prompt.system}"
