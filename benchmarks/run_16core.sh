#!/usr/bin/env bash
# The thread sweep of docs/BENCHMARKS.md on a many-core machine, in one go: build and
# install this checkout, then time microtensor and PyTorch eager at 1, 2, 4, 8 and 16
# threads in one process (tiny, cpu and mid configs, 3 rounds), with OpenBLAS left to
# pick its own kernel as on a user's machine; then tiny and cpu again with
# OMP_WAIT_POLICY=PASSIVE. Thread counts above the machine's CPUs are skipped.
#
#   bash benchmarks/run_16core.sh                 # from anywhere; results in ./out-bench
#   OUT=/path/to/results bash benchmarks/run_16core.sh
#
# Writes to $OUT (default out-bench/ in the repository): machine.txt (lscpu, uptime),
# sweep.jsonl / sweep.txt / scaling.png, and sweep_passive.jsonl / sweep_passive.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-out-bench}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)

{ lscpu; echo; uptime; echo; "$PY" --version; } > "$OUT/machine.txt" 2>&1 || true
echo "# building (about 2 minutes)"
"$PY" -m pip install --no-build-isolation --no-deps --no-index . > "$OUT/build.log" 2>&1 \
    || { tail -30 "$OUT/build.log"; exit 1; }

# the scripts import the installed package (the source folder is not on sys.path)
BENCH=(env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE "$PY" benchmarks/bench_train.py --strict-quiet)
echo "# sweep, load average: $(cut -d' ' -f1-3 /proc/loadavg)"
"${BENCH[@]}" --config tiny,cpu,mid --threads 1,2,4,8,16 --rounds 3 \
    --json "$OUT/sweep.jsonl" --plot "$OUT/scaling.png" | tee "$OUT/sweep.txt"
echo "# OMP_WAIT_POLICY=PASSIVE, load average: $(cut -d' ' -f1-3 /proc/loadavg)"
OMP_WAIT_POLICY=PASSIVE "${BENCH[@]}" --config tiny,cpu --threads 1,2,4,8,16 --rounds 3 \
    --json "$OUT/sweep_passive.jsonl" --plot "$OUT/scaling_passive.png" | tee "$OUT/sweep_passive.txt"
uptime >> "$OUT/machine.txt"
echo "# results in $OUT"
