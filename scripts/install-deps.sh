#!/usr/bin/env bash
# Installs the Debian packages the tests, benchmarks and demo need, when they
# are missing. Idempotent and quick when everything is there. Needs root.
set -euo pipefail
need=()
command -v nft >/dev/null || need+=(nftables)
command -v ip >/dev/null || need+=(iproute2)
command -v arping >/dev/null || need+=(arping)
command -v qemu-system-x86_64 >/dev/null || need+=(qemu-system-x86)
command -v xz >/dev/null || need+=(xz-utils)
command -v containerd >/dev/null || need+=(containerd)
command -v runc >/dev/null || need+=(runc)
if [ ${#need[@]} -eq 0 ]; then
  exit 0
fi
if [ "$(id -u)" != 0 ]; then
  echo "missing packages ${need[*]}: run as root (apt-get install -y ${need[*]})" >&2
  exit 1
fi
echo "installing ${need[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq -o DPkg::Lock::Timeout=600 "${need[@]}" >/dev/null
