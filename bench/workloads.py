"""Synthetic, seeded request workloads for the serving benchmark.

No dataset can be downloaded here, so prompts are composed from small banks of natural-ish
phrases. Request ``i`` of a workload depends only on ``(workload, seed, i)`` and the options, so
``--num-requests 50`` is the first 50 requests of ``--num-requests 500`` and two targets (or two
arrival rates) always see the same prompts.

Workloads:

- ``chat``: short everyday questions, short answers (32-128 output tokens).
- ``chat-60w``: the same questions after a few sentences of the asker's background, about 60
  words a prompt (what a chat user types; the tail-latency bench's workload), 32-128 tokens.
- ``shared-prefix``: a long common system prompt (a company handbook of ``prefix_words`` words,
  the same for every request of a seed) followed by a varied question about it - the RAG-like
  shape that a prefix cache should speed up; short answers (32-96 tokens).
- ``code``: copy-heavy edits: a small Python module and a change to make, the answer being the
  whole module again (256-512 output tokens); most of the answer repeats the prompt, the shape
  speculative decoding's prompt lookup speeds up.
- ``mixed``: each request is chat (50%), shared-prefix (30%) or code (20%).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

WORKLOADS: tuple[str, ...] = ("chat", "chat-60w", "shared-prefix", "code", "mixed")
DEFAULT_PREFIX_WORDS = 600
CHAT_BACKGROUND_WORDS = 60  # chat-60w: words of a prompt, background and question together
_MIXED_WEIGHTS: tuple[tuple[str, float], ...] = (
    ("chat", 0.5),
    ("shared-prefix", 0.3),
    ("code", 0.2),
)


@dataclass(frozen=True, slots=True)
class BenchRequest:
    """One request of a workload, independent of the API used to send it."""

    index: int
    kind: str  # "chat" | "shared-prefix" | "code"
    system: str | None
    user: str
    max_tokens: int

    def messages(self) -> list[dict[str, str]]:
        """The request as chat messages for /v1/chat/completions."""
        messages = []
        if self.system:
            messages.append({"role": "system", "content": self.system})
        messages.append({"role": "user", "content": self.user})
        return messages

    def prompt(self) -> str:
        """The request as one plain-text prompt for /v1/completions."""
        head = f"{self.system}\n\n" if self.system else ""
        return f"{head}Question: {self.user}\nAnswer:"


# ---------------------------------------------------------------------------------------------
# Phrase banks (bench/data/workloads.json): everyday tasks, pairs and concepts to ask about, the
# asker's contexts; names, cities, teams, products, features and policies for the handbook; and
# for ``code``, small Python files with the edits to make to them.


def _tuples(value: Any) -> Any:
    """JSON lists back to the tuples the banks are (a bank of pairs: a tuple of tuples)."""
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


_BANKS: dict[str, Any] = {
    name: _tuples(bank)
    for name, bank in json.loads(
        (Path(__file__).parent / "data" / "workloads.json").read_text()
    ).items()
}
_TASKS: tuple[str, ...] = _BANKS["tasks"]
_PAIRS: tuple[tuple[str, str], ...] = _BANKS["pairs"]
_CONCEPTS: tuple[str, ...] = _BANKS["concepts"]
_ACTIVITIES: tuple[str, ...] = _BANKS["activities"]
_CONTEXTS: tuple[str, ...] = _BANKS["contexts"]
_FIRST_NAMES: tuple[str, ...] = _BANKS["first_names"]
_LAST_NAMES: tuple[str, ...] = _BANKS["last_names"]
_CITIES: tuple[str, ...] = _BANKS["cities"]
_TEAMS: tuple[str, ...] = _BANKS["teams"]
_PRODUCT_WORDS: tuple[str, ...] = _BANKS["product_words"]
_PRODUCT_SUFFIXES: tuple[str, ...] = _BANKS["product_suffixes"]
_FEATURES: tuple[str, ...] = _BANKS["features"]
_POLICIES: tuple[tuple[str, str], ...] = _BANKS["policies"]  # topic, rule with an {n}
_CODE_FILES: tuple[tuple[str, str], ...] = _BANKS["code_files"]  # name, source
_CODE_EDITS: tuple[str, ...] = _BANKS["code_edits"]


# ---------------------------------------------------------------------------------------------
# Generators.


def _request_rng(seed: int, index: int) -> random.Random:
    # String seeds are hashed with SHA-512, so this is stable across runs and platforms.
    return random.Random(f"strait-bench:{seed}:{index}")


def _chat_question(rng: random.Random) -> str:
    shape = rng.randrange(4)
    if shape == 0:
        question = f"How do I {rng.choice(_TASKS)}?"
    elif shape == 1:
        a, b = rng.choice(_PAIRS)
        question = f"What is the difference between {a} and {b}?"
    elif shape == 2:
        question = f"Can you explain {rng.choice(_CONCEPTS)}?"
    else:
        question = f"Give me {rng.randint(3, 7)} tips for {rng.choice(_ACTIVITIES)}."
    context = rng.choice(_CONTEXTS)
    return f"{question} {context}".strip()


@dataclass(frozen=True, slots=True)
class _Handbook:
    """The shared system prompt of a seed and the facts its questions can ask about."""

    text: str
    questions: tuple[str, ...]


def _chat_with_background(rng: random.Random, words: int = CHAT_BACKGROUND_WORDS) -> str:
    """A chat question after sentences about the asker, ``words`` words or a few more."""
    question = _chat_question(rng)
    sentences = [
        lambda: f"My name is {_person(rng)} and I live in {rng.choice(_CITIES)}.",
        lambda: (
            f"I work on the {rng.choice(_TEAMS)} team of a company of about "
            f"{rng.randint(20, 900)} people."
        ),
        lambda: (
            f"Last month I spent a weekend on {rng.choice(_ACTIVITIES)} and it went "
            f"{rng.choice(('well', 'badly', 'better than expected'))}."
        ),
        lambda: f"A colleague told me to read about {rng.choice(_CONCEPTS)} first.",
        lambda: f"I tried to {rng.choice(_TASKS)} before, without much success.",
        lambda: rng.choice([c for c in _CONTEXTS if c]),
    ]
    background: list[str] = []
    while len(" ".join([*background, question]).split()) < words:
        background.append(rng.choice(sentences)())
    return " ".join([*background, question])


def _person(rng: random.Random) -> str:
    return f"{rng.choice(_FIRST_NAMES)} {rng.choice(_LAST_NAMES)}"


def build_handbook(seed: int, words: int = DEFAULT_PREFIX_WORDS) -> _Handbook:
    """A company handbook of at least ``words`` words, deterministic in ``seed``."""
    rng = random.Random(f"strait-bench-handbook:{seed}")
    company = f"{rng.choice(_PRODUCT_WORDS)}{rng.choice(('works', 'labs', 'soft', 'ly'))}"
    header = (
        f"You are the support assistant of {company}. Answer questions from customers and "
        f"employees using only the handbook below. If the handbook does not say, answer that "
        f"you do not know. Be brief and precise.\n\n# {company} handbook\n"
    )
    paragraphs: list[str] = []
    questions: list[str] = []
    count = len(header.split())
    teams = list(_TEAMS)
    rng.shuffle(teams)
    products = [f"{w} {s}" for w in _PRODUCT_WORDS for s in _PRODUCT_SUFFIXES]
    rng.shuffle(products)
    policies = list(_POLICIES)
    rng.shuffle(policies)
    section = 0
    while count < words:
        # Cycle teams, products and policies so each section adds facts of a new entity.
        kind = section % 3
        if (kind == 0 and not teams) or (kind == 2 and not policies):
            kind = 1  # products outlast the other banks
        if kind == 0:
            team = teams.pop()
            lead, city = _person(rng), rng.choice(_CITIES)
            year, size = rng.randint(2009, 2023), rng.randint(4, 60)
            paragraphs.append(
                f"## The {team} team\nThe {team} team is based in {city} and is led by {lead}. "
                f"It was founded in {year} and has {size} members. Questions about {team} "
                f"should be sent to the team channel first; {lead.split()[0]} holds office "
                f"hours every {rng.choice(('Monday', 'Tuesday', 'Wednesday', 'Thursday'))}."
            )
            questions += [
                f"Who leads the {team} team?",
                f"Where is the {team} team based?",
                f"How many members does the {team} team have, and when was it founded?",
            ]
        elif kind == 1 and products:
            product = products.pop()
            price = rng.choice((9, 12, 19, 29, 49, 79, 99, 149))
            feats = rng.sample(_FEATURES, 2)
            paragraphs.append(
                f"## {product}\n{product} costs ${price} per user per month. It includes "
                f"{feats[0]} and {feats[1]}. Annual plans get two months free, and customers "
                f"can switch plans at any time from the account page."
            )
            questions += [
                f"How much does {product} cost?",
                f"What does {product} include?",
                f"Can I get a discount on {product} if I pay yearly?",
            ]
        elif kind == 2:
            topic, template = policies.pop()
            policy = template.format(n=rng.choice((7, 14, 30, 45, 60, 90)))
            paragraphs.append(f"## Policy on {topic}\n{policy}")
            questions.append(f"What is the policy on {topic}?")
        else:
            # Every bank is used up: repeat a section so the prompt still reaches its length.
            paragraphs.append(paragraphs[rng.randrange(len(paragraphs))])
        count += len(paragraphs[-1].split())
        section += 1
    return _Handbook(text=header + "\n\n".join(paragraphs), questions=tuple(questions))


def _code_request(rng: random.Random) -> str:
    name, code = rng.choice(_CODE_FILES)
    edit = rng.choice(_CODE_EDITS)
    return (
        f"Here is the Python module `{name}.py`.\n\n```python\n{code}```\n\n{edit} "
        "Reply with the whole module, changed, in one code block, and nothing else."
    )


def _mixed_kind(rng: random.Random) -> str:
    draw = rng.random()
    acc = 0.0
    for kind, weight in _MIXED_WEIGHTS:
        acc += weight
        if draw < acc:
            return kind
    return _MIXED_WEIGHTS[-1][0]


def generate(
    workload: str,
    num_requests: int,
    seed: int = 0,
    *,
    max_tokens: int | None = None,
    prefix_words: int = DEFAULT_PREFIX_WORDS,
) -> list[BenchRequest]:
    """The first ``num_requests`` requests of ``workload`` for ``seed``.

    ``max_tokens`` replaces each kind's sampled output length when given.
    """
    if workload not in WORKLOADS:
        raise ValueError(f"unknown workload {workload!r}; choose one of {', '.join(WORKLOADS)}")
    if num_requests < 0:
        raise ValueError(f"num_requests must be >= 0, got {num_requests}")
    handbook: _Handbook | None = None
    requests: list[BenchRequest] = []
    for index in range(num_requests):
        rng = _request_rng(seed, index)
        kind = _mixed_kind(rng) if workload == "mixed" else workload
        system: str | None = None
        if kind == "chat":
            user, sampled = _chat_question(rng), rng.randint(32, 128)
        elif kind == "chat-60w":
            user, sampled = _chat_with_background(rng), rng.randint(32, 128)
        elif kind == "shared-prefix":
            if handbook is None:
                handbook = build_handbook(seed, prefix_words)
            system = handbook.text
            user, sampled = rng.choice(handbook.questions), rng.randint(32, 96)
        else:
            user, sampled = _code_request(rng), rng.randint(256, 512)
        requests.append(
            BenchRequest(
                index=index,
                kind=kind,
                system=system,
                user=user,
                max_tokens=max_tokens if max_tokens is not None else sampled,
            )
        )
    return requests
