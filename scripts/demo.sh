#!/usr/bin/env bash
# The whole-node demo (issue 7), run by `make demo` after `make deps build`.
#
# It runs the Go test TestNodeDemo (test/demo): a node in network namespaces
# (cloud fabric with an anti-spoofing gateway, fake spiderpool-agent, the
# node's master link), aether-agent and aether-proxy as processes, four pods
# through the real conflist eni-vlan -> aether-cni, a short report, and a
# full teardown. Every expected outcome is asserted: the exit status is
# non-zero when any did not happen.
#
# Where the running kernel has 802.1Q the demo runs natively; otherwise it
# runs the same test binary inside the qemu VM lane (test/vm) and says so.
# Ctrl-C tears everything down (the test stops its daemons and removes its
# namespaces; in the VM lane, qemu and everything in it simply end).
set -uo pipefail
cd "$(dirname "$0")/.."

if [ "$(id -u)" != 0 ]; then
  echo "make demo needs root (network namespaces, nftables, qemu lane)" >&2
  exit 1
fi

GO=${GO:-go}
export GOFLAGS=${GOFLAGS:--buildvcs=false}

# Does this kernel have 802.1Q? Try a VLAN link on a veth in a scratch netns
# (never in the machine's own network namespace).
has_8021q() {
  command -v ip >/dev/null 2>&1 || return 1
  local ns="aetdemo-probe-$$"
  ip netns add "$ns" 2>/dev/null || return 1
  local ok=1
  if ip -n "$ns" link add dq0 type veth peer name dq1 2>/dev/null &&
     ip -n "$ns" link add link dq0 name dq0.5 type vlan id 5 2>/dev/null; then
    ok=0
  fi
  ip netns del "$ns" 2>/dev/null
  return $ok
}

# The demo runs as a compiled test binary in its own session and process
# group, so a Ctrl-C reaches this script first, which then asks the test
# (and, in the VM lane, qemu) to stop with SIGTERM and waits for the
# teardown: the test stops its daemons, deletes its pods and removes its
# namespaces in its cleanups.
tmp=$(mktemp -d /tmp/aether-demo.XXXXXX)
child=""
on_signal() {
  echo
  echo "demo: interrupted: tearing everything down"
  if [ -n "$child" ]; then
    kill -TERM -- "-$child" 2>/dev/null
    wait "$child" 2>/dev/null
  fi
  rm -rf "$tmp"
  exit 130
}
trap on_signal INT TERM
trap 'rm -rf "$tmp"' EXIT

start=$(date +%s)
if ! $GO test -c -o "$tmp/demo.test" ./test/demo; then
  echo "demo: FAILED: the demo test binary does not build" >&2
  exit 1
fi
if has_8021q; then
  echo "demo: this kernel has 802.1Q: running the demo natively"
  (cd test/demo && AETHER_DEMO=1 exec setsid "$tmp/demo.test" -test.v -test.count=1 -test.timeout 5m -test.run '^TestNodeDemo$') &
else
  echo "demo: this kernel has no 802.1Q: running the demo inside the qemu VM lane"
  (cd test/demo && exec setsid "$tmp/demo.test" -test.v -test.count=1 -test.timeout 15m -test.run '^TestNodeDemoInVM$') &
fi
child=$!
wait "$child"
rc=$?
child=""
echo "demo: finished in $(( $(date +%s) - start ))s with exit status $rc"
if [ "$rc" != 0 ]; then
  echo "demo: FAILED: at least one expected outcome did not happen (see the [FAIL] lines above)" >&2
fi
exit "$rc"
