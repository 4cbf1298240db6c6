#!/bin/sh
# Join the nodes into one cluster (one replica per primary) and wait until it serves.
# Safe to rerun: nodes that already know each other (a restart, a second `up`) are left
# as they are, and the script only waits for cluster_state:ok on every node.
#   R3_NODES         "host:port ..." (default: 127.0.0.1:7000 ... 127.0.0.1:7005)
#   R3_INIT_TIMEOUT  seconds to wait in all (default 120)
set -eu
NODES=${R3_NODES:-"127.0.0.1:7000 127.0.0.1:7001 127.0.0.1:7002 127.0.0.1:7003 127.0.0.1:7004 127.0.0.1:7005"}
deadline=$(($(date +%s) + ${R3_INIT_TIMEOUT:-120}))

cli() {  # cli HOST:PORT ARGS...: one command to one node, its answer without CRs
    node=$1
    shift
    redis-cli -h "${node%:*}" -p "${node##*:}" "$@" 2>/dev/null | tr -d '\r'
}
field() {  # field HOST:PORT NAME: a field of the node's CLUSTER INFO
    cli "$1" cluster info | sed -n "s/^$2://p"
}
wait_until() {  # wait_until WHAT COMMAND...: retry COMMAND each second until the deadline
    what=$1
    shift
    until "$@"; do
        if [ "$(date +%s)" -ge "$deadline" ]; then
            echo "cluster-init: gave up waiting for $what" >&2
            exit 1
        fi
        sleep 1
    done
}
answers() { [ "$(cli "$1" ping)" = PONG ]; }
all_ok() {
    for node in $NODES; do
        [ "$(field "$node" cluster_state)" = ok ] || return 1
    done
}

for node in $NODES; do
    wait_until "$node to answer" answers "$node"
done
joined=0
for node in $NODES; do
    if [ "$(field "$node" cluster_known_nodes)" != 1 ]; then
        joined=1
    fi
done
if [ "$joined" = 0 ]; then
    # shellcheck disable=SC2086  # one argument per node
    redis-cli --cluster create $NODES --cluster-replicas 1 --cluster-yes
else
    echo "cluster-init: the nodes already form a cluster; waiting for it to serve"
fi
wait_until "cluster_state:ok on every node" all_ok
echo "cluster-init: cluster_state:ok on $(echo $NODES | wc -w) nodes"
