# Sourced by the launch scripts next to it: the environment NCCL and minitron need, and `run`,
# which runs a command (or, with DRY_RUN=1, prints it: tests/test_scripts.py reads those lines).
# Nothing here downloads anything: the corpus ships in data/corpus.txt.

export MINITRON_BACKEND=nccl          # one process per GPU; gloo is for CPUs
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
# NCCL's own log: WARN says what failed; INFO also prints the rings/trees and the algorithm and
# protocol it picks per collective (lesson 14 reads them). MINITRON_SHOW_STDERR=1 keeps it.
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
# A collective that waits on a dead peer errors out (and the rank exits) instead of hanging.
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
# Across nodes: the interface NCCL's bootstrap and socket transport use (e.g. eth0, ib0), and
# the InfiniBand adapters (e.g. mlx5_0,mlx5_1); left unset, NCCL picks. NCCL_IB_DISABLE=1
# falls back to TCP sockets where there is no InfiniBand.
[ -n "${NCCL_SOCKET_IFNAME:-}" ] && export NCCL_SOCKET_IFNAME
[ -n "${NCCL_IB_HCA:-}" ] && export NCCL_IB_HCA
[ -n "${NCCL_IB_DISABLE:-}" ] && export NCCL_IB_DISABLE
# One hardware queue per device, so a communication kernel queued behind compute starts in the
# order it was issued (Megatron sets it for tensor-parallel overlap).
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
export MINITRON_TIMEOUT=${MINITRON_TIMEOUT:-600}   # first steps compile kernels: be patient

# The same model on every script (the grid differs); the CPU runs of the lessons use the same flags.
MODEL="--hidden 256 --heads 8 --layers 4 --seq 256"

run() {
    if [ -n "${DRY_RUN:-}" ]; then
        printf '%s\n' "$*"
    else
        "$@"
    fi
}
