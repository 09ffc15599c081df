#!/usr/bin/env bash
# Starts N local CPU processes of `python -m jaxgrpo.train`, wired through jax.distributed.
#
#   launch/local_multiprocess.sh N -- --config tiny.py [--config.a.b=v ...]
#
# Each process gets DEVICES_PER_PROCESS virtual CPU devices (default 1) and gloo CPU
# collectives; process i is --config.mesh.process_id=i of N, all talking to a coordinator on
# localhost:PORT (default: a free port). Only process 0 writes logs; every process writes its
# part of each checkpoint. The script waits for all processes and exits with the first failure;
# Ctrl-C stops them all.
set -euo pipefail

if [[ $# -lt 1 || ! "$1" =~ ^[0-9]+$ ]]; then
  echo "usage: $0 N -- <jaxgrpo.train arguments>" >&2
  exit 2
fi
N=$1
shift
if [[ "${1:-}" == "--" ]]; then
  shift
fi
PYTHON=${PYTHON:-python}
DEVICES_PER_PROCESS=${DEVICES_PER_PROCESS:-1}
PORT=${PORT:-$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("localhost", 0)); print(s.getsockname()[1])')}

# The caller's XLA flags are kept; the forced device count is this script's.
xla_flags=""
for flag in ${XLA_FLAGS:-}; do
  [[ "$flag" == --xla_force_host_platform_device_count=* ]] || xla_flags+="$flag "
done
xla_flags+="--xla_force_host_platform_device_count=${DEVICES_PER_PROCESS}"

pids=()
cleanup() {
  for pid in "${pids[@]}"; do
    kill "$pid" 2>/dev/null || true
  done
}
trap cleanup INT TERM

for ((i = 0; i < N; i++)); do
  JAX_PLATFORMS=cpu \
  JAX_CPU_COLLECTIVES_IMPLEMENTATION=gloo \
  XLA_FLAGS="$xla_flags" \
    "$PYTHON" -m jaxgrpo.train "$@" \
    "--config.mesh.coordinator_address=localhost:${PORT}" \
    "--config.mesh.num_processes=${N}" \
    "--config.mesh.process_id=${i}" &
  pids+=($!)
done

status=0
for pid in "${pids[@]}"; do
  wait "$pid" || {
    rc=$?
    if [[ $status -eq 0 ]]; then
      status=$rc
      cleanup
    fi
  }
done
exit $status
