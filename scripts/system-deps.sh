#!/usr/bin/env bash
# System packages some tests need: a real Prometheus server (Debian's package
# brings promtool too), headless Chromium for the HTML report test, and a C compiler
# for serving/kernels/cpu_kernels.c (without one the engine keeps its torch path and the
# kernel tests skip).
# Installed only when missing and only as root; otherwise those tests skip
# with a message that names the missing program.
set -u
need=()
command -v prometheus >/dev/null 2>&1 || need+=(prometheus)
command -v chromium >/dev/null 2>&1 || need+=(chromium)
command -v cc >/dev/null 2>&1 || command -v gcc >/dev/null 2>&1 || need+=(gcc libc6-dev)
if [ ${#need[@]} -eq 0 ]; then exit 0; fi
if [ "$(id -u)" != 0 ]; then
  echo "system-deps: not root; missing ${need[*]} (tests that need them will skip)" >&2
  exit 0
fi
echo "system-deps: installing ${need[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq >/dev/null && apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null \
  || echo "system-deps: apt-get failed for ${need[*]} (tests that need them will skip)" >&2
exit 0
