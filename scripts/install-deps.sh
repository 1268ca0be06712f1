#!/usr/bin/env bash
# Installs the Debian packages the tests, benchmarks and demo need, when they
# are missing, and makes sure apt knows Debian's kernel package (the 802.1Q VM
# lane downloads it). Idempotent and quick when everything is there. Needs
# root to change anything.
set -euo pipefail
need=()
command -v nft >/dev/null || need+=(nftables)
command -v ip >/dev/null || need+=(iproute2)
command -v arping >/dev/null || need+=(arping)
command -v qemu-system-x86_64 >/dev/null || need+=(qemu-system-x86)
command -v xz >/dev/null || need+=(xz-utils)
command -v containerd >/dev/null || need+=(containerd)
command -v runc >/dev/null || need+=(runc)
# nsenter + unshare: node B's mount namespace in the two-node Kubernetes lane
# (util-linux is essential in Debian; checked for minimal images).
command -v nsenter >/dev/null && command -v unshare >/dev/null || need+=(util-linux)
[ -x /usr/bin/time ] || need+=(time)
# prometheus + promtool: the chart's scrape configuration and dashboard
# queries (deploy tests, the Kubernetes lane); without its recommends
# (node-exporter and friends). No service starts: the lane runs its own.
need_norec=()
command -v promtool >/dev/null || need_norec+=(prometheus)
# qemu-aarch64-static: test/arm64 runs the arm64 binaries under it, invoked by
# path, and never needs the machine's binfmt_misc registrations; so without
# its recommends (binfmt-support registers the emulators there).
command -v qemu-aarch64-static >/dev/null || need_norec+=(qemu-user-static)
lists_ok=true
apt-cache show linux-image-amd64 >/dev/null 2>&1 || lists_ok=false
if [ ${#need[@]} -eq 0 ] && [ ${#need_norec[@]} -eq 0 ] && $lists_ok; then
  exit 0
fi
if [ "$(id -u)" != 0 ]; then
  echo "missing packages (${need[*]} ${need_norec[*]}) or apt package lists: run as root (apt-get update && apt-get install -y ${need[*]} ${need_norec[*]})" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
if [ ${#need[@]} -gt 0 ]; then
  echo "installing ${need[*]}"
  apt-get install -y -qq -o DPkg::Lock::Timeout=600 "${need[@]}" >/dev/null
fi
if [ ${#need_norec[@]} -gt 0 ]; then
  echo "installing ${need_norec[*]} (without recommends)"
  apt-get install -y -qq --no-install-recommends -o DPkg::Lock::Timeout=600 "${need_norec[@]}" >/dev/null
fi
