#!/usr/bin/env bash
# The GPU checks and figures, each step under a time limit so that what finished is kept. Run from the
# repository root on a machine with CUDA (on a lent one with .gpu/ beside the project, through .gpu/run.sh,
# which installs the project first):
#
#   bash .gpu/run.sh bash tools/gpu_checks.sh quick   # the most valuable checks in at most 7 minutes, install included
#   bash tools/gpu_checks.sh                          # everything but quick, in the order below: about 25 minutes
#   bash tools/gpu_checks.sh tests syncs latency      # named steps only: a device call of at most 10 minutes
#   bash tools/gpu_checks.sh steps                    #   takes each of these three parts
#   bash tools/gpu_checks.sh flex
#   bash .gpu/run.sh bash tools/gpu_checks.sh supernet  # the compiled supernets: their CUDA tests, their timing
#   bash .gpu/run.sh bash tools/gpu_checks.sh padding   # operands padded for the GPU's kernels: tests, WT103 timing
#   bash .gpu/run.sh bash tools/gpu_checks.sh seed      # the seed's training table, WT103 compiled, a wt2-seed search
#   bash .gpu/run.sh bash tools/gpu_checks.sh study     # a first study at wt2-par's GPU shape
#
# quick, in order of value: the most valuable CUDA tests (every command on CUDA, bf16, CUDA graphs against
# eager, the latency table by CUDA events; each under a minute where pytest-timeout is installed); gpu_step.py
# at WT103 base, the Transformer-XL in bf16, eager; gpu_step.py at wt2-par, eager against CUDA graphs
# (train.compile=reduce-overhead) beside the supernet, mixed and fair; a version-2 latency table of the train,
# inference and generate targets at wt2-par's GPU shapes. Then one table of every model timed: tokens/s,
# ms/step, MFU, peak memory ($OUT/table.md).
#
# The rest: tests (pytest -m gpu: every command on CUDA, resume, checkpoints across devices, bf16, syncs),
# syncs (benchmarks/host_syncs.py), steps (benchmarks/gpu_step.py: tokens/s, memory and MFU, bf16 and TF32,
# compiled, the loss's own grouping against the host's, the sampled supernet, heads of 41 padded or not, CUDA
# graphs for the Transformer-XL (its loss compiled, and eager) and the fair and mixed supernets, identity blocks against a shallower model;
# where the WT103 and the CUDA-graphed wt2-par steps spend their time, by the profiler), padding (operands
# padded to multiples of 8 off the CPU: the CUDA tests of a model padded against unpadded and of heads of 41 in
# SDPA's fused kernels, and WT103's eager step padded and not, profiled), supernet (the fair
# and mixed supernets under train.compile=reduce-overhead: their CUDA tests against eager, and wt2-par's steps
# eager against CUDA graphs, profiled), flex
# (gpu_step.py --flex: attention by FlexAttention against SDPA, eager and compiled, at WT103 base and the long
# shape), latency (quick's latency table).
#
# seed and study are one device call each, at most 9 minutes with the install (their limits add up to 500 s).
# seed: benchmarks/seed_table.py trains wt2-seed CUDA-graphed in bf16 to the largest of the seed's six step counts
# that fits (it times the second epoch, then decides) and writes $OUT/seed-table.md beside the seed's; then
# WT103-base compiled (reduce-overhead) against eager, after its compile (gpu_step.py: MFU, tokens/s, the compile's
# seconds); then the default search at wt2-seed for 300 steps, and its probability figure (parnas plot). study: a
# search at wt2-par's GPU shape at budget 0.65 with its final pick, priced by the wt2-par latency table timed on
# this GPU's kind (benchmarks/tables/), then benchmarks/gpu_study.py: retrains of the export, the Transformer-XL
# and the two depth-scaled front points around the export's cost, 2 seeds each, as many steps as fit, and the
# verdict with the seed spread ($OUT/study.md).
#
# Each step's output goes to $OUT/NAME.log as it runs (runs/gpu where OUT is not set), and a line to
# $OUT/summary.tsv as it ends (step, result: passed, failed or cut at its limit, exit status, seconds, limit);
# the GPU and torch to $OUT/device.txt. Exit status 0 when every step passed, 1 otherwise, 2 without a GPU.
# GPU_CHECKS_SCALE multiplies every limit, and the time seed's and study's scripts give themselves (tests run the
# plans with stand-in commands and tiny limits; GPU_CHECKS_SCALE=0.65 fits both calls in a 15-minute loan).
set -u
export PYTHONUNBUFFERED=1  # logs line by line: a step cut at its limit keeps what it printed
out=${OUT:-runs/gpu}
scale=${GPU_CHECKS_SCALE:-1}
known="quick tests syncs steps padding supernet flex latency seed study"
wanted=${*:-tests syncs steps padding supernet flex latency}

