"""Synthetic, seeded request workloads for the serving benchmark.

No dataset can be downloaded here, so prompts are composed from small banks of natural-ish
phrases. Request ``i`` of a workload depends only on ``(workload, seed, i)`` and the options, so
``--num-requests 50`` is the first 50 requests of ``--num-requests 500`` and two targets (or two
arrival rates) always see the same prompts.

Workloads:

- ``chat``: short everyday questions, short answers (32-128 output tokens).
- ``chat-60w``: the same questions after a few sentences of the asker's background, about 60
  words a prompt (what a chat user types; the tail-latency sitting's workload), 32-128 tokens.
- ``shared-prefix``: a long common system prompt (a company handbook of ``prefix_words`` words,
  the same for every request of a seed) followed by a varied question about it - the RAG-like
  shape that a prefix cache should speed up; short answers (32-96 tokens).
- ``code``: copy-heavy edits: a small Python module and a change to make, the answer being the
  whole module again (256-512 output tokens); most of the answer repeats the prompt, the shape
  speculative decoding's prompt lookup speeds up.
- ``mixed``: each request is chat (50%), shared-prefix (30%) or code (20%).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

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
# Phrase banks.

_TASKS = (
    "keep basil alive on a windowsill",
    "fix a squeaky door hinge",
    "get rid of fruit flies in the kitchen",
    "make a sourdough starter from scratch",
    "clean a cast iron pan without ruining it",
    "fall asleep faster after a late coffee",
    "prepare for a first half marathon",
    "remove a red wine stain from a carpet",
    "back up photos from an old phone",
    "learn to touch type in a month",
    "store fresh herbs so they last longer",
    "plan a vegetable garden for a small balcony",
    "write a polite reminder email to a landlord",
    "choose a good pair of hiking boots",
    "teach a dog to stop pulling on the leash",
    "organise a cluttered garage in a weekend",
)
_PAIRS = (
    ("baking soda", "baking powder"),
    ("a virus", "a bacterium"),
    ("weather", "climate"),
    ("a lake", "a pond"),
    ("an alligator", "a crocodile"),
    ("a Roth IRA", "a traditional IRA"),
    ("latitude", "longitude"),
    ("espresso", "drip coffee"),
    ("a comet", "an asteroid"),
    ("RAM", "disk storage"),
    ("jam", "jelly"),
    ("a hurricane", "a typhoon"),
)
_CONCEPTS = (
    "compound interest",
    "how vaccines train the immune system",
    "why the sky is blue",
    "how a refrigerator keeps food cold",
    "what inflation means for savings",
    "how tides are caused by the moon",
    "how noise cancelling headphones work",
    "why bread rises",
    "how a bill becomes law",
    "what a carbon footprint is",
)
_ACTIVITIES = (
    "a long train journey",
    "working from home",
    "hosting a dinner for eight people",
    "a rainy weekend with kids",
    "studying for an exam",
    "cycling to work in winter",
    "a first visit to a farmers market",
    "camping in the mountains",
)
_CONTEXTS = (
    "I am a complete beginner.",
    "I only have about ten minutes.",
    "Please keep it short.",
    "My budget is quite tight.",
    "I live in a small flat.",
    "Explain it like I am twelve.",
    "",
    "",
)

_FIRST_NAMES = (
    "Amara", "Bruno", "Chen", "Dalia", "Emeka", "Freya", "Gustavo", "Hana", "Idris", "Jonas",
    "Keiko", "Lucia", "Mateo", "Nadia", "Oskar", "Priya", "Quinn", "Rosa", "Samir", "Tove",
)  # fmt: skip
_LAST_NAMES = (
    "Okafor", "Lindqvist", "Moreau", "Tanaka", "Haddad", "Novak", "Fernandes", "Kowalski",
    "Brennan", "Ivanova", "Mensah", "Schultz", "Delgado", "Park", "Rahman", "Whitfield",
)  # fmt: skip
_CITIES = (
    "Lisbon", "Toronto", "Nairobi", "Osaka", "Tallinn", "Austin", "Lyon", "Melbourne",
    "Bogota", "Krakow", "Dublin", "Singapore", "Porto", "Denver", "Seoul", "Accra",
)  # fmt: skip
_TEAMS = (
    "billing", "onboarding", "data platform", "mobile", "security", "logistics", "design",
    "customer success", "payments", "search", "infrastructure", "analytics",
)  # fmt: skip
_PRODUCT_WORDS = (
    "Harbor", "Lumen", "Cobalt", "Fjord", "Ember", "Atlas", "Quarry", "Nimbus", "Sable", "Vista",
)  # fmt: skip
_PRODUCT_SUFFIXES = ("Sync", "Desk", "Flow", "Vault", "Pulse", "Board")
_FEATURES = (
    "unlimited shared workspaces",
    "daily encrypted backups",
    "single sign-on for every member",
    "a dedicated support engineer",
    "audit logs kept for two years",
    "offline mode on mobile devices",
    "priority access to new releases",
    "custom domains and branding",
    "usage reports by team",
    "an uptime guarantee of 99.9 percent",
)
_POLICIES = (
    ("refunds", "Refunds are granted within {n} days of purchase when the customer has used "
     "less than a quarter of the included quota."),
    ("urgent support tickets", "Support tickets marked urgent must receive a first reply "
     "within {n} minutes during business hours."),
    ("remote work", "Employees may work remotely up to {n} days per month after their first "
     "quarter."),
    ("deleting customer data", "Customer data is deleted {n} days after an account is closed "
     "unless a legal hold applies."),
    ("price changes", "Price changes are announced to existing customers at least {n} days "
     "in advance."),
    ("on-call rotations", "Each team reviews its on-call rotation every {n} weeks and "
     "publishes the schedule."),
)  # fmt: skip

# Copy-heavy code edits: a small file and a change; the answer is the file again, changed.
_CODE_FILES: tuple[tuple[str, str], ...] = (
    (
        "parse_duration",
        """def parse_duration(text):
    units = {"h": 3600, "m": 60, "s": 1}
    total = 0
    number = ""
    for char in text.strip():
        if char.isdigit():
            number += char
        elif char in units and number:
            total += int(number) * units[char]
            number = ""
        else:
            raise ValueError(f"bad duration: {text!r}")
    if number:
        raise ValueError(f"missing unit in {text!r}")
    return total
