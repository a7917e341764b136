# SPDX-License-Identifier: Apache-2.0
"""Long-context tasks generated locally from a seed (no downloads), after RULER's categories
(Hsieh et al., 2024, "RULER: What's the Real Context Size of Your Long-Context Language Models?",
section 3): retrieval (needle variants, key-value), multi-hop tracing (variable tracking) and
aggregation (common-word extraction).

Every generator takes ``(tokenizer, length, depth, seed)`` and returns a :class:`Task` whose prompt
is about ``length`` tokens of the served model's tokenizer (the question and template included).
``depth`` (0..1) places the asked item where a task has one place (the needles, the asked key);
tasks without one (``variable_tracking``, ``common_words``) use it only as a further seed. Scoring
is RULER's ``string_match_all``: the fraction of the expected answers found verbatim in the output.

=====================  =================================================================  ==========
task                   what is asked                                                     answers
=====================  =================================================================  ==========
``niah_single``        one needle in RULER's noise haystack ("The grass is green...")     1 number
``niah_single_varied`` one needle in a varied haystack (sentences that all differ)        1 number
``niah_multikey``      one of four needles with different keys, varied haystack           1 number
``niah_multivalue``    all four values given for one key (RULER niah_multivalue)           4 numbers
``niah_multiquery``    the values of four different keys at once (RULER niah_multiquery)  4 numbers
``kv_retrieval``       the value of one key in a JSON object of random UUID pairs         1 UUID
``variable_tracking``  every variable bound to a value through a chain of 4 assignments   5 names
``common_words``       the 10 most frequent words of a numbered word list (RULER cwe)     10 words
=====================  =================================================================  ==========
"""

from __future__ import annotations

import json
import random
import uuid
from collections.abc import Callable
from dataclasses import dataclass

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
KEYS = [
    "apple",
    "river",
    "falcon",
    "violet",
    "copper",
    "harbor",
    "maple",
    "comet",
    "lantern",
    "meadow",
    "pepper",
    "orbit",
    "canyon",
    "ember",
    "glacier",
    "willow",
    "saffron",
    "quartz",
    "tundra",
    "velvet",
]
HEAD = (
    "Some special magic numbers are hidden within the following text. Make sure to memorize "
    "them. I will quiz you about the numbers afterwards.\n"
)


@dataclass(frozen=True)
class Task:
    name: str
    prompt: str  # the user message
    answers: tuple[str, ...]
    depth: float | None
    seed: int
    max_tokens: int = 32  # enough to write every answer

    @property
    def answer(self) -> str:
        return ", ".join(self.answers)

    def score(self, output: str) -> float:
        """RULER's string_match_all: the fraction of the answers that appear in the output."""
        return sum(a.lower() in output.lower() for a in self.answers) / len(self.answers)


def _ntok(tokenizer, text: str) -> int:
    return len(tokenizer(text)["input_ids"])


def _magic(rng: random.Random) -> str:
    return str(rng.randrange(1_000_000, 10_000_000))


def _needle(key: str, value: str) -> str:
    return f"One of the special magic numbers for {key} is: {value}."


SUBJECTS = [
    "The old mill",
    "A quiet village",
    "The northern road",
    "Every winter market",
    "The river barge",
    "A tall lighthouse",
    "The school choir",
    "An early train",
    "The city library",
    "A small bakery",
]
VERBS = [
    "stood near",
    "looked over",
    "was rebuilt beside",
    "gathered people from",
    "was painted like",
    "opened every day near",
    "was known across",
    "sent letters to",
    "grew famous in",
    "was quiet after",
]
OBJECTS = [
    "the eastern hills",
    "the harbor wall",
    "the crowded square",
    "the pine forest",
    "the stone bridge",
    "the summer fields",
    "the frozen lake",
    "the copper mines",
    "the orchard gates",
    "the sleepy valley",
]


def _sentence(rng: random.Random) -> str:
    return f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)} in {rng.randrange(1700, 2000)}."


def _fill(tokenizer, budget: int, make: Callable[[], str], sep: str = " ") -> list[str]:
    """Pieces from ``make()`` while their tokens (each counted with its separator) fit ``budget``."""
    pieces: list[str] = []
    used = 0
    while True:
        p = make()
        used += _ntok(tokenizer, sep + p)
        if used > budget:
            return pieces or [p]
        pieces.append(p)


def _place(pieces: list[str], items: list[str], spots: list[int]) -> list[str]:
    """``pieces`` with each item inserted before piece ``spot`` (spots index the original list)."""
    out = list(pieces)
    for spot, item in sorted(zip(spots, items), key=lambda x: -x[0]):  # from the back: spots stay valid
        out.insert(spot, item)
    return out


