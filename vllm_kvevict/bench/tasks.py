"""Long-context retrieval tasks generated locally from a seed (no downloads).

``niah_single``: RULER's single-needle task (Hsieh et al., 2024, "niah_single_1"): a haystack of
repeated noise sentences, one needle "One of the special magic numbers for {key} is: {value}." at a
chosen depth, and the question asking for it. ``niah_multikey``: RULER's "niah_multikey_1" with a
varied haystack: four needles with different keys (the asked one at the chosen depth, three
distractors at seeded depths) in sentences generated from a seed, so that no two are alike.
Scored by exact match of the 7-digit value in the answer. Prompts are sized in tokens of the served
model's tokenizer.
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


SUBJECTS = ["The old mill", "A quiet village", "The northern road", "Every winter market", "The river barge",
            "A tall lighthouse", "The school choir", "An early train", "The city library", "A small bakery"]
VERBS = ["stood near", "looked over", "was rebuilt beside", "gathered people from", "was painted like",
         "opened every day near", "was known across", "sent letters to", "grew famous in", "was quiet after"]
OBJECTS = ["the eastern hills", "the harbor wall", "the crowded square", "the pine forest", "the stone bridge",
           "the summer fields", "the frozen lake", "the copper mines", "the orchard gates", "the sleepy valley"]


def _sentence(rng: random.Random) -> str:
    return f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)} in {rng.randrange(1700, 2000)}."


def niah_multikey(tokenizer, length: int, depth: float, seed: int, n_needles: int = 4) -> Task:
    """Four needles with distinct keys in a varied haystack; the question asks for the one at ``depth``."""
    rng = random.Random(seed)
    keys = rng.sample(KEYS, n_needles)
    values = [str(rng.randrange(1_000_000, 10_000_000)) for _ in keys]
    needles = [f"One of the special magic numbers for {k} is: {v}." for k, v in zip(keys, values)]
    head = ("Some special magic numbers are hidden within the following text. Make sure to memorize "
            "them. I will quiz you about the numbers afterwards.\n")
    question = f"\nWhat is the special magic number for {keys[0]} mentioned in the provided text?"
    budget = length - len(tokenizer(head + " ".join(needles) + question)["input_ids"])
    sentences, used = [], 0
    while True:
        s = _sentence(rng)
        used += len(tokenizer(" " + s)["input_ids"])
        if used > budget:
            break
        sentences.append(s)
    n = max(1, len(sentences))
    spots = [round(depth * n)] + [rng.randrange(0, n + 1) for _ in needles[1:]]
    for spot, needle in sorted(zip(spots, needles), key=lambda x: -x[0]):  # from the back: spots stay valid
        sentences.insert(spot, needle)
    return Task("niah_multikey", head + " ".join(sentences) + question, values[0], depth, seed)


TASKS = {"niah_single": niah_single, "niah_multikey": niah_multikey}


def depths(n: int) -> list[float]:
    """``n`` needle depths spread evenly over the prompt, ends included."""
    return [i / (n - 1) for i in range(n)] if n > 1 else [0.5]
