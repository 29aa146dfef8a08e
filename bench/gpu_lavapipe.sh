#!/usr/bin/env bash
# A real ggml GPU device on a CPU-only machine: llama.cpp's Vulkan backend on Mesa's software
# driver (lavapipe, "llvmpipe"), to prove phi4's offload (device listing, the memory plan, a
# partial offload, answers) where no GPU is lent. About 15x slower than the CPU backend: for
# proof, never for speed.
#
#   bench/gpu_lavapipe.sh build [--sdist FILE]    llama.cpp with Vulkan, into $PHI4_VK_WORK
#   bench/gpu_lavapipe.sh test [PYTEST ARGS]      the gpu-marked tests on that build
#   bench/gpu_lavapipe.sh env                     the exports that put the build in a shell
#
# Needs CMake, Debian's (or the distribution's) Vulkan headers and loader, SPIR-V headers, glslc
# and Mesa's drivers:
#
#   apt-get install cmake libvulkan-dev spirv-headers glslc mesa-vulkan-drivers
#
# build takes the llama.cpp sources vendored in the llama-cpp-python sdist of the version phi4
# runs (downloaded with pip unless --sdist names one), applies bench/patches/ where the headers
# need it (Debian 12's Vulkan 1.3.239 lacks VK_EXT_layer_settings), compiles libllama with
# -DGGML_VULKAN=ON as shared libraries (587 s on 2 cores, beside another build) and puts the
# sdist's llama_cpp package with those libraries in $PHI4_VK_WORK/site (default .vk/site, ignored by
# git). Nothing is installed into the venv: the tests put that site ahead of it on PYTHONPATH
# for the daemons they start, so the CPU build stays what everything else runs.
#
# test builds the shaped Phi-4-mini model if it is not cached (bench/shaped_model.py, about 4
# minutes) and runs pytest -m gpu with GGML_VK_VISIBLE_DEVICES=0 (ggml skips CPU-type Vulkan
# devices otherwise). Not part of .ci/run: the build is too long for it.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
VK=${PHI4_VK_WORK:-$ROOT/.vk}
PYTHON=${PYTHON:-$ROOT/.venv/bin/python}
STARTED=$(date +%s)

say() { printf '[gpu_lavapipe %4ss] %s\n' "$(($(date +%s) - STARTED))" "$*" >&2; }
die() { say "error: $*"; exit 1; }
# shellcheck source=bench/llama_build.sh
. "$ROOT/bench/llama_build.sh"

vulkan_header() {
    local dir
    for dir in /usr/include /usr/local/include ${VULKAN_SDK:+"$VULKAN_SDK/include"}; do
        [ -f "$dir/vulkan/vulkan_core.h" ] && { echo "$dir/vulkan/vulkan_core.h"; return; }
    done
    return 1
}

