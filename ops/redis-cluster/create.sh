#!/bin/sh
# Creates lastevent's Redis Cluster, or completes it: idempotent, run on every
# deployment (compose.cluster.yaml's redis-cluster-create, the Job of the same name in
# ops/k8s/overlays/redis-cluster).
#
# REDIS_CLUSTER_SHARDS: the shards, separated by ';', each the names of its nodes (host
# or host:port, as each announces itself), the first the shard's primary at creation:
# three shards of three nodes, so three primaries with two replicas each. A shard's
# replicas are named here rather than left to `--cluster-replicas 2`, so that which
# nodes make a shard is known from their names (on Kubernetes no two nodes of a shard
# share a host, and each shard's first node is on a host of its own).
#
# 1. Waits until every node answers (at most REDIS_CLUSTER_WAIT_S, 300 s; past that, a
#    node that does not answer is left out if the cluster exists already).
# 2. No slot served anywhere yet: creates the cluster of the shards' first nodes, the
#    slots split evenly (`redis-cli --cluster create --cluster-replicas 0`).
# 3. A node not in the cluster yet (new, or replaced by an empty one) joins its shard as
#    a replica of the shard's primary (`redis-cli --cluster add-node --cluster-slave`),
#    and the node it replaces (the same name, failed) is forgotten on every node.
# 4. Waits until every primary has a connected replica (what `replica` needs) and every
#    node announces its name; then warns of a primary with fewer replicas than its
#    shard's other nodes, and of a replica serving another shard (replica migration).
set -eu
set -f

wait_s=${REDIS_CLUSTER_WAIT_S:-300}
shards=$(printf '%s\n' "$REDIS_CLUSTER_SHARDS" | tr ';' '\n' | sed 's/^ *//; s/ *$//; /^$/d')
all=$(printf '%s\n' "$shards" | tr ' ' '\n' | sed '/^$/d')

say() { echo "create.sh: $*" >&2; }
host_of() { echo "${1%:*}"; }
port_of() { case $1 in *:*) echo "${1##*:}" ;; *) echo 6379 ;; esac; }
cli() {
    node=$1
    shift
    redis-cli -h "$(host_of "$node")" -p "$(port_of "$node")" "$@" 2>/dev/null | tr -d '\r'
}
# `redis-cli --cluster` takes addresses: CLUSTER MEET takes no names
ip_of() {
    ip=$(getent hosts "$(host_of "$1")" | sed -n '1s/[[:space:]].*//p')
    [ -n "$ip" ] || { say "$1 does not resolve"; return 1; }
    echo "$ip:$(port_of "$1")"
}
info() { cli "$1" cluster info | sed -n "s/^$2://p"; }
myself() { cli "$1" cluster nodes | grep ' myself,' || true; }
# "ID master|slave SLOTS MASTER": the node's id, role, how many slot ranges it serves
# and the id of its primary ("-" for none)
role() {
    # shellcheck disable=SC2046 # (split into its fields)
    set -- $(myself "$1")
    [ $# -ge 8 ] || return 0
    case $3 in *master*) r=master ;; *) r=slave ;; esac
    echo "$1 $r $(($# - 8)) $4"
}

# (role's answer) a primary that serves slots
is_primary() { [ "${2:-}" = master ] && [ "${3:-0}" -gt 0 ]; }

# ---- 1. every node answers
deadline=$(($(date +%s) + wait_s))
up=
for node in $all; do
    until [ "$(cli "$node" ping)" = PONG ]; do
        if [ "$(date +%s)" -ge "$deadline" ]; then
            say "$node does not answer"
            break
        fi
        sleep 2
    done
    [ "$(cli "$node" ping)" = PONG ] && up="$up $node"
done

# ---- 2. the cluster of the shards' first nodes
served=0
for node in $up; do
    n=$(info "$node" cluster_slots_assigned)
    [ "${n:-0}" -gt "$served" ] && served=$n
done
if [ "$served" -eq 0 ]; then
    [ "$(echo "$up" | wc -w)" -eq "$(echo "$all" | wc -w)" ] || {
        say "a new cluster needs every node"
        exit 1
    }
    primaries=
    for shard in $(printf '%s\n' "$shards" | sed 's/ .*//'); do
        primaries="$primaries $(ip_of "$shard")"
    done
    say "creating the cluster of$primaries"
    # shellcheck disable=SC2086
    redis-cli --cluster create $primaries --cluster-replicas 0 --cluster-yes
