#!/usr/bin/env bash
# Stop the throwaway Slurm that slurm/local/up.sh started (and nothing else), and remove its shaped fabric.
# It waits for each daemon to exit, so that up.sh right after it starts fresh ones.
set -u
STATE=${HPCDL_SLURM_STATE:-/var/tmp/hpcdl-slurm}
for f in "$STATE"/slurmd-n1.pid "$STATE"/slurmd-n2.pid "$STATE"/slurmd-n1[0-9].pid "$STATE"/slurmd-n2[0-9].pid "$STATE"/slurmctld.pid "$STATE"/slurmdbd.pid "$STATE"/mariadb/mariadb.pid; do
    [ -f "$f" ] || continue
    pid=$(cat "$f")
    kill "$pid" 2>/dev/null || continue
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    echo "local-slurm: stopped $(basename "$f" .pid)"
done
if [ "$(id -u)" = 0 ]; then
    bash "$(dirname "$0")/fabric.sh" down  # the nodes first: their mounts of the shared filesystem go with them
    bash "$(dirname "$0")/pfs.sh" down
fi
exit 0
