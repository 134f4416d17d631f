#!/usr/bin/env bash
# GPU smoke test: a few steps of every backend on the GPUs of this machine, each checked for what it really ran.
#   bash scripts/gpu_smoke.sh            (needs CUDA and at least 2 GPUs; run from the repository root)
set -euo pipefail
gpus=$(python -c "import torch; print(torch.cuda.device_count())")
if [ "$gpus" -lt 2 ]; then echo "gpu_smoke: needs >= 2 CUDA GPUs (found $gpus); on CPU use hftrain parity instead" >&2; exit 2; fi
recipe=recipes/quickstart.yaml
common=(training.max_steps=20 training.save_steps=10 training.bf16=true monitor.sample_max_new_tokens=0)
check() {  # check OUTPUT_DIR EXPECTED_DISTRIBUTED_TYPE
  python - "$1" "$2" "$gpus" <<'PY'
import json, sys
out, expected, gpus = sys.argv[1], sys.argv[2], int(sys.argv[3])
r = json.load(open(f"{out}/results.json"))
world = 1 if expected == "NO" else gpus
assert (r["distributed_type"], r["world_size"]) == (expected, world), r
print(f"ok  {out}: {r['distributed_type']} x{r['world_size']}, eval_loss {r['eval_loss']:.3f}, {r['tokens_per_s_median']} tokens/s")
PY
}
for pair in ddp:MULTI_GPU fsdp:FSDP fsdp_offload:FSDP deepspeed_zero3:DEEPSPEED deepspeed_zero3_offload:DEEPSPEED; do
  cfg=${pair%%:*}; kind=${pair##*:}; out=runs/smoke/$cfg
  rm -rf "$out"
  accelerate launch --config_file "accelerate_configs/$cfg.yaml" --num_processes "$gpus" -m hftrain train "$recipe" "${common[@]}" "training.output_dir=$out"
  check "$out" "$kind"
  hftrain export "$out/checkpoint-20" --out "$out/exported" >/dev/null
done
rm -rf runs/smoke/device_map
hftrain train "$recipe" "${common[@]}" parallelism.strategy=device_map training.output_dir=runs/smoke/device_map
check runs/smoke/device_map NO
echo "gpu_smoke: all backends ok"
