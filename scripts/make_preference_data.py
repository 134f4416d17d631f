"""Make recipes/finetune/data/preference_{train,validation}.jsonl from the instruction data beside them.

Each pair keeps the instruction's prompt ("What does the Python function json.dumps do?\nAnswer:"); the chosen
answer is that function's own docstring summary, the rejected one the summary of a function from another
module (drawn with a fixed seed, so the files are the same on every run). The instruction data is CPython's
docstrings (PSF license). Run from the repository root: python scripts/make_preference_data.py
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


def main() -> None:
    for split, seed in (("train", 0), ("validation", 1)):
        examples = [json.loads(line) for line in (DATA / f"{split}.jsonl").read_text(encoding="utf-8").splitlines()]
        with (DATA / f"preference_{split}.jsonl").open("w", encoding="utf-8") as f:
            for pair in pairs(examples, seed):
                f.write(json.dumps(pair) + "\n")


if __name__ == "__main__":
    main()
