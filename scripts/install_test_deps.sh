#!/usr/bin/env bash
# What the test suite needs beyond pip, installed with apt on Debian/Ubuntu when missing (sudo unless root); does
# nothing when it is there. The README's test command and .ci/run both start with this script.
# - headless Chromium: tests/eval/test_report.py renders the HTML report in it;
# - a C++ compiler: the test extra's llama-cpp-python is a source package that builds llama.cpp with cmake (cmake
#   and ninja come from PyPI as its build requirements); tests/export/test_gguf.py runs exported GGUF files in it;
# - SLURM and munge: tests/launch/test_slurm.py starts slurmctld + slurmd on this machine and sbatches the script
#   `hftrain launch-script --kind slurm` writes (the daemons are started by the test, not here).
set -euo pipefail
missing=()
command -v chromium >/dev/null || missing+=(chromium)
command -v g++ >/dev/null || missing+=(g++)
command -v slurmctld >/dev/null || missing+=(slurm-wlm)
command -v munged >/dev/null || missing+=(munge)
if [ ${#missing[@]} -gt 0 ]; then
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO=sudo
  $SUDO apt-get update -q && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q "${missing[@]}"
fi