""",
    ),
    (
        "merge_intervals",
        """def merge_intervals(intervals):
    ordered = sorted(intervals, key=lambda pair: pair[0])
    merged = []
    for start, end in ordered:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def total_covered(intervals):
    return sum(end - start for start, end in merge_intervals(intervals))
""",
    ),
    (
        "word_frequencies",
        """import string


def word_frequencies(text):
    counts = {}
    table = str.maketrans("", "", string.punctuation)
    for word in text.lower().translate(table).split():
        counts[word] = counts.get(word, 0) + 1
    return counts


def top_words(text, limit=10):
    counts = word_frequencies(text)
    ranked = sorted(counts.items(), key=lambda item: (-item[1], item[0]))
    return ranked[:limit]
""",
    ),
    (
        "rate_limiter",
        """import time


class RateLimiter:
    def __init__(self, rate, burst):
        self.rate = rate
        self.burst = burst
        self.tokens = burst
        self.updated = time.monotonic()

    def allow(self, cost=1):
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.updated) * self.rate)
        self.updated = now
        if self.tokens >= cost:
            self.tokens -= cost
            return True
        return False
""",
    ),
    (
        "binary_search_range",
        """def first_index(values, target):
    low, high = 0, len(values)
    while low < high:
        middle = (low + high) // 2
        if values[middle] < target:
            low = middle + 1
        else:
            high = middle
    return low


def search_range(values, target):
    start = first_index(values, target)
    if start == len(values) or values[start] != target:
        return (-1, -1)
    end = first_index(values, target + 1) - 1
    return (start, end)
""",
    ),
    (
        "retry_with_backoff",
        """import random
import time


def retry_with_backoff(operation, attempts=5, base_delay=0.1):
    for attempt in range(attempts):
        try:
            return operation()
        except Exception:
            if attempt == attempts - 1:
                raise
            delay = base_delay * (2 ** attempt)
            time.sleep(delay + random.uniform(0, delay))
    return None
""",
    ),
)
_CODE_EDITS = (
    "Add a one-line docstring to every function.",
    "Add type annotations to every function signature.",
    "Rename every local variable named `total` or `counts` or `merged` or `delay` or `middle` "
    "to a longer, clearer name.",
    "Add a comment above each loop saying what it does.",
)


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
