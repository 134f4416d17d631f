"""`hftrain` command line: a thin front over the same functions the Python API uses.

``key=value`` overrides may stand anywhere after the command, mixed with options:
``hftrain train recipes/quickstart.yaml --help``, ``hftrain plan RECIPE training.max_steps=10``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from .errors import HftrainError, Preempted
from .recipe import inner_model
from .recipe_schema import Recipe

SECTIONS = ["model", "tokenizer", "data", "training", "finetune", "parallelism", "hub", "faults", "monitor"]


def _type_name(annotation: Any) -> str:
    text = str(annotation).replace("typing.", "").replace("NoneType", "None")
    return text.replace("<class '", "").replace("'>", "")


def explain(section: str | None = None, brief_training: bool = True) -> str:
    """Every recipe key with its type, default and docstring (the text of `hftrain explain`)."""
    out: list[str] = []
    for name in [section] if section else SECTIONS:
        if name not in Recipe.model_fields:
            raise HftrainError(f"explain: unknown section {name!r}; sections are {', '.join(SECTIONS)}")
        model = inner_model(Recipe.model_fields[name].annotation)
        assert model is not None
        out.append(f"{name}:  {Recipe.model_fields[name].description or ''}")
        if name == "training" and brief_training and section is None:
            out.append("  Any transformers.TrainingArguments field, with its own name and meaning. hftrain's defaults:")
            from .recipe import TRAINING_DEFAULTS

            out += [f"    {k}: {v}" for k, v in TRAINING_DEFAULTS.items()]
            out.append("    output_dir: runs/<recipe file name>")
            out.append("  `hftrain explain training` lists every field.")
            continue
        out += _describe_fields(model, indent="  ")
    return "\n".join(out)


def _describe_fields(model: type[BaseModel], indent: str) -> list[str]:
    lines = []
    for key, info in model.model_fields.items():
        default = info.get_default(call_default_factory=True)
        if isinstance(default, BaseModel):
            default = "{...}"
        elif isinstance(default, list) and default and isinstance(default[0], BaseModel):
            default = "[...]"
        lines.append(f"{indent}{key}: {_type_name(info.annotation)} = {default!r}")
        doc = " ".join((info.description or "").split())
        if doc:
            lines.append(f"{indent}    {doc}")
        nested = inner_model(info.annotation)
        if nested is not None and nested is not model:
            lines += _describe_fields(nested, indent + "    ")
    return lines


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hftrain",
        description="Pretrain and fine-tune GPT-NeoX-style models on the Hugging Face stack.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser(
        "train",
        help="train a recipe (resumes an interrupted run in the same output_dir)",
        description="Train RECIPE. Overrides: section.key=value anywhere after the command, e.g. training.max_steps=50.",
        epilog="Recipe keys:\n\n" + explain(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    train.add_argument("recipe", help="recipe YAML file, e.g. recipes/quickstart.yaml")
    train.add_argument("--accelerate-config", metavar="NAME_OR_PATH",
                       help="start the processes of this accelerate config (shipped: ddp, fsdp, zero3, ...) and train in them")
    train.add_argument("--nproc", type=int, help="processes to start with --accelerate-config (default: the config's; 2 on CPU)")
    train.add_argument("--cpu", action="store_true", help="with --accelerate-config: rehearse the backend on CPU processes (gloo)")
    train.add_argument("--max-restarts", type=int, default=0, metavar="N",
                       help="after a crash, start again (resuming from the last complete checkpoint) up to N times")
    plan = sub.add_parser("plan", help="print the model's size, FLOPs and memory; trains nothing")
    plan.add_argument("recipe")
    plan.add_argument("--gpus", type=int, help="also give per-GPU memory of each strategy on this many GPUs, and advice")
    plan.add_argument("--gpu-mem-gb", type=float, default=80.0, help="memory of one GPU for --gpus (default 80)")
    par = sub.add_parser("parity", help="run a recipe on single / DDP / FSDP / ZeRO-3 (2 processes) and compare per step")
    par.add_argument("recipe")
    par.add_argument("--steps", type=int, default=20, help="optimizer steps per backend (default 20)")
    par.add_argument("--backends", default="single,DDP,FSDP,ZeRO-3", help="comma-separated subset of single,DDP,FSDP,ZeRO-3")
    par.add_argument("--tolerance", type=float, default=1e-4, help="exit 1 when a relative difference exceeds this")
    data = sub.add_parser("data", help="prepare pre-tokenized shards, or inspect a recipe's data").add_subparsers(dest="data_command", required=True)
    prep = data.add_parser("prepare", help="tokenize and pack the training data once into shards + manifest")
    prep.add_argument("recipe")
    prep.add_argument("--out", required=True, help="directory or URL (s3://...) for the shards")
    prep.add_argument("--shard-size-mb", type=float, default=1024.0, help="shard size (default 1024 MB)")
    insp = data.add_parser("inspect", help="sources, shard counts, first blocks decoded, token estimate")
    insp.add_argument("recipe")
    insp.add_argument("--blocks", type=int, default=2, help="how many blocks to decode (default 2)")
    ls = sub.add_parser("launch-script", help="write a multi-node launch script (torchrun rendezvous or SLURM)")
    ls.add_argument("recipe")
    ls.add_argument("--kind", choices=["torchrun", "slurm"], default="slurm")
    ls.add_argument("--nodes", type=int, default=2)
    ls.add_argument("--gpus-per-node", type=int, default=8)
    ls.add_argument("--accelerate-config", default="accelerate_configs/fsdp.yaml")
    ls.add_argument("--out", help="write the script here (default: print it)")
    push = sub.add_parser("push", help="share a run's final model (or a model directory) on the hub or in S3")
    push.add_argument("path", help="a run directory (training.output_dir) or a model directory")
    push.add_argument("--repo-id", help="NAMESPACE/NAME on the hub (HF_ENDPOINT for a self-hosted server; token from HF_TOKEN)")
    push.add_argument("--revision", help="branch to push to (created if missing)")
    push.add_argument("--private", action="store_true", help="create the repo private")
    push.add_argument("--to", help="an s3:// (or other fsspec) URL instead of the hub")
    ex = sub.add_parser("export", help="consolidate a checkpoint (DDP, FSDP or ZeRO-3) into one standard HF model directory")
    ex.add_argument("checkpoint")
    ex.add_argument("--out", required=True)
    ex.add_argument("--merge", action="store_true", help="a LoRA checkpoint: merge the adapter into its base model")
    exp = sub.add_parser("explain", help="document every recipe key (or one section's)")
    exp.add_argument("section", nargs="?", choices=SECTIONS)
    sub.add_parser("presets", help="list the named model shapes")
    from .evaluate import add_parser as add_eval_parser

    add_eval_parser(sub)
    from .report import add_parser as add_report_parser

    add_report_parser(sub)
    return parser


def _without_option(argv: list[str], option: str) -> list[str]:
    """argv minus `option VALUE` / `option=VALUE`."""
    out, skip = [], False
    for word in argv:
        if skip:
            skip = False
        elif word == option:
            skip = True
        elif not word.startswith(option + "="):
            out.append(word)
    return out


def split_overrides(argv: list[str]) -> tuple[list[str], list[str]]:
    """`key=value` words are overrides; everything else goes to argparse."""
    overrides = [a for a in argv if "=" in a and not a.startswith("-")]
    return [a for a in argv if a not in overrides], overrides


def run(argv: list[str]) -> int:
    if argv[:1] == ["eval"]:  # no recipe overrides: a `key=value` word (e.g. s3://b/year=2024/x.jsonl) is a value
        from .evaluate import run as run_eval

        return run_eval(_parser().parse_args(argv))
    if argv[:1] == ["report"]:  # a run directory may contain "=": no recipe overrides
        from .report import run as run_report

        return run_report(_parser().parse_args(argv))
    words, overrides = split_overrides(argv)
    args = _parser().parse_args(words)
    if args.command == "explain":
        print(explain(args.section, brief_training=False))
        return 0
    if args.command == "presets":
        from .presets import preset_table

        print(preset_table())
        return 0
    if args.command == "launch-script":
        from .multinode import render

        script = render(args.kind, args.nodes, args.gpus_per_node, args.recipe, args.accelerate_config, overrides)
        if args.out:
            Path(args.out).write_text(script, encoding="utf-8")
            Path(args.out).chmod(0o755)
            print(f"wrote {args.out}")
        else:
            print(script)
        return 0
    if args.command == "push":
        from .hub import push_run

        print(f"pushed: {push_run(Path(args.path), repo_id=args.repo_id, to=args.to, private=args.private or None, revision=args.revision)}")
        return 0
    if args.command == "export":
        from .export import export

        print(f"exported: {export(Path(args.checkpoint), Path(args.out), merge=args.merge)}")
        return 0
    if args.command == "parity":
        from .parity import parity

        return parity(args.recipe, overrides, args.steps, args.backends.split(","), args.tolerance)
    from .recipe import load_recipe

    recipe = load_recipe(args.recipe, overrides)  # validated here, before any process is started
    if args.command == "train" and args.max_restarts > 0:
        from .launch import supervise

        return supervise(_without_option(argv, "--max-restarts"), args.max_restarts)
    if args.command == "train" and args.accelerate_config:
        from .launch import relaunch

        return relaunch([args.recipe, *overrides], args.accelerate_config, args.nproc, args.cpu, recipe)
    if args.command == "data":
        from .data.commands import inspect, prepare

        if args.data_command == "prepare":
            prepare(recipe, args.out, args.shard_size_mb)
        else:
            print(inspect(recipe, args.blocks))
        return 0
    if args.command == "plan":
        from .plan import format_plan, format_strategies, plan

        name = recipe.model.from_pretrained or recipe.model.preset
        info = plan(recipe)
        print(format_plan(info, str(name)))
        if args.gpus:
            print(format_strategies(info, args.gpus, args.gpu_mem_gb))
        return 0
    from .parallel import shutdown
    from .train import train

    train(recipe)
    shutdown()
    return 0


def main(argv: list[str] | None = None) -> int:
    try:
        return run(sys.argv[1:] if argv is None else argv)
    except Preempted as err:
        print(f"hftrain: {err}", file=sys.stderr)
        return err.exit_code
    except HftrainError as err:
        print(f"hftrain: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("hftrain: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
