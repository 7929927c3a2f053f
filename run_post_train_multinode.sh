#!/usr/bin/env bash
# Multi-node launcher: one torchrun per node, c10d rendezvous at MASTER_ADDR:MASTER_PORT. Run the same command on
# every node with its own NODE_RANK (0 .. NNODES-1); the job starts when all NNODES have joined.
#
#   NNODES=8 NODE_RANK=<0..7> NPROC_PER_NODE=8 MASTER_ADDR=<node 0 host> MASTER_PORT=29500 \
#     CONFIG=configs/multinode_64gpu.yaml bash run_post_train_multinode.sh --train_video_csv prompts.csv
#   AUTO_RESUME=1 ... bash run_post_train_multinode.sh ...   # every node resumes from the newest complete checkpoint
# MAX_RESTARTS (default 3): torchrun restarts the worker group after a failure (a crashed rank, or outside SLURM a
# lost node that comes back) without a person, each time from the newest complete checkpoint
# (--resume_from_checkpoint latest is added whenever MAX_RESTARTS > 0; a first run starts fresh). The checkpoint
# to load is resolved once on rank 0 and broadcast.
#
# SIGTERM to the processes of every node (SLURM's scancel --signal=TERM does that; torchrun forwards its own copy,
# which post_train.py reads as the same request): the step finishes, a checkpoint is written, the launch exits 0.
# A signal to a shell that started this script does not reach torchrun.
#
# SLURM: sbatch run_post_train_slurm.sh, which runs this script on every node with the variables of the allocation,
# stops the run before the time limit with a checkpoint and requeues the job (docs/scaling.md, "SLURM").
# Plain ssh (hosts in hosts.txt, the first one is the master; the repository at the same path on every node):
#   i=0; for h in $(cat hosts.txt); do
#     ssh "$h" "cd /path/to/sage-grpo && NNODES=8 NODE_RANK=$i MASTER_ADDR=$(head -n 1 hosts.txt) \
#       bash run_post_train_multinode.sh --train_video_csv prompts.csv" & i=$((i + 1)); done; wait
# pdsh: pdsh -R exec -w ^hosts.txt ssh %h 'cd /path/to/sage-grpo && NNODES=8 NODE_RANK=%n MASTER_ADDR=node0 \
#   bash run_post_train_multinode.sh ...'   (with -R exec, %n is the host's 0-based index in the list)
#
# output_dir must be a filesystem every node sees (checkpoints are written collectively by all ranks).
# NPROC_PER_NODE defaults to the node's visible GPU count; MASTER_PORT to 29500; CONFIG to the 64-GPU config;
# PYTHON to python3 (the environment with torch and this project). The flags are checked once per node, in one
# process, before torchrun starts (scripts/check_launch.py), for the world size NNODES x NPROC_PER_NODE.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
missing=()
for v in NNODES NODE_RANK MASTER_ADDR; do
  [ -n "${!v:-}" ] || missing+=("$v")
done
if [ "${#missing[@]}" -gt 0 ]; then
  echo "run_post_train_multinode.sh: set ${missing[*]} (see the usage at the top of this script)" >&2
  exit 2
fi
for v in NNODES NODE_RANK; do
  if ! [[ "${!v}" =~ ^[0-9]+$ ]]; then
    echo "run_post_train_multinode.sh: $v must be a non-negative integer, got '${!v}'" >&2
    exit 2
  fi
done
if [ "$NODE_RANK" -ge "$NNODES" ]; then
  echo "run_post_train_multinode.sh: NODE_RANK $NODE_RANK must be below NNODES $NNODES" >&2
  exit 2
fi
PY="${PYTHON:-python3}"
source scripts/_launch_torch.sh  # torch's check, visible_gpus, TORCH_ELASTIC_SHUTDOWN_TIMEOUT
NPROC_PER_NODE="${NPROC_PER_NODE:-$visible_gpus}"
MASTER_PORT="${MASTER_PORT:-29500}"
CONFIG="${CONFIG:-configs/multinode_64gpu.yaml}"
MAX_RESTARTS="${MAX_RESTARTS:-3}"
resume=()
if [ "${AUTO_RESUME:-0}" = "1" ] || [ "$MAX_RESTARTS" != "0" ]; then
  resume=(--resume_from_checkpoint latest)  # a restarted worker group continues from the newest checkpoint
fi
"$PY" scripts/check_launch.py --nnodes "$NNODES" --nproc_per_node "$NPROC_PER_NODE" --config "$CONFIG" \
  "${resume[@]}" "$@"
RDZV_TIMEOUT="${RDZV_TIMEOUT:-600}"  # seconds the rendezvous waits for every node (torchrun's join_timeout default)
if [ "$NNODES" -gt 1 ]; then  # torchrun's rendezvous says nothing while it waits for the other nodes
  echo "run_post_train_multinode.sh: node $NODE_RANK of $NNODES waiting at $MASTER_ADDR:$MASTER_PORT for all $NNODES nodes to join (torchrun's rendezvous; it gives up after $RDZV_TIMEOUT s: start every node with the same NNODES, MASTER_ADDR and MASTER_PORT)" >&2
fi
exec "$PY" -m sage_grpo.launch --nnodes "$NNODES" --node_rank "$NODE_RANK" --nproc_per_node "$NPROC_PER_NODE" \
  --max-restarts "$MAX_RESTARTS" --rdzv_backend c10d --rdzv_endpoint "$MASTER_ADDR:$MASTER_PORT" \
  --rdzv_id "${RDZV_ID:-sage-grpo}" --rdzv_conf "join_timeout=$RDZV_TIMEOUT" post_train.py --config "$CONFIG" "${resume[@]}" "$@"
