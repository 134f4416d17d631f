#!/usr/bin/env bash
# CI: the fast tier (pytest -m "not slow") on the LOWEST versions pyproject.toml allows of transformers, accelerate,
# datasets, peft, huggingface_hub, tokenizers and trl. The main suite only ever sees the newest ones pip picks, so a floor
# that no longer installs or works would go unnoticed until a user with an older stack hits it.
# Like the README's test command, in its own venv (.venv-lowest, git-ignored) with torch 2.13.0 (CPU) first; each floor
# `>=X` (read from pyproject.toml) becomes a constraint `==` the lowest release >= X, beside torch==2.13.0, so a
# dependency of .[test] that needs newer makes pip fail (ResolutionImpossible) instead of upgrading.
# About 7 minutes on 2 cores: install 3, tests 4.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1 HF_HUB_OFFLINE=1
PKGS="transformers accelerate datasets peft huggingface_hub tokenizers trl"
scripts/install_test_deps.sh
python3 -m venv --clear .venv-lowest && . .venv-lowest/bin/activate
pip install torch==2.13.0
python - "$PKGS" >.venv-lowest/constraints.txt <<'EOF'
import re, subprocess, sys
text = open("pyproject.toml", encoding="utf-8").read()
print("torch==2.13.0")
for name in sys.argv[1].split():
    floor = re.search(rf'"{name}>=([\d.]+)', text).group(1)
    key = tuple(map(int, floor.split(".")))
    pip = [sys.executable, "-m", "pip", "index", "versions", name]
    out = subprocess.run(pip, capture_output=True, text=True, check=True).stdout
    released = [v.strip() for v in out.split("Available versions:")[1].splitlines()[0].split(",")]
    lowest = min((v for v in released if re.fullmatch(r"[\d.]+", v) and tuple(map(int, v.split("."))) >= key),
                 key=lambda v: tuple(map(int, v.split("."))))
    print(f"{name}=={lowest}")
EOF
cat .venv-lowest/constraints.txt
pip install -e ".[test]" -c .venv-lowest/constraints.txt
echo "versions tested:" && pip list | grep -iE "^(torch|${PKGS// /|}) "
pytest -m "not slow" -p no:cacheprovider
