#!/usr/bin/env bash
# A prepared GPU run: phi4 and llama-server on one CUDA device (the H200 that is sometimes lent:
# no network, 64 MiB may travel, 10 minutes a command, 15 minutes in all).
#
#   bench/gpu_device.sh pack  [--sdist FILE] [--no-wheels]   here: fill .gpu/ with what travels
#   bench/gpu_device.sh build [--cuda on|off] [--configure-only]
#                                                            there: llama.cpp, CUDA for sm_90
#   bench/gpu_device.sh bench [--model PATH] [--quick] [--budget S]
#                                                            there: the benches, results in $OUT
#   bench/gpu_device.sh all   [build and bench options]      there: build, then bench
#   bench/gpu_device.sh wheels                               the wheels pack takes (name==version)
#
# pack (on a machine with PyPI) writes .gpu/: the llama.cpp sources vendored in the
# llama-cpp-python sdist, trimmed of models, docs and tests (~15 MB compressed); the sdist's
# Python package llama_cpp; and wheels of phi4's dependencies that the device's image lacks, at
# the versions installed here. The device call is then
#
#   run(command="bash bench/gpu_device.sh all", carry=[".gpu"], timeout_s=590)
#
# build compiles llama.cpp once, as shared libraries, and the same build serves both sides:
# llama_cpp (the Python package) loads its libllama from it, and llama-server and
# llama-batched-bench are its binaries. Everything lands in $PHI4_GPU_WORK (/tmp/phi4-gpu), so a
# second call on a machine still warm skips what is done. bench builds the shaped Phi-4-mini
# model (bench/shaped_model.py) and runs, each step skipped once --budget seconds (default 540)
# have passed since the script started: a smoke solve with full offload; bench/batching.py at
# 1/4/16/64 concurrent against llama-server, f16 then q8_0 KV; bench/speed.py; bench/memory.py
# (decode at depth, f16 vs q8_0). Each step's log and results go to $WORK/results, and after
# every step $OUT (bench/results/gpu where $OUT is unset) gets them again as results.tar.gz and
# their Markdown tables as summary.md (the device returns at most 8 files), so a run cut short
# still returns what it measured.
#
# With --cuda off the same script builds and runs on a CPU machine: that is how it is tested.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
CARRY=${PHI4_GPU_CARRY:-$ROOT/.gpu}
WORK=${PHI4_GPU_WORK:-/tmp/phi4-gpu}
OUT=${OUT:-$ROOT/bench/results/gpu}
RES="$WORK/results"
# The checkout's venv where there is one (here), else the image's python3 (there).
if [ -x "$ROOT/.venv/bin/python" ]; then PYTHON=${PYTHON:-$ROOT/.venv/bin/python}; else PYTHON=${PYTHON:-python3}; fi
STARTED=$(date +%s)
LLAMA_CPP_PYTHON=0.3.36
# The device's image has these (compiled, or large and not version-sensitive): not carried.
ON_DEVICE="numpy pyyaml charset-normalizer hf-xet sympy mpmath"

say() { printf '[gpu_device %4ss] %s\n' "$(($(date +%s) - STARTED))" "$*" >&2; }
die() { say "error: $*"; exit 1; }
# shellcheck source=bench/llama_build.sh
. "$ROOT/bench/llama_build.sh"

pack() {
    local sdist="" wheels=1
    while [ $# -gt 0 ]; do
        case $1 in
            --sdist) sdist=$2; shift 2 ;;
            --no-wheels) wheels=0; shift ;;
            *) die "pack: unknown option $1" ;;
        esac
    done
    local tmp
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' RETURN
    local top
    top=$(unpack_sdist "$LLAMA_CPP_PYTHON" "$sdist" "$tmp")
    [ -d "$top/vendor/llama.cpp" ] || die "pack: $sdist holds no vendor/llama.cpp"
    [ -d "$top/llama_cpp" ] || die "pack: $sdist holds no llama_cpp package"
    rm -rf "$CARRY"
    mkdir -p "$CARRY"
    # What a CUDA build of the library and the two tools never reads.
    (cd "$top/vendor/llama.cpp" && rm -rf models docs media benches tests examples gguf-py \
        conversion build .devops .github)
    tar -czf "$CARRY/llama.cpp.tar.gz" -C "$top/vendor" llama.cpp
    cp -r "$top/llama_cpp" "$CARRY/llama_cpp"
    rm -rf "$CARRY/llama_cpp/lib"
    if [ "$wheels" = 1 ]; then
        mkdir -p "$CARRY/wheels"
        local specs
        specs=$(dependencies) || die "pack: phi4 is not installed in $PYTHON (install it first)"
        say "wheels: $specs"
        # shellcheck disable=SC2086  # one word per requirement
        "$PYTHON" -m pip wheel -q --no-deps -w "$CARRY/wheels" $specs
    fi
    say "packed $(du -sh "$CARRY" | cut -f1) into $CARRY (the device takes at most 64 MiB)"
}

