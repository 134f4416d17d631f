"""The README's commands, recipes and files exist, and CI runs exactly the README's test command."""

from __future__ import annotations

import re
import shlex
import subprocess

import pytest

from hftrain.cli import build_parser

from .support.cli import ROOT, in_process

README = (ROOT / "README.md").read_text(encoding="utf-8")
DOC_PAGES = sorted((ROOT / "docs").glob("*.md"))
DOCS = README + "".join(page.read_text(encoding="utf-8") for page in DOC_PAGES)  # every command, wherever it lives


def _shell_blocks(text: str = DOCS) -> list[str]:
    """The ```bash blocks of the README, then of docs/*.md (the first two are the README's quickstart and tests)."""
    return re.findall(r"```bash\n(.*?)```", text, flags=re.S)


def test_readme_opens_with_quickstart_then_tests():
    first, second = (b.strip() for b in _shell_blocks()[:2])
    assert first.endswith("hftrain train recipes/quickstart.yaml") and "pip install -e ." in first
    assert second.endswith("pytest") and 'pip install -e ".[test]"' in second
    assert README.index(first) < README.index(second) < README.index("## ")


def test_readme_links_every_docs_page():
    assert DOC_PAGES, "docs/ holds the long sections"
    for page in DOC_PAGES:
        assert f"](docs/{page.name})" in README, f"README does not link docs/{page.name}"


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert _shell_blocks()[1].strip() in ci.splitlines()
    assert "scripts/test_lowest_versions.sh" in ci  # the fast tier at pyproject.toml's lowest versions


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
    named = set(re.findall(r"`hftrain ([a-z][\w-]*)", DOCS))  # a subcommand, not an option (`hftrain --help`)
    known = set(build_parser()._subparsers._group_actions[0].choices)  # noqa: SLF001
    assert named and named <= known, named - known


@pytest.mark.parametrize(
    "path",
    sorted(
        set(
            re.findall(
                r"(?<![\w/])((?:recipes|accelerate_configs|hftrain|tests|benchmarks|notebooks|scripts|docs)/[\w./*-]+)",
                DOCS,
            )
        )
    ),
)
def test_every_file_named_in_the_readme_exists(path):
    path = path.rstrip(".,)")
    if "*" in path:
        assert list(ROOT.glob(path)), path
    elif path.endswith("/"):
        assert (ROOT / path).is_dir(), path
    else:
        assert (ROOT / path).exists(), path


# ------------------------------------------------------------------------- every README command, run where it can be
def _command_lines() -> list[str]:
    return [line.split("  #")[0].strip() for block in _shell_blocks() for line in block.splitlines() if line.strip()]


