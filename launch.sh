#!/usr/bin/env bash
# Starts tpserve's ranks; every flag but --rank/--master goes to `tpserve serve` (see --help there).
#   One host, both ranks here:   ./launch.sh [--config configs/default.yaml] [--port 50051] ...
#   Two hosts, one GPU each:     host A: ./launch.sh --config configs/gb10-pair.yaml --rank 0 --master A[:PORT] --interface IF
#                                host B: ./launch.sh --config configs/gb10-pair.yaml --rank 1 --master A[:PORT] --interface IF
# On one host the ranks run under torchrun, which stops both when either fails. Across two hosts
# each host runs its one rank itself (this script becomes it), so a stop signal reaches the rank
# directly, nothing is left behind, and rank 0 serves the store on the master address alone.
# --interface (or `interface:` in the config) names the link between the hosts to gloo and NCCL
# (GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME); the rank refuses to start if it is missing or does not
# lead to the master. Run this under a supervisor (systemd, a container restart policy) to have
# the pair restarted after a failure.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
python="$here/.venv/bin/python"
[ -x "$python" ] || python=python3

rank="" master="" tp=2 interface="" args=()
while [ $# -gt 0 ]; do
    case "$1" in
        --rank) rank=$2; shift 2 ;;
        --rank=*) rank=${1#*=}; shift ;;
        --master) master=$2; shift 2 ;;
        --master=*) master=${1#*=}; shift ;;
        --tp) tp=$2; args+=("$1" "$2"); shift 2 ;;
        --tp=*) tp=${1#*=}; args+=("$1"); shift ;;
        --interface) interface=$2; args+=("$1" "$2"); shift 2 ;;
        --interface=*) interface=${1#*=}; args+=("$1"); shift ;;
        *) args+=("$1"); shift ;;
    esac
done
# A loop, not `printf | grep -q`: under pipefail grep's early exit can SIGPIPE printf and read as no match.
has_config=""
for arg in "${args[@]}"; do
    case "$arg" in --config|--config=*) has_config=1 ;; esac
done
[ -n "$has_config" ] || args=(--config "$here/configs/default.yaml" "${args[@]}")
if [ -n "$interface" ]; then
    export GLOO_SOCKET_IFNAME="$interface" NCCL_SOCKET_IFNAME="$interface"
fi

if [ -n "$master" ]; then
    [ -n "$rank" ] || { echo "launch.sh: --master needs --rank" >&2; exit 2; }
    exec "$python" -m tpserve.cli serve --rank "$rank" --master "$master" "${args[@]}"
fi
[ -z "$rank" ] || { echo "launch.sh: --rank needs --master (rank 0's HOST[:PORT])" >&2; exit 2; }

# A stop signal goes to the ranks, not to torchrun: rank 0 drains and sends the followers Stop,
# every rank exits 0, and so does torchrun (a signalled torchrun exits 1 with a traceback whatever
# its ranks did). torchrun and the ranks run in a session of their own, so a signal to this
# script's process group (Ctrl-C in its terminal, a supervisor's group kill) reaches this script
# alone, which passes it on as SIGTERM to the ranks.
own_session=()
command -v setsid >/dev/null && own_session=(setsid)
"${own_session[@]}" "$python" -m torch.distributed.run --standalone --nproc-per-node "$tp" \
    -m tpserve.cli serve "${args[@]}" &
launcher=$!
stop_ranks() {
    ranks=$(ps -o pid= --ppid "$launcher" | tr -s ' \n' ' ')
    echo "launch.sh: $1 received; SIGTERM to the ranks (${ranks:-none found: to torchrun})" >&2
    kill -TERM $ranks 2>/dev/null || kill -TERM "$launcher" 2>/dev/null || true
}
trap 'stop_ranks SIGTERM' TERM
trap 'stop_ranks SIGINT' INT
trap 'stop_ranks SIGHUP' HUP
while true; do
    code=0
    wait "$launcher" || code=$?
    kill -0 "$launcher" 2>/dev/null || exit "$code"  # else a trapped signal cut the wait short
done
