#!/usr/bin/env bash
# A shared filesystem for the local Slurm, as a cluster's /scratch is: MooseFS, its metadata server and its
# storage servers each in a network namespace of its own on the fabric's bridge (slurm/local/fabric.sh),
# their links shaped by tc tbf, and FUSE clients on the host and on the fabric's nodes (n3 and n4; FABRIC_NODES).
#
#   pfs.sh check             say what this machine lacks for it (the fabric's needs, FUSE, the packages)
#   pfs.sh up                install MooseFS if missing, start the metadata server and the storage servers,
#                            mount the filesystem on the host at $PFS_MOUNT (the fabric must be up)
#   pfs.sh node-mount        the client of a fabric node, run in its namespaces before its slurmd (fabric.sh)
#   pfs.sh rate RATE         shape the storage servers' links to RATE (e.g. 200mbit) in place
#   pfs.sh mds-cpu PERCENT   cap the metadata server at PERCENT of one core (100: no cap) in place
#   pfs.sh stop-storage N    stop storage server N (1, 2, ...), as a failed server; start-storage N restarts it
#   pfs.sh served            the bytes the storage servers have sent (their links' counters), for benchmarks
#   pfs.sh status            the servers, their addresses, the rates, the mounts
#   pfs.sh down              unmount, stop the servers, remove their namespaces (the stored chunks stay)
#
# Why MooseFS (GlusterFS 10 also runs here): it has what a parallel filesystem is made of, one metadata
# server that every open and stat goes to and storage servers that hold the data in chunks (64 MiB, as Lustre
# stripes a file over OSTs), where GlusterFS has no metadata server and hashes names to bricks; its client is
# one FUSE daemon per mount that can run in a node's network namespace, so each node's reads cross that
# node's shaped link; flock works on its mount. A "loaded Lustre" is made by the two knobs above: the storage
# links' rate (bandwidth) and a CPU cap on the metadata server (opens and stats per second). Each file is
# kept once (goal 1), as a Lustre stripe is on one OST: a stopped storage server takes its chunks with it.
set -euo pipefail

STATE=${HPCDL_SLURM_STATE:-/var/tmp/hpcdl-slurm}
BRIDGE=${FABRIC_BRIDGE:-hpcdl-fab0}
NET=${FABRIC_NET:-10.77.0}
MASTER=$NET.20                     # the metadata server, in namespace hpfs-m
STORAGE=${PFS_STORAGE:-1 2}        # storage server N in namespace hpfs-sN at $NET.(20+N)
RATE=${PFS_RATE:-1gbit}            # the storage servers' links
MOUNT=${PFS_MOUNT:-$STATE/scratch}
DIR=$STATE/pfs
CGROUP=/sys/fs/cgroup/cpu/hpcdl-pfs-master   # cgroup v1's cpu controller (this kernel's; v2 has cpu.max instead)
PACKAGES="moosefs-master moosefs-chunkserver moosefs-client moosefs-cli"
HERE=$(cd "$(dirname "$0")" && pwd)

say() { echo "pfs: $*"; }
die() { echo "pfs: error: $*" >&2; exit 1; }

missing() {
    bash "$HERE/fabric.sh" check >/dev/null 2>&1 || echo "the shaped fabric (run 'slurm/local/fabric.sh check')"
    [ -c /dev/fuse ] || echo "FUSE (/dev/fuse: kernel module fuse)"
    [ -f /sys/fs/cgroup/cpu/cpu.cfs_quota_us ] \
        || echo "the cgroup v1 cpu controller at /sys/fs/cgroup/cpu (the metadata server's CPU cap)"
}

install_packages() {
    local need; need=$(for p in $PACKAGES; do dpkg-query -W -f='${Status}\n' "$p" 2>/dev/null | grep -q 'ok installed' || echo "$p"; done)
    [ -z "$need" ] && return 0
    say "installing $(echo $need)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >/dev/null
    # shellcheck disable=SC2086
    apt-get install -y -qq --no-install-recommends $need >/dev/null
}

in_ns() { local ns=$1; shift; nsenter --net="/run/netns/$ns" "$@"; }

namespace() {  # namespace NAME ADDRESS RATE: a namespace on the bridge, its link shaped both ways
    local ns=$1 addr=$2 rate=$3 port="hpcdl-${1#hpfs-}"
    ip netns list | grep -qw "$ns" || ip netns add "$ns"
    ip link show "$port" >/dev/null 2>&1 || ip link add "$port" type veth peer name eth0 netns "$ns"
    ip link set "$port" master "$BRIDGE" up
    ip -n "$ns" addr replace "$addr/24" dev eth0
    ip -n "$ns" link set eth0 up
    ip -n "$ns" link set lo up
    [ -z "$rate" ] || shape_link "$ns" "$port" "$rate"
}

