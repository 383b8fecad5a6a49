#!/usr/bin/env bash
# Build loopwatch_native (native/, Rust + pyo3, built by maturin) into .venv.
#
# Toolchain: the cargo on PATH; else Debian's `cargo` package when apt-get can install it;
# else ONE line saying what is missing, and loopwatch runs on its pure-Python span path.
# A failed build also ends in one line (the log is .cache/native-build.log) and removes any
# earlier build, so a stale extension is never used. Exit status 0 either way, unless
# LOOPWATCH_REQUIRE_NATIVE=1 (CI): then a missing extension fails the install.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
LOG=.cache/native-build.log
mkdir -p .cache

fallback() {
    echo "loopwatch: native span path not built ($1); the pure-Python decoder will be used" >&2
    "$PY" -m pip uninstall -y -q loopwatch-native >/dev/null 2>&1 || true
    rm -f .venv/.native
    [ "${LOOPWATCH_REQUIRE_NATIVE:-0}" = 1 ] && exit 1
    exit 0
}

if ! command -v cargo >/dev/null 2>&1 && [ -x "$HOME/.cargo/bin/cargo" ]; then
    export PATH="$HOME/.cargo/bin:$PATH"
fi
if ! command -v cargo >/dev/null 2>&1; then
    if command -v apt-get >/dev/null 2>&1; then
        SUDO=""
        [ "$(id -u)" = 0 ] || SUDO="sudo -n"
        { $SUDO apt-get update -q && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q cargo; } \
            >"$LOG" 2>&1 || true
    fi
    command -v cargo >/dev/null 2>&1 \
        || fallback "no cargo on PATH and apt-get could not install Debian's cargo"
fi

# pip builds in native/ (maturin, fetched into pip's build environment), so native/target
# keeps cargo's incremental state between installs.
if ! "$PY" -m pip install -q ./native >"$LOG" 2>&1; then
    fallback "cargo build failed with $(cargo --version 2>/dev/null), see $LOG"
fi
if ! "$PY" -c 'import sys; from streams.spanpath import native; sys.exit(native.ACTIVE != "native")' \
    >>"$LOG" 2>&1; then
    fallback "the built extension does not load, see $LOG"
fi
touch .venv/.native
echo "loopwatch: native span path built ($(cargo --version))"
