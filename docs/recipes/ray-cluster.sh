#!/bin/bash
# A Ray cluster for `ds4-eval run --ray`, by hand (or let your platform start one: KubeRay, a
# Slurm allocation, `ray up`). Every node needs ds4eval with the `ray` extra and the model file
# at the same path; the driver runs on a node of the cluster (its shard traces are written there).
#
#   on the head:     docs/recipes/ray-cluster.sh head
#   on each worker:  docs/recipes/ray-cluster.sh worker HEAD_IP
#   then, on the head:
#     ds4-eval run --ray auto --suite core --device cuda --trace runs/core.trace
#
# The engine backend gets one task per GPU (--device cuda) or per --threads CPUs; server backends
# one task per CPU, each with --concurrency requests in flight. A worker that dies has its shard
# re-run by Ray, and only the cases it had not finished run again; run the same command after a
# driver crash and it resumes from runs/core.trace.shards/.
set -euo pipefail
port=${RAY_PORT:-6379}
case "${1:-}" in
  head)   ray start --head --port "$port" --num-cpus "${HEAD_CPUS:-0}" --include-dashboard false ;;
  worker) ray start --address "${2:?HEAD_IP}:$port" ${WORKER_CPUS:+--num-cpus "$WORKER_CPUS"} ;;
  *)      echo "usage: $0 head | worker HEAD_IP" >&2; exit 2 ;;
esac
