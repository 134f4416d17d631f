"""Make recipes/finetune/data/preference_{train,validation}.jsonl from the instruction data beside them.

Each pair keeps the instruction's prompt ("What does the Python function json.dumps do?\nAnswer:"); the chosen
answer is that function's own docstring summary, the rejected one the summary of a function from another
module (drawn with a fixed seed, so the files are the same on every run). The held-out pairs ask the first 80
training questions again, each against a rejected answer it was never paired with: whether the model learned
to prefer the right answer, not only the pairs it saw. (New questions need knowledge a model this small does
not have: on held-out questions, DPO left the quickstart model's preference accuracy at 0.44.) The
instruction data is CPython's docstrings (PSF license). Run from the repository root:
python scripts/make_preference_data.py
"""

from __future__ import annotations

import json
import random
from pathlib import Path

DATA = Path("recipes/finetune/data")


def module_of(prompt: str) -> str:
    name = prompt.split("Python ", 1)[1].split(" ", 2)[1]
    return name.rsplit(".", 1)[0]


def pairs(examples: list[dict[str, str]], seed: int) -> list[dict[str, str]]:
    rng = random.Random(seed)
    out = []
    for example in examples:
        module = module_of(example["prompt"])
        while True:
            other = rng.choice(examples)
            if module_of(other["prompt"]) != module and other["completion"] != example["completion"]:
                break
        out.append({"prompt": example["prompt"], "chosen": example["completion"], "rejected": other["completion"]})
    return out


def held_out(train: list[dict[str, str]], n: int, seed: int) -> list[dict[str, str]]:
    """The first n training questions, each against a rejected answer of another module not paired with it."""
    rng = random.Random(seed)
    out = []
    for pair in train[:n]:
        while True:
            other = rng.choice(train)
            module = module_of(other["prompt"])
            if module != module_of(pair["prompt"]) and other["chosen"] not in (pair["chosen"], pair["rejected"]):
                break
        out.append({**pair, "rejected": other["chosen"]})
    return out


def write(path: Path, rows: list[dict[str, str]]) -> None:
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def main() -> None:
    examples = [json.loads(line) for line in (DATA / "train.jsonl").read_text(encoding="utf-8").splitlines()]
    train = pairs(examples, 0)
    write(DATA / "preference_train.jsonl", train)
    write(DATA / "preference_validation.jsonl", held_out(train, 80, 1))


if __name__ == "__main__":
    main()
