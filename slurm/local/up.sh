#!/usr/bin/env bash
# Start a throwaway Slurm on this machine: munge, MariaDB + slurmdbd (so that sacct works),
# slurmctld, and slurmd daemons that simulate nodes. Used by `make test` and `make demo`.
#   partition debug (default): n1 and n2, on the host's loopback;
#   partition fabric: n3 and n4, each in its own network namespace on a bridge, links shaped by tc tbf to
#   FABRIC_RATE (default 1gbit; slurm/local/fabric.sh). FABRIC=0 leaves the fabric out; where the machine
#   cannot host it, up.sh says what is missing and starts the debug partition alone (in CI: an error);
#   a shared filesystem (MooseFS, slurm/local/pfs.sh) at $STATE/scratch, as a cluster's /scratch: its servers in
#   namespaces on the fabric's bridge, mounted on the host and on n3 and n4 through their own links (PFS=0
#   leaves it out; it needs the fabric; in CI, a machine that cannot host it is an error);
#   partition wide: n11 to n26 (WIDE_NODES of them, default 16), on loopback, for many-rank rehearsals.
#   Every simulated node claims all of the host's CPUs (at least 2, so that it takes 2 tasks): they share
#   the same cores, so a 32-rank job here runs 16-fold oversubscribed on a 2-core host. Times are
#   inflated; what grows with the number of ranks (connections, requests, files read) is not.
#
# It does nothing when a Slurm already answers. It needs root, and no systemd: every daemon is started
# by hand and tracked by its PID file under $HPCDL_SLURM_STATE. `slurm/local/down.sh` stops them.
# The settings that keep tests fast are commented in the slurm.conf written below.
set -euo pipefail

STATE=${HPCDL_SLURM_STATE:-/var/tmp/hpcdl-slurm}
CONF=/etc/slurm/slurm.conf
MARK="# written by hpcdl slurm/local/up.sh"
PACKAGES="slurmctld slurmd slurm-client munge libpmix-dev slurmdbd mariadb-server"

say() { echo "local-slurm: $*"; }
die() { echo "local-slurm: error: $*" >&2; exit 1; }

slurm_answers() { command -v sinfo >/dev/null && timeout 10 sinfo -h -o %P >/dev/null 2>&1; }

FABRIC=${FABRIC:-1}
WIDE_NODES=${WIDE_NODES:-16}
wide_last=$(( 10 + WIDE_NODES ))
HERE=$(cd "$(dirname "$0")" && pwd)
PFS=${PFS:-1}; [ "$FABRIC" != 0 ] || PFS=0
# FABRIC_NODES="3 4 5 6 7 8 9 10": more namespace nodes on the fabric (5 to 10), in a partition fabric-all beside
# fabric (n3 and n4 alone, as the tests expect), for the benchmarks that count what grows with nodes (bench data-path)
FABRIC_NODES=${FABRIC_NODES:-3 4}
for x in $FABRIC_NODES; do
    [[ "$x" =~ ^([3-9]|10)$ ]] || die "FABRIC_NODES='$FABRIC_NODES': fabric nodes are numbered 3 to 10 (n3..n10)"
done
[ "$(printf '%s\n' $FABRIC_NODES | sort -u | wc -l)" = "$(echo $FABRIC_NODES | wc -w)" ] \
    || die "FABRIC_NODES='$FABRIC_NODES' names a node twice"
[[ " $FABRIC_NODES " == *" 3 "* && " $FABRIC_NODES " == *" 4 "* ]] \
    || die "FABRIC_NODES='$FABRIC_NODES' must hold 3 and 4 (partition fabric, n3 and n4)"
fabric_count=$(echo $FABRIC_NODES | wc -w)
# ready: up and mounted, or (outside CI) recorded as impossible here, so that a machine without it does not restart
# Slurm at every call
# a listing, not a statfs: the client answers statfs with its metadata server gone (CI, 2026-11-29: every read EIO)
pfs_ready() { [ "$PFS" = 0 ] || { [ -e "$STATE/pfs/up" ] && grep -qs "^mfs.* $STATE/scratch fuse " /proc/self/mounts \
                                    && timeout 10 ls "$STATE/scratch" >/dev/null 2>&1; } \
              || { [ "${CI:-}" != true ] && [ -e "$STATE/pfs/unavailable" ]; }; }
# a node in two partitions (fabric-all) is listed twice by sinfo -N: counted once
up_nodes() { timeout 10 sinfo -h -N ${1:+-p "$1"} -o '%N %T' 2>/dev/null | sort -u | grep -c -E ' (idle|mixed|allocated)$' || true; }

