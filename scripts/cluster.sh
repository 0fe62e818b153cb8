#!/usr/bin/env bash
# A small cluster on one machine: network namespaces as nodes, joined by
# rate-limited virtual Ethernet links through a switch, for rehearsing a
# multi-node `mpirun weft train` (launch, layout, traffic, failures).
#
#   scripts/cluster.sh up [--nodes N] [--link RATE] [--name NAME]
#   scripts/cluster.sh status [--name NAME]
#   scripts/cluster.sh measure [--name NAME] [--seconds S]
#   scripts/cluster.sh exec NODE -- COMMAND...    (run a command on a node)
#   scripts/cluster.sh kill-node NODE             (the node dies: every process on
#                                                  it killed, its link down)
#   scripts/cluster.sh revive NODE                (a dead node back: its namespace made
#                                                  anew, link up)
#   scripts/cluster.sh link NODE down|up          (take its link down / up: a flap)
#   scripts/cluster.sh down [--name NAME]
#
# Layout (NAME defaults to "weft"; N to 2; RATE, a `tc` rate, to 1gbit):
#
#   NAME-sw     the switch: a bridge `br0` and one veth end per node
#   NAME-head   the head node, where `mpirun` runs (like a login node):
#               10.213.0.254, its link not limited
#   NAME-n0..   the nodes n0, n1, ...: 10.213.0.1, .2, ..., each with its
#               own hostname (n0, n1, ...: a UTS namespace per launch) and
#               its link limited to RATE in both directions (`tbf` on the
#               node's egress and on the switch's port towards it)
#
# Nothing is made in the host's namespace: every interface is created
# inside the switch's namespace with its peer moved straight into the
# node's, the addresses exist only inside the namespaces, and no route
# leads out of them (no default route, no forwarding). The host's own
# interfaces and routes are never touched. State lives in
# /run/NAME-cluster: the hostfile, the launch agent (Open MPI's rsh
# launcher calls it as `agent HOST COMMAND...`; it enters the node's
# namespace), the `mpirun` prefix (`mpirun`, and `launch` without the
# hostfile), the link rate and this script's path.
#
# `up` is idempotent (an existing cluster of the same name is taken down
# first) and ends by printing, on its last line, the command prefix that
# starts ranks on the nodes; add `-np 4 weft train ...` to it. Ranks of
# one node share memory (Open MPI's vader); between nodes they talk TCP
# over the limited links.
set -euo pipefail

die() {
    echo "cluster.sh: $*" >&2
    exit 1
}

cmd=${1:-}
[ -n "$cmd" ] || die "usage: cluster.sh up|status|measure|exec|kill-node|revive|link|down (see the header of $0)"
shift

name=weft
nodes=2
rate=1gbit
seconds=3
node=""
state=""
positional=()
while [ $# -gt 0 ]; do
    case "$1" in
    --nodes)
        nodes=${2:?--nodes needs a count}
        shift 2
        ;;
    --link)
        rate=${2:?--link needs a rate such as 1gbit or 500mbit}
        shift 2
        ;;
    --name)
        name=${2:?--name needs a name}
        shift 2
        ;;
    --seconds)
        seconds=${2:?--seconds needs a number}
        shift 2
        ;;
    --)
        shift
        break
        ;;
    *)
        positional+=("$1")
        shift
        ;;
    esac
done

[[ $name =~ ^[a-z][a-z0-9]{0,7}$ ]] || die "--name '$name': 1 to 8 lower-case letters and digits, starting with a letter"
state=/run/$name-cluster
sw=$name-sw
head=$name-head
subnet=10.213.0

need() {
    [ "$(id -u)" = 0 ] || die "network namespaces need root (run as root; id -u is $(id -u))"
    for t in ip tc unshare nsenter; do
        command -v "$t" >/dev/null || die "'$t' not found (Debian: iproute2, util-linux)"
    done
}

# The rate in bytes per second, for tbf's burst.
rate_bytes() {
    local r=$1 n unit
    [[ $r =~ ^([0-9]+)(kbit|mbit|gbit)$ ]] || die "--link '$r': a rate such as 500mbit, 1gbit or 10gbit"
    n=${BASH_REMATCH[1]}
    unit=${BASH_REMATCH[2]}
    case $unit in
    kbit) echo $((n * 1000 / 8)) ;;
    mbit) echo $((n * 1000000 / 8)) ;;
    gbit) echo $((n * 1000000000 / 8)) ;;
    esac
}

