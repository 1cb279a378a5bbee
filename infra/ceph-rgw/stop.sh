#!/usr/bin/env bash
# Stops the cluster started by start.sh DIR (every daemon whose config lives in DIR).
set -uo pipefail
dir=$(realpath -m "${1:?usage: stop.sh DIR}")
pkill -f -- "-c $dir/ceph.conf" || true
for _ in $(seq 1 50); do pgrep -f -- "-c $dir/ceph.conf" >/dev/null || exit 0; sleep 0.2; done
pkill -9 -f -- "-c $dir/ceph.conf" || true