shape_link() {  # the fabric's rule: a 2 ms bucket, at least 64 KiB
    local ns=$1 port=$2 rate=$3 bits burst
    bits=$(FABRIC_BRIDGE=$BRIDGE bash "$HERE/fabric.sh" bits "$rate") || exit 1
    burst=$(( bits / 8 / 500 )); [ "$burst" -ge 65536 ] || burst=65536
    tc -n "$ns" qdisc replace dev eth0 root tbf rate "$rate" burst "$burst" latency 100ms
    tc qdisc replace dev "$port" root tbf rate "$rate" burst "$burst" latency 100ms
}

master_cfg() {
    mkdir -p "$DIR/master"
    [ -s "$DIR/master/metadata.mfs" ] || [ -s "$DIR/master/metadata.mfs.back" ] \
        || printf 'MFSM NEW' > "$DIR/master/metadata.mfs"  # a new, empty filesystem (moosefs-master's metadata.mfs.empty)
    # every client of the fabric's network, as root, may mount the whole tree
    printf '%s\n' "$NET.0/24 / rw,alldirs,admin,maproot=0:0" "$NET.0/24 . rw" > "$DIR/master/mfsexports.cfg"
    : > "$DIR/master/mfstopology.cfg"
    cat > "$DIR/master/mfsmaster.cfg" <<CFG
WORKING_USER = root
WORKING_GROUP = root
SYSLOG_IDENT = hpcdl-mfsmaster
NICE_LEVEL = 0
DATA_PATH = $DIR/master
EXPORTS_FILENAME = $DIR/master/mfsexports.cfg
TOPOLOGY_FILENAME = $DIR/master/mfstopology.cfg
MATOCS_LISTEN_HOST = $MASTER
MATOCL_LISTEN_HOST = $MASTER
MATOML_LISTEN_HOST = $MASTER
# a storage server that stops is dropped after this many seconds, and its chunks are then reported missing
MATOCS_TIMEOUT = 10
# no rebalancing: a Lustre does not move stripes between OSTs on its own, and the moves would count as reads in
# the storage servers' link counters (pfs.sh served: 6.4 MB in an epoch that read nothing, bench data-path)
ACCEPTABLE_PERCENTAGE_DIFFERENCE = 10.0
CHUNKS_WRITE_REP_LIMIT = 2,1,0,0
CHUNKS_READ_REP_LIMIT = 10,5,0,0
CFG
}

storage_cfg() {  # storage_cfg N
    local d="$DIR/cs$1"
    mkdir -p "$d/chunks"
    echo "$d/chunks" > "$d/mfshdd.cfg"
    cat > "$d/mfschunkserver.cfg" <<CFG
WORKING_USER = root
WORKING_GROUP = root
SYSLOG_IDENT = hpcdl-mfschunkserver$1
NICE_LEVEL = 0
DATA_PATH = $d
HDD_CONF_FILENAME = $d/mfshdd.cfg
HDD_LEAVE_SPACE_DEFAULT = 1GiB
MASTER_HOST = $MASTER
BIND_HOST = $NET.$(( 20 + $1 ))
CSSERV_LISTEN_HOST = $NET.$(( 20 + $1 ))
CFG
}

daemon_up() {  # daemon_up NAMESPACE BINARY CONFIG [OPTION...]: started unless its lock says it runs
    local ns=$1 bin=$2 cfg=$3; shift 3
    in_ns "$ns" "$bin" -c "$cfg" test >/dev/null 2>&1 && return 0
    in_ns "$ns" "$bin" -c "$cfg" "$@" start >"$DIR/$(basename "$(dirname "$cfg")").log" 2>&1 \
        || die "$(basename "$bin") in namespace $ns did not start: $(tail -3 "$DIR/$(basename "$(dirname "$cfg")").log")"
}

mounted() { grep -qs "^mfs.* $1 fuse " /proc/self/mounts; }
answers() { timeout 10 stat -f "$1" >/dev/null 2>&1; }

release_dead() {  # a FUSE mount whose client is gone (a machine restored without its processes) stays in the
    # mount table and fails every stat with ENOTCONN ("Transport endpoint is not connected"), mkdir -p included
    grep -qs " $1 fuse" /proc/self/mounts && ! answers "$1" || return 0
    say "$1: a mount whose client is gone ($(stat "$1" 2>&1 | sed 's/.*: //')); unmounting it"
    umount -l "$1"
}

