#!/usr/bin/env bash
# Set up DeepInfer: a virtual environment with deepinfer-core and the backend DEEPINFER_ACCELERATOR names.
#
#   DEEPINFER_ACCELERATOR=nvidia|ascend|cpu ./build.sh [--dev]
#
#   --dev   also install the test tools and every in-repo backend package (without hardware extras),
#           so the test suite can check all of them; this is what CI uses.
# Environment: DEEPINFER_VENV (default .venv) is created if missing, reused otherwise.
set -euo pipefail
cd "$(dirname "$0")"

accel="${DEEPINFER_ACCELERATOR:-cpu}"
venv="${DEEPINFER_VENV:-.venv}"
dev=0
for arg in "$@"; do
  case "$arg" in
    --dev) dev=1 ;;
    *) echo "build.sh: unknown argument '$arg' (expected --dev)" >&2; exit 2 ;;
  esac
done
case "$accel" in
  nvidia|ascend|cpu) ;;
  *) echo "build.sh: DEEPINFER_ACCELERATOR='$accel' is not one of nvidia, ascend, cpu" >&2; exit 2 ;;
esac

python="${PYTHON:-python3}"
if [ ! -x "$venv/bin/python" ]; then
  echo "build.sh: creating $venv with $("$python" --version)"
  # --system-site-packages lets a GPU host reuse its preinstalled torch / triton.
  if [ "$accel" = cpu ]; then "$python" -m venv "$venv"; else "$python" -m venv --system-site-packages "$venv"; fi
fi
pip=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check)

if ! "$venv/bin/python" -c "import torch" 2>/dev/null; then
  if [ "$accel" = cpu ]; then
    # The CPU build; an unpinned torch would pull a multi-GB CUDA build.
    "${pip[@]}" torch==2.13.0
  else
    "${pip[@]}" torch
  fi
fi

"${pip[@]}" -e ./deepinfer-core
case "$accel" in
  nvidia)
    "${pip[@]}" -e "./deepinfer-backend-cuda[tilelang]"
    # The kernel set: Triton kernels compiled ahead of time (cubins for sm_90a and sm_100a + manifest.json)
    # by the Triton installed here, so the runtime loads cubins from the same compiler its JIT would use; plus the
    # TileLang kernels' sm_90a cubins where nvcc is on the PATH (skipped, with a log line, where it is not).
    "$venv/bin/python" -m deepinfer_cuda.kernel_set.build ;;
  ascend) "${pip[@]}" -e "./deepinfer-backend-ascend[npu]" ;;
  cpu) ;;
esac

if [ "$dev" = 1 ]; then
  "${pip[@]}" -e "./deepinfer-core[test,structured]"
  # Every in-repo backend, so registration and "unusable here" errors are tested on any machine.
  "${pip[@]}" -e ./deepinfer-backend-cuda -e ./deepinfer-backend-ascend
fi
echo "build.sh: ready ($accel) in $venv; activate with: source $venv/bin/activate"
