#!/usr/bin/env bash
# The prepared GPU data-plane run (benchmarks/gpu_dataplane.py): LLaDA-8B and LLaDA2.0-mini
# shapes with random bf16 weights on one GPU, under 8 minutes on one H200. Run from the
# repository root without installing (PYTHONPATH), as gpu_check.sh does; the run folder goes
# under $OUT (default runs/), and the log to $OUT/gpu_dataplane.log.
#
#     bash benchmarks/gpu_dataplane.sh
#     DEADLINE=60 bash benchmarks/gpu_dataplane.sh --smoke        # the same path on a CPU
#
# The published decoders run beside the engine when their code is on the machine:
# FASTDLLM_CODE (Fast-dLLM's llada/ folder) and LLADA2_CODE (a folder with LLaDA2's
# modeling_llada2_moe.py, e.g. ZHZisZZ/dllm's dllm/pipelines/llada2/models); by default
# shared/published/Fast-dLLM/llada and shared/published/dllm/dllm/pipelines/llada2/models.
# SITE: a folder with what that code wants and the machine may lack (transformers 4.5x, einops;
# pip install --target), put on PYTHONPATH. Without them the summary says what was skipped.
set -u
OUT=${OUT:-runs}
DEADLINE=${DEADLINE:-400}  # the script's own budget; `timeout` stops it 60 s after, whatever
FASTDLLM_CODE=${FASTDLLM_CODE:-shared/published/Fast-dLLM/llada}
LLADA2_CODE=${LLADA2_CODE:-shared/published/dllm/dllm/pipelines/llada2/models}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${SITE:+:$SITE}${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
args=(--deadline "$DEADLINE" --out "$OUT")
[ -d "$FASTDLLM_CODE" ] && args+=(--fastdllm-code "$FASTDLLM_CODE")
[ -d "$LLADA2_CODE" ] && args+=(--llada2-code "$LLADA2_CODE")
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total --format=csv
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
timeout $((${DEADLINE%.*} + 60)) python3 benchmarks/gpu_dataplane.py "${args[@]}" "$@" \
    2>&1 | tee "$OUT/gpu_dataplane.log"
echo "exit status: ${PIPESTATUS[0]} (124: stopped by timeout; summary.json holds what was done)"