dependencies() {
    # phi4's requirements, all the way down, as installed here (name==version), for the device's
    # Python 3.12 on Linux: what the device must load ahead of its image's own versions.
    "$PYTHON" - "$ON_DEVICE" <<'EOF'
import importlib.metadata as metadata
import re
import sys

from packaging.requirements import Requirement

device = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
          "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
          "platform_python_implementation": "CPython", "implementation_name": "cpython",
          "extra": ""}
skip = {"llama-cpp-python", *sys.argv[1].split()}
seen, todo, specs = set(), ["phi4cli"], []
while todo:
    name = re.sub(r"[-_.]+", "-", todo.pop()).lower()
    if name in seen or name in skip:
        continue
    seen.add(name)
    dist = metadata.distribution(name)
    if name != "phi4cli":
        specs.append(f"{name}=={dist.version}")
    for text in dist.requires or []:
        requirement = Requirement(text)
        if requirement.marker is None or requirement.marker.evaluate(device):
            todo.append(requirement.name)
print(" ".join(sorted(specs)))
EOF
}

build() {
    local cuda=on configure_only=0
    while [ $# -gt 0 ]; do
        case $1 in
            --cuda) cuda=$2; shift 2 ;;
            --configure-only) configure_only=1; shift ;;
            --model|--budget) shift 2 ;;  # bench's, when called through all
            --quick) shift ;;
            *) die "build: unknown option $1" ;;
        esac
    done
    [ -f "$CARRY/llama.cpp.tar.gz" ] || die "build: $CARRY/llama.cpp.tar.gz is missing: run pack first"
    mkdir -p "$WORK"
    if [ ! -f "$WORK/src/CMakeLists.txt" ]; then
        rm -rf "$WORK/src"
        tar -xzf "$CARRY/llama.cpp.tar.gz" -C "$WORK"
        mv "$WORK/llama.cpp" "$WORK/src"
    fi
    local flags=()
    if [ "$cuda" = on ]; then
        flags+=(-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCH:-90}")
    else
        flags+=(-DGGML_CUDA=OFF "${NO_AMX[@]}")
    fi
    if ! configured "$WORK/build" || ! grep -q "GGML_CUDA:BOOL=${cuda^^}" "$WORK/build/CMakeCache.txt"; then
        say "configuring llama.cpp (CUDA $cuda)"
        configure_llama "$WORK/src" "$WORK/build" "${flags[@]}"
    fi
    [ "$configure_only" = 1 ] && { say "configured in $WORK/build"; return; }
    say "building llama, llama-server, llama-batched-bench with $(nproc) jobs"
    cmake --build "$WORK/build" --target llama llama-server llama-batched-bench -j "$(nproc)" \
        > "$WORK/build.log" 2>&1 || { tail -40 "$WORK/build.log" >&2; die "build: compilation failed"; }
    # The Python package, loading this build's libraries.
    site_from_build "$CARRY/llama_cpp" "$WORK/build" "$WORK/site"
}

