#!/usr/bin/env bash
# GPU acceptance check: the gpu test tier (pytest -m gpu: training, fine-tuning, backends, benchmark) and the
# throughput benchmark against the run_clm-style baseline, on 1 GPU or more; one report (report.md + report.json).
#   bash scripts/gpu_check.sh [--out DIR] [--wheelhouse DIR] [--dry-run]
#     --out DIR         where the report and logs go (default runs/gpu_check)
#     --wheelhouse DIR  first install hftrain's requirements from DIR alone (pip --no-index; scripts/wheelhouse.py makes it)
#     --dry-run         check the environment, list what would run, write a "no GPU: dry run" report, exit 0
#                       (also what happens on a machine without CUDA)
# Run from the repository root. Exit status 0 when every item passed. About 8-10 minutes on one H100.
set -uo pipefail
out=runs/gpu_check wheelhouse="" dry=0
while [ $# -gt 0 ]; do
  case "$1" in
    --out) out=$2; shift 2 ;;
    --wheelhouse) wheelhouse=$2; shift 2 ;;
    --dry-run) dry=1; shift ;;
    -h|--help) sed -n '2,9p' "$0"; exit 0 ;;
    *) echo "gpu_check: unknown argument $1" >&2; exit 2 ;;
  esac
done
py=${PYTHON:-python}
mkdir -p "$out/items" && out=$(cd "$out" && pwd) || exit 2
[ -z "$wheelhouse" ] || wheelhouse=$(cd "$wheelhouse" && pwd) || exit 2
cd "$(dirname "$0")/.." || exit 2
start=$(date +%s)

if [ -n "$wheelhouse" ]; then  # offline: hftrain and its requirements from the wheelhouse alone (torch stays the image's)
  "$py" -m pip install --no-index --find-links "$wheelhouse" ".[deepspeed,qlora]" 2>&1 | tee "$out/pip.log" | tail -3
  [ "${PIPESTATUS[0]}" -eq 0 ] || { echo "gpu_check: offline install from $wheelhouse failed (see $out/pip.log)" >&2; exit 1; }
fi

"$py" scripts/gpu_report.py --env > "$out/environment.json"
env_ok=$?
gpus=$("$py" -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)" 2>/dev/null || echo 0)
echo "gpu_check: $gpus GPU(s); environment $( [ $env_ok -eq 0 ] && echo complete || echo "INCOMPLETE, see $out/environment.json")"

"$py" -m pytest tests/gpu -m gpu --collect-only -q -p no:cacheprovider > "$out/collected.txt" 2>&1 \
  || echo "gpu_check: collecting the gpu tests failed (see $out/collected.txt)"
if [ "$dry" -eq 1 ] || [ "$gpus" -eq 0 ]; then
  echo "gpu_check: no GPU: dry run. It would run:"
  echo "  GPU_REPORT_DIR=$out/items $py -m pytest tests/gpu -m gpu --junitxml $out/junit.xml"
  echo "  $py benchmarks/throughput.py --device cuda --shapes gpu-160m --json $out/benchmark.json"
  grep '::' "$out/collected.txt" | sed 's/^/    /'
  "$py" scripts/gpu_report.py "$out" --dry-run --collected "$out/collected.txt"
  exit 0
fi

# The benchmark runs once, below, at full length; its gpu test (a shorter run of the same code) is for pytest -m gpu alone.
GPU_REPORT_DIR="$out/items" "$py" -m pytest tests/gpu -m gpu -p no:cacheprovider -o addopts="" -ra --durations=0 \
  --junitxml "$out/junit.xml" --deselect tests/gpu/test_gpu_benchmark.py 2>&1 | tee "$out/pytest.log"
"$py" benchmarks/throughput.py --device cuda --shapes gpu-160m --json "$out/benchmark.json" > "$out/benchmark.log" 2>&1
bench_rc=$?
tail -4 "$out/benchmark.log"
"$py" scripts/gpu_report.py "$out" --collected "$out/collected.txt" --bench-rc "$bench_rc"
rc=$?
echo "gpu_check: $(( $(date +%s) - start )) s in all; report: $out/report.md"
exit $rc
