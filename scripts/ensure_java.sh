#!/usr/bin/env bash
# TorchServe 0.12 needs Java 17+. Install OpenJDK 17 when it is missing and we can (Debian/Ubuntu as root).
set -euo pipefail
version=$(java -version 2>&1 | awk -F'"' '/version/ {print $2}' | cut -d. -f1 || true)
if [[ -n "${version}" && "${version}" -ge 17 ]]; then
  exit 0
fi
echo "Java 17 not found (have: ${version:-none}); installing openjdk-17-jre-headless" >&2
if command -v apt-get >/dev/null && [[ $(id -u) -eq 0 ]]; then
  apt-get update -qq && apt-get install -y -qq openjdk-17-jre-headless
else
  echo "Cannot install Java here: install OpenJDK 17 (e.g. 'sudo apt-get install openjdk-17-jre-headless')." >&2
  exit 1
fi