python_env() {
    # phi4 from this checkout, llama_cpp from the build, the carried wheels: ahead of the image's.
    if [ -d "$CARRY/wheels" ] && [ ! -f "$WORK/site/.wheels" ]; then
        "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$WORK/site" "$CARRY"/wheels/*.whl
        touch "$WORK/site/.wheels"
    fi
    export PYTHONPATH="$ROOT:$WORK/site${PYTHONPATH:+:$PYTHONPATH}"
    export PYTHONUNBUFFERED=1
}

bundle() {
    # $OUT gets the results so far, each file replaced whole (a kill mid-write leaves the last).
    mkdir -p "$OUT"
    tar -czf "$OUT/.results.tar.gz" -C "$RES" . && mv "$OUT/.results.tar.gz" "$OUT/results.tar.gz"
    {
        echo "# phi4 on $(cat "$RES/device.txt" 2>/dev/null || uname -m)"
        local table
        for table in $(cd "$RES" && find . -name '*.md' | sort); do
            printf '\n## %s\n\n' "${table#./}"
            cat "$RES/$table"
        done
        printf '\n## steps\n\n'
        cat "$RES/steps.txt" 2>/dev/null
    } > "$OUT/.summary.md" && mv "$OUT/.summary.md" "$OUT/summary.md"
}

left() { echo $((BUDGET - ($(date +%s) - STARTED))); }

step() {
    # step NAME NEEDS_S COMMAND...: run it, its output in $RES/NAME.log, unless too little is left.
    local name=$1 needs=$2
    shift 2
    if [ "$(left)" -lt "$needs" ]; then
        say "skipped $name: $(left) s left of the budget, it needs about $needs"
        echo "- $name: skipped ($(left) s left, needs about $needs)" >> "$RES/steps.txt"
        bundle
        return 0
    fi
    say "$name"
    local begun rc=0
    begun=$(date +%s)
    "$@" > "$RES/$name.log" 2>&1 || rc=$?
    if [ "$rc" = 0 ]; then
        say "$name: done"
        echo "- $name: done in $(($(date +%s) - begun)) s" >> "$RES/steps.txt"
    else
        say "$name: failed (exit $rc), the end of its log:"
        tail -15 "$RES/$name.log" >&2
        echo "- $name: FAILED (exit $rc) after $(($(date +%s) - begun)) s; see $name.log" >> "$RES/steps.txt"
    fi
    bundle
}

smoke() {
    # One answer through the daemon, as a user runs it; the model's load shows its offload.
    "$PYTHON" -m phi4cli solve -m "$1" -t 0 -n 16 --json "What is 2+2?" > "$RES/smoke.json"
}

bench() {
    local model="" quick=0
    BUDGET=540
    while [ $# -gt 0 ]; do
        case $1 in
            --model) model=$2; shift 2 ;;
            --quick) quick=1; shift ;;
            --budget) BUDGET=$2; shift 2 ;;
            --cuda) shift 2 ;;  # build's, when called through all
            --configure-only) shift ;;
            *) die "bench: unknown option $1" ;;
        esac
    done
    [ -f "$WORK/site/llama_cpp/lib/libllama.so" ] || die "bench: no build in $WORK: run build first"
    python_env
    rm -rf "$RES"
    mkdir -p "$RES"
    if command -v nvidia-smi > /dev/null; then
        nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader \
            > "$RES/device.txt" 2>&1 || true
        nvidia-smi > "$RES/nvidia-smi.txt" 2>&1 || true
    else
        echo "$(uname -m), $(nproc) CPUs, no GPU" > "$RES/device.txt"
    fi
    "$PYTHON" - > "$RES/llama_cpp.txt" 2>&1 <<'EOF' || true
import llama_cpp
print("llama_cpp", llama_cpp.__version__, "from", llama_cpp.__file__)
print("gpu offload:", bool(llama_cpp.llama_supports_gpu_offload()))
EOF
    if [ -z "$model" ]; then
        export PHI4_BENCH_CACHE="$WORK/cache"
        step shaped_model 120 "$PYTHON" "$ROOT/bench/shaped_model.py"
        model=$(tail -1 "$RES/shaped_model.log")
    fi
    [ -f "$model" ] || die "bench: no model at $model"
    local tokens=256 concurrent=(1 4 16 64) rounds=3 server=()
    # llama-server from the same build, where it was built (a CPU test may have none).
    [ -x "$WORK/build/bin/llama-server" ] && server=(--server "$WORK/build/bin/llama-server")
    [ "$quick" = 1 ] && { tokens=8; concurrent=(1 4); rounds=1; }
    export PHI4_HOME="$WORK/home"
    step smoke 30 smoke "$model"
    "$PYTHON" -m phi4cli status --json > "$RES/status.json" 2>&1 || true
    "$PYTHON" -m phi4cli stop > /dev/null 2>&1 || true
    local kv
    for kv in f16 q8_0; do
        step "batching_$kv" 150 "$PYTHON" "$ROOT/bench/batching.py" --model "$model" \
            "${server[@]}" --tokens "$tokens" --concurrent "${concurrent[@]}" \
            --rounds "$rounds" --phi4-arg=--kv-cache-type --phi4-arg="$kv" \
            --server-arg=-ctk --server-arg="$kv" --server-arg=-ctv --server-arg="$kv" \
            --server-arg=-ngl --server-arg=999 --out "$RES/batching_$kv"
    done
    step speed 120 "$PYTHON" "$ROOT/bench/speed.py" --model "$model" --tokens "$tokens" \
        --out "$RES/speed"
    if [ "$quick" = 1 ]; then
        step memory 60 "$PYTHON" "$ROOT/bench/memory.py" --model "$model" --skip long chat \
            --depth 200 --decode-tokens 4 --n-ctx 1024 --out "$RES/memory"
    else
        step memory 120 "$PYTHON" "$ROOT/bench/memory.py" --model "$model" --skip long \
            --out "$RES/memory"
    fi
    bundle
    say "results in $OUT: summary.md, results.tar.gz ($(cd "$RES" && find . -type f | wc -l) files)"
}

command=${1:-}
[ $# -gt 0 ] && shift
case $command in
    pack) pack "$@" ;;
    build) build "$@" ;;
    bench) bench "$@" ;;
    all) build "$@"; bench "$@" ;;
    wheels) dependencies ;;
    *) sed -n '2,/gpu_device.sh wheels/{s/^# \{0,1\}//;p}' "$0" >&2; exit 2 ;;
esac
