"""Deterministic long-context prompts: a procedurally generated logbook and a question about it.

`logbook(n_entries, seed)` writes the same text on every machine and Python version (it
uses only `random.Random` with an integer seed, whose sequence Python guarantees, and word
lists defined here). `long_prompt(n_entries, ask_entry)` ends with a question about one
early entry, so the next-token distribution at the end depends on text thousands of tokens
back: the long-context frontier that a change to attention, RoPE or the KV cache moves first.

The three long prompts of the reference set share their opening entries, so a session that
already holds the shorter one reuses it as a prefix for the longer ones.
`python -m quality_testing.longtext` rewrites the prompt files named in LONG_PROMPTS.
It does not tokenize; token counts are checked by the reference set's tests.
"""
from __future__ import annotations

import random
from pathlib import Path

import click

from ds4eval.atomicfile import write_text_atomic
SEED = 20261130
HEADER = (
    "Field log of the Harrowgate tidal greenhouse. Each entry records the day, the keeper on\n"
    "duty, the bed that was tended, what was planted or harvested, and one observation.\n"
    "Read the log carefully; a question about it follows at the end.\n\n"
)

KEEPERS = ("Ilse Varga", "Tomas Okafor", "Mirela Sand", "Bram Kettering", "Nadia Quell", "Osric Pell",
           "Yuna Marsh", "Fen Adebayo", "Linnea Ros", "Caspar Duvall")
CROPS = ("sea kale", "samphire", "dwarf beans", "bitter cress", "salt lettuce", "rock chard", "marsh garlic",
         "purple tomatoes", "tidal basil", "winter radish", "bog cranberries", "sweet fennel")
ACTIONS = ("planted", "harvested", "thinned", "transplanted", "pruned", "staked")
WEATHER = ("a grey drizzle hung over the glass all morning", "the wind turned east and rattled the vents",
           "the sun broke through after noon and the beds steamed", "a spring tide flooded the lower channel",
           "fog kept the temperature flat until evening", "hail struck the north panes for ten minutes",
           "the air was still and the bees worked the flowering rows", "frost rimed the outer frames at dawn")
NOTES = ("the drip line on the east side was clogged with sand and had to be flushed",
         "snails had reached the seedlings despite the copper tape",
         "the new compost was still too hot to use near the roots",
         "two panes near the door need fresh putty before the storms",
         "the rain barrel overflowed into the path again",
         "a robin has started nesting above the tool shelf",
         "leaf tips were yellowing, probably from the brackish water",
         "the thermometer in the propagation room reads two degrees high",
         "the irrigation timer lost its settings after the power cut",
         "germination was patchy where the soil had crusted")


def _entry(rng: random.Random, day: int) -> tuple[str, dict]:
    keeper = rng.choice(KEEPERS)
    bed = f"{rng.choice('ABCDEFGH')}-{rng.randint(1, 40)}"
    crop = rng.choice(CROPS)
    action = rng.choice(ACTIONS)
    count = rng.randint(3, 96)
    text = (f"Day {day}. Keeper: {keeper}. Bed {bed}: {action} {count} {crop}. "
            f"Weather: {rng.choice(WEATHER)}. Note: {rng.choice(NOTES)}.\n")
    return text, {"day": day, "keeper": keeper, "bed": bed, "crop": crop, "action": action, "count": count}


def logbook(n_entries: int, seed: int = SEED) -> tuple[str, list[dict]]:
    """The header and the first n_entries entries; entry i of a longer log equals entry i of a shorter one."""
    rng = random.Random(seed)
    parts, facts = [HEADER], []
    for day in range(1, n_entries + 1):
        text, fact = _entry(rng, day)
        parts.append(text)
        facts.append(fact)
    return "".join(parts), facts


def long_prompt(n_entries: int, ask_entry: int, seed: int = SEED) -> str:
    """The log followed by a question whose answer sits in entry `ask_entry` (1-based)."""
    if not 1 <= ask_entry <= n_entries:
        raise ValueError(f"ask_entry {ask_entry} is outside 1..{n_entries}")
    text, facts = logbook(n_entries, seed)
    f = facts[ask_entry - 1]
    return (f"{text}\nQuestion: on day {f['day']}, which crop was {f['action']} in bed {f['bed']}, "
            f"and who was the keeper?\nAnswer: On day {f['day']}, the keeper")


# file name -> (entries, entry asked about). Sizes give about 1K, 3K and 7K tokens with the
# embedded model's tokenizer (checked by tests/quality_testing).
LONG_PROMPTS = {
    "long_1k.txt": (18, 4),
    "long_3k.txt": (55, 7),
    "long_7k.txt": (129, 2),
}


def write_long_prompts(directory: Path) -> list[Path]:
    written = []
    for name, (n, ask) in LONG_PROMPTS.items():
        path = directory / name
        write_text_atomic(path, long_prompt(n, ask))
        written.append(path)
    return written


@click.command()
@click.option("--dir", "directory", default=str(Path(__file__).parent / "prompts"), show_default=True,
              help="Folder to write the long prompt files into.")
def main(directory: str) -> None:
    """Rewrite the long-context prompt files from the generator."""
    for p in write_long_prompts(Path(directory)):
        click.echo(p)


if __name__ == "__main__":
    main()