if slurm_answers && [ "$(up_nodes)" -gt 0 ]; then
    if ! grep -qF "$MARK" "$CONF" 2>/dev/null || { { [ "$FABRIC" = 0 ] || { [ "$(up_nodes fabric)" -ge 2 ] \
            && { [ "$fabric_count" = 2 ] || [ "$(up_nodes fabric-all)" -ge "$fabric_count" ]; }; }; } \
            && [ "$(up_nodes wide)" -ge "$WIDE_NODES" ] && pfs_ready; }; then
        say "a Slurm already answers ($(sinfo -h -o '%P %D %T' | tr '\n' ';')); nothing to start"
        exit 0
    fi
    say "the local Slurm answers without its fabric, its wide partition or its shared filesystem; restarting it with them"
    bash "$HERE/down.sh"
fi
[ "$(id -u)" = 0 ] || die "no Slurm answers, and starting a local one needs root (run 'sudo $0')"

fabric_nodes=""
if [ "$FABRIC" != 0 ]; then
    if FABRIC_NODES="$FABRIC_NODES" bash "$HERE/fabric.sh" up; then
        fabric_nodes=$(for x in $FABRIC_NODES; do printf 'n%s ' "$x"; done)
        echo "$FABRIC_NODES" > "$STATE/fabric-nodes"  # fabric.sh's later calls (down.sh) take every node
    elif [ "${CI:-}" = true ]; then
        die "CI needs the shaped fabric (partition fabric); see what fabric.sh says is missing above"
    else
        say "no fabric partition: the machine cannot host it (above); starting nodes n1 n2 only"
    fi
fi

if [ -n "$fabric_nodes" ] && [ "$PFS" != 0 ]; then
    if PFS_MOUNT="$STATE/scratch" bash "$HERE/pfs.sh" up; then
        rm -f "$STATE/pfs/unavailable"
    else
        [ "${CI:-}" != true ] || die "CI needs the shared filesystem (slurm/local/pfs.sh); see what it says above"
        rm -f "$STATE/pfs/up"; mkdir -p "$STATE/pfs"; date > "$STATE/pfs/unavailable"
        say "no shared filesystem: it did not come up (above; 'rm $STATE/pfs/unavailable' and up.sh try again); the fabric's nodes start without it"
    fi
fi

missing=$(for p in $PACKAGES; do dpkg-query -W -f='${Status}\n' "$p" 2>/dev/null | grep -q 'ok installed' || echo "$p"; done)
if [ -n "$missing" ]; then
    say "installing $(echo $missing)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >/dev/null
    # shellcheck disable=SC2086
    apt-get install -y -qq --no-install-recommends $missing >/dev/null
fi

if [ -f "$CONF" ] && ! grep -qF "$MARK" "$CONF"; then
    die "$CONF exists and was not written by hpcdl; refusing to overwrite a real Slurm's configuration"
fi

host=$(hostname -s)
ncpu=$(nproc)
mem_mb=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 / 2 ))   # half the RAM for each node
mkdir -p "$STATE"/{log,state,mariadb} /run/munge /run/mysqld
wide_nodes=$(seq -f 'n%g' 11 "$wide_last" | tr '\n' ' ')
for n in n1 n2 $fabric_nodes $wide_nodes; do mkdir -p "$STATE/spool/$n" "$STATE/tmp/$n"; done
chown munge:munge /run/munge; chown mysql:mysql /run/mysqld "$STATE/mariadb"

pid_alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }
wait_for() {  # wait_for SECONDS DESCRIPTION COMMAND...
    local n=$1 what=$2; shift 2
    for _ in $(seq $((n * 5))); do "$@" >/dev/null 2>&1 && return 0; sleep 0.2; done
    die "$what did not come up within ${n}s; logs are in $STATE/log"
}

# munge: every Slurm message is signed with this key.
[ -s /etc/munge/munge.key ] || { mungekey --create --force; chown munge:munge /etc/munge/munge.key; }
if ! pid_alive /run/munge/munged.pid; then
    su -s /bin/sh munge -c "/usr/sbin/munged --pid-file=/run/munge/munged.pid" \
        || /usr/sbin/munged --force --pid-file=/run/munge/munged.pid
fi
wait_for 10 munge sh -c 'munge -n | unmunge'

# MariaDB for slurmdbd (accounting: submitit sees a cancelled job end only through sacct).
if ! pid_alive "$STATE/mariadb/mariadb.pid"; then
    [ -d /var/lib/mysql/mysql ] || mariadb-install-db --user=mysql --datadir=/var/lib/mysql >/dev/null
    setsid /usr/sbin/mariadbd --user=mysql --skip-networking --pid-file="$STATE/mariadb/mariadb.pid" \
        --log-error="$STATE/mariadb/mariadb.log" </dev/null >/dev/null 2>&1 &
fi
wait_for 30 MariaDB mariadb -e 'select 1'
mariadb -e 'create database if not exists slurm_acct_db'

cat > /etc/slurm/slurmdbd.conf <<CONF
$MARK
AuthType=auth/munge
DbdHost=localhost
SlurmUser=root
PidFile=$STATE/slurmdbd.pid
LogFile=$STATE/log/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=root
StorageLoc=slurm_acct_db
CONF
chmod 600 /etc/slurm/slurmdbd.conf

