#!/usr/bin/env bash
# Starts tpserve's ranks; every flag but --rank/--master goes to `tpserve serve` (see --help there).
#   One host, both ranks here:   ./launch.sh [--config configs/default.yaml] [--port 50051] ...
#   Two hosts, one GPU each:     host A: ./launch.sh --config configs/gb10-pair.yaml --rank 0 --master A[:PORT]
#                                host B: ./launch.sh --config configs/gb10-pair.yaml --rank 1 --master A[:PORT]
# Rank 0 serves gRPC. The ranks run under torchrun, which stops both when either fails; run this
# under a supervisor (systemd, a container restart policy) to have the pair restarted.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
python="$here/.venv/bin/python"
[ -x "$python" ] || python=python3

rank="" master="" tp=2 args=()
while [ $# -gt 0 ]; do
    case "$1" in
        --rank) rank=$2; shift 2 ;;
        --rank=*) rank=${1#*=}; shift ;;
        --master) master=$2; shift 2 ;;
        --master=*) master=${1#*=}; shift ;;
        --tp) tp=$2; args+=("$1" "$2"); shift 2 ;;
        --tp=*) tp=${1#*=}; args+=("$1"); shift ;;
        *) args+=("$1"); shift ;;
    esac
done
if [ -z "${args[*]:-}" ] || ! printf '%s\n' "${args[@]}" | grep -q -- '^--config'; then
    args=(--config "$here/configs/default.yaml" "${args[@]}")
fi

torchrun=("$python" -m torch.distributed.run)
if [ -n "$master" ]; then
    [ -n "$rank" ] || { echo "launch.sh: --master needs --rank" >&2; exit 2; }
    host=${master%%:*}
    port=29500
    [ "$host" = "$master" ] || port=${master##*:}
    torchrun+=(--nnodes "$tp" --node-rank "$rank" --nproc-per-node 1 --master-addr "$host" --master-port "$port")
else
    torchrun+=(--standalone --nproc-per-node "$tp")
fi

# A stop signal goes to the ranks, not to torchrun: rank 0 drains and sends the followers Stop,
# every rank exits 0, and so does torchrun (a signalled torchrun exits 1 whatever its ranks did).
"${torchrun[@]}" -m tpserve.cli serve "${args[@]}" &
launcher=$!
stop_ranks() { kill -TERM $(ps -o pid= --ppid "$launcher") 2>/dev/null || kill -TERM "$launcher" 2>/dev/null || true; }
trap stop_ranks TERM INT
while true; do
    code=0
    wait "$launcher" || code=$?
    kill -0 "$launcher" 2>/dev/null || exit "$code"  # else a trapped signal cut the wait short
done
