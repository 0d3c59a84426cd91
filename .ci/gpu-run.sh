#!/usr/bin/env bash
# The GPU check, run on the lent H200 (device tool) from the repo root:
#   GPU test suite with the soak (skips become failures), the benchmark, the quickstart on CUDA.
# Results land in $OUT (gpu-tests.log, bench/, quickstart.log).
set -uo pipefail
pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1 KVASYNC_REQUIRE_GPU=1 KVASYNC_SOAK_SECONDS=${KVASYNC_SOAK_SECONDS:-20}
OUT=${OUT:-gpu-out}; mkdir -p "$OUT/bench"
nvidia-smi -L | tee "$OUT/gpu-tests.log"
timeout ${TEST_TIMEOUT:-330} python3 -m pytest -q -ra -p no:cacheprovider -m "slow or not slow" tests ${PYTEST_ARGS:-} 2>&1 | tail -60 | tee -a "$OUT/gpu-tests.log"
timeout 60 python3 examples/quickstart.py 2>&1 | tee "$OUT/quickstart.log"
# The bench writes bench.json, bench.txt and the plots into $OUT/bench: copy them into
# docs/benchmarks/ (they replace the previous run's). BENCH_SECTIONS (comma separated, default
# all) splits a run that would not fit in one call; sections already done are saved as it goes.
timeout ${BENCH_TIMEOUT:-200} python3 -m kvasync.bench --out "$OUT/bench" --total-mib ${BENCH_MIB:-1024} \
  --reps ${BENCH_REPS:-2} ${BENCH_SECTIONS:+--sections "$BENCH_SECTIONS"} 2>&1 | tail -80 | tee "$OUT/bench.log"
