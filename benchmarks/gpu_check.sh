#!/usr/bin/env bash
# The one prepared run for a lent GPU: bash benchmarks/gpu_check.sh   (about 9 minutes at most)
#
#   1. nvidia-smi and the Python stack (torch, CUDA, triton, the GPU);
#   2. fla (package flash-linear-attention, import name fla): installed from wheels in $FLA_WHEELS
#      (default .whl/, carried to the machine) when there are any, else `pip install` is tried
#      (the lent machines reach no registry: the fla rows then say "not installed");
#   3. the Triton path against the PyTorch reference on CUDA, fp32 (benchmarks/kernel_bench.py --parity).
#      This stands in for the tests/test_kernels*.py files, which cannot test the GPU: they set
#      TRITON_INTERPRET=1 themselves and build CPU tensors, so under pytest they always run the
#      interpreter on the CPU;
#   4. decode on the GPU: the test that holds the CUDA-graph step (compile_step on CUDA) to the eager
#      one, then the bundled model converted to hybrid, `rnnify bench` against the original on the GPU,
#      eager and with --compile (the step captured as a CUDA graph), batch 1 and 8 at 256 and 1,024
#      tokens (JSON: bench-cuda-hybrid{,-compile}.json);
#   5. python benchmarks/kernel_bench.py $BENCH_ARGS, by default --preset issue (it stops starting rows
#      after 300 s; BENCH_ARGS="--preset smoke" tries this script on any machine), in the time left;
#   6. results (JSON, PNG, parity JSON, this log) copied to benchmarks/results/ and to $OUT if set.
#
# TRITON_INTERPRET must be unset before triton is imported, or the kernels are built for the
# interpreter (rnnify.kernels.utils reads it once; triton decides at @triton.jit) and the benchmark
# refuses to time them. RNNIFY_FORCE_TRITON is unset too: the benchmark pins backend= per row.
# Exit status: 0 when the parity check, the decode checks and the benchmark passed, else 1.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
unset TRITON_INTERPRET RNNIFY_FORCE_TRITON
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
LIMIT=${GPU_CHECK_SECONDS:-540}
BENCH_ARGS=${BENCH_ARGS:---preset issue}
RUN=$(mktemp -d)

# step NAME CAP CMD...: CMD under a timeout of CAP seconds, less if the whole run's time is short
step() {
    local name=$1 cap=$2 t rc
    shift 2
    t=$((LIMIT - SECONDS - 20))
    ((t > cap)) && t=$cap
    if ((t < 10)); then
        echo "== $name: not started, ${LIMIT}s nearly spent"
        return 124
    fi
    echo "== $name (at ${SECONDS}s, timeout ${t}s)"
    timeout --kill-after=10 "$t" "$@"
    rc=$?
    echo "== $name: exit $rc at ${SECONDS}s"
    return $rc
}

# into a folder of its own, never the machine's site-packages; --no-deps: torch and triton stay as they are
install_fla() {
    local wheels=${FLA_WHEELS:-.whl} site
    site=$(mktemp -d)
    if compgen -G "$wheels/*.whl" >/dev/null; then
        step "install fla from $wheels" 60 "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$site" "$wheels"/*.whl
    else
        step "pip install flash-linear-attention" 60 \
            "$PY" -m pip install -q --retries 0 --timeout 5 --no-deps --target "$site" fla-core flash-linear-attention
    fi
    export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
    "$PY" -c "import fla; print('fla', fla.__version__)" || echo "fla: not installed; its rows will say so"
}

# the decode step on the GPU: the CUDA-graph test, then rnnify bench eager and compiled (CUDA graphs)
decode_on_gpu() {
    local model=examples/models/stdlib-llama rc=0 flag
    # TRITON_INTERPRET=0: tests/conftest.py sets it to 1 only where it is unset
    step "CUDA-graph step against the eager one" 120 env TRITON_INTERPRET=0 "$PY" -m pytest -q -n 0 \
        -p no:cacheprovider tests/test_bench.py -k cuda_graph || rc=1
    step "convert the bundled model to hybrid" 60 "$PY" -m rnnify convert "$model" --to hybrid \
        -o "$RUN/llama-hybrid" --no-compile || return 1
    for flag in "" --compile; do
        step "rnnify bench on the GPU ${flag:-eager}" 90 "$PY" -m rnnify bench "$RUN/llama-hybrid" --against "$model" \
            --device cuda --contexts 256,1024 --batch 1,8 $flag --json "$RUN/bench-cuda-hybrid${flag:+-compile}.json" || rc=1
    done
    rm -rf "$RUN/llama-hybrid"
    return $rc
}

main() {
    local parity_rc decode_rc bench_rc bench_cap json
    step "nvidia-smi" 20 nvidia-smi
    step "python stack" 60 "$PY" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'triton', triton.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'NO CUDA DEVICE')"
    install_fla
    step "parity: Triton vs reference on CUDA, fp32" 150 "$PY" benchmarks/kernel_bench.py --parity --out "$RUN"
    parity_rc=$?
    decode_on_gpu
    decode_rc=$?
    bench_cap=$((LIMIT - SECONDS - 50))  # leaves time to replot what a killed run kept
    ((bench_cap > 420)) && bench_cap=420
    # shellcheck disable=SC2086  # BENCH_ARGS is a list of arguments
    step "benchmark $BENCH_ARGS" "$bench_cap" "$PY" benchmarks/kernel_bench.py $BENCH_ARGS --out "$RUN"
    bench_rc=$?
    json=$(find "$RUN" -name 'kernels-*.json' ! -name 'kernels-parity-*' | head -n 1)
    if ((bench_rc != 0)) && [[ -n $json ]]; then  # killed or crashed: draw what the JSON kept
        step "replot $json" 60 "$PY" benchmarks/kernel_bench.py --replot "$json"
    fi
    echo "== parity exit $parity_rc, decode exit $decode_rc, benchmark exit $bench_rc, ${SECONDS}s"
    ((parity_rc == 0 && decode_rc == 0 && bench_rc == 0))
}

main 2>&1 | tee "$RUN/gpu_check.log"
rc=${PIPESTATUS[0]}
mkdir -p benchmarks/results
cp "$RUN"/kernels-* "$RUN"/bench-cuda-* benchmarks/results/ 2>/dev/null
if [[ -n ${OUT:-} ]]; then
    cp "$RUN"/* "$OUT"/
fi
echo "results in $RUN, copied to benchmarks/results${OUT:+ and $OUT}:"
ls -l "$RUN"
exit "$rc"
