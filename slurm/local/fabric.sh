#!/usr/bin/env bash
# A shaped network for the local Slurm: nodes n3 and n4 (FABRIC_NODES: up to n10), each in its own network
# namespace (h3, h4) and its own UTS namespace (hostname n3, n4), on a private bridge, each link shaped by tc tbf.
#
#   fabric.sh check          say what this machine lacks for the fabric (root, ip netns, veth, bridge, tbf)
#   fabric.sh up [RATE]      create the bridge, the namespaces and the shaped links (RATE: FABRIC_RATE, 1gbit)
#   fabric.sh rate RATE      change both nodes' shaping in place (e.g. 10gbit), without restarting Slurm
#   fabric.sh slurmd         start slurmd n3 in h3 and n4 in h4 (slurm/local/up.sh calls it)
#   fabric.sh status         the nodes, their addresses and the rate
#   fabric.sh down           stop what runs in the namespaces and remove all of it
#
# Each node's slurmd is bound to its half of the host's cores, so two nodes do not share a core.
# Ranks on one node talk inside their namespace (its loopback, and /dev/shm, which is shared); ranks on
# different nodes cross the bridge through two shaped links: the sender node's egress and the bridge's
# port toward the receiver, both at RATE, as a switch port is in each direction. The bridge's address in
# the host's namespace is the controller's (slurmd and srun reach slurmctld there). No namespace has a
# route beyond 10.77.0.0/24, so the traffic stays between these namespaces and the host.
set -euo pipefail

STATE=${HPCDL_SLURM_STATE:-/var/tmp/hpcdl-slurm}
# FABRIC_BRIDGE, FABRIC_NET and FABRIC_NODES make another fabric beside it (the tests' teardown check)
BRIDGE=${FABRIC_BRIDGE:-hpcdl-fab0}
NET=${FABRIC_NET:-10.77.0}
CONTROLLER=$NET.254
# node nX lives in namespace hX at $NET.X; up.sh records the nodes it started (FABRIC_NODES), for down.sh
NODES=${FABRIC_NODES:-$(cat "$STATE/fabric-nodes" 2>/dev/null || echo 3 4)}
# down removes what up.sh recorded too: a FABRIC_NODES inherited from the caller may name fewer nodes
[ "${1:-}" != down ] || NODES=$(printf '%s\n' $NODES $(cat "$STATE/fabric-nodes" 2>/dev/null) | sort -nu | tr '\n' ' ')
RATE=${FABRIC_RATE:-1gbit}

say() { echo "fabric: $*"; }
die() { echo "fabric: error: $*" >&2; exit 1; }

missing() {  # what this machine lacks, one line each; nothing when the fabric can be built
    [ "$(id -u)" = 0 ] || echo "root: network namespaces, veth pairs and tc need root (run 'sudo $0 ...')"
    command -v ip >/dev/null || echo "the ip command (Debian package iproute2)"
    command -v tc >/dev/null || echo "the tc command (Debian package iproute2)"
    command -v unshare >/dev/null && command -v nsenter >/dev/null || echo "the unshare and nsenter commands (Debian package util-linux)"
    [ "$(id -u)" = 0 ] && command -v ip >/dev/null && command -v tc >/dev/null || return 0
    local probe=hfp$$  # interface names: at most 15 characters
    if ! ip netns add "$probe" 2>/dev/null; then echo "network namespaces (ip netns add failed: kernel without CONFIG_NET_NS, or no CAP_SYS_ADMIN)"; return 0; fi
    ip link add "$probe"a type veth peer name "$probe"b 2>/dev/null || echo "veth pairs (kernel module veth)"
    ip link add "$probe"br type bridge 2>/dev/null || echo "bridges (kernel module bridge)"
    if ip link show "$probe"a >/dev/null 2>&1; then
        tc qdisc add dev "$probe"a root tbf rate 1gbit burst 256kb latency 50ms 2>/dev/null \
            || echo "tc tbf shaping (kernel module sch_tbf)"
    fi
    unshare --uts true 2>/dev/null || echo "UTS namespaces (unshare --uts failed: each node needs its own hostname)"
    ip link del "$probe"a 2>/dev/null || true
    ip link del "$probe"br 2>/dev/null || true
    ip netns del "$probe" 2>/dev/null || true
}

rate_bits() {  # 1gbit -> 1000000000, as tc reads it (SI units, bits per second)
    [[ "$1" =~ ^([0-9]+)([kmgt]?)bit$ ]] || die "rate '$1': give it as tc does, e.g. 500mbit, 1gbit, 10gbit"
    local scale=1
    case "${BASH_REMATCH[2]}" in k) scale=1000 ;; m) scale=1000000 ;; g) scale=1000000000 ;; t) scale=1000000000000 ;; esac
    echo $(( BASH_REMATCH[1] * scale ))
}

shape() {  # shape RATE: both directions of every node's link
    local rate=$1 bits burst
    bits=$(rate_bits "$rate") || exit 1
    # tbf's bucket: 2 ms at the rate, at least 64 KiB, so that one GSO packet always fits
    burst=$(( bits / 8 / 500 )); [ "$burst" -ge 65536 ] || burst=65536
    for x in $NODES; do
        tc -n "h$x" qdisc replace dev eth0 root tbf rate "$rate" burst "$burst" latency 100ms
        tc qdisc replace dev "hpcdl-h$x" root tbf rate "$rate" burst "$burst" latency 100ms
    done
    mkdir -p "$STATE"; echo "$rate" > "$STATE/$BRIDGE.rate"
}