for name in $wanted; do
    case " $known " in *" $name "*) ;; *)
        echo "gpu_checks: unknown step '$name' (known: ${known// /, })" >&2; exit 2 ;; esac
done
[[ $scale =~ ^[0-9]*\.?[0-9]+$ && $scale =~ [1-9] ]] ||
    { echo "gpu_checks: GPU_CHECKS_SCALE=$scale is not a positive number (it multiplies every limit)" >&2; exit 2; }
command -v nvidia-smi >/dev/null || { echo "gpu_checks: no NVIDIA GPU here (nvidia-smi not found); run it on a GPU" \
    "machine: bash .gpu/run.sh bash tools/gpu_checks.sh quick" >&2; exit 2; }

mkdir -p "$out"
summary=$out/summary.tsv
printf 'step\tresult\texit\tseconds\tlimit\n' >"$summary"
failed=0 ran=0
begin=${EPOCHREALTIME//[.,]/}

wants() { case " $wanted " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }

step() {  # step NAME SECONDS COMMAND...: COMMAND under SECONDS x GPU_CHECKS_SCALE, if NAME's part is wanted
    local name=$1 limit_ms start ms rc result
    limit_ms=$(awk -v s="$2" -v k="$scale" 'BEGIN { printf "%d", s * k * 1000 }')
    local limit=$((limit_ms / 1000)).$(printf %03d $((limit_ms % 1000)))
    shift 2
    wants "${name%%-*}" || return 0
    echo "== $name (limit $limit s, $(date +%T)): $*"
    start=${EPOCHREALTIME//[.,]/}
    timeout -k 10 "$limit" "$@" >"$out/$name.log" 2>&1  # TERM at the limit, KILL 10 s later if still there
    rc=$?
    ms=$(( (${EPOCHREALTIME//[.,]/} - start) / 1000 ))
    case $rc in
        0) result=passed ;;
        124) result=cut ;;
        137) [ "$ms" -ge "$limit_ms" ] && result=cut || result=failed ;;  # KILLed after the limit, or by the kernel
        *) result=failed ;;
    esac
    printf '%s\t%s\t%s\t%d.%03d\t%s\n' "$name" "$result" "$rc" $((ms / 1000)) $((ms % 1000)) "$limit" >>"$summary"
    echo "   $result (exit $rc) after $((ms / 1000)).$(printf %03d $((ms % 1000))) s"
    tail -n 20 "$out/$name.log" | sed 's/^/   /'
    ran=$((ran + 1))
    [ "$rc" -eq 0 ] || failed=$((failed + 1))
}

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda)"; } 2>&1 | tee "$out/device.txt"

pytest_gpu=(python3 -m pytest -v --tb=short -m gpu -p no:cacheprovider --durations=10)
per_test=
if wants quick || wants tests || wants padding || wants supernet; then
    if python3 -c "import pytest_timeout" 2>/dev/null; then
        per_test=--timeout
    else  # the step's limit still stops the tests; -v has named each one that ended before it
        echo "pytest-timeout is not installed: no per-test limit, only the tests step's own"
    fi
fi
latency=(python3 -m parnas.cli latency --config wt2-par --set data.batch_size=32 --set data.seg_len=128
         --set model.mem_len=128 --set train.precision=bf16-mixed --out "$out/gpu-wt2-par-v2.json")

# quick's limits: 360 s, which with the install before it (.gpu/run.sh's pip install --no-deps -e .: 9 s on the
# 2-core development CPU) and the lines above makes about 6.5 minutes, so the one command ends within 7 even
# when every step is cut (a step that ignores TERM is KILLed 10 s later). From an H100 at e3d9426: a CUDA test
# takes about 16 s (the whole -m gpu set about 8 minutes, so quick picks 7 of them); a WT103 compile took over
# 110 s (quick times WT103 eager only: 3 models' builds took 4.6 s each); the wt2-par step with 5 eager models
# took 22 s (CUDA graphs add a compile of the 12-block model); the latency table decodes a short run of tokens
# per round now (it decoded some 8,000 before, and was cut at 55 s), timed by CUDA events. At 276e6c8 on an H100
# (benchmarks/tables/README.md) every step finished, in 284 s: tests 136 s, WT103 20 s, wt2-par 75 s (48 s of it
# the CUDA-graphed model's compile), latency 47 s (three unsteady tries then; one try since). On an H200 at
# 35e0848 (2026-11-28), in 323 s: tests 160 s, WT103 21 s, wt2-par 84 s (54 s compiling; the fair supernet
# added), latency 39 s (the tokenizer trained first): the limits below keep that much and more room (WT103 the
# least: two eager models, padded and not, about 28 s by those times), and still add up to 360 s.
quick_k="test_search_export_retrain_evaluate_generate_compare_on_cuda or test_cuda_bf16_retrain_and_evaluate"
quick_k+=" or test_cuda_graphs_train_like_eager or test_a_cuda_graphed_retrain or test_on_cuda_a_table_is_timed_by_events"
step quick-tests 185 "${pytest_gpu[@]}" -k "$quick_k" ${per_test:+"$per_test=60"}
step quick-wt103 35 python3 benchmarks/gpu_step.py --shape wt103-base --no-supernet --unpadded --rounds 3
step quick-wt2par 95 python3 benchmarks/gpu_step.py --shape wt2-par --compile reduce-overhead --fair --unpadded \
    --rounds 5
step quick-latency 45 "${latency[@]}"

step tests 360 "${pytest_gpu[@]}" ${per_test:+"$per_test=150"}
step syncs 40 python3 benchmarks/host_syncs.py
step steps-wt103-bf16 160 python3 benchmarks/gpu_step.py --shape wt103-base --compile default --groups-on-device \
    --unpadded --rounds 5 --profile
step steps-wt103-tf32 60 python3 benchmarks/gpu_step.py --shape wt103-base --precision tf32 --unpadded --rounds 5
step steps-wt2par 70 python3 benchmarks/gpu_step.py --shape wt2-par --groups-on-device --sampled --fair \
    --layout AIAIIIAIIDDD --layout ADADAD --rounds 5
# two compiles of about 50 s each on an H200: the CUDA-graphed step with its loss compiled, and with it eager
step steps-graphs-wt2par 160 python3 benchmarks/gpu_step.py --shape wt2-par --compile reduce-overhead --eager-loss \
    --rounds 5 --profile
step steps-graphs-wt103 150 python3 benchmarks/gpu_step.py --shape wt103-base --compile reduce-overhead --rounds 5
step steps-nvidia 40 python3 benchmarks/gpu_step.py --shape nvidia-base --shape long --rounds 5
step padding-tests 60 "${pytest_gpu[@]}" tests/nn/test_alignment.py tests/gpu/test_gpu.py -k "padded or heads_of_41" \
    ${per_test:+"$per_test=30"}
step padding-wt103 45 python3 benchmarks/gpu_step.py --shape wt103-base --no-supernet --unpadded --rounds 3 --profile
step supernet-tests 150 "${pytest_gpu[@]}" tests/strategies/test_compiled_search.py ${per_test:+"$per_test=100"}
# three compiles of 40-90 s each on an H200 (the Transformer-XL's took 46 s; the supernets run every candidate)
step supernet-wt2par 330 python3 benchmarks/gpu_step.py --shape wt2-par --compile reduce-overhead --fair \
    --compile-supernet --unpadded --rounds 5 --profile
step flex-wt103 110 python3 benchmarks/gpu_step.py --shape wt103-base --flex --compile default --rounds 5
step flex-long 60 python3 benchmarks/gpu_step.py --shape long --flex --rounds 5
step latency 80 "${latency[@]}"

# seed: the training 290 s (benchmarks/seed_table.py keeps 15 s of it for its final evaluation and exit), WT103 130 s
# (its compile under reduce-overhead: over 110 s at e3d9426, since cut to about 0.61x; two eager models' builds take
# some 10 s), the search 70 s (first step 14-18 s on a warm H200 with its tokenizer cached, which the training
# step leaves; 300 fair steps, then the final pick; the seed's 4,000 warm-up steps scaled to 20, as 7% of the
# steps), the figure 10 s: 500 s.
# A device call brings back at most 8 files of $OUT, none deeper than two folders: seed's and study's runs
# (checkpoints of tens of MiB, TensorBoard logs) go to a folder of their own, and what they found is copied to
# $OUT at the end. seed leaves 8 files there: device.txt, summary.tsv, its 4 logs, seed-table.md and
# probabilities.png; study 6: device.txt, summary.tsv, its 2 logs, study.md and study-architecture.json.
work=$out/work
if wants seed || wants study; then work=$(mktemp -d "${TMPDIR:-/tmp}/gpu_checks.XXXXXX"); fi
scaled() { awk -v s="$1" -v k="$scale" 'BEGIN { printf "%g", s * k }'; }  # a script's own --seconds, as its limit
step seed-train 290 python3 benchmarks/seed_table.py --seconds "$(scaled 275)" --out "$work/seed"
step seed-wt103 130 python3 benchmarks/gpu_step.py --shape wt103-base --compile reduce-overhead --no-supernet \
    --rounds 3
step seed-search 70 python3 -m parnas.cli search --config wt2-seed --set train.precision=bf16-mixed \
    --set train.max_steps=300 --set train.warmup_steps=20 --set search.out_dir="$work/seed-search"
step seed-plot 10 python3 -m parnas.cli plot "$work/seed-search" --no-tensorboard

# study at wt2-par's GPU shape (the H100 and H200 logs in benchmarks/tables/): its search 120 s (a 200-step fair
# search took 13 s for its steps and 28 s for its pick on an H200, its first step 14-16 s on a warm machine and 32 s
# on a fresh H100; this one 300 steps, its pick's rounds 150 and 300, no table to time), its retrains 370 s
# (benchmarks/gpu_study.py sizes their steps to the 355 s it is given): 490 s.
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1)
case $gpu in
    *H100*) wt2par_table=benchmarks/tables/h100-wt2-par-v2.json ;;
    *H200*) wt2par_table=benchmarks/tables/h200-wt2-par-v2.json ;;
    *) wt2par_table= ;;  # another GPU: the search times its own table (some 10-40 s more)