def _haystack_task(name, tokenizer, length, depth, seed, rng, needles, question, answers, varied=True, max_tokens=32):
    """Needles in a haystack: the first at ``depth``, the others at seeded depths."""
    budget = length - _ntok(tokenizer, HEAD + " ".join(needles) + question)
    if varied:
        pieces = _fill(tokenizer, budget, lambda: _sentence(rng))
    else:
        pieces = [NOISE] * max(1, budget // _ntok(tokenizer, " " + NOISE))
    n = len(pieces)
    spots = [round(depth * n)] + [rng.randrange(0, n + 1) for _ in needles[1:]]
    body = " ".join(_place(pieces, needles, spots))
    return Task(name, HEAD + body + question, tuple(answers), depth, seed, max_tokens)


def niah_single(tokenizer, length: int, depth: float, seed: int) -> Task:
    """RULER niah_single_1: one needle in the repeated noise paragraph."""
    rng = random.Random(seed)
    key, value = rng.choice(KEYS), _magic(rng)
    question = f"\nWhat is the special magic number for {key} mentioned in the provided text?"
    return _haystack_task(
        "niah_single", tokenizer, length, depth, seed, rng, [_needle(key, value)], question, [value], varied=False
    )


def niah_single_varied(tokenizer, length: int, depth: float, seed: int) -> Task:
    """One needle in a varied haystack: sentences that differ from each other (generated from the
    seed), so the needle is not the only unusual text in the prompt (RULER's noise haystack, one
    sentence repeated, flatters every policy)."""
    rng = random.Random(seed + 70_000)
    key, value = rng.choice(KEYS), _magic(rng)
    question = f"\nWhat is the special magic number for {key} mentioned in the provided text?"
    return _haystack_task(
        "niah_single_varied", tokenizer, length, depth, seed, rng, [_needle(key, value)], question, [value]
    )


def niah_multikey(tokenizer, length: int, depth: float, seed: int, n_needles: int = 4) -> Task:
    """RULER niah_multikey_1 (varied haystack): four keys, the asked one at ``depth``."""
    rng = random.Random(seed)
    keys = rng.sample(KEYS, n_needles)
    values = [_magic(rng) for _ in keys]
    question = f"\nWhat is the special magic number for {keys[0]} mentioned in the provided text?"
    return _haystack_task(
        "niah_multikey",
        tokenizer,
        length,
        depth,
        seed,
        rng,
        [_needle(k, v) for k, v in zip(keys, values)],
        question,
        [values[0]],
    )


def niah_multivalue(tokenizer, length: int, depth: float, seed: int, n_values: int = 4) -> Task:
    """RULER niah_multivalue: one key given four values; all are asked."""
    rng = random.Random(seed)
    key = rng.choice(KEYS)
    values = [_magic(rng) for _ in range(n_values)]
    question = (
        f"\nWhat are all the special magic numbers for {key} mentioned in the provided text? "
        f"List all {n_values} of them."
    )
    return _haystack_task(
        "niah_multivalue",
        tokenizer,
        length,
        depth,
        seed,
        rng,
        [_needle(key, v) for v in values],
        question,
        values,
        max_tokens=96,
    )


def niah_multiquery(tokenizer, length: int, depth: float, seed: int, n_keys: int = 4) -> Task:
    """RULER niah_multiquery: four keys, each with its value; all four are asked at once."""
    rng = random.Random(seed)
    keys = rng.sample(KEYS, n_keys)
    values = [_magic(rng) for _ in keys]
    question = (
        f"\nWhat are the special magic numbers for {', '.join(keys[:-1])} and {keys[-1]} mentioned in "
        f"the provided text? Give each of them."
    )
    return _haystack_task(
        "niah_multiquery",
        tokenizer,
        length,
        depth,
        seed,
        rng,
        [_needle(k, v) for k, v in zip(keys, values)],
        question,
        values,
        max_tokens=96,
    )


def kv_retrieval(tokenizer, length: int, depth: float, seed: int) -> Task:
    """Key-value retrieval (Liu et al., 2023, "Lost in the Middle", section 4; RULER niah_multikey_3):
    a JSON object of random UUID keys and values; the value of the key at ``depth`` is asked."""
    rng = random.Random(seed + 40_000)

    def uid() -> str:
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))

    head = "Extract the value corresponding to the specified key in the JSON object below.\n\n"
    question_len = _ntok(tokenizer, '\n\nKey: "' + uid() + '"\nThe value associated with the specified key is:')

    def render(pairs) -> str:
        return json.dumps(dict(pairs), indent=0)

    per_pair = _ntok(tokenizer, render([(uid(), uid()) for _ in range(20)])) / 20
    n = max(2, int((length - _ntok(tokenizer, head) - question_len) / per_pair))
    pairs = [(uid(), uid()) for _ in range(n)]
    while n > 2 and _ntok(tokenizer, head + render(pairs)) + question_len > length:
        pairs, n = pairs[:-1], n - 1
    key, value = pairs[min(n - 1, round(depth * (n - 1)))]
    question = f'\n\nKey: "{key}"\nThe value associated with the specified key is:'
    return Task("kv_retrieval", head + render(pairs) + question, (value,), depth, seed, 64)


