"""`hftrain launch-script RECIPE --kind sagemaker`: a launcher for an Amazon SageMaker training job.

The launcher is a short Python script over the SageMaker Python SDK v3 (``sagemaker-train``: ``ModelTrainer``,
the SDK's current training interface; v2's framework estimators are in maintenance). Running it:

* stages the training code in a temporary directory: this hftrain package, the recipe, a requirements.txt
  with hftrain's dependencies (torch comes from the image) and a two-line entry script (``stage_code``);
* submits one training job: the AWS PyTorch training image, ``Torchrun()`` distribution (one process per
  GPU on every instance), managed spot capacity with ``checkpoint_s3_uri`` + ``/opt/ml/checkpoints`` so an
  interrupted job resumes, the overrides as hyperparameters, the accelerate backend (FSDP, DDP) as
  environment variables, and metric definitions for hftrain's metric lines (``METRIC_DEFINITIONS``).

Data: s3:// data paths in the recipe stream straight from S3 with hftrain's own reader (nothing is copied
before training starts, the data position resumes exactly, any size fits without sizing the volume). An input
channel (``--channel NAME s3://...``) is there for data that must sit on local disk: SageMaker copies it to
/opt/ml/input/data/NAME before training and the recipe reads it as ``channel:NAME`` (sagemaker_job.py).
This module never imports the SDK at import time: hftrain works without the ``sagemaker`` extra.
"""

from __future__ import annotations

import importlib.metadata
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hftrain.errors import HftrainError
from hftrain.launch import processes as launch
from hftrain.launch.sagemaker_job import CHANNEL, CHECKPOINTS_VAR, DEFAULT_CHECKPOINTS, METRICS_PREFIX
from hftrain.launch.script_checks import found_here

if TYPE_CHECKING:
    from hftrain.recipe.data_section import Source
    from hftrain.recipe.schema import Recipe


@dataclass(frozen=True)
class SageMakerPart:
    """What a SageMaker launch script checks (`check_recipe`): every file the job would read, since a job
    cannot read this machine's: the data sources (data.train, data.validation), model.from_pretrained,
    tokenizer.path, and training.resume_from_checkpoint and training.deepspeed where the recipe sets them."""

    sources: tuple[Source, ...]
    from_pretrained: str | None
    tokenizer_path: str | None
    resume_from_checkpoint: object
    deepspeed: object

    @classmethod
    def of(cls, recipe: Recipe) -> SageMakerPart:
        data, training = recipe.data, recipe.training_kwargs()
        return cls(
            sources=(*data.train, *([data.validation] if data.validation else [])),
            from_pretrained=recipe.model.from_pretrained,
            tokenizer_path=recipe.tokenizer.path,
            resume_from_checkpoint=training.get("resume_from_checkpoint"),
            deepspeed=training.get("deepspeed"),
        )


ENTRY_SCRIPT = "hftrain_sagemaker_entry.py"
PYTORCH_IMAGE = ("2.10", "py313")  # the newest AWS PyTorch training image the SDK lists (image_uris, offline)
_NUMBER = r"([-+0-9.eE]+|nan|inf)"

# Name -> the key of hftrain's metric lines it captures (a space before the key: `loss=` is not `eval_loss=`).
_METRICS = {
    "train:loss": "loss",
    "train:learning_rate": "learning_rate",
    "train:grad_norm": "grad_norm",
    "train:tokens_per_s": "tokens_per_s",
    "train:mfu": "mfu",
    "train:data_wait_frac": "data_wait_frac",
    "eval:loss": "eval_loss",
    "eval:bits_per_byte": "eval_bits_per_byte",
    "eval:perplexity": "eval_perplexity",
}
METRIC_DEFINITIONS = [
    {"Name": name, "Regex": f"^{METRICS_PREFIX} .* {key}={_NUMBER}"} for name, key in _METRICS.items()
]