# Run as written, from the repository root (they write nothing).
FAST = [
    "hftrain plan recipes/pretrain/pythia-1b.yaml --gpus 8 --gpu-mem-gb 80 --price-per-hour 2.5",
    "hftrain train --help",
    "hftrain plan recipes/pretrain/pythia-1b.yaml --gpus 8 --gpu-mem-gb 80",
    "hftrain launch-script recipes/pretrain/pythia-1b.yaml --kind slurm --nodes 2 --gpus-per-node 8",
    "hftrain plan recipes/quickstart.yaml",
]
# Run in order in one scratch directory (recipes/ linked in, runs/ written there), each with SHORT appended: the
# README's runs, a few steps long. Checkpoint numbers in the README (200, 600) become the short runs' last step.
SHORT = [
    "training.max_steps=2",
    "training.save_steps=2",
    "training.eval_steps=2",
    "training.logging_steps=1",
    "tokenizer.train.max_documents=100",
    "data.eval_blocks=2",
    "monitor.sample_max_new_tokens=0",
    "monitor.plot=false",
]
CHAIN = [
    "hftrain train recipes/quickstart.yaml training.max_steps=50 training.learning_rate=3e-4",
    "hftrain train recipes/quickstart.yaml parallelism.strategy=device_map",
    "hftrain export runs/quickstart/checkpoint-600 --out runs/quickstart/exported",
    "hftrain export runs/quickstart/final --format gguf --quant q8_0 --out runs/quickstart/quickstart-q8_0.gguf",
    "hftrain data inspect recipes/finetune/lora.yaml --check-packing",
    "hftrain data prepare recipes/quickstart.yaml --out runs/quickstart-tokens",
    'hftrain train recipes/quickstart.yaml "data.train={pretokenized: runs/quickstart-tokens}" "tokenizer={path: '
    'runs/quickstart-tokens/tokenizer}" training.output_dir=runs/quickstart-from-tokens',
    "hftrain train recipes/finetune/lora.yaml",
    "hftrain train recipes/finetune/full.yaml",
    "hftrain export runs/finetune-lora/checkpoint-200 --merge --out runs/finetune-lora/merged",
    "hftrain train recipes/finetune/dpo.yaml",
    "hftrain export runs/finetune-dpo/checkpoint-200 --merge --out runs/finetune-dpo/merged",
]
S3_LINE = "hftrain train recipes/quickstart.yaml 'data.train={path: \"s3://corpus/*.jsonl.gz\"}'"
# Run elsewhere in the suite (the same command on a tiny recipe), or not runnable on this machine, with the reason.
ELSEWHERE = {
    "python3 -m venv .venv": (
        "the install lines: the suite runs inside that environment (their hftrain command is in CHAIN)"
    ),
    "scripts/install_test_deps.sh": "the test command itself (.ci/run runs it; test_install_script_is_what_ci_runs)",
    'pip install "moto[server]"': "the S3 setup: tests/support/s3.py starts moto's server (test_readme_s3_example)",
    "export AWS_ENDPOINT_URL": "the S3 setup: s3_server.env() sets exactly these variables",
    "aws s3 mb": "the S3 setup: done with boto3 against the same server",
    "hftrain train recipes/finetune/qlora.yaml": "bitsandbytes 4-bit needs a CUDA GPU (tests/gpu/)",
    "hftrain train recipes/finetune/lora.yaml --accelerate-config": (
        "tests/parallel/test_finetune_distributed.py::test_method_trains_on_2_processes"
    ),
    "accelerate launch --config_file accelerate_configs/fsdp.yaml -m hftrain train recipes/finetune/qlora.yaml": (
        "bitsandbytes needs a CUDA GPU"
    ),
    "accelerate launch --config_file accelerate_configs/fsdp.yaml -m hftrain train recipes/pretrain/pythia-160m.yaml": (
        "GPU-sized (160M parameters)"
    ),
    "accelerate launch --config_file accelerate_configs/deepspeed_zero3.yaml": "GPU-sized (160M parameters)",
    "hftrain train recipes/pretrain/pythia-160m.yaml --accelerate-config zero3": "GPU-sized (160M parameters)",
    "hftrain train recipes/quickstart.yaml --accelerate-config fsdp --cpu": (
        "tests/checkpoint/test_elastic.py::test_sharded_backend_matches_one_process_resumes_and_exports"
    ),
    "hftrain parity recipes/quickstart.yaml --steps 20": (
        "tests/parallel/test_distributed.py::test_parity_across_backends (the command) and "
        "test_every_backend_gives_the_losses_of_one_process (every backend)"
    ),
    "hftrain train recipes/quickstart.yaml --accelerate-config ddp --nproc 2 training.max_steps=600": (
        "600 quickstart steps on 2 processes; "
        "tests/checkpoint/test_elastic.py::test_a_killed_2_process_run_continues_on_1 does the same on a small recipe"
    ),
    "hftrain train recipes/quickstart.yaml training.max_steps=600": (
        "the second half of the line above (tests/checkpoint/test_elastic.py)"
    ),
    "hftrain parity recipes/quickstart.yaml --elastic": (
        "tests/checkpoint/test_elastic.py::test_parity_elastic_prints_its_summary (the same check on a small recipe)"
    ),
    "hftrain data prepare recipes/pretrain/pythia-160m.yaml --out /shared/fineweb-neox --executor slurm": (
        "needs a cluster and fineweb-edu; "
        "tests/launch/test_slurm.py::test_prepare_on_slurm_gives_the_folder_one_machine_gives runs the SLURM executor "
        "on a real SLURM with 2 node agents"
    ),
    "python scripts/wheelhouse.py": "downloads ~230 MB of wheels (tests/test_wheelhouse.py builds a small one)",
    "pip install --no-index --find-links wheels": "installs the wheelhouse above",
    "python benchmarks/": "benchmarks take 10+ minutes on a quiet machine; never part of the suite",
    'pip install -e ".[sagemaker]"': "the install lines: the test extra holds the sagemaker extra's packages",
    "hftrain launch-script recipes/pretrain/pythia-1b.yaml --kind sagemaker": (
        "tests/launch/test_sagemaker.py::test_launcher_submits_the_job_moto_receives (the same command, then its "
        "launcher against moto)"
    ),
    "python launch_pythia_1b.py": (
        "submits a real, paid SageMaker job; test_sagemaker runs a generated launcher against moto"
    ),
    "hftrain launch-script recipes/pretrain/pythia-1b.yaml --kind torchrun": (
        "tests/parallel/test_distributed.py::test_launch_script_for_2_nodes_x_8_gpus (the same script, text checked); "
        "test_multinode.py runs its --cpu form"
    ),
    "NODE_RANK=": "needs two machines; tests/launch/test_multinode.py runs the script as two node agents on 127.0.0.1",
    "hftrain launch-script recipes/pretrain/pythia-1b.yaml --kind torchrun --nodes 4 --min-nodes 2": (
        "tests/launch/test_elastic_launch.py::test_the_elastic_script_and_what_is_refused (the same script, text "
        "checked); test_multinode.py runs its --cpu form"
    ),
    "hftrain data batch recipes/pretrain/pythia-160m-continue.yaml --step 0": (
        "needs the preshuffled Pile (600 GB); tests/data/test_megatron.py::"
        "test_the_shipped_pythia_continuation_reads_pythias_rows runs the recipe on a tiny sharded corpus"
    ),
    "hftrain plan recipes/pretrain/pythia-160m-continue.yaml": (
        "reads pythia-160m-deduped's config from the Hub; tests/recipe/test_recipe.py::"
        "test_every_shipped_recipe_validates_and_plans plans the recipe on a local model"
    ),
    "accelerate launch --config_file accelerate_configs/ddp.yaml -m hftrain train "
    "recipes/pretrain/pythia-160m-continue": (
        "GPU-sized (160M parameters, the 600 GB Pile); tests/data/test_megatron.py::"
        "test_a_pythia_continuation_killed_on_2_processes_resumes_on_1_on_the_stored_rows trains the same path"
    ),
    "HEAD_NODE=10.0.0.1 ./train_elastic.sh": (
        "needs several machines; "
        "tests/launch/test_multinode.py::test_an_elastic_launch_goes_on_without_a_lost_node_and_takes_it_back runs it "
        "as node agents on 127.0.0.1"
    ),
}


