#!/usr/bin/env bash
# The H200 benchmark, prepared to run in device calls of one part each (issues 2-4, 7, 8):
#
#   run(command="bash benchmarks/h200.sh full targets", carry=[".whl", ".peers"], timeout_s=590)
#
# after `bash ../shared/gpu/wheels.sh` (fills .whl/) and `cp -r ../shared/peers .peers`.
# Each line of $OUT/results.jsonl is one measurement (ours from `python -m paisoar_jax.bench`,
# the PyTorch peers' own JSON), tagged with its name; $OUT/log holds everything printed.
# Ours carry "estimate": what `plan --target h200` predicts for the very program that ran
# (step_ms, mfu, measured_over_estimated), so each line is predicted beside measured.
# `bash benchmarks/h200.sh tiny` dry-runs the same steps here on a CPU with tiny shapes.
# A second argument picks a part; one part fits one device call, most important first:
#   targets   gpt2_124m and gpt_1b in bf16 and fp16 beside the PyTorch compile peer (issue 7)
#   variants  fp8, XLA attention, remat dots, fp32, XLA flags, the fp32 eager peer, the input
#             pipeline
#   vision    ResNet-50 and ViT-B/16 beside the PyTorch ResNet-50 peer (issue 8)
#   all       the three in order (too long for one device call at full size)
#   first     one call's worth when little device time is left: the shipped gpt2_124m beside
#             both peers (plain JAX, PyTorch compile), then with the logits whole and scanned
#             (issue 48), gpt_1b and ResNet-50 (its shipped data.workers=8) beside their peers
# Each result line is written as it comes, so a call cut short keeps what finished.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/h200_out}
mkdir -p "$OUT"
SIZE=${1:-full}
PART=${2:-all}
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" > /dev/null; then  # the GPU machine lacks grain and array-record
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
fi
exec > >(tee -a "$OUT/log") 2>&1
python3 -c "import jax; print('devices', jax.devices())"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || true

if [ "$SIZE" = tiny ]; then
  SHAPE=(model.layers=2 model.width=64 model.heads=4 model.seq_len=64 model.vocab_size=512
         train.global_batch=8)
  STEPS=(train.steps=6 train.log_every=2)
  CUDNN=model.attention=xla  # cuDNN attention is refused off-GPU
else
  SHAPE=()
  STEPS=(train.steps=60 train.log_every=10)
  CUDNN=model.attention=cudnn
fi

ITEM_S=${ITEM_S:-300}
record() {  # record NAME COMMAND...: runs it (ITEM_S seconds at most) and keeps its last JSON line
  local name=$1
  shift
  echo "== $name ($(date +%T)): $*"
  local line
  line=$(timeout "$ITEM_S" "$@" | grep '^{' | tail -1)
  if [ -n "$line" ]; then
    echo "{\"name\": \"$name\", \"result\": $line}" | tee -a "$OUT/results.jsonl"
  else
    echo "{\"name\": \"$name\", \"result\": null}" | tee -a "$OUT/results.jsonl"
  fi
}

ours() {  # ours NAME CONFIG OVERRIDES...
  local name=$1 config=$2
  shift 2
  record "$name" python3 -m paisoar_jax.bench --config "$config" "${SHAPE[@]}" "${STEPS[@]}" "$@"
}

if [ "$PART" = first ]; then
ours gpt2_shipped gpt2_124m  # as a user runs it: unrolled, the loss in slices (auto)
if [ "$SIZE" != tiny ]; then
  record peer_gpt2_jax python3 .peers/gpt_jax.py cudnn
  record peer_gpt2_bf16_compile python3 .peers/gpt_torch.py bf16_compile
fi
ours gpt2_logits_whole gpt2_124m model.loss_chunks=0
ours gpt2_scanned gpt2_124m model.scan_layers=true
if [ "$SIZE" != tiny ]; then
  ours gpt1b_shipped gpt_1b train.steps=30
  record peer_gpt1b_jax env L=24 D=2048 H=16 T=2048 B=8 python3 .peers/gpt_jax.py cudnn
  record peer_gpt1b_bf16_compile env L=24 D=2048 H=16 T=2048 B=8 \
    python3 .peers/gpt_torch.py bf16_compile
  record resnet50_bf16 python3 -m paisoar_jax.bench --config resnet50 train.steps=60
  record peer_resnet50_compile python3 .peers/resnet_torch.py compile
fi
fi