ENTRY = '''"""Run by SageMaker's torchrun driver in every process: `hftrain train {recipe}` with the job's
hyperparameters."""
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # the hftrain package staged beside this file

from hftrain.cli import program  # noqa: E402
from hftrain.launch.sagemaker_job import hyperparameter_overrides  # noqa: E402

sys.exit(program(["train", str(HERE / "{recipe}"), *hyperparameter_overrides()]))
'''


@dataclass
class JobOptions:
    """The launcher's settings; every one has a default (role and region: the standard AWS configuration)."""

    instance_type: str = "ml.g5.12xlarge"
    instance_count: int = 1
    spot: bool = True
    role: str | None = None
    region: str | None = None
    bucket: str | None = None
    image: str | None = None
    max_run_hours: float = 24.0
    volume_gb: int = 200
    accelerate_config: str | None = None
    channels: dict[str, str] = field(default_factory=dict)
    job_name: str | None = None


def job_name(recipe_path: str) -> str:
    """A SageMaker job name prefix from the recipe's file name (letters, digits, hyphens)."""
    stem = re.sub(r"[^A-Za-z0-9-]+", "-", Path(recipe_path).stem).strip("-") or "run"
    return f"hftrain-{stem}"[:40].rstrip("-")


def parse_channels(items: list[list[str]]) -> dict[str, str]:
    """`--channel NAME s3://bucket/prefix` pairs -> {name: uri}."""
    channels = {}
    for name, uri in items:
        if not re.fullmatch(r"[A-Za-z0-9\.\-_]{1,64}", name) or not uri.startswith("s3://"):
            raise HftrainError(
                f"--channel {name} {uri}: expected NAME s3://bucket/prefix (NAME: letters, digits, . - _)."
            )
        channels[name.lower()] = uri
    return channels


def check_recipe(part: SageMakerPart, channels: dict[str, str]) -> None:
    """A SageMaker job cannot read files on this machine: data must be s3://, a hub dataset, builtin or a channel."""
    for source in part.sources:
        for key in ("path", "pretokenized", "megatron"):
            value = getattr(source, key)
            if value is None or ("://" in value and not value.startswith("file://")):
                continue
            if value.startswith(CHANNEL):
                if value[len(CHANNEL) :].partition("/")[0].lower() not in channels:
                    raise HftrainError(
                        f"data {key} {value!r}: no such input channel; add --channel NAME s3://... to the "
                        "launch-script command."
                    )
                continue
            raise HftrainError(
                f"data {key} {value!r} is a path on this machine, which a SageMaker job cannot read. Upload it to S3 "
                "and give the s3:// URL (hftrain streams it), or pass "
                "--channel NAME s3://... and use channel:NAME as the path."
            )
    resume, deepspeed = part.resume_from_checkpoint, part.deepspeed
    elsewhere = {  # every other file a job reads: where it should come from instead
        "model.from_pretrained": (part.from_pretrained, "give a hub id or an s3:// copy"),
        "tokenizer.path": (
            part.tokenizer_path,
            "give a hub id (`hftrain push` a run's final/ shares its "
            "tokenizer), or train it in the job (tokenizer.train)",
        ),
        "training.resume_from_checkpoint": (
            resume if isinstance(resume, str) else None,
            "a job resumes from its own checkpoints (SageMaker restores them): set it to true",
        ),
        "training.deepspeed": (
            deepspeed if isinstance(deepspeed, str) else None,
            "pass the backend with --accelerate-config",
        ),
    }
    for key, (value, instead) in elsewhere.items():
        if value and "://" not in value and Path(value).expanduser().exists():
            raise HftrainError(
                f"{key} {value!r} is a path on this machine, which a SageMaker job cannot read; {instead}."
            )


