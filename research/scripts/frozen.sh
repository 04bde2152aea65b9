#!/usr/bin/env bash
# Run a long queue (research/scripts/general.sh, research/scripts/results.sh) from a frozen copy of HEAD: bash reads a script as it
# runs it and every step imports rarecache afresh, so edits to the work tree would otherwise change the code
# under a running evaluation. Each queue has its own copy (frozen-QUEUE), so queues run side by side; stop a
# queue before starting it again (its copy is replaced):
#   nohup bash research/scripts/frozen.sh research/scripts/general.sh >> ~/.cache/rarecache/runs/general.log 2>&1 &
set -euo pipefail
cd "$(dirname "$0")/../.."
[ $# -eq 1 ] && [ -f "$1" ] || { echo "usage: bash research/scripts/frozen.sh research/scripts/QUEUE.sh" >&2; exit 2; }
wt=${FROZEN:-$HOME/.cache/rarecache/frozen-$(basename "$1" .sh)}
git worktree remove --force "$wt" 2>/dev/null || rm -rf "$wt"
git worktree prune
git worktree add --detach "$wt" HEAD
export PYTHONPATH=$wt OMP_WAIT_POLICY=PASSIVE  # PASSIVE: idle OpenMP threads yield the cores (2x faster shared)
exec bash "$wt/$1"
