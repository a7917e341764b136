"""Long-context retrieval tasks generated locally from a seed (no downloads).

``niah_single``: RULER's single-needle task (Hsieh et al., 2024, "niah_single_1"): a haystack of
repeated noise sentences, one needle "One of the special magic numbers for {key} is: {value}." at a
chosen depth, and the question asking for it. Scored by exact match of the 7-digit value in the
answer. Prompts are sized in tokens of the served model's tokenizer.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
KEYS = [
    "apple", "river", "falcon", "violet", "copper", "harbor", "maple", "comet", "lantern", "meadow",
    "pepper", "orbit", "canyon", "ember", "glacier", "willow", "saffron", "quartz", "tundra", "velvet",
]


@dataclass(frozen=True)
class Task:
    name: str
    prompt: str  # the user message
    answer: str
    depth: float
    seed: int

    def score(self, output: str) -> float:
        return float(self.answer in output)


def niah_single(tokenizer, length: int, depth: float, seed: int) -> Task:
    """A single-needle prompt of about ``length`` tokens with the needle at ``depth`` (0..1)."""
    rng = random.Random(seed)
    key, value = rng.choice(KEYS), str(rng.randrange(1_000_000, 10_000_000))
    needle = f"One of the special magic numbers for {key} is: {value}."
    head = ("Some special magic numbers are hidden within the following text. Make sure to memorize "
            "them. I will quiz you about the numbers afterwards.\n")
    question = f"\nWhat is the special magic number for {key} mentioned in the provided text?"
    fixed = len(tokenizer(head + needle + question)["input_ids"])
    per_noise = len(tokenizer(" " + NOISE)["input_ids"])
    n_noise = max(1, (length - fixed) // per_noise)
    sentences = [NOISE] * n_noise
    sentences.insert(round(depth * n_noise), needle)
    return Task("niah_single", head + " ".join(sentences) + question, value, depth, seed)


def depths(n: int) -> list[float]:
    """``n`` needle depths spread evenly over the prompt, ends included."""
    return [i / (n - 1) for i in range(n)] if n > 1 else [0.5]