if [ "$PART" = targets ] || [ "$PART" = all ]; then
# Issue 7's targets first: gpt2_124m (B=16, T=1024) and gpt_1b (L24 D2048 T2048 B=8) in bf16
# and fp16, each beside the PyTorch bf16 + torch.compile peer.
ours gpt2_bf16_cudnn gpt2_124m precision.policy=bf16 "$CUDNN"
ours gpt2_bf16_cudnn_bf16_logits gpt2_124m precision.policy=bf16 "$CUDNN" model.fp32_logits=false
ours gpt2_fp16_cudnn gpt2_124m precision.policy=fp16 "$CUDNN"
if [ "$SIZE" != tiny ]; then
  record peer_gpt2_bf16_compile python3 .peers/gpt_torch.py bf16_compile
  ours gpt1b_bf16_cudnn gpt_1b precision.policy=bf16 "$CUDNN" train.steps=30
  ours gpt1b_fp16_cudnn gpt_1b precision.policy=fp16 "$CUDNN" train.steps=30
  record peer_gpt1b_bf16_compile env L=24 D=2048 H=16 T=2048 B=8 \
    python3 .peers/gpt_torch.py bf16_compile
fi
fi

if [ "$PART" = variants ] || [ "$PART" = all ]; then
# What each setting changes (the variants table of RESULTS.md), fp8, and the input pipeline.
ours gpt2_fp8_cudnn gpt2_124m precision.policy=fp8 "$CUDNN"
ours gpt2_bf16_auto gpt2_124m  # the shipped config as a user runs it: "attention" says what auto took
ours gpt2_bf16_xla gpt2_124m precision.policy=bf16 model.attention=xla
ours gpt2_bf16_cudnn_dots gpt2_124m precision.policy=bf16 "$CUDNN" remat.policy=dots
ours gpt2_bf16_cudnn_unrolled gpt2_124m precision.policy=bf16 "$CUDNN" model.scan_layers=false
ours gpt2_fp32 gpt2_124m precision.policy=fp32 model.attention=xla
# XLA GPU flags, one at a time against gpt2_bf16_cudnn: command buffers (CUDA graphs, on by
# default) off, and the latency-hiding scheduler on (it matters once there are collectives).
record gpt2_bf16_cudnn_no_command_buffers env XLA_FLAGS=--xla_gpu_enable_command_buffer= \
  python3 -m paisoar_jax.bench --config gpt2_124m "${SHAPE[@]}" "${STEPS[@]}" "$CUDNN"
record gpt2_bf16_cudnn_latency_hiding env XLA_FLAGS=--xla_gpu_enable_latency_hiding_scheduler=true \
  python3 -m paisoar_jax.bench --config gpt2_124m "${SHAPE[@]}" "${STEPS[@]}" "$CUDNN"
if [ "$SIZE" != tiny ]; then
  ours gpt1b_fp8_cudnn gpt_1b precision.policy=fp8 "$CUDNN" train.steps=30
  ours gpt1b_bf16_cudnn_bf16_logits gpt_1b precision.policy=bf16 "$CUDNN" \
    model.fp32_logits=false train.steps=30
  record peer_gpt2_fp32_eager python3 .peers/gpt_torch.py fp32_eager
fi
# The input pipeline alone (issue 4): 16 cores, gpt2_124m's batch shape.
record data_synthetic python3 -m paisoar_jax.bench --data-only --config gpt2_124m "${SHAPE[@]}"
record data_embedded_w8 python3 -m paisoar_jax.bench --data-only --config gpt2_124m \
  "${SHAPE[@]}" data.source=embedded model.vocab_size=50304 data.workers=8
fi

if [ "$PART" = vision ] || [ "$PART" = all ]; then
# ResNet-50 and ViT-B/16 at B=256, 224 px, bf16, synthetic images (issue 8), then the peer.
if [ "$SIZE" = tiny ]; then
  record resnet_tiny python3 -m paisoar_jax.bench --config resnet_tiny train.steps=6
  record vit_tiny python3 -m paisoar_jax.bench --config vit_tiny data.source=synthetic \
    train.steps=6
else
  record resnet50_bf16 python3 -m paisoar_jax.bench --config resnet50 train.steps=60
  record vit_b16_bf16 python3 -m paisoar_jax.bench --config vit_b16 train.steps=60
  record data_resnet50_w8 python3 -m paisoar_jax.bench --data-only --config resnet50 \
    --batches 50
  record peer_resnet50_compile python3 .peers/resnet_torch.py compile
  record peer_resnet50_eager python3 .peers/resnet_torch.py
fi
fi
echo "== done: $(wc -l < "$OUT/results.jsonl") results in $OUT/results.jsonl"
