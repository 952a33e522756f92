#!/usr/bin/env bash
# Every check and figure the GPU work needs, in about 20 minutes on one GPU, each step under a time limit so that
# what finished is kept. Logs (one per step) and the generation latency table go to $OUT, or to runs/gpu where OUT
# is not set. Run from the repository root on a machine with CUDA:
#
#   bash tools/gpu_checks.sh                       # everything, in the order below
#   bash tools/gpu_checks.sh tests syncs latency   # named steps only: a device call of at most 10 minutes
#   bash tools/gpu_checks.sh steps                 #   takes each of these three parts
#   bash tools/gpu_checks.sh flex
#
# Steps: tests (pytest -m gpu: every command on CUDA, resume, checkpoints across devices, bf16, syncs),
# syncs (benchmarks/host_syncs.py), steps (benchmarks/gpu_step.py: tokens/s, memory and MFU, bf16 and TF32,
# compiled, the loss's own grouping against the host's, the sampled supernet, heads of 41 padded or not, CUDA graphs, identity blocks
# against a shallower model), flex (gpu_step.py --flex: attention by FlexAttention against SDPA, eager and
# compiled, at WT103 base and the long shape), latency (a version-2 latency table of the train, inference and generate targets at
# wt2-par's GPU shapes, for a study priced by it on any machine).
set -u
out=${OUT:-runs/gpu}
mkdir -p "$out"
wanted=${*:-tests syncs steps flex latency}
failed=0

step() {  # step NAME SECONDS COMMAND...: runs COMMAND under a limit, its output in $out/NAME.log
    local name=$1 limit=$2
    shift 2
    case " $wanted " in *" ${name%%-*} "*) ;; *) return 0 ;; esac
    echo "== $name ($(date +%T)): $*"
    local start=$SECONDS rc
    timeout "$limit" "$@" >"$out/$name.log" 2>&1
    rc=$?
    echo "   exit $rc after $((SECONDS - start)) s"
    tail -n 20 "$out/$name.log" | sed 's/^/   /'
    [ "$rc" -eq 0 ] || failed=1
}

command -v nvidia-smi >/dev/null || { echo "gpu_checks: no NVIDIA GPU here (nvidia-smi not found)" >&2; exit 2; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda)"
step tests 360 python3 -m pytest -v --tb=short -m gpu -p no:cacheprovider --timeout 150 --durations=10
step syncs 40 python3 benchmarks/host_syncs.py
step steps-wt103-bf16 150 python3 benchmarks/gpu_step.py --shape wt103-base --compile default --groups-on-device \
    --unpadded-heads --rounds 5
step steps-wt103-tf32 60 python3 benchmarks/gpu_step.py --shape wt103-base --precision tf32 --unpadded-heads --rounds 5
step steps-wt2par 70 python3 benchmarks/gpu_step.py --shape wt2-par --groups-on-device --sampled \
    --layout AIAIIIAIIDDD --layout ADADAD --rounds 5
step steps-graphs-wt2par 90 python3 benchmarks/gpu_step.py --shape wt2-par --compile reduce-overhead --rounds 5
step steps-graphs-wt103 150 python3 benchmarks/gpu_step.py --shape wt103-base --compile reduce-overhead --rounds 5
step steps-nvidia 40 python3 benchmarks/gpu_step.py --shape nvidia-base --shape long --rounds 5
step flex-wt103 110 python3 benchmarks/gpu_step.py --shape wt103-base --flex --compile default --rounds 5
step flex-long 60 python3 benchmarks/gpu_step.py --shape long --flex --rounds 5
step latency 80 python3 -m parnas.cli latency --config wt2-par --set data.batch_size=32 --set data.seg_len=128 \
    --set model.mem_len=128 --set train.precision=bf16-mixed --out "$out/gpu-wt2-par-v2.json"
exit "$failed"