elif [ "$served" -ne 16384 ]; then
    say "only $served of 16384 slots are served: see redis-cli --cluster check / fix"
    exit 1
fi

# ---- 3. every node in its shard
printf '%s\n' "$shards" | while IFS= read -r shard; do
    primary='' primary_id=''
    for node in $shard; do
        # shellcheck disable=SC2046
        set -- $(role "$node")
        if is_primary "$@"; then
            primary=$node primary_id=$1
        fi
    done
    if [ -z "$primary" ]; then
        say "no node of the shard '$shard' serves slots: not joining its others"
        continue
    fi
    for node in $shard; do
        case " $up " in *" $node "*) ;; *) continue ;; esac
        # shellcheck disable=SC2046
        set -- $(role "$node")
        if [ "$(info "$node" cluster_known_nodes)" = 1 ]; then
            say "$node joins as a replica of $primary"
            redis-cli --cluster add-node "$(ip_of "$node")" "$(ip_of "$primary")" \
                --cluster-slave --cluster-master-id "$primary_id"
        elif [ "${2:-}" = master ] && [ "${3:-0}" -eq 0 ]; then
            say "$node (in the cluster, no slots) replicates $primary"
            cli "$node" cluster replicate "$primary_id"
        else
            continue
        fi
        new_id=$(cli "$node" cluster myid)
        # the node it replaces: the same name, failed (never one that serves slots: its
        # shard would have no other primary, and nothing joins it above)
        cli "$primary" cluster nodes | while read -r id addr flags _; do
            name=${addr#*,}
            name=${name%%,*}
            [ "$name" = "$(host_of "$node")" ] || continue
            [ "$id" != "$new_id" ] || continue
            case $flags in *fail*) ;; *) continue ;; esac
            say "forgetting $id (the $name that was)"
            for other in $up; do
                cli "$other" cluster forget "$id" >/dev/null || true
            done
        done
    done
done

# ---- 4. every primary has a replica, every node its name
while :; do
    missing=
    for shard in $(printf '%s\n' "$shards" | tr ' ' ','); do
        for node in $(echo "$shard" | tr ',' ' '); do
            # shellcheck disable=SC2046
            set -- $(role "$node")
            is_primary "$@" || continue
            replicas=$(cli "$node" info replication | sed -n 's/^connected_slaves://p')
            [ "${replicas:-0}" -ge 1 ] || missing="$missing $node(no replica)"
        done
    done
    for node in $up; do
        # a node whose name has not reached this one yet shows an empty one
        cli "$node" cluster nodes | grep -q '@[0-9]*\(,,\|, \| \)' && missing="$missing $node(names)"
    done
    [ -z "$missing" ] && break
    if [ "$(date +%s)" -ge "$((deadline + 60))" ]; then
        say "not ready:$missing"
        exit 1
    fi
    sleep 1
done

# what is not as the shards say (after a failover, a lost node, a replica migration)
for shard in $(printf '%s\n' "$shards" | tr ' ' ','); do
    others=$(($(echo "$shard" | tr ',' ' ' | wc -w) - 1))
    primary='' primary_id=''
    for node in $(echo "$shard" | tr ',' ' '); do
        # shellcheck disable=SC2046
        set -- $(role "$node")
        if is_primary "$@"; then
            primary=$node primary_id=$1
        fi
    done
    [ -n "$primary" ] || continue
    replicas=$(cli "$primary" info replication | sed -n 's/^connected_slaves://p')
    [ "${replicas:-0}" -ge "$others" ] ||
        say "warning: $primary has ${replicas:-0} replica(s), its shard $others other node(s)"
    for node in $(echo "$shard" | tr ',' ' '); do
        # shellcheck disable=SC2046
        set -- $(role "$node")
        if [ "${2:-}" = slave ] && [ "${4:-}" != "$primary_id" ]; then
            say "warning: $node replicates $4, not its shard's primary $primary; once $4" \
                "has another replica: redis-cli -h $(host_of "$node") -p $(port_of "$node")" \
                "CLUSTER REPLICATE $primary_id"
        fi
    done
done
# shellcheck disable=SC2086
set -- $up
redis-cli --cluster check "$(ip_of "$1")" || true
say "ready"