client() {  # client [OPTIONS]: the FUSE client, in the caller's network namespace, at $MOUNT
    release_dead "$MOUNT"
    mkdir -p "$MOUNT"
    mounted "$MOUNT" && return 0
    # mfsioretries: a read of a stopped storage server's chunk fails in about 30 s (8 tries) instead of minutes
    mfsmount "$MOUNT" -H "$MASTER" -o mfsioretries=8 "$@" >"$DIR/mount-$(hostname -s).log" 2>&1 \
        || die "mfsmount $MOUNT failed: $(tail -3 "$DIR/mount-$(hostname -s).log")"
}

cap_master() {  # cap_master PERCENT
    local pct=$1 pid
    [[ "$pct" =~ ^[0-9]+$ ]] && [ "$pct" -ge 1 ] || die "mds-cpu '$pct': give a percent of one core, 1 or more (100: no cap)"
    mkdir -p "$CGROUP"
    echo 100000 > "$CGROUP/cpu.cfs_period_us"
    if [ "$pct" -ge 100 ]; then echo -1 > "$CGROUP/cpu.cfs_quota_us"; else echo $(( pct * 1000 )) > "$CGROUP/cpu.cfs_quota_us"; fi
    pid=$(cat "$DIR/master/.mfsmaster.lock" 2>/dev/null | tr -dc 0-9)
    [ -n "$pid" ] || pid=$(pgrep -f "mfsmaster -c $DIR/master/mfsmaster.cfg" | head -1)
    [ -n "$pid" ] && echo "$pid" > "$CGROUP/cgroup.procs"  # every thread of it
    echo "$pct" > "$DIR/mds-cpu"
}

up() {
    local why; why=$(missing)
    [ -z "$why" ] || die "this machine cannot host the shared filesystem; it lacks:
$why"
    ip link show "$BRIDGE" >/dev/null 2>&1 || die "the fabric is down; run 'slurm/local/fabric.sh up' first"
    rm -f "$DIR/up"  # set again only when all of it is up: fabric.sh slurmd mounts it on the nodes then
    install_packages
    mkdir -p "$DIR"
    namespace hpfs-m "$MASTER" ""
    master_cfg
    # -a: a metadata server that was killed (a machine restarted with /var/tmp kept) left metadata.mfs.back and
    # its change logs, not metadata.mfs; it then starts only when told to replay them
    daemon_up hpfs-m /usr/sbin/mfsmaster "$DIR/master/mfsmaster.cfg" -a
    in_ns hpfs-m /usr/sbin/mfsmaster -c "$DIR/master/mfsmaster.cfg" reload >/dev/null 2>&1 || true  # a running one
    cap_master "$(cat "$DIR/mds-cpu" 2>/dev/null || echo 100)"
    for n in $STORAGE; do
        namespace "hpfs-s$n" "$NET.$(( 20 + n ))" "$RATE"
        storage_cfg "$n"
        daemon_up "hpfs-s$n" /usr/sbin/mfschunkserver "$DIR/cs$n/mfschunkserver.cfg"
    done
    echo "$RATE" > "$DIR/rate"
    client
    # one copy of each chunk, as a Lustre stripe lives on one OST; a removed file's chunks freed at once (MooseFS
    # keeps them in its trash for a day by default: the tests' datasets would fill /var/tmp)
    mfssetgoal -r 1 "$MOUNT" >/dev/null
    mfssettrashtime -r 0 "$MOUNT" >/dev/null
    wait_storage || die "not every storage server registered with the metadata server within 30 s: $(mfscli -H "$MASTER" -SCS 2>&1 | tail -3 | tr '\n' ' ')"
    touch "$DIR/up"  # fabric.sh slurmd mounts it on the nodes
    say "up: metadata server $MASTER, storage servers $(for n in $STORAGE; do printf '%s.%s ' "$NET" $(( 20 + n )); done)(links shaped to $RATE), mounted at $MOUNT"
}

wait_storage() {  # until every storage server has registered with the metadata server
    local want; want=$(echo $STORAGE | wc -w)
    for _ in $(seq 150); do
        [ "$(mfscli -H "$MASTER" -SCS 2>/dev/null | grep -c "^chunk servers:")" -ge "$want" ] && return 0
        sleep 0.2
    done
    return 1
}

