#!/bin/sh
# slurm.conf's TaskProlog on the local Slurm: what it prints as "export NAME=VALUE" enters each task's
# environment. On the fabric's nodes (n3, n4; n5 to n10 with FABRIC_NODES), MPICH's UCX would find the other node's ranks reachable
# through shared memory (one kernel under both namespaces: the same boot id) and never touch the shaped
# link; these nodes use UCX's TCP transport, as two machines would have to.
case "$(hostname)" in
    n[3-9]|n10) [ -n "${UCX_TLS:-}" ] || echo "export UCX_TLS=tcp,self" ;;
esac
