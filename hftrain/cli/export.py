"""`hftrain export CHECKPOINT --out DIR [--merge]`: any hftrain checkpoint -> one standard HF model directory;
`--format gguf --out FILE [--quant f32|f16|q8_0]`: one GGUF file for llama.cpp (export/gguf_file.py)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

TAKES_OVERRIDES = False


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "export",
        help=(
            "consolidate a checkpoint (DDP, FSDP, ZeRO-3, LoRA) into one "
            "standard HF model directory, or one GGUF file for llama.cpp"
        ),
    )
    p.add_argument("checkpoint")
    p.add_argument("--out", required=True, help="a new directory (--format hf) or a new file (--format gguf)")
    p.add_argument("--merge", action="store_true", help="a LoRA checkpoint: merge the adapter into its base model")
    p.add_argument(
        "--format",
        choices=["hf", "gguf"],
        default="hf",
        help="hf: a transformers model directory; gguf: llama.cpp's format",
    )
    p.add_argument(
        "--quant",
        choices=["f32", "f16", "q8_0"],
        default=None,
        help="GGUF tensor type of the weight matrices (default f16)",
    )
    return p


def run(args: argparse.Namespace, overrides: list[str]) -> int:
    from hftrain.errors import HftrainError

    if args.format == "gguf":
        from hftrain.export.gguf_file import export_gguf

        out = export_gguf(Path(args.checkpoint), Path(args.out), quant=args.quant or "f16", merge=args.merge)
        print(f"exported: {out} (GGUF, {args.quant or 'f16'}, {out.stat().st_size / 1e6:,.1f} MB)")
        return 0
    if args.quant is not None:
        raise HftrainError(
            "--quant applies to --format gguf; a model directory keeps the checkpoint's weights as they are."
        )
    from hftrain.export.model_dir import export

    print(f"exported: {export(Path(args.checkpoint), Path(args.out), merge=args.merge)}")
    return 0
