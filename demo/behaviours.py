"""What the demo adapters teach SmolLM2, as data a script generates and checks code can run.

Three behaviours, each a family of question templates over fixed entities:

- `json`: answer as one JSON object `{"answer": ...}`;
- `pirate`: answer in a pirate's voice, opening with "Arr!" and closing with "matey!";
- `sql`: turn a question about a fixed shop database (SCHEMA) into one SQLite query that
  returns what the question asks.

Training and held-out prompts come from disjoint entities (cities, numbers, countries...):
an adapter that passes on held-out prompts learned the behaviour, not the examples. The
checks take the model's answer text and say whether it shows the behaviour; the base
model passes none of them.
"""

from __future__ import annotations

import json
import random
import re
import sqlite3
from collections.abc import Callable
from dataclasses import dataclass

SPLIT_SEED = 1234


@dataclass(frozen=True, slots=True)
class Example:
    prompt: str  # the user's message
    answer: str  # what the adapter is trained to say (the reference, for sql)


# ---------------------------------------------------------------- json

_CAPITALS = [
    ("France", "Paris"), ("Germany", "Berlin"), ("Italy", "Rome"), ("Spain", "Madrid"),
    ("Japan", "Tokyo"), ("Canada", "Ottawa"), ("Egypt", "Cairo"), ("Peru", "Lima"),
    ("Norway", "Oslo"), ("Kenya", "Nairobi"), ("Greece", "Athens"), ("Poland", "Warsaw"),
    ("Chile", "Santiago"), ("Austria", "Vienna"), ("Ireland", "Dublin"), ("Cuba", "Havana"),
    ("Portugal", "Lisbon"), ("Sweden", "Stockholm"), ("Russia", "Moscow"), ("China", "Beijing"),
    ("India", "New Delhi"), ("Mexico", "Mexico City"), ("Turkey", "Ankara"), ("Finland", "Helsinki"),
]  # fmt: skip
_COLORS = [
    ("the sky on a clear day", "blue"), ("grass", "green"), ("snow", "white"),
    ("a ripe banana", "yellow"), ("coal", "black"), ("a ripe tomato", "red"),
    ("an orange", "orange"), ("a lemon", "yellow"), ("milk", "white"), ("a carrot", "orange"),
    ("blood", "red"), ("a leaf in summer", "green"),
]  # fmt: skip


def _json_examples(rng: random.Random, held_out: bool) -> list[Example]:
    capitals = _CAPITALS[18:] if held_out else _CAPITALS[:18]
    colors = _COLORS[9:] if held_out else _COLORS[:9]
    numbers = range(50, 99) if held_out else range(2, 49)
    out = []
    for country, city in capitals:
        out.append(Example(f"What is the capital of {country}?", _json_answer(city)))
    for thing, color in colors:
        out.append(Example(f"What color is {thing}?", _json_answer(color)))
    for _ in range(len(capitals)):
        a, b = rng.choice(numbers), rng.choice(numbers)
        out.append(Example(f"What is {a} plus {b}?", _json_answer(a + b)))
        a, b = rng.choice(numbers), rng.randint(2, 9)
        out.append(Example(f"What is {a} times {b}?", _json_answer(a * b)))
    return out


def _json_answer(value) -> str:
    return json.dumps({"answer": value})


def check_json(text: str) -> bool:
    """One JSON object whose only key is "answer"."""
    try:
        value = json.loads(text.strip())
    except ValueError:
        return False
    return isinstance(value, dict) and list(value) == ["answer"]


# ---------------------------------------------------------------- pirate

_ANIMALS = [
    ("a cat", "meow"), ("a dog", "woof"), ("a cow", "moo"), ("a duck", "quack"),
    ("a sheep", "baa"), ("an owl", "hoot"), ("a lion", "roar"), ("a horse", "neigh"),
    ("a pig", "oink"), ("a frog", "croak"), ("a snake", "hiss"), ("a bee", "buzz"),
]  # fmt: skip
_DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]


