#!/usr/bin/env bash
# Predicted vs measured on a real GPU: a small Llama trained on one NVIDIA GPU with NCCL through
# `dsforge compile` and the job's own launcher; prints the cost model's peak memory and step time next to
# what the run measured (memory_report.json: torch.cuda.max_memory_allocated / max_memory_reserved, mean
# step time without the warm-up step).
#
# Usage: benchmarks/gpu_check.sh            (PYTHON=... to choose the interpreter; default .venv/bin/python)
#        DSFORGE_GPU_PRESET=dgx-h100 ...    (hardware preset to predict with; default: from the GPU's name)
# Exit codes: 0 checked, 1 the run failed, 2 no CUDA GPU (nothing is run).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$(pwd)
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=$ROOT/.venv/bin/python; else PYTHON=python3; fi
fi
if ! found=$(command -v "$PYTHON"); then
  echo "gpu_check: no Python interpreter '$PYTHON'; set PYTHON to one with dsforge's runtime extra" >&2
  exit 2
fi
PYTHON=$found

if ! gpu=$("$PYTHON" -c 'import torch, sys
sys.exit(1) if not torch.cuda.is_available() else print(torch.cuda.get_device_name(0))' 2>/dev/null); then
  echo "gpu_check: no CUDA GPU is visible to torch in $PYTHON (torch.cuda.is_available() is False, or torch" \
       "is missing); this check needs one NVIDIA GPU with NCCL and a CUDA build of torch. Nothing was run." >&2
  exit 2
fi

case "${DSFORGE_GPU_PRESET:-$gpu}" in
  dgx-*|pcie-*) preset=$DSFORGE_GPU_PRESET ;;
  *H200*) preset=dgx-h200 ;;
  *H100*) preset=dgx-h100 ;;
  *A100*80*) preset=dgx-a100-80gb ;;
  *A100*) preset=dgx-a100-40gb ;;
  *L40S*) preset=pcie-l40s ;;
  *V100*) preset=dgx-1-v100 ;;
  *) preset=dgx-h100; echo "gpu_check: no preset for '$gpu'; predicting with dgx-h100 (set DSFORGE_GPU_PRESET)" >&2 ;;
esac
precision=bf16
[ "$preset" = dgx-1-v100 ] && precision=fp16

work=$(mktemp -d "${TMPDIR:-/tmp}/dsforge-gpu-check.XXXXXX")
trap 'rm -rf "$work"' EXIT
cat > "$work/gpu-check.yaml" <<EOF
version: 1
name: gpu-check
model: {arch: llama, layers: 8, hidden: 1024, heads: 16, kv_heads: 8, ffn_hidden: 2816, vocab: 32000, seq_len: 2048,
        tied_embeddings: false}
hardware: {preset: $preset, nodes: 1, gpus_per_node: 1}
parallel: {tp: 1, pp: 1, dp: 1, zero: 1}
training:
  global_batch: 8
  micro_batch: 4
  precision: $precision
  steps: 12
  optimizer: {name: adamw, lr: 3.0e-4}
  scheduler: {name: constant}
  checkpoint: {dir: $work/checkpoints, every: 0, resume: never}
EOF

echo "gpu_check: $gpu, predicted with hardware preset $preset" >&2
PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -m dsforge compile "$work/gpu-check.yaml" -o "$work/job"
bindir=$(dirname "$PYTHON")
export PATH="$bindir:$PATH" PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" DSFORGE_TIMEOUT_S=${DSFORGE_TIMEOUT_S:-300}
if ! bash "$work/job/launch.sh"; then
  echo "gpu_check: the training run failed (see above)" >&2
  exit 1
fi

"$PYTHON" - "$work/job" <<'EOF'
import json, sys
from pathlib import Path
job = Path(sys.argv[1])
plan, report = json.loads((job / "plan.json").read_text()), json.loads((job / "memory_report.json").read_text())
row = report["ranks"][0]
pred, meas = row["predicted"], row["measured"]
reserve = plan["summary"]["memory"]["stages"][0]["components"].get("reserve", 0.0) if plan.get("summary") else 0.0
gib = 1024 ** 3
print("                               predicted     measured")
print(f"peak tensors (GiB)          {(pred['peak'] - reserve) / gib:10.2f}   {meas['peak'] / gib:10.2f}"
      "   (estimate without its reserve; max_memory_allocated)")
print(f"peak incl. reserve (GiB)    {pred['peak'] / gib:10.2f}   {meas.get('max_reserved', 0) / gib:10.2f}"
      "   (estimate's device total; max_memory_reserved)")
for key in ("parameters", "gradients", "optimizer", "activations_per_micro_batch"):
    print(f"{key + ' (GiB)':<28}{pred[key] / gib:10.3f}   {(meas.get(key) or 0) / gib:10.3f}")
step = plan["summary"]["time"]["step_s"] if plan.get("summary") else float("nan")
print(f"step time (ms)              {step * 1000:10.1f}   {report['step_seconds_mean'] * 1000:10.1f}")
print(f"tokens/s                    {plan['summary']['time']['tokens_per_s'] if plan.get('summary') else 0:10.0f}"
      f"   {report['tokens_per_s_mean']:10.0f}")
EOF
