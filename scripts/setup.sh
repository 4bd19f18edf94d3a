#!/usr/bin/env bash
# Installs the Debian packages dflash.cpp builds against. Idempotent: packages already present are
# skipped, so a second run costs nothing. Run as root (CI and the dev machines are root) or via sudo.
set -euo pipefail

packages=(
  build-essential cmake ninja-build pkg-config
  libgtest-dev libgmock-dev libbenchmark-dev   # tests and micro-benchmarks
  libfmt-dev                                    # formatting
  nlohmann-json3-dev                            # JSON (CLI --json, server, converter config.json)
  libcli11-dev                                  # command-line parsing
  libcpp-httplib-dev                            # HTTP server (dflash serve)
  libutf8proc-dev                               # Unicode categories for the BPE pre-tokenizer
  clang libclang-rt-14-dev                      # libFuzzer + sanitizer runtimes
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done

if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
else
  echo "setup: all packages present"
fi