# Apply `tbf` at RATE to DEV in namespace NS: a burst of 1 ms of traffic
# (at least 64 KiB, one GSO packet), a queue of up to 50 ms. A larger
# bucket lets a message that follows a pause pass at the bridge's speed
# (with 10 ms, a 1.75 MB all-reduce every 40 ms of compute took a third
# of the time the rate allows), which no real link does; TCP still
# reaches about 0.95 of the rate with 1 ms.
limit() {
    local ns=$1 dev=$2 bytes burst
    bytes=$(rate_bytes "$rate")
    burst=$((bytes / 1000))
    [ "$burst" -ge 65536 ] || burst=65536
    ip -n "$ns" link set dev "$dev" up
    tc -n "$ns" qdisc replace dev "$dev" root tbf rate "$rate" burst "$burst" latency 50ms
}

node_names() {
    local f=$state/hostfile
    [ -f "$f" ] || die "no cluster named '$name' is up (no $f); run: scripts/cluster.sh up"
    awk '{print $1}' "$f"
}

check_node() {
    local n=$1
    [ -f "$state/hostfile" ] || die "no cluster named '$name' is up (no $state/hostfile); run: scripts/cluster.sh up"
    node_names | grep -qx "$n" || die "'$n' is not a node of cluster '$name' (nodes: $(node_names | tr '\n' ' '))"
}

down() {
    local ns
    for ns in $(ip netns list | awk '{print $1}' | grep -E "^$name-(sw|head|n[0-9]+)$" || true); do
        # every process left on the node, then the namespace
        for pid in $(ip netns pids "$ns" 2>/dev/null || true); do
            kill -9 "$pid" 2>/dev/null || true
        done
        ip netns delete "$ns" 2>/dev/null || true
        rm -rf "/etc/netns/$ns"
    done
    rmdir /etc/netns 2>/dev/null || true
    rm -rf "$state"
}

add_port() {
    # add_port NS ADDR [limited]: a veth from the switch into NS, named eth0
    # there, port p-NS on the bridge
    local ns=$1 addr=$2 limited=${3:-}
    local port="p-${ns#"$name"-}"
    ip -n "$sw" link add "$port" type veth peer name eth0 netns "$ns"
    ip -n "$sw" link set "$port" master br0
    ip -n "$ns" addr add "$addr/24" dev eth0
    ip -n "$ns" link set lo up
    if [ -n "$limited" ]; then
        limit "$ns" eth0
        limit "$sw" "$port"
    else
        ip -n "$ns" link set eth0 up
        ip -n "$sw" link set "$port" up
    fi
}

up() {
    need
    [[ $nodes =~ ^[0-9]+$ ]] && [ "$nodes" -ge 1 ] && [ "$nodes" -le 64 ] || die "--nodes '$nodes': a count from 1 to 64"
    rate_bytes "$rate" >/dev/null
    command -v mpirun >/dev/null || echo "cluster.sh: note: mpirun not found (Debian: openmpi-bin); the cluster is made, ranks cannot be launched" >&2
    down
    mkdir -p "$state"
    # On any failure from here, leave nothing behind.
    trap 'echo "cluster.sh: up failed; cleaning up" >&2; down' ERR
    ip netns add "$sw"
    ip -n "$sw" link add br0 type bridge
    ip -n "$sw" link set br0 up
    ip -n "$sw" link set lo up
    ip netns add "$head"
    add_port "$head" "$subnet.254"
    : >"$state/hostfile"
    local hosts="127.0.0.1 localhost"$'\n'"$subnet.254 head"$'\n'
    for ((i = 0; i < nodes; i++)); do
        ip netns add "$name-n$i"
        add_port "$name-n$i" "$subnet.$((i + 1))" limited
        echo "n$i slots=$(nproc)" >>"$state/hostfile"
        hosts+="$subnet.$((i + 1)) n$i"$'\n'
    done
    # Names resolve inside the namespaces only (`ip netns exec` binds
    # /etc/netns/NS/hosts over /etc/hosts for what it runs).
    for ns in "$head" $(for ((i = 0; i < nodes; i++)); do echo "$name-n$i"; done); do
        mkdir -p "/etc/netns/$ns"
        printf '%s' "$hosts" >"/etc/netns/$ns/hosts"
    done
    # The launch agent: `agent HOST COMMAND...` runs COMMAND (one shell
    # command line, as ssh would) on node HOST, with HOST as its hostname.
    cat >"$state/agent" <<EOF
#!/bin/sh
# Open MPI's rsh launch agent for cluster '$name' (scripts/cluster.sh).
host=\$1
shift
case "\$host" in
n[0-9]*) ;;
*) echo "cluster agent: unknown node '\$host'" >&2; exit 1 ;;
esac
exec ip netns exec "$name-\$host" unshare --uts -- /bin/sh -c "hostname \$host && \$*"
EOF
    # Run a command in the head node's namespace, where mpirun must run
    # (it reaches the nodes' daemons over the switch).
    cat >"$state/enter-head" <<EOF
