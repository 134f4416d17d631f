"""How long `hftrain`'s cheap commands take to answer, against `python -c 'import torch'` in the same run.

Each command runs in a fresh process, alternating with the others (so a busy minute costs them alike), REPEATS
times; the table gives medians and the ratio to `import torch`. Issue 54's target: at most 1.5x `import torch` for
`--help`, `presets`, `explain`, `plan`, `launch-script` and a recipe wrong on its face; `--help` without torch at
all. The first round warms hftrain's cache as a machine's first command does (transformers' field table, the
libraries' memory for `plan`): the medians are what every later command takes.

    python benchmarks/cli_start.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = {
    "import torch": [sys.executable, "-c", "import torch"],
    "hftrain --help": [sys.executable, "-m", "hftrain", "--help"],
    "hftrain presets": [sys.executable, "-m", "hftrain", "presets"],
    "hftrain train /nonexistent.yaml": [sys.executable, "-m", "hftrain", "train", "/nonexistent.yaml"],
    "hftrain explain training": [sys.executable, "-m", "hftrain", "explain", "training"],
    "hftrain train recipes/quickstart.yaml training.max_step=5": [
        *(sys.executable, "-m", "hftrain", "train", "recipes/quickstart.yaml", "training.max_step=5")
    ],
    "hftrain plan recipes/quickstart.yaml": [sys.executable, "-m", "hftrain", "plan", "recipes/quickstart.yaml"],
    "hftrain launch-script (slurm, 2 x 8)": [
        *(sys.executable, "-m", "hftrain", "launch-script", "recipes/pretrain/pythia-1b.yaml", "--kind", "slurm"),
        *("--nodes", "2", "--gpus-per-node", "8", "--out", "/dev/null"),
    ],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    times: dict[str, list[float]] = {name: [] for name in COMMANDS}
    for _ in range(args.repeats):
        for name, argv in COMMANDS.items():
            started = time.perf_counter()
            subprocess.run(argv, cwd=ROOT, capture_output=True, check=False)
            times[name].append(time.perf_counter() - started)
    torch_s = statistics.median(times["import torch"])
    print(f"| command | median of {args.repeats} | x import torch |\n| --- | ---: | ---: |")
    for name, seen in times.items():
        print(f"| `{name}` | {statistics.median(seen):.2f} s | {statistics.median(seen) / torch_s:.2f} |")


if __name__ == "__main__":
    main()
