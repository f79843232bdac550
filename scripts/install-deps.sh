#!/usr/bin/env bash
# Installs the build and test dependencies of deltamoe from Debian packages (Debian 12 / Ubuntu 24.04).
set -euo pipefail
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
PKGS=(build-essential cmake git pkg-config
      libopenblas-openmp-dev libomp-dev
      nlohmann-json3-dev libcli11-dev libcpp-httplib-dev libpcre2-dev libsqlite3-dev
      libpng-dev libjpeg-dev libgtest-dev libbenchmark-dev)
missing=()
for p in "${PKGS[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
