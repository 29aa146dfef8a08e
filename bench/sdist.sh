# Sourced by bench/gpu_device.sh and bench/gpu_lavapipe.sh (which define say, die and PYTHON).
#
# unpack_sdist VERSION SDIST DIR: unpack the llama-cpp-python sdist SDIST (downloaded with pip
# into DIR where SDIST is empty) into DIR and print the directory it unpacked to.
unpack_sdist() {
    local version=$1 sdist=$2 dir=$3
    if [ -z "$sdist" ]; then
        say "downloading the llama-cpp-python $version sdist"
        # --no-binary for this package only: its build requirements may come as wheels.
        "$PYTHON" -m pip download -q --no-binary llama-cpp-python --no-deps -d "$dir" \
            "llama-cpp-python==$version" >&2
        sdist=$(ls "$dir"/llama_cpp_python-*.tar.gz)
    fi
    [ -f "$sdist" ] || die "no sdist at $sdist"
    tar -xzf "$sdist" -C "$dir"
    local top
    top=$(find "$dir" -mindepth 1 -maxdepth 1 -type d -name 'llama_cpp_python-*' | head -1)
    [ -n "$top" ] || die "$sdist holds no llama_cpp_python-* directory"
    echo "$top"
}