esac
study_shape=(--config wt2-par --set data.batch_size=32 --set data.seg_len=128 --set model.mem_len=128
             --set train.precision=bf16-mixed)
step study-search 120 python3 -m parnas.cli search "${study_shape[@]}" --set search.par-gumbel-darts.latency_budget=0.65 \
    --set train.max_steps=300 ${wt2par_table:+--set "search.latency_table=$wt2par_table"} \
    --set search.out_dir="$work/study-search"
step study-retrain 370 python3 benchmarks/gpu_study.py --search "$work/study-search" --seconds "$(scaled 355)" \
    --out "$work/study" "${study_shape[@]}" ${wt2par_table:+--latency-table "$wt2par_table"}
for found in seed/seed-table.md:seed-table.md seed-search/probabilities.png:probabilities.png \
             study/study.md:study.md study-search/architecture.json:study-architecture.json; do
    [ -f "$work/${found%%:*}" ] && cp "$work/${found%%:*}" "$out/${found##*:}"
done

table() {  # one Markdown table of every model gpu_step.py timed in the logs given (its rows, parsed)
    awk 'FNR == 1 { step = FILENAME; sub(/.*\//, "", step); sub(/\.log$/, "", step) }
        /^[a-z0-9-]+: .* layers, d_model/ { shape = $1; sub(/:$/, "", shape) }
        / tokens\/s +[0-9.]+ ms\/step +peak / {
            match($0, /[0-9,]+ tokens\/s/); tps = substr($0, RSTART, RLENGTH - 9)
            name = substr($0, 1, RSTART - 1); gsub(/^ +| +$/, "", name)
            match($0, /[0-9.]+ ms\/step/); ms = substr($0, RSTART, RLENGTH - 8)
            match($0, /peak +[0-9.]+ GiB/); peak = substr($0, RSTART + 5, RLENGTH - 9); gsub(/ /, "", peak)
            mfu = "-"; if (match($0, /MFU [0-9.]+%/)) mfu = substr($0, RSTART + 4, RLENGTH - 4)
            if (!rows++) print "| step | shape | model | tokens/s | ms/step | MFU | peak GiB |\n|---|---|---|---:|---:|---:|---:|"
            printf "| %s | %s | %s | %s | %s | %s | %s |\n", step, shape, name, tps, ms, mfu, peak
        }' "$@"
}
logs=()
for log in "$out"/quick-wt*.log "$out"/steps-*.log "$out"/padding-wt*.log "$out"/supernet-wt*.log "$out"/flex-*.log; do [ -f "$log" ] && logs+=("$log"); done
if [ ${#logs[@]} -gt 0 ] && table "${logs[@]}" >"$out/table.md" && [ -s "$out/table.md" ]; then
    echo "every model timed (also in $out/table.md):"
    cat "$out/table.md"
fi

ms=$(( (${EPOCHREALTIME//[.,]/} - begin) / 1000 ))
echo "gpu_checks: $ran steps, $((ran - failed)) passed, $failed failed or cut, in $((ms / 1000)) s; logs in $out"
[ "$failed" -eq 0 ]