status() {
    ip netns list | grep -qw hpfs-m || { say "down"; return 1; }
    say "metadata server $MASTER (namespace hpfs-m), CPU cap $(cat "$DIR/mds-cpu" 2>/dev/null || echo 100)% of a core"
    for n in $STORAGE; do
        local state=stopped
        in_ns "hpfs-s$n" /usr/sbin/mfschunkserver -c "$DIR/cs$n/mfschunkserver.cfg" test >/dev/null 2>&1 && state=running
        say "storage server $n: $NET.$(( 20 + n )) (namespace hpfs-s$n), $state, $(tc -n "hpfs-s$n" qdisc show dev eth0 | head -1)"
    done
    if mounted "$MOUNT"; then say "mounted on the host at $MOUNT"; else say "not mounted on the host"; fi
}

down() {
    release_dead "$MOUNT"
    mounted "$MOUNT" && { umount "$MOUNT" 2>/dev/null || umount -l "$MOUNT"; }
    for n in $STORAGE; do
        [ -f "$DIR/cs$n/mfschunkserver.cfg" ] && in_ns "hpfs-s$n" /usr/sbin/mfschunkserver -c "$DIR/cs$n/mfschunkserver.cfg" stop >/dev/null 2>&1 || true
    done
    [ -f "$DIR/master/mfsmaster.cfg" ] && in_ns hpfs-m /usr/sbin/mfsmaster -c "$DIR/master/mfsmaster.cfg" stop >/dev/null 2>&1 || true
    for ns in hpfs-m $(for n in $STORAGE; do echo "hpfs-s$n"; done); do
        if ip netns list | grep -qw "$ns"; then
            for p in $(ip netns pids "$ns"); do kill -9 "$p" 2>/dev/null || true; done
            ip netns del "$ns"
        fi
        ip link del "hpcdl-${ns#hpfs-}" 2>/dev/null || true
    done
    rmdir "$CGROUP" 2>/dev/null || true
    rm -f "$DIR/up"
    say "down: servers stopped, namespaces removed (the stored data stays in $DIR)"
}

case "${1:-}" in
    check) why=$(missing); if [ -n "$why" ]; then echo "pfs: this machine lacks:"; echo "$why"; exit 1; fi; say "this machine can host the shared filesystem" ;;
    up) up ;;
    node-mount)  # in a node's private mount namespace, the host's mount copied there gives way to the node's own
        [ "$(readlink /proc/self/ns/mnt)" != "$(readlink /proc/1/ns/mnt)" ] \
            || die "node-mount runs in a node's private mount namespace (fabric.sh slurmd), not on the host"
        if mounted "$MOUNT"; then umount -l "$MOUNT"; fi
        # No page cache on the nodes: the simulated nodes share one kernel and its RAM, and ImageNet does not fit a
        # node's; what a node reads twice, it reads twice from the storage servers, as on a cluster.
        client -o mfscachemode=DIRECT ;;
    rate) [ -n "${2:-}" ] || die "give a rate, e.g. 'pfs.sh rate 200mbit'"
          for n in $STORAGE; do shape_link "hpfs-s$n" "hpcdl-s$n" "$2"; done; echo "$2" > "$DIR/rate"; say "storage links shaped to $2" ;;
    mds-cpu) cap_master "${2:-}"; say "metadata server capped at ${2}% of a core" ;;
    stop-storage) [ -n "${2:-}" ] || die "give the storage server's number"
                  in_ns "hpfs-s$2" /usr/sbin/mfschunkserver -c "$DIR/cs$2/mfschunkserver.cfg" stop >/dev/null; say "storage server $2 stopped" ;;
    start-storage) [ -n "${2:-}" ] || die "give the storage server's number"
                   daemon_up "hpfs-s$2" /usr/sbin/mfschunkserver "$DIR/cs$2/mfschunkserver.cfg"
                   wait_storage || die "storage server $2 did not register within 30 s"; say "storage server $2 started" ;;
    served)  # the bytes every storage server has sent since it came up (its link's counter): what the filesystem
             # served, with its protocol's and TCP's headers; a benchmark reads it before and after (bench data-path)
        total=0
        for n in $STORAGE; do
            sent=$(nsenter --net="/run/netns/hpfs-s$n" cat /proc/net/dev | awk '$1 == "eth0:" {print $10}')
            [ -n "$sent" ] || die "storage server $n: no counter of its link (is the filesystem up? 'pfs.sh status')"
            total=$(( total + sent ))
        done
        echo "$total" ;;
    status) status ;;
    down) down ;;
    *) sed -n '5,15p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
