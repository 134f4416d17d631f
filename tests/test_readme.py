"""The README's commands, recipes and files exist, and CI runs exactly the README's test command."""

from __future__ import annotations

import re
import shlex

import pytest

from hftrain.cli import build_parser

from .support.cli import ROOT

README = (ROOT / "README.md").read_text(encoding="utf-8")
BLOCKS = re.findall(r"```(?:bash)?\n(.*?)```", README, flags=re.S)
COMMAND_LINES = [line.strip() for block in BLOCKS for line in block.splitlines() if line.strip() and not line.startswith(("#", " "))]


def _shell_blocks() -> list[str]:
    return re.findall(r"```bash\n(.*?)```", README, flags=re.S)


def test_readme_opens_with_quickstart_then_tests():
    first, second = (b.strip() for b in _shell_blocks()[:2])
    assert first.endswith("hftrain train recipes/quickstart.yaml") and "pip install -e ." in first
    assert second.endswith("pytest") and 'pip install -e ".[test]"' in second
    assert README.index(first) < README.index(second) < README.index("## ")


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert _shell_blocks()[1].strip() in ci.splitlines()


def _hftrain_invocations() -> list[list[str]]:
    found = []
    for block in _shell_blocks():
        for line in block.splitlines():
            for part in line.split("&&"):
                words = shlex.split(part.strip())
                if words[:1] == ["hftrain"]:
                    found.append(words[1:])
                elif words[:3] == ["python", "-m", "hftrain"]:
                    found.append(words[3:])
    return found


def test_every_hftrain_command_in_the_readme_parses():
    invocations = _hftrain_invocations()
    assert len(invocations) >= 4
    parser = build_parser()
    for words in invocations:
        if "--help" in words:
            continue
        args = parser.parse_args([w for w in words if "=" not in w or w.startswith("-")])
        if hasattr(args, "recipe"):
            assert (ROOT / args.recipe).is_file(), args.recipe


def test_subcommands_named_in_the_table_exist():
    named = set(re.findall(r"`hftrain ([\w-]+)", README))
    known = set(build_parser()._subparsers._group_actions[0].choices)  # noqa: SLF001
    assert named and named <= known, named - known


@pytest.mark.parametrize("path", sorted(set(re.findall(r"(?<![\w/])((?:recipes|accelerate_configs|hftrain|tests|benchmarks|notebooks)/[\w./*-]+)", README))))
def test_every_file_named_in_the_readme_exists(path):
    path = path.rstrip(".,)")
    if "*" in path:
        assert list(ROOT.glob(path)), path
    elif path.endswith("/"):
        assert (ROOT / path).is_dir(), path
    else:
        assert (ROOT / path).exists(), path
