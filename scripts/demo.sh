#!/usr/bin/env bash
# The whole-node demo (issue 7) is not built yet. Until it is, this prints what
# exists so far and says plainly what does not; it never pretends.
set -euo pipefail
cd "$(dirname "$0")/.."
echo "aether-node demo: the whole-node scenario (eni-vlan -> aether-cni -> agent -> proxy) is NOT built yet."
echo
echo "Built so far (bin/):"
for b in bin/*; do
  [ -f "$b" ] && [ -x "$b" ] && echo "  $(basename "$b")"
done
echo
echo "Run 'make test' (as root) to exercise each component against real namespaces, libcni and the other real parts."
