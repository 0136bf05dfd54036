#!/usr/bin/env bash
# Compile the patched llama.cpp's CUDA backend on a machine without a GPU, so that the device's scarce minutes never
# meet a compile error (issue 24). nvcc is the machine's (CUDA 13 on ours); cuBLAS, which that toolkit lacks, comes
# from the nvidia-cublas wheel, merged with the toolkit into one root for CMake's FindCUDAToolkit. The build is
# clover-gguf's own (`build-llama --backend cuda`: a user's cmake options, every tool, into the usual cache), for
# CMAKE_CUDA_ARCHITECTURES 90 (H100/H200) and 89 (RTX 40). It prints how long it took; outside CI (too slow for it).
# Without a driver the libraries link against a stub libcuda: a compile check, not a build to run.
#
#   bash bench/device/cuda_compile.sh [WORK]     env: PYTHON (python3), JOBS (all cores), CUDA_ARCH ("90;89")
set -euo pipefail
WORK=${1:-${TMPDIR:-/tmp}/clover-cuda-compile}
PY=${PYTHON:-python3}
JOBS=${JOBS:-$(nproc)}
ARCH=${CUDA_ARCH:-90;89}
# the toolkit: $CUDA_HOME, else /usr/local/cuda (the nvcc on PATH may be a wrapper script elsewhere)
TOOLKIT=${CUDA_HOME:-/usr/local/cuda}
[[ -x $TOOLKIT/bin/nvcc ]] || { echo "cuda_compile.sh: no $TOOLKIT/bin/nvcc (set CUDA_HOME)" >&2; exit 2; }
TOOLKIT=$(cd "$TOOLKIT" && pwd -P)
mkdir -p "$WORK"
ROOT=$WORK/cuda-root
if [[ ! -f $ROOT/include/cublas_v2.h ]]; then
    rm -rf "$WORK/cublas" "$ROOT.tmp"
    ls "$WORK"/wheel/nvidia_cublas-*.whl >/dev/null 2>&1 ||
        "$PY" -m pip download -q --no-deps --only-binary=:all: nvidia-cublas -d "$WORK/wheel"
    "$PY" -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])' "$WORK"/wheel/*.whl "$WORK/cublas"
    CUBLAS=$(dirname "$(find "$WORK/cublas" -name cublas_v2.h | head -n 1)")/..
    # the toolkit's files, linked, with cuBLAS's headers and libraries beside them
    mkdir -p "$ROOT.tmp"
    for d in "$TOOLKIT"/*; do ln -s "$d" "$ROOT.tmp/$(basename "$d")"; done
    rm "$ROOT.tmp/include" "$ROOT.tmp/lib64"
    mkdir "$ROOT.tmp/include" "$ROOT.tmp/lib64"
    ln -s "$TOOLKIT"/include/* "$CUBLAS"/include/* "$ROOT.tmp/include/"
    ln -s "$(readlink -f "$TOOLKIT/lib64")"/* "$ROOT.tmp/lib64/"
    for so in "$CUBLAS"/lib/*.so.*; do
        ln -sf "$so" "$ROOT.tmp/lib64/"
        ln -sf "$so" "$ROOT.tmp/lib64/$(basename "${so%%.so.*}").so"
    done
    # the driver library (libcuda) comes with a GPU driver, which a machine without a GPU lacks: an empty stub stands
    # in for it at link time and the executables may leave its symbols undefined (LDFLAGS below). The result is for
    # compiling, not for running.
    mkdir "$ROOT.tmp/lib64/stubs"
    echo "" | cc -shared -x c - -o "$ROOT.tmp/lib64/stubs/libcuda.so"
    mv "$ROOT.tmp" "$ROOT"
fi
export CUDAToolkit_ROOT=$ROOT CUDACXX=$ROOT/bin/nvcc LDFLAGS="${LDFLAGS:+$LDFLAGS }-Wl,--allow-shlib-undefined"
T0=$(date +%s)
# build-llama ends by loading the library, which needs the NVIDIA driver: without one that check fails, and what
# counts here is that every source compiled and every library and tool linked (the build is kept in the cache)
"$PY" -m clover_gguf build-llama --backend cuda --cuda-arch "$ARCH" --jobs "$JOBS" || true
BIN=$("$PY" -c '
from clover_gguf.build import cached_builds, patch_hash
hits = [b for b in cached_builds() if b.backend == "cuda" and b.patch_hash == patch_hash()]
print(hits[0].bin_dir if hits else "")')
[[ -n $BIN && -e $BIN/libggml-cuda.so ]] || { echo "cuda_compile.sh: no CUDA build of these patches (see above)" >&2; exit 1; }
for t in libllama.so llama-cli llama-server llama-quantize llama-fit-params test-llama-archs llama-bench; do
    [[ -e $BIN/$t ]] || { echo "cuda_compile.sh: $BIN/$t is missing" >&2; exit 1; }
done
echo "CUDA build compiled and linked: $BIN (archs $ARCH, $JOBS jobs, $(nproc) cores), $(($(date +%s) - T0)) s now"
