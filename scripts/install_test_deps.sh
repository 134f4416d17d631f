#!/usr/bin/env bash
# What the test suite needs beyond pip: headless Chromium (tests/eval/test_report.py renders the HTML report in it).
# Installs it with apt on Debian/Ubuntu when it is missing (sudo unless root); does nothing when it is there.
# The README's test command and .ci/run both start with this script.
set -euo pipefail
if ! command -v chromium >/dev/null; then
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO=sudo
  $SUDO apt-get update -q && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q chromium
fi