# slurmd in the fabric's namespaces reach the controller at the bridge's address
controller=127.0.0.1; [ -n "$fabric_nodes" ] && controller=10.77.0.254
fabric_conf=""
if [ -n "$fabric_nodes" ]; then
    fabric_conf="# The shaped fabric (slurm/local/fabric.sh): each node in its namespace hX, hostname nX, at 10.77.0.X,
# bound to half the cores (CPUs counts them all, so that a node takes 2 tasks on a 2-core host).
$(for x in $FABRIC_NODES; do echo "NodeName=n$x NodeHostname=n$x NodeAddr=10.77.0.$x Port=$(( 7000 + x )) CPUs=$ncpu RealMemory=$mem_mb State=UNKNOWN"; done)
PartitionName=fabric Nodes=n[3-4] MaxTime=INFINITE State=UP
$([ "$fabric_count" = 2 ] || echo "PartitionName=fabric-all Nodes=$(echo $fabric_nodes | tr ' ' ',') MaxTime=INFINITE State=UP")
# On the fabric's nodes, MPICH's UCX must use TCP (the script says why).
TaskProlog=$STATE/fabric-task-prolog.sh"
    install -m 755 "$HERE/fabric-task-prolog.sh" "$STATE/fabric-task-prolog.sh"  # outlives the checkout
fi
cat > "$CONF" <<CONF
$MARK
ClusterName=hpcdl
SlurmctldHost=$host($controller)
SlurmUser=root
AuthType=auth/munge
# A requeued job would otherwise wait 120 s for the old credential to expire.
AuthInfo=cred_expire=5
# No cgroups in this sandbox.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
ReturnToService=2
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd-%n.pid
SlurmdSpoolDir=$STATE/spool/%n
StateSaveLocation=$STATE/state
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd-%n.log
# Per-node TmpFS, or the two simulated nodes' PMIx directories collide.
TmpFS=$STATE/tmp/%n
# Schedule at once instead of every few seconds.
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0,sched_interval=1,bf_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MailProg=/bin/true
KillWait=2
MinJobAge=600
SlurmdParameters=config_overrides
# Each slurmd listens on 7000 + its number: below hpcdl's rendezvous ports (15000-29999, derived from the job
# id), which a job step on these nodes would otherwise meet (job 103's step 0 drew 17013, n13's port)
NodeName=n[1-2] NodeHostname=$host NodeAddr=127.0.0.1 Port=[7001-7002] CPUs=$ncpu RealMemory=$mem_mb State=UNKNOWN
PartitionName=debug Nodes=n[1-2] Default=YES MaxTime=INFINITE State=UP
# Many-rank rehearsals: nodes that share this host's cores (see the top of up.sh).
NodeName=n[11-$wide_last] NodeHostname=$host NodeAddr=127.0.0.1 Port=[7011-$(( 7000 + wide_last ))] CPUs=$(( ncpu > 2 ? ncpu : 2 )) RealMemory=$mem_mb State=UNKNOWN
PartitionName=wide Nodes=n[11-$wide_last] MaxTime=INFINITE State=UP
$fabric_conf
CONF

if ! pid_alive "$STATE/slurmdbd.pid"; then /usr/sbin/slurmdbd; fi
wait_for 30 slurmdbd sacctmgr -n list cluster
sacctmgr -i -Q add cluster hpcdl >/dev/null 2>&1 || true

if ! pid_alive "$STATE/slurmctld.pid"; then /usr/sbin/slurmctld; fi
for n in n1 n2 $wide_nodes; do
    pid_alive "$STATE/slurmd-$n.pid" || /usr/sbin/slurmd -N "$n"
done
if [ -n "$fabric_nodes" ]; then FABRIC_NODES="$FABRIC_NODES" bash "$HERE/fabric.sh" slurmd; fi
wait_for 30 slurmctld scontrol ping
all_nodes="n1 n2 $fabric_nodes $wide_nodes"
node_ready() { [ "$(up_nodes)" -eq "$(echo $all_nodes | wc -w)" ]; }
for _ in $(seq 150); do node_ready && break; scontrol update nodename="$(echo $all_nodes | tr ' ' ,)" state=resume >/dev/null 2>&1 || true; sleep 0.2; done
node_ready || die "nodes $all_nodes are not all idle: $(sinfo -N -h -o '%N %T %E' | tr '\n' ';')"
say "up: partition debug, nodes n1 n2${fabric_nodes:+; partition fabric, nodes ${fabric_nodes% } over links shaped to $(cat "$STATE/hpcdl-fab0.rate")}$([ ! -e "$STATE/pfs/up" ] || echo "; shared filesystem at $STATE/scratch") ($ncpu CPUs each); partition wide, nodes n[11-$wide_last] sharing this host's cores; accounting in slurmdbd; state in $STATE"