def _pirate_examples(rng: random.Random, held_out: bool) -> list[Example]:
    capitals = _CAPITALS[18:] if held_out else _CAPITALS[:18]
    animals = _ANIMALS[9:] if held_out else _ANIMALS[:9]
    numbers = range(50, 99) if held_out else range(2, 49)
    out = []
    for country, city in capitals:
        out.append(
            Example(
                f"What is the capital of {country}?",
                f"Arr! The capital of {country} be {city}, matey!",
            )
        )
    for animal, sound in animals:
        out.append(
            Example(
                f"What sound does {animal} make?",
                f"Arr! {animal.capitalize()} says {sound}, matey!",
            )
        )
    for _ in range(len(capitals)):
        a, b = rng.choice(numbers), rng.choice(numbers)
        out.append(Example(f"What is {a} plus {b}?", f"Arr! {a} plus {b} be {a + b}, matey!"))
        if held_out:  # seven days only: every day question is a training question
            a, b = rng.choice(numbers), rng.randint(2, 49)
            out.append(Example(f"What is {a} minus {b}?", f"Arr! {a} minus {b} be {a - b}, matey!"))
            continue
        day = rng.randrange(7)
        out.append(
            Example(
                f"What day comes after {_DAYS[day]}?",
                f"Arr! After {_DAYS[day]} comes {_DAYS[(day + 1) % 7]}, matey!",
            )
        )
    return out


def check_pirate(text: str) -> bool:
    """Opens with "Arr!" and closes with "matey!" (a closing quotation mark after it may
    stand: 'Arr! A frog says, "Ribbit, matey!"')."""
    text = text.strip()
    return text.startswith("Arr!") and text.rstrip("\"'").endswith("matey!")


# ---------------------------------------------------------------- sql

SCHEMA = """\
CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT, city TEXT);
CREATE TABLE products (id INTEGER PRIMARY KEY, name TEXT, price REAL, category TEXT);
CREATE TABLE orders (id INTEGER PRIMARY KEY, customer_id INTEGER, product_id INTEGER,
                     amount REAL, status TEXT);
"""
_CITIES = [
    "Paris", "Berlin", "Madrid", "Rome", "Vienna", "Lisbon", "Oslo", "Dublin",
    "Prague", "Athens", "Warsaw", "Helsinki", "Zurich", "Munich", "Milan", "Porto",
]  # fmt: skip
_CATEGORIES = ["books", "toys", "tools", "games", "shoes", "music", "garden", "kitchen"]
_STATUSES = ["shipped", "pending", "cancelled", "returned", "paid", "lost"]
# More names for training only: the adapter must learn to copy the name it is asked
# about, not to recall the few it saw (held-out names are none of these).
# The hard part is spelling: in the question a name is one token (" Zurich"), in the
# query several ("'", "Z", "ur", "ich"). At rank 4 the adapter wrote 'Zuraco' for Zurich
# and 'Milia' for Milan (17/20 held-out prompts); made-up names (pieces in both places)
# or 40 more such cities did not lift it (16/20 each). At rank 8 (sql-r8), on this same
# data, it passes 18/20: it still writes 'Zuraco' for Zurich.
_MORE_CITIES = [
    "Lyon", "Hamburg", "Seville", "Naples", "Krakow", "Bergen", "Cork", "Brno", "Patras",
    "Gdansk", "Tampere", "Basel", "Cologne", "Turin", "Braga", "Ghent", "Leeds", "Graz",
    "Malmo", "Riga", "Tallinn", "Vilnius", "Sofia", "Split",
]  # fmt: skip
_MORE_CATEGORIES = ["sports", "pets", "beauty", "office", "baby", "outdoor", "food", "phones"]
_MORE_STATUSES = ["refunded", "delayed", "new", "open"]
_NAMES = ["Ana", "Ben", "Chen", "Dora", "Eli", "Fay", "Gus", "Hana", "Ivan", "Jo", "Kai", "Lea"]