def _name(rng: random.Random) -> str:
    return "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5))


def variable_tracking(tokenizer, length: int, depth: float, seed: int, hops: int = 4) -> Task:
    """RULER variable tracking (vt): ``VAR X1 = 12345``, then ``VAR X2 = VAR X1`` ... (``hops``
    assignments) spread in order through the noise haystack; every variable holding the value is asked."""
    rng = random.Random(seed * 1000 + round(depth * 997) + 50_000)
    names: list[str] = []
    while len(names) < hops + 1:
        n = _name(rng)
        if n not in names:
            names.append(n)
    value = str(rng.randrange(10_000, 100_000))
    chain = [f"VAR {names[0]} = {value}."] + [f"VAR {b} = VAR {a}." for a, b in zip(names, names[1:])]
    head = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
    question = (
        f"\nQuestion: Find all variables that are assigned the value {value} in the text above. "
        f"Answer: According to the chain(s) of variable assignment in the text above, "
        f"{hops + 1} variables are assigned the value {value}, they are:"
    )
    budget = length - _ntok(tokenizer, head + " ".join(chain) + question)
    pieces = [NOISE] * max(1, budget // _ntok(tokenizer, " " + NOISE))
    spots = sorted(rng.sample(range(len(pieces) + 1), len(chain)))  # distinct: the chain reads in order
    body = " ".join(_place(pieces, chain, spots))
    return Task("variable_tracking", head + body + question, tuple(names), None, seed, 64)


SYLLABLES = [
    "ba",
    "ke",
    "lo",
    "mi",
    "nu",
    "pa",
    "re",
    "so",
    "ti",
    "vu",
    "da",
    "fe",
    "go",
    "hi",
    "ju",
    "ka",
    "le",
    "mo",
    "ne",
    "pi",
    "ro",
    "sa",
    "te",
    "vo",
    "zi",
]


def common_words(tokenizer, length: int, depth: float, seed: int, n_common: int = 10) -> Task:
    """RULER common-word extraction (cwe): a numbered list in which ``n_common`` words occur ``f_c``
    times and the others ``f_u < f_c`` times, shuffled; the ``n_common`` most frequent are asked. The
    words are seeded three-syllable pseudo-words, so no word is frequent in the model's prior."""
    rng_seed = seed * 1000 + round(depth * 997) + 60_000
    head = "Below is a numbered list of words. In these words, some appear more often than others. Memorize the ones that appear most often.\n"
    question = (
        f"\nQuestion: What are the {n_common} most common words in the above list? "
        f"Answer: The top {n_common} words that appear most often in the list are:"
    )

    def build(n_entries: int, rng: random.Random) -> tuple[list[str], list[str]]:
        f_c = max(3, n_entries // (3 * n_common))  # a third of the list is the common words
        f_u = max(1, f_c // 3)
        seen: set[str] = set()

        def word() -> str:
            while True:
                w = "".join(rng.choice(SYLLABLES) for _ in range(3))
                if w not in seen:
                    seen.add(w)
                    return w

        common = [word() for _ in range(n_common)]
        words = [w for w in common for _ in range(f_c)]
        while len(words) + f_u <= n_entries:
            words += [word()] * f_u
        rng.shuffle(words)
        return common, words

    def render(ws: list[str]) -> str:
        return head + " ".join(f"{i + 1}. {w}" for i, w in enumerate(ws)) + question

    n_entries = max(4 * n_common, length // 4)
    common, words = build(n_entries, random.Random(rng_seed))
    n_entries = max(4 * n_common, int(n_entries * length / _ntok(tokenizer, render(words))))  # one rescale
    common, words = build(n_entries, random.Random(rng_seed))
    while len(words) > 3 * n_common and _ntok(tokenizer, render(words)) > length:
        w = next(w for w in reversed(words) if w not in common)  # drop one occurrence of a rare word
        words.remove(w)
    return Task("common_words", render(words), tuple(common), None, seed, 96)


TASKS: dict[str, Callable[..., Task]] = {
    "niah_single": niah_single,
    "niah_single_varied": niah_single_varied,
    "niah_multikey": niah_multikey,
    "niah_multivalue": niah_multivalue,
    "niah_multiquery": niah_multiquery,
    "kv_retrieval": kv_retrieval,
    "variable_tracking": variable_tracking,
    "common_words": common_words,
}


def depths(n: int) -> list[float]:
    """``n`` needle depths spread evenly over the prompt, ends included."""
    return [i / (n - 1) for i in range(n)] if n > 1 else [0.5]
