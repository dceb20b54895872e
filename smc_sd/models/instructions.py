"""A broad, seeded set of instruction prompts built offline, for distilling the default draft.

Two sources, both available without any download:
- templates filled from word lists (explain / list / write / compare / code / advise ... about a
  few hundred topics);
- the first paragraph of docstrings of Python's standard library, wrapped in a request
  ("Explain in plain words: ...").

`instruction_prompts(n, seed, exclude)` returns n distinct prompts; the same seed gives the same
list. Prompts in `exclude` (the held-out evaluation prompts) are never returned.
"""

from __future__ import annotations

import importlib
import inspect
import random

TOPICS = """
photosynthesis; the water cycle; black holes; volcanoes; earthquakes; the moon; the solar system;
gravity; electricity; magnetism; the human heart; the immune system; vaccines; DNA; evolution;
climate change; rainforests; coral reefs; bees; dolphins; elephants; penguins; wolves; owls;
the Roman Empire; ancient Egypt; the printing press; the Industrial Revolution; the internet;
computers; smartphones; artificial intelligence; robots; electric cars; solar power; wind turbines;
nuclear energy; recycling; plastic pollution; the ocean; deserts; mountains; rivers; glaciers;
rain; snow; thunderstorms; rainbows; music; jazz; painting; photography; poetry; chess; football;
basketball; tennis; swimming; running; yoga; sleep; breakfast; coffee; tea; bread; chocolate;
gardening; cooking pasta; baking cookies; saving money; budgeting; job interviews; public speaking;
learning a language; time management; friendship; kindness; honesty; teamwork; leadership;
libraries; museums; trains; airplanes; bicycles; bridges; castles; cities; villages; farms;
democracy; taxes; inflation; banks; markets; supply and demand; fractions; prime numbers;
probability; geometry; algebra; the Pythagorean theorem; statistics; maps; compasses; clocks;
calendars; birthdays; holidays; winter; summer; autumn; spring; forests; lakes; islands; stars;
planets; comets; telescopes; microscopes; bacteria; viruses; fungi; trees; flowers; seeds;
dinosaurs; fossils; the pyramids; the Great Wall of China; the Olympics; theatre; movies; books;
newspapers; email; passwords; online safety; databases; spreadsheets; operating systems; sorting
algorithms; recursion; binary numbers; encryption; cloud computing; open source software
"""

PEOPLE = """
a child; a student; a beginner; a grandparent; a busy parent; a new employee; a teacher;
a scientist; a tourist; a small business owner; a ten-year-old; a friend
"""

STYLES = """
a short poem; a haiku; a limerick; a short story; a diary entry; a news headline; a tweet;
a product description; a thank-you note; a letter to a friend; a riddle; a joke; a slogan;
a dialogue between two characters; a recipe; a motivational speech
"""

CODE_TASKS = """
reverses a string; checks whether a number is prime; counts the words in a sentence;
returns the largest item of a list; computes the factorial of n; merges two sorted lists;
removes duplicates from a list; converts Celsius to Fahrenheit; checks whether a word is a
palindrome; sums the digits of a number; finds the average of a list of numbers;
returns the n-th Fibonacci number; capitalizes every word of a sentence; counts vowels in a
string; flattens a nested list; sorts a list of names alphabetically; reads a file and counts
its lines; validates an email address; computes the area of a circle; finds common elements of
two lists
"""

TEMPLATES = (
    "Explain {topic} in simple terms.",
    "Explain {topic} to {person}.",
    "What is {topic}?",
    "Why is {topic} important?",
    "Give me three interesting facts about {topic}.",
    "List five things everyone should know about {topic}.",
    "Write {style} about {topic}.",
    "Write {style} about {topic} for {person}.",
    "What is the difference between {topic} and {other}?",
    "How are {topic} and {other} related?",
    "Summarize the history of {topic} in a few sentences.",
    "Give three tips for {person} interested in {topic}.",
    "Describe {topic} in one paragraph.",
    "What are the pros and cons of {topic}?",
    "Ask me three quiz questions about {topic}.",
    "Write a Python function that {task}.",
    "How would you write a program that {task}? Explain step by step.",
    "Write a JavaScript function that {task}.",
    "Answer in one sentence: what is {topic}?",
    "Tell me a fun fact about {topic}.",
)

STDLIB_MODULES = (
    "os", "os.path", "json", "re", "math", "random", "statistics", "collections", "itertools",
    "functools", "datetime", "calendar", "string", "textwrap", "pathlib", "shutil", "csv",
    "heapq", "bisect", "fractions", "decimal", "argparse", "logging", "unittest", "typing",
    "dataclasses", "enum", "subprocess", "threading", "queue", "socket", "urllib.parse",
    "http.client", "email.message", "zipfile", "tarfile", "gzip", "hashlib", "base64", "uuid",
    "time", "copy", "pprint", "difflib", "inspect", "tempfile", "glob", "fnmatch", "sqlite3",
)


def _words(block: str) -> list[str]:
    return [" ".join(w.split()) for w in block.split(";") if w.strip()]


def stdlib_paragraphs() -> list[str]:
    """First paragraphs (one line each, 40-400 characters) of standard-library docstrings."""
    found = []
    for name in STDLIB_MODULES:
        module = importlib.import_module(name)
        for attribute in sorted(vars(module)):
            if attribute.startswith("_"):
                continue
            doc = inspect.getdoc(getattr(module, attribute, None))
            if not doc:
                continue
            paragraph = " ".join(doc.split("\n\n")[0].split())
            if 40 <= len(paragraph) <= 400 and paragraph not in found:
                found.append(paragraph)
    return found


def instruction_prompts(n: int, seed: int, exclude=()) -> list[str]:
    """n distinct instruction prompts, about one in six built from a standard-library docstring.

    Args:
        n: how many prompts.
        seed: the generator's seed; equal seeds give equal lists.
        exclude: prompts never to return (compared after stripping whitespace).

    Raises:
        ValueError: if n distinct prompts cannot be built.
    """
    rng = random.Random(seed)
    topics, people, styles, tasks = map(_words, (TOPICS, PEOPLE, STYLES, CODE_TASKS))
    docs = stdlib_paragraphs()
    banned = {p.strip() for p in exclude}
    prompts: list[str] = []
    seen = set(banned)
    for _ in range(50 * n):
        if len(prompts) == n:
            return prompts
        if rng.random() < 1 / 6:
            prompt = rng.choice(("Explain in plain words: ", "What does this mean? ")) + rng.choice(docs)
        else:
            topic, other = rng.sample(topics, 2)
            prompt = rng.choice(TEMPLATES).format(
                topic=topic, other=other, person=rng.choice(people), style=rng.choice(styles),
                task=rng.choice(tasks),
            )
        if prompt not in seen:
            seen.add(prompt)
            prompts.append(prompt)
    raise ValueError(f"could only build {len(prompts)} distinct prompts, not {n}")