def test_every_readme_command_is_run_or_says_where_and_why_not():
    unplaced = [
        line
        for line in _command_lines()
        if line not in FAST + CHAIN + [S3_LINE] and not any(line.startswith(prefix) for prefix in ELSEWHERE)
    ]
    assert not unplaced, f"README commands no test runs: {unplaced}"
    for line in FAST + CHAIN + [S3_LINE]:
        assert line in _command_lines(), f"no longer in the README: {line}"


def test_install_script_is_what_ci_runs():
    script = (ROOT / "scripts" / "install_test_deps.sh").read_text(encoding="utf-8")
    assert 'apt-get install -y -q "${missing[@]}"' in script
    assert (
        "command -v chromium >/dev/null || missing+=(chromium)" in script
        and "command -v g++ >/dev/null || missing+=(g++)" in script
    )
    assert _shell_blocks()[1].strip().startswith("scripts/install_test_deps.sh && ")
    assert subprocess.run(["bash", "-n", str(ROOT / "scripts" / "install_test_deps.sh")]).returncode == 0


def _run_line(capsys, line: str, cwd, extra=()) -> str:
    """The README line as written, through the CLI's own entry point in this process, from `cwd`: what it printed.
    (The console script itself runs end to end in tests/cli/test_train.py::test_quickstart_as_shipped.)"""
    import os

    words = shlex.split(line)
    assert words[0] == "hftrain"
    before = os.getcwd()
    os.chdir(cwd)
    try:
        code, printed = in_process(capsys, *words[1:], *extra)
    finally:
        os.chdir(before)
    assert code == 0, (line, printed[-3000:])
    assert "Traceback" not in printed
    return printed


@pytest.mark.parametrize("line", FAST)
def test_readme_command_runs(capsys, line):
    _run_line(capsys, line, ROOT)


def _scratch(tmp_path):
    (tmp_path / "recipes").symlink_to(ROOT / "recipes")
    return tmp_path


@pytest.mark.slow(seconds=90)  # the suite's order: the longest files start first (tests/conftest.py)
def test_readme_training_commands_run_in_order(tmp_path, capsys):
    """In the README's order, in one scratch directory, each line a few steps long."""
    cwd = _scratch(tmp_path)
    for line in CHAIN:
        line = line.replace("checkpoint-600", "checkpoint-2").replace("checkpoint-200", "checkpoint-2")
        extra = SHORT if line.startswith("hftrain train") else ()
        if ("finetune" in line or "tokenizer=" in line) and line.startswith("hftrain train"):
            extra = [w for w in SHORT if not w.startswith("tokenizer.")]
        if line.startswith("hftrain data prepare"):
            extra = ["tokenizer.train.max_documents=100", "data.eval_blocks=2"]
        printed = _run_line(capsys, line, cwd, extra=extra)
        if "--check-packing" in line:  # the quickstart model's shape and tokenizer, on this machine's kernels
            assert all(f"check-packing: {k} max |diff|" in printed for k in ("eager", "sdpa", "flex_attention")), (
                printed
            )
    assert (cwd / "runs/quickstart/exported/model.safetensors").is_file()
    assert (cwd / "runs/quickstart/quickstart-q8_0.gguf").read_bytes()[
        :4
    ] == b"GGUF"  # what llama.cpp reads: test_gguf.py
    assert (cwd / "runs/finetune-lora/merged/model.safetensors").is_file()
    assert (cwd / "runs/finetune-dpo/merged/model.safetensors").is_file()


@pytest.mark.slow
def test_readme_s3_example(tmp_path, s3, capsys):
    import gzip
    import json

    from .support.data import make_documents

    s3.make_bucket("corpus")
    s3.put(
        "corpus/data.jsonl.gz",
        gzip.compress("".join(json.dumps({"text": d}) + "\n" for d in make_documents(4000)).encode()),
    )
    printed = _run_line(capsys, S3_LINE, _scratch(tmp_path), extra=SHORT)
    assert "final checkpoint: runs/quickstart/final" in printed