#!/bin/sh
# Runs its arguments on the head node of cluster '$name' (scripts/cluster.sh).
exec ip netns exec "$head" unshare --uts -- /bin/sh -c 'hostname head && exec "\$0" "\$@"' "\$@"
EOF
    chmod +x "$state/agent" "$state/enter-head"
    local prefix="$state/enter-head mpirun --allow-run-as-root --hostfile $state/hostfile"
    prefix+=" --mca plm_rsh_agent $state/agent --mca plm_rsh_no_tree_spawn 1"
    prefix+=" --mca pml ob1 --mca btl self,vader,tcp --mca btl_tcp_if_include eth0 --mca oob_tcp_if_include eth0"
    # Two TCP connections per pair of ranks: over one, Open MPI's TCP
    # transport moves about 0.65 of the link each way when both directions
    # carry data (a ring's every step), over two about 0.9 (one connection
    # alone carries the link's full rate both ways: `measure`'s streams).
    prefix+=" --mca btl_tcp_links 2"
    # Messages up to 1 MiB go eagerly, into kernel socket buffers of 4 MiB:
    # above the default 64 KiB eager limit each message waits for a
    # rendezvous reply, which the receiving rank sends only when one of its
    # waits polls, and on nodes whose ranks share cores that is late (FSDP
    # across 4 nodes: 150 ms a step, 75 ms eagerly). Sent eagerly, the
    # kernel moves the bytes at the link's rate while the ranks compute, as
    # a NIC does. Tune the same keys for a real cluster's TCP transport.
    prefix+=" --mca btl_tcp_eager_limit 1048576 --mca btl_tcp_max_send_size 1048576"
    prefix+=" --mca btl_tcp_sndbuf 4194304 --mca btl_tcp_rcvbuf 4194304"
    # A node that dies silently (its link down) is noticed by mpirun's
    # keepalive probes on its daemon's connection within about 6 s
    # (idle 3 s, then 3 probes 1 s apart), before the ranks' collectives
    # time out (parallel.timeout_s), so mpirun names the node it lost.
    prefix+=" --mca oob_tcp_keepalive_time 3 --mca oob_tcp_keepalive_intvl 1 --mca oob_tcp_keepalive_probes 3"
    prefix+=" -x PATH"
    echo "$prefix" >"$state/mpirun"
    # The same without the hostfile, for a supervisor that writes its own
    # (`weft train --supervise --hostfile $state/hostfile --launch
    # "$(cat $state/launch) -np {n} --hostfile {hostfile}"`).
    echo "${prefix/ --hostfile $state\/hostfile/}" >"$state/launch"
    echo "$rate" >"$state/rate"
    # this script, for tools that do node faults (`weft chaos --cluster`)
    realpath "$0" >"$state/script"
    trap - ERR
    echo "cluster '$name': $nodes node(s) n0..n$((nodes - 1)) on $subnet.0/24, each link $rate both ways; head $subnet.254"
    echo "hostfile: $state/hostfile; take it down with: scripts/cluster.sh down$([ "$name" = weft ] || echo " --name $name")"
    echo "$prefix"
}