def backend_environment(config_name: str | None) -> dict[str, str]:
    """The variables `accelerate launch` would set for this config's backend (ACCELERATE_*, FSDP_*), so the
    processes that SageMaker's torchrun starts run the same backend. None: plain DDP over all GPUs."""
    if not config_name:
        return {}
    config = found_here(config_name)  # a file, or the shipped config a path names (script_checks.py)
    backend = launch.backend_of(config)
    if backend == "zero3":
        raise HftrainError(
            f"{config}: DeepSpeed configs are not translated for SageMaker jobs; use an FSDP or DDP config."
        )
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    parsed = launch_command_parser().parse_args(
        ["--config_file", str(config), "--num_machines", "1", "--num_processes", "2", ENTRY_SCRIPT]
    )
    args, _, _ = _validate_launch_command(parsed)
    env = prepare_multi_gpu_env(args)
    return {key: str(value) for key, value in sorted(env.items()) if key.startswith(("ACCELERATE_", "FSDP_"))}


def requirements() -> list[str]:
    """hftrain's own dependencies, for the job's requirements.txt; torch stays the image's."""
    try:
        required = importlib.metadata.requires("hftrain") or []
    except importlib.metadata.PackageNotFoundError:
        raise HftrainError(
            "hftrain is not installed as a package (pip install -e .); its dependencies are unknown."
        ) from None
    return [r for r in required if "extra ==" not in r and not re.match(r"^torch\b", r)]


def stage_code(recipe_path: str | Path, dest: str | Path) -> Path:
    """Fill `dest` with what the job runs: hftrain/, the recipe, requirements.txt and the entry script."""
    import hftrain

    dest, recipe = Path(dest), Path(recipe_path)
    shutil.copytree(
        Path(hftrain.__file__).parent,
        dest / "hftrain",
        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"),
        dirs_exist_ok=True,
    )
    shutil.copy2(recipe, dest / recipe.name)
    (dest / "requirements.txt").write_text("\n".join(requirements()) + "\n", encoding="utf-8")
    (dest / ENTRY_SCRIPT).write_text(ENTRY.format(recipe=recipe.name), encoding="utf-8")
    return dest


def default_image(region: str, instance_type: str) -> str:
    """The AWS PyTorch training image for the instance type, from the SDK's bundled table (no network)."""
    from sagemaker.core import image_uris

    version, py = PYTORCH_IMAGE
    return image_uris.retrieve(
        "pytorch", region=region, version=version, py_version=py, instance_type=instance_type, image_scope="training"
    )


def hyperparameters(overrides: list[str]) -> dict[str, str]:
    """The overrides as the job's hyperparameters: {dotted.key: value text}; in the job they are overrides again."""
    return dict(item.split("=", 1) for item in overrides)


def render(recipe_path: str, part: SageMakerPart, overrides: list[str], options: JobOptions, command: str) -> str:
    """The launcher script's text."""
    from hftrain.launch.sagemaker_template import LAUNCHER

    check_recipe(part, options.channels)
    environment = {CHECKPOINTS_VAR: DEFAULT_CHECKPOINTS, **backend_environment(options.accelerate_config)}
    values: dict[str, Any] = {
        "RECIPE": str(Path(recipe_path).resolve()),
        "JOB_NAME": options.job_name or job_name(recipe_path),
        "INSTANCE_TYPE": options.instance_type,
        "INSTANCE_COUNT": options.instance_count,
        "SPOT": options.spot,
        "ROLE": options.role,
        "REGION": options.region,
        "BUCKET": options.bucket,
        "IMAGE": options.image,
        "MAX_RUN_HOURS": options.max_run_hours,
        "VOLUME_GB": options.volume_gb,
        "HYPERPARAMETERS": hyperparameters(overrides),
        "ENVIRONMENT": environment,
        "CHANNELS": options.channels,
    }
    settings = "\n".join(f"{key} = {value!r}" for key, value in values.items())
    return LAUNCHER.format(command=command, settings=settings, checkpoints=DEFAULT_CHECKPOINTS)
