"""`hftrain launch-script RECIPE --kind torchrun|slurm|sagemaker`: write a multi-node launch script."""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path
from typing import Any

from hftrain.cli.numbers import positive_float, positive_int

NAME = "launch-script"


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        NAME, help="write a multi-node launch script (torchrun rendezvous, SLURM, or a SageMaker training job)"
    )
    p.add_argument("recipe")
    p.add_argument("--kind", choices=["torchrun", "slurm", "sagemaker"], default="slurm")
    p.add_argument("--nodes", type=positive_int, default=2)
    p.add_argument("--gpus-per-node", type=positive_int, default=8)
    p.add_argument(
        "--accelerate-config",
        default="fsdp",
        help="the backend: a shipped config name (ddp, fsdp, zero3, ...; resolved on each node) or a path valid on "
        "every node (sagemaker: its ACCELERATE_*/FSDP_* settings go to the job; 'none' for plain DDP)",
    )
    p.add_argument(
        "--cpu",
        action="store_true",
        help=(
            "torchrun/slurm: a CPU rehearsal (gloo processes, as `hftrain "
            "train --cpu`); --gpus-per-node is then processes per node"
        ),
    )
    p.add_argument(
        "--min-nodes",
        type=positive_int,
        metavar="MIN",
        help="torchrun: an elastic script: MIN to --nodes nodes, torchrun restarting every node's processes when a "
        "node is lost or joins (the run resumes from its last "
        "checkpoint); needs one training.output_dir every node mounts",
    )
    p.add_argument("--out", help="write the script here, as a new executable file (default: print it)")
    p.add_argument("--force", action="store_true", help="with --out: replace a file that exists there")
    sm = p.add_argument_group("sagemaker (pip install 'hftrain[sagemaker]')")
    sm.add_argument("--instance-type", default="ml.g5.12xlarge", help="default: ml.g5.12xlarge (4 x A10G 24 GB)")
    sm.add_argument("--instance-count", type=positive_int, default=1)
    sm.add_argument(
        "--spot", action=argparse.BooleanOptionalAction, default=True, help="managed spot capacity (default: on)"
    )
    sm.add_argument(
        "--role", help="execution role name or ARN (default: the SageMaker config's, else the caller's role)"
    )
    sm.add_argument("--region", help="default: the standard AWS configuration")
    sm.add_argument(
        "--bucket", help="S3 bucket for code, checkpoints and the model (default: sagemaker-REGION-ACCOUNT)"
    )
    sm.add_argument("--image", help="training image URI (default: the AWS PyTorch training image)")
    sm.add_argument("--max-run-hours", type=positive_float, default=24.0)
    sm.add_argument("--volume-gb", type=positive_int, default=200)
    sm.add_argument(
        "--channel",
        action="append",
        nargs=2,
        default=[],
        metavar=("NAME", "S3URI"),
        help="an input channel, read in the recipe as channel:NAME (default: none; s3:// paths stream)",
    )
    sm.add_argument("--job-name", help="job name prefix (default: hftrain-RECIPE)")
    return p


def _sagemaker(args: argparse.Namespace, overrides: list[str], recipe: Any) -> str:
    from hftrain.launch.sagemaker import JobOptions, SageMakerPart, parse_channels, render

    config = None if args.accelerate_config.lower() in ("none", "ddp") else args.accelerate_config
    options = JobOptions(
        instance_type=args.instance_type,
        instance_count=args.instance_count,
        spot=args.spot,
        role=args.role,
        region=args.region,
        bucket=args.bucket,
        image=args.image,
        max_run_hours=args.max_run_hours,
        volume_gb=args.volume_gb,
        accelerate_config=config,
        channels=parse_channels(args.channel),
        job_name=args.job_name,
    )
    command = shlex.join(["hftrain", NAME, *getattr(args, "argv", [args.recipe])[1:]])
    return render(args.recipe, SageMakerPart.of(recipe), overrides, options, command)


def run(args: argparse.Namespace, overrides: list[str]) -> int:
    from hftrain.launch.script_checks import ScriptLaunch, check_script
    from hftrain.planning.part import PlanPart
    from hftrain.recipe.load import load_recipe

    sagemaker = args.kind == "sagemaker"
    nodes, per_node = (args.instance_count, None) if sagemaker else (args.nodes, args.gpus_per_node)
    recipe = load_recipe(args.recipe, overrides)  # every kind: refused here (and below), before any file is written
    check_script(
        PlanPart.of(recipe), ScriptLaunch(args.kind, args.accelerate_config, nodes, per_node, args.min_nodes or 0)
    )
    if sagemaker:
        script = _sagemaker(args, overrides, recipe)
    else:
        from hftrain.launch.multinode import render

        script = render(
            args.kind,
            args.nodes,
            args.gpus_per_node,
            args.recipe,
            args.accelerate_config,
            overrides,
            args.cpu,
            args.min_nodes or 0,
        )
    if args.out:  # a new executable file, or --force: in place of a regular one (never through /dev/null)
        from hftrain.checkpoint.files import write_new_file

        write_new_file(Path(args.out), script, "--out", replace=args.force, executable=True)
        print(f"wrote {args.out}")
    else:
        print(script)
    return 0
