#!/bin/bash
# Slurm job array: one task per shard, then a dependent job merges.
#   sbatch --array=1-4 slurm-array.sh
#   sbatch --dependency=afterany:<array job id> --wrap 'bash slurm-array.sh merge'
#SBATCH --job-name=mla-doctor-audit
#SBATCH --cpus-per-task=2
#SBATCH --time=00:15:00
#SBATCH --output=mla-doctor-%A_%a.log
set -u
INVENTORY=${INVENTORY:-$HOME/mla-doctor/inventory.yaml}
OUT=${OUT:-$HOME/mla-doctor/reports}
mkdir -p "$OUT"
if [ "${1:-}" = merge ]; then
  # mla-doctor: merge
  mla-doctor report merge "$OUT"/shard-*.json -o "$OUT/fleet.json" --html "$OUT/fleet.html" --junit "$OUT/fleet.xml"
  exit $?
fi
# mla-doctor: shard
mla-doctor audit -i "$INVENTORY" --shard "$SLURM_ARRAY_TASK_ID/$SLURM_ARRAY_TASK_COUNT" --format json -o "$OUT/shard-$SLURM_ARRAY_TASK_ID.json"