status() {
    [ -d "$state" ] || {
        echo "cluster '$name': down"
        return 0
    }
    echo "cluster '$name': up, links $(cat "$state/rate")"
    for n in $(node_names); do
        local ns=$name-$n st pids
        st=$(ip -n "$ns" -br link show dev eth0 2>/dev/null | awk '{print $2}') || st=missing
        pids=$(ip netns pids "$ns" 2>/dev/null | wc -l)
        echo "  $n: $(ip -n "$ns" -br -4 addr show dev eth0 2>/dev/null | awk '{print $3}') link ${st:-missing}, $pids process(es)"
    done
    echo "mpirun prefix: $(cat "$state/mpirun")"
}

# Stream bytes from n1 (or the head, with one node) to n0 over TCP for
# S seconds and print the rate reached through the switch.
measure() {
    need
    local names src dst
    names=$(node_names)
    dst=$name-$(echo "$names" | sed -n 1p)
    src=$(echo "$names" | sed -n 2p)
    if [ -n "$src" ]; then src=$name-$src; else src=$head; fi
    local port=5201
    ip netns exec "$dst" python3 -c "
import socket
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(('0.0.0.0', $port)); s.listen(1); c, _ = s.accept()
buf = bytearray(1 << 20)
while c.recv_into(buf):
    pass
" &
    local server=$!
    sleep 0.5
    ip netns exec "$src" python3 -c "
import socket, time
c = socket.create_connection(('$subnet.1', $port))
buf = bytes(1 << 20); sent = 0; t0 = time.perf_counter()
while time.perf_counter() - t0 < $seconds:
    c.sendall(buf); sent += len(buf)
c.shutdown(socket.SHUT_WR); c.recv(1); dt = time.perf_counter() - t0
print(f'link rate measured ${src#"$name"-} -> ${dst#"$name"-}: {sent / dt / 1e6:.1f} MB/s ({sent * 8 / dt / 1e9:.3f} Gbit/s; tbf rate $(cat "$state/rate"))')
"
    wait "$server" || true
}

case "$cmd" in
up) up ;;
down)
    need
    down
    echo "cluster '$name': down"
    ;;
status) status ;;
measure) measure ;;
exec)
    need
    [ ${#positional[@]} -ge 1 ] || die "usage: cluster.sh exec NODE -- COMMAND..."
    check_node "${positional[0]}"
    [ $# -ge 1 ] || die "usage: cluster.sh exec NODE -- COMMAND..."
    n=${positional[0]}
    exec ip netns exec "$name-$n" unshare --uts -- /bin/sh -c 'hostname "$0" && shift && exec "$@"' "$n" x "$@"
    ;;
kill-node | revive)
    need
    [ ${#positional[@]} -eq 1 ] || die "usage: cluster.sh $cmd NODE"
    check_node "${positional[0]}"
    ns=$name-${positional[0]}
    # what runs there dies either way: a dead node's processes, or a
    # revived node's leftovers
    pids=$(ip netns pids "$ns" || true)
    for p in $pids; do kill -9 "$p" 2>/dev/null || true; done
    if [ "$cmd" = kill-node ]; then
        ip -n "$ns" link set dev eth0 down
        echo "node ${positional[0]}: dead ($(echo "$pids" | grep -c . || true) process(es) killed, link down)"
    else
        # a fresh node in its place: the namespace made anew (its old
        # network stack, sockets and link gone with it), same name and
        # address, its link limited again at the cluster's rate
        rate=$(cat "$state/rate")
        # the old link's switch port goes first (its peer with it): a
        # namespace lives on while a killed process in it is still exiting
        ip -n "$sw" link delete "p-${positional[0]}" 2>/dev/null || true
        ip netns delete "$ns"
        ip netns add "$ns"
        add_port "$ns" "$subnet.$((${positional[0]#n} + 1))" limited
        echo "node ${positional[0]}: back (namespace made anew, link up at $rate)"
    fi
    ;;
link)
    need
    [ ${#positional[@]} -eq 2 ] || die "usage: cluster.sh link NODE down|up"
    check_node "${positional[0]}"
    case ${positional[1]} in
    down | up) ip -n "$name-${positional[0]}" link set dev eth0 "${positional[1]}" ;;
    *) die "link: '${positional[1]}' is neither down nor up" ;;
    esac
    echo "node ${positional[0]}: link ${positional[1]}"
    ;;
*) die "unknown command '$cmd' (up, status, measure, exec, kill-node, revive, link, down)" ;;
esac