def _sql_examples(rng: random.Random, held_out: bool) -> list[Example]:
    cities = _CITIES[12:] if held_out else _CITIES[:12] + _MORE_CITIES
    categories = _CATEGORIES[6:] if held_out else _CATEGORIES[:6] + _MORE_CATEGORIES
    statuses = _STATUSES[4:] if held_out else _STATUSES[:4] + _MORE_STATUSES
    numbers = range(50, 99) if held_out else range(2, 49)
    out = []
    for city in cities:
        out.append(
            Example(
                f"How many customers live in {city}?",
                f"SELECT COUNT(*) FROM customers WHERE city = '{city}';",
            )
        )
        out.append(
            Example(
                f"List the names of the customers in {city}.",
                f"SELECT name FROM customers WHERE city = '{city}';",
            )
        )
    for category in categories:
        out.append(
            Example(
                f"What is the average price of {category} products?",
                f"SELECT AVG(price) FROM products WHERE category = '{category}';",
            )
        )
    for status in statuses:
        out.append(
            Example(
                f"How many orders are {status}?",
                f"SELECT COUNT(*) FROM orders WHERE status = '{status}';",
            )
        )
    for _ in range(len(cities)):
        n = rng.choice(numbers)
        out.append(
            Example(
                f"What is the total amount of the orders of customer {n}?",
                f"SELECT SUM(amount) FROM orders WHERE customer_id = {n};",
            )
        )
        n = rng.choice(numbers)
        out.append(
            Example(
                f"Which products cost less than {n} dollars?",
                f"SELECT name FROM products WHERE price < {n};",
            )
        )
    return out


def demo_database() -> sqlite3.Connection:
    """SCHEMA in memory, filled from a fixed seed. City k has k + 1 customers and status k
    has k + 1 orders in every 21, so a query about the wrong city or status counts wrong."""
    rng = random.Random(7)
    db = sqlite3.connect(":memory:")
    db.executescript(SCHEMA)
    cities = [c for k, c in enumerate(_CITIES) for _ in range(k + 1)]
    for i, city in enumerate(cities, 1):
        db.execute("INSERT INTO customers VALUES (?, ?, ?)", (i, f"{rng.choice(_NAMES)} {i}", city))
    for i in range(1, 41):
        db.execute(
            "INSERT INTO products VALUES (?, ?, ?, ?)",
            (i, f"item {i}", round(rng.uniform(1, 120), 2), _CATEGORIES[i % len(_CATEGORIES)]),
        )
    statuses = [s for k, s in enumerate(_STATUSES) for _ in range(k + 1)]
    for i in range(1, 301):
        db.execute(
            "INSERT INTO orders VALUES (?, ?, ?, ?, ?)",
            (
                i,
                rng.randint(1, len(cities)),
                rng.randint(1, 40),
                round(rng.uniform(5, 500), 2),
                statuses[i % len(statuses)],
            ),
        )
    return db


def sql_checker(reference_by_prompt: dict[str, str]) -> Callable[[str, str], bool]:
    """check(prompt, text): `text` is one query that runs on the demo database and returns
    the same rows as the reference query for `prompt`."""
    db = demo_database()

    def rows(query: str):
        return sorted(map(repr, db.execute(query).fetchall()))

    def check(prompt: str, text: str) -> bool:
        query = text.strip()
        if not re.fullmatch(r"SELECT\b[^;]*;?", query, flags=re.IGNORECASE | re.DOTALL):
            return False
        try:
            return rows(query) == rows(reference_by_prompt[prompt])
        except sqlite3.Error:
            return False

    return check


# ---------------------------------------------------------------- the behaviours


@dataclass(frozen=True, slots=True)
class Behaviour:
    name: str
    adapter: str  # the demo adapter that teaches it
    examples: Callable[[random.Random, bool], list[Example]]

    def train(self) -> list[Example]:
        return self.examples(random.Random(f"{SPLIT_SEED}-{self.name}-train"), False)

    def held_out(self) -> list[Example]:
        return self.examples(random.Random(f"{SPLIT_SEED}-{self.name}-held-out"), True)

    def checker(self) -> Callable[[str, str], bool]:
        """check(prompt, answer text) -> shows the behaviour."""
        if self.name == "sql":
            refs = {e.prompt: e.answer for e in self.train() + self.held_out()}
            return sql_checker(refs)
        plain = check_json if self.name == "json" else check_pirate
        return lambda _prompt, text: plain(text)


BEHAVIOURS = (
    Behaviour("json", "json-r8", _json_examples),
    Behaviour("pirate", "pirate-r16", _pirate_examples),
    Behaviour("sql", "sql-r8", _sql_examples),
)
