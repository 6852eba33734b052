#!/bin/sh
# Starts a node of lastevent's Redis Cluster (compose.cluster.yaml,
# ops/k8s/overlays/redis-cluster): `start.sh --cluster-announce-hostname NAME`, the
# arguments passed on to redis-server after redis.conf (beside this script).
#
# nodes.conf, the node's view of the cluster, holds each peer's IP address and name. A
# container or pod that is recreated gets a new address. Redis learns a peer's new
# address when that peer pings it, which is enough while one node moves at a time, but
# not when all of them moved at once (`docker compose down` and `up`, every pod
# rescheduled): no node would reach another. So first each peer's address is looked up
# by its name; a peer that does not resolve yet (not running) keeps the one it had, and
# tells the others its new one once it runs.
set -eu
set -f  # (nodes.conf has brackets in it: no globbing)

here=$(dirname "$0")
conf=${REDIS_DATA_DIR:-/data}/nodes.conf

refresh() {
    # one line of nodes.conf: ID IP:PORT@CPORT[,NAME[,AUX=...]] FLAGS ...
    if [ "$1" = vars ] || [ $# -lt 2 ]; then
        echo "$*"
        return
    fi
    id=$1 addr=$2
    shift 2
    endpoint=${addr%%,*}
    name=
    case $addr in *,*) name=${addr#*,} name=${name%%,*} ;; esac
    case $name in *=*) name= ;; esac
    old=${endpoint%:*}
    new=
    if [ -n "$name" ]; then
        new=$(getent hosts "$name" 2>/dev/null | sed -n '1s/[[:space:]].*//p') || new=
    fi
    if [ -n "$new" ] && [ "$new" != "$old" ]; then
        echo "start.sh: $name ($id) moved from $old to $new" >&2
        addr=$new:${endpoint##*:}${addr#"$endpoint"}
    fi
    echo "$id $addr $*"
}

if [ -s "$conf" ]; then
    while IFS= read -r line; do
        # shellcheck disable=SC2086 # (split into its fields)
        refresh $line
    done <"$conf" >"$conf.new"
    mv "$conf.new" "$conf"
fi

# REDIS_PASSWORD (compose.cluster.yaml and the Kubernetes overlay require it): every
# client must send it (requirepass), and a replica sends it to its primary (masterauth)
if [ -n "${REDIS_PASSWORD:-}" ]; then
    set -- "$@" --requirepass "$REDIS_PASSWORD" --masterauth "$REDIS_PASSWORD"
fi

# the image's entrypoint: as root it hands the data dir to the redis user and drops to it
exec "${REDIS_ENTRYPOINT:-docker-entrypoint.sh}" redis-server "$here/redis.conf" "$@"