up() {
    local why; why=$(missing)
    [ -z "$why" ] || die "this machine cannot host the shaped fabric; it lacks:
$why"
    ip link show "$BRIDGE" >/dev/null 2>&1 || ip link add "$BRIDGE" type bridge
    ip addr replace "$CONTROLLER/24" dev "$BRIDGE"
    ip link set "$BRIDGE" up
    local hosts="127.0.0.1 localhost
$CONTROLLER $(hostname -s) hpcdl-controller"
    for x in $NODES; do hosts="$hosts
$NET.$x n$x"; done
    for x in $NODES; do
        ip netns list | grep -qw "h$x" || ip netns add "h$x"
        if ! ip link show "hpcdl-h$x" >/dev/null 2>&1; then
            ip link add "hpcdl-h$x" type veth peer name eth0 netns "h$x"
        fi
        ip link set "hpcdl-h$x" master "$BRIDGE" up
        ip -n "h$x" addr replace "$NET.$x/24" dev eth0
        ip -n "h$x" link set eth0 up
        ip -n "h$x" link set lo up
        # the nodes' and the controller's names, bound over /etc/hosts for what runs in hX
        mkdir -p "/etc/netns/h$x"
        printf '%s\n' "$hosts" > "/etc/netns/h$x/hosts.tmp" && mv "/etc/netns/h$x/hosts.tmp" "/etc/netns/h$x/hosts"
    done
    shape "$RATE"
    say "up: bridge $BRIDGE ($CONTROLLER), nodes $(for x in $NODES; do printf 'n%s=%s.%s ' "$x" "$NET" "$x"; done)links shaped to $RATE"
}

slurmd() {
    for x in $NODES; do
        local pid="$STATE/slurmd-n$x.pid"
        if [ -f "$pid" ] && kill -0 "$(cat "$pid")" 2>/dev/null; then continue; fi
        # Enter the network namespace only (ip netns exec would remount /sys, without the cgroup tree that
        # slurmd reads), with a private mount namespace to bind the fabric's hosts file over /etc/hosts, and
        # a UTS namespace for its own hostname: MPI, oneCCL and gloo then see two hosts, as on a cluster.
        # Each node owns its share of the cores (n3 the first half, n4 the second), as separate machines
        # would: its slurmd, and so every task it starts, is bound there.
        local ncpu i; ncpu=$(nproc); i=$(( (x + 1) % 2 ))  # n3, n5... the first half; n4, n6... the second
        local cores="$(( i * ncpu / 2 ))-$(( (i + 1) * ncpu / 2 - 1 ))"
        [ "$ncpu" -ge 2 ] || cores=0
        # The shared filesystem's client (slurm/local/pfs.sh), when it is up, mounts in the node's namespaces,
        # so that the node's reads of it cross the node's link.
        local pfs=true
        [ ! -e "$STATE/pfs/up" ] || pfs="bash '$(cd "$(dirname "$0")" && pwd)/pfs.sh' node-mount"
        taskset -c "$cores" nsenter --net="/run/netns/h$x" unshare --uts --mount --propagation private sh -c \
            "mount --bind /etc/netns/h$x/hosts /etc/hosts && hostname n$x && $pfs && exec /usr/sbin/slurmd -N n$x" \
            || die "slurmd n$x did not start in namespace h$x; its log is $STATE/log/slurmd-n$x.log"
    done
}

status() {
    ip link show "$BRIDGE" >/dev/null 2>&1 || { say "down"; return 1; }
    say "bridge $BRIDGE $CONTROLLER, rate $(cat "$STATE/$BRIDGE.rate" 2>/dev/null || echo '?')"
    for x in $NODES; do
        say "n$x: namespace h$x, $(ip -n "h$x" -4 -br addr show eth0 2>/dev/null | awk '{print $3}'), $(tc -n "h$x" qdisc show dev eth0 | head -1)"
    done
}

down() {
    for x in $NODES; do
        local pid="$STATE/slurmd-n$x.pid"
        [ -f "$pid" ] && kill "$(cat "$pid")" 2>/dev/null && say "stopped slurmd n$x"
        if ip netns list | grep -qw "h$x"; then
            # whatever still runs there (job steps, ranks) goes with the namespace
            for p in $(ip netns pids "h$x"); do kill -9 "$p" 2>/dev/null || true; done
            ip netns del "h$x"
        fi
        ip link del "hpcdl-h$x" 2>/dev/null || true
        rm -rf "/etc/netns/h$x"
    done
    ip link del "$BRIDGE" 2>/dev/null || true
    rm -f "$STATE/$BRIDGE.rate"
    [ "$BRIDGE" != hpcdl-fab0 ] || rm -f "$STATE/fabric-nodes"
    say "down: no namespace, link or bridge of the fabric is left"
}

case "${1:-}" in
    check) why=$(missing); if [ -n "$why" ]; then echo "fabric: this machine lacks:"; echo "$why"; exit 1; fi; say "this machine can host the fabric" ;;
    up) RATE=${2:-$RATE}; up ;;
    rate) [ -n "${2:-}" ] || die "give a rate, e.g. 'fabric.sh rate 10gbit'"; ip link show "$BRIDGE" >/dev/null 2>&1 || die "the fabric is down; run 'fabric.sh up' first"; shape "$2"; say "links shaped to $2" ;;
    slurmd) slurmd ;;
    bits) rate_bits "${2:-}" ;;
    status) status ;;
    down) down ;;
    *) sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
