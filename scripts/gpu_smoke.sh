#!/usr/bin/env bash
# GPU smoke test: a few steps of every backend on the GPUs of this machine, each checked for what it really ran.
#   bash scripts/gpu_smoke.sh            (needs CUDA; run from the repository root)
# With 1 GPU: FSDP, FSDP + offload, ZeRO-3, ZeRO-3 + offload at world size 1, and device_map; with 2 or more, the
# same backends on every GPU, plus DDP. (scripts/gpu_check.sh goes further: shards, resume, fine-tuning, speed.)
set -euo pipefail
gpus=$(python -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)")
if [ "$gpus" -lt 1 ]; then echo "gpu_smoke: needs a CUDA GPU (found none); on CPU use hftrain parity instead" >&2; exit 2; fi
recipe=recipes/quickstart.yaml
common=(training.max_steps=20 training.save_steps=10 training.bf16=true monitor.sample_max_new_tokens=0)
check() {  # check OUTPUT_DIR EXPECTED_DISTRIBUTED_TYPE EXPECTED_WORLD_SIZE
  python - "$1" "$2" "$3" <<'PY'
import json, sys
out, expected, world = sys.argv[1], sys.argv[2], int(sys.argv[3])
r = json.load(open(f"{out}/results.json"))
assert (r["distributed_type"], r["world_size"]) == (expected, world), r
print(f"ok  {out}: {r['distributed_type']} x{r['world_size']}, eval_loss {r['eval_loss']:.3f}, {r['tokens_per_s_median']} tokens/s")
PY
}
pairs=(fsdp:FSDP fsdp_offload:FSDP deepspeed_zero3:DEEPSPEED deepspeed_zero3_offload:DEEPSPEED)
if [ "$gpus" -ge 2 ]; then pairs=(ddp:MULTI_GPU "${pairs[@]}"); else echo "gpu_smoke: 1 GPU: world size 1 (DDP needs 2 GPUs; skipped)"; fi
for pair in "${pairs[@]}"; do
  cfg=${pair%%:*}; kind=${pair##*:}; out=runs/smoke/$cfg
  rm -rf "$out"
  accelerate launch --config_file "accelerate_configs/$cfg.yaml" --num_processes "$gpus" -m hftrain train "$recipe" "${common[@]}" "training.output_dir=$out"
  check "$out" "$kind" "$gpus"
  hftrain export "$out/checkpoint-20" --out "$out/exported" >/dev/null
done
rm -rf runs/smoke/device_map
hftrain train "$recipe" "${common[@]}" parallelism.strategy=device_map training.output_dir=runs/smoke/device_map
check runs/smoke/device_map NO 1
echo "gpu_smoke: all backends ok on $gpus GPU(s)"
