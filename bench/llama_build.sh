# Sourced by bench/gpu_device.sh and bench/gpu_lavapipe.sh (which define say, die and PYTHON):
# llama.cpp from the llama-cpp-python sdist, configured and built as shared libraries, and the
# sdist's Python package beside the libraries it loads.

# As the README's install line does on x86-64 (these machines' compilers lack AMX-INT8;
# docs/install-and-builds.md says why).
NO_AMX=()
if [ "$(uname -m)" = x86_64 ]; then
    NO_AMX=(-DCMAKE_C_FLAGS=-mno-amx-int8 -DCMAKE_CXX_FLAGS=-mno-amx-int8)
fi

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

# configured BUILD: whether a configure finished in BUILD (CMake leaves its cache behind a
# failed one, so the cache alone does not say).
configured() {
    [ -f "$1/build.ninja" ] || [ -f "$1/Makefile" ]
}

# configure_llama SRC BUILD [CMAKE ARGS...]: a fresh Release configure of shared libraries,
# without curl, OpenSSL, tests, examples or the web UI; its log beside BUILD, as configure.log.
configure_llama() {
    local src=$1 build=$2
    shift 2
    local log generator=()
    log="$(dirname "$build")/configure.log"
    command -v ninja > /dev/null && generator=(-G Ninja)
    rm -rf "$build"
    cmake -S "$src" -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release \
        -DBUILD_SHARED_LIBS=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF \
        -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF "$@" > "$log" 2>&1 \
        || { tail -30 "$log" >&2; die "cmake could not configure (see $log)"; }
}

# site_from_build PACKAGE BUILD SITE: SITE/llama_cpp is PACKAGE (the sdist's llama_cpp) with the
# shared libraries BUILD made in its lib/, where it loads them from.
site_from_build() {
    local package=$1 build=$2 site=$3
    rm -rf "$site/llama_cpp"
    mkdir -p "$site/llama_cpp/lib"
    cp -r "$package/." "$site/llama_cpp/"
    find "$build/bin" -maxdepth 1 -name '*.so*' -exec cp -P {} "$site/llama_cpp/lib/" \;
    say "built: $(ls "$site/llama_cpp/lib" | tr '\n' ' ')"
}