build() {
    local sdist=""
    while [ $# -gt 0 ]; do
        case $1 in
            --sdist) sdist=$2; shift 2 ;;
            *) die "build: unknown option $1" ;;
        esac
    done
    local header
    local apt="apt-get install cmake libvulkan-dev spirv-headers glslc mesa-vulkan-drivers"
    header=$(vulkan_header) || die "no Vulkan headers: $apt"
    command -v cmake > /dev/null || die "no cmake: $apt"
    command -v glslc > /dev/null || die "no glslc (ggml compiles its shaders with it): $apt"
    [ -n "$(find /usr/share /usr/lib /usr/local -path '*SPIRV-Headers*Config.cmake' -print -quit 2> /dev/null)" ] \
        || die "no SPIR-V headers (ggml-vulkan's CMake asks for SPIRV-Headers): $apt"
    local version
    version=$("$PYTHON" -c 'import importlib.metadata as m; print(m.version("llama-cpp-python"))') \
        || die "no llama-cpp-python in $PYTHON: install phi4 first (README, Install)"
    mkdir -p "$VK"
    if [ ! -f "$VK/src/CMakeLists.txt" ] || [ "$(cat "$VK/src/.version" 2>/dev/null)" != "$version" ]; then
        local tmp
        tmp=$(mktemp -d)
        trap 'rm -rf "$tmp"' RETURN
        local top
        top=$(unpack_sdist "$version" "$sdist" "$tmp")
        [ -d "$top/vendor/llama.cpp/ggml/src/ggml-vulkan" ] || die "build: $sdist holds no vendor/llama.cpp with ggml-vulkan"
        rm -rf "$VK/src" "$VK/build" "$VK/llama_cpp"
        mv "$top/vendor/llama.cpp" "$VK/src"
        mv "$top/llama_cpp" "$VK/llama_cpp"
        rm -rf "$VK/llama_cpp/lib"
        echo "$version" > "$VK/src/.version"
        if ! grep -q VK_EXT_layer_settings "$header"; then
            say "$header lacks VK_EXT_layer_settings: applying bench/patches/ggml-vulkan-layer-settings.patch"
            patch -d "$VK/src" -p1 < "$ROOT/bench/patches/ggml-vulkan-layer-settings.patch" > /dev/null \
                || die "build: the patch does not apply to llama-cpp-python $version's llama.cpp"
        fi
    fi
    if ! configured "$VK/build"; then
        say "configuring llama.cpp $version with Vulkan"
        configure_llama "$VK/src" "$VK/build" -DGGML_VULKAN=ON -DLLAMA_BUILD_TOOLS=OFF \
            -DLLAMA_BUILD_SERVER=OFF "${NO_AMX[@]}"
    fi
    say "building libllama with Vulkan, $(nproc) jobs (about 10 minutes on 2 cores)"
    cmake --build "$VK/build" --target llama -j "$(nproc)" > "$VK/build.log" 2>&1 \
        || { tail -40 "$VK/build.log" >&2; die "build: compilation failed (see $VK/build.log)"; }
    site_from_build "$VK/llama_cpp" "$VK/build" "$VK/site"
    [ -f "$VK/site/llama_cpp/lib/libggml-vulkan.so" ] || die "build: no libggml-vulkan.so was built"
    exports
    PYTHONPATH="$VK/site" GGML_VK_VISIBLE_DEVICES=0 "$PYTHON" - <<'EOF' >&2
import llama_cpp
from phi4cli.daemon.llama.model import gpu_devices

print("llama_cpp", llama_cpp.__version__, "from", llama_cpp.__file__)
for device in gpu_devices():
    print(f"device: {device.name}, {device.total_bytes / 2**20:,.0f} MiB, {device.free_bytes / 2**20:,.0f} MiB free")
EOF
}

exports() {
    echo "export PHI4_VK_SITE=$VK/site GGML_VK_VISIBLE_DEVICES=0"
}

run_tests() {
    [ -f "$VK/site/llama_cpp/lib/libggml-vulkan.so" ] || die "test: no Vulkan build in $VK: run build first"
    if [ -z "${PHI4_SHAPED_MODEL:-}" ]; then
        say "the shaped Phi-4-mini model (built once, then cached)"
        PHI4_SHAPED_MODEL=$("$PYTHON" "$ROOT/bench/shaped_model.py" | tail -1)
    fi
    export PHI4_SHAPED_MODEL PHI4_VK_SITE="$VK/site" GGML_VK_VISIBLE_DEVICES=0
    cd "$ROOT"
    "$PYTHON" -m pytest -m gpu -v tests/test_gpu_vulkan.py "$@"
}

command=${1:-}
[ $# -gt 0 ] && shift
case $command in
    build) build "$@" ;;
    test) run_tests "$@" ;;
    env) exports ;;
    *) sed -n '2,/gpu_lavapipe.sh env/{s/^# \{0,1\}//;p}' "$0" >&2; exit 2 ;;
esac
