#!/usr/bin/env bash
# The GPU smoke run on a lent GPU machine (docs/gpu.md, "Run the server on a lent GPU"), after
# `make gpu-kit` here:   run(carry=["gpu-kit"], command="bash tools/gpu_smoke.sh", timeout_s=540)
# Installs gpu-kit/'s wheels into a folder of their own and sgl-kvevict (editable, offline) into the
# machine's Python, then tools/gpu_smoke.py runs the checks and writes $OUT/gpu_smoke.md; the whole run
# ends within SMOKE_BUDGET_SECONDS (default 510; a rehearsal 1210: CPU-mode servers start slowly), the
# report keeping what was found by then.
#   bash tools/gpu_smoke.sh --rehearsal | --dry-run    on a CPU machine, in this venv (nothing installed)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-smoke-out}
PYTHON=${PYTHON:-python3}
case " $* " in
    *" --rehearsal "*) BUDGET=${SMOKE_BUDGET_SECONDS:-1210} ;;
    *) BUDGET=${SMOKE_BUDGET_SECONDS:-510} ;;
esac
SITE=${SMOKE_SITE:-/tmp/gpu-kit-site}
mkdir -p "$OUT"
started=$SECONDS

install_kit() {
    [ -d gpu-kit/wheels ] || { echo "no gpu-kit/wheels: run make gpu-kit, then carry gpu-kit"; return 1; }
    "$PYTHON" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile --target "$SITE" gpu-kit/wheels/*.whl &&
    "$PYTHON" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-build-isolation -e .
}

if [ $# -eq 0 ]; then
    echo "[smoke] installing gpu-kit/ into $SITE and sgl-kvevict into $PYTHON"
    if install_kit > "$OUT/install.log" 2>&1; then
        install="ok:$((SECONDS - started))"
    else
        install="failed:$(tail -n 3 "$OUT/install.log" | tr '\n' ' ' | cut -c1-300)"
    fi
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
else
    install="this venv ($*)"
fi
# What lets a Llama forward run without the real sgl_kernel (docs/gpu.md).
export SGLANG_FORCE_FUSED_OP_BACKEND=torch SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1 PYTHONUNBUFFERED=1
# FlashInfer's JIT calls nvcc: where the CUDA toolkit is installed but not on PATH, put it there.
if ! command -v nvcc > /dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then
    export PATH="/usr/local/cuda/bin:$PATH" CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
fi
left=$((BUDGET - (SECONDS - started)))
# SIGTERM at the budget lets the driver stop its server and finish the report; SIGKILL 20 s later.
timeout --signal=TERM --kill-after=20 "$left" "$PYTHON" tools/gpu_smoke.py --out "$OUT" --budget "$((left - 10))" --install "$install" "$@"
code=$?
[ $code -eq 124 ] && echo "[smoke] stopped at the budget of $BUDGET s; the report has what was found"
exit $code
