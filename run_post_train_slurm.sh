#!/usr/bin/env bash
# SLURM batch script: post_train.py on whole nodes through run_post_train_multinode.sh (one task per node), stopped
# cleanly before the time limit and continued by the same job, requeued. Submit it from the repository root:
#   sbatch run_post_train_slurm.sh --train_video_csv prompts.csv       # 8 nodes x 8 GPUs, configs/multinode_64gpu.yaml
#   CONFIG=configs/single_node_8gpu.yaml sbatch --nodes 1 run_post_train_slurm.sh --train_video_csv prompts.csv
#   sbatch --nodes 4 run_post_train_slurm.sh --dp_replicate 4 --train_video_csv prompts.csv   # 4 nodes: one replica each
# sbatch's own flags override the #SBATCH lines below; the environment (CONFIG, PYTHON, MAX_RESTARTS, ...) reaches
# every node. What happens when:
# - the time limit nears: SLURM sends USR1 to this script 900 s before it (--signal=B:USR1@900; up to 60 s earlier).
#   The trap below sends SIGTERM to every process of the training step (scancel --signal=TERM: the job's steps, not
#   this script), waits while the step finishes and writes its checkpoint, then requeues the job, which starts again
#   and continues from the newest complete checkpoint (AUTO_RESUME=1). 900 s must cover a step plus a checkpoint
#   save. The B: (this script only) is what lets it requeue after the save; a bare `--signal=B:TERM@900` without a
#   trap would end this script at once, and the job with it, before any checkpoint.
# - the job is preempted, or a node fails: SLURM requeues it (--requeue, where the cluster allows requeueing) and the
#   requeued job continues from the newest complete checkpoint. The step's processes get SIGTERM first and write a
#   checkpoint if the grace time (the partition's GraceTime, else KillWait, 30 s by default) covers a step plus a
#   save; otherwise the last --save_interval checkpoint is where it continues.
# - a rank crashes: torchrun restarts the worker group on the same nodes, up to MAX_RESTARTS times (default 3 in
#   run_post_train_multinode.sh), each time from the newest complete checkpoint; after that the job ends with the
#   error and is not requeued.
# - you stop it: `scancel --signal=TERM <jobid>` signals the step only: it writes a checkpoint and the job ends
#   without a requeue. A plain `scancel <jobid>` kills after KillWait.
#SBATCH --job-name=sage-grpo
#SBATCH --nodes=8
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --signal=B:USR1@900
#SBATCH --requeue
#SBATCH --open-mode=append
set -uo pipefail
if [ -z "${SLURM_JOB_NODELIST:-}" ]; then  # run by hand outside a SLURM allocation
  echo "run_post_train_slurm.sh: not inside a SLURM job; submit it with sbatch (e.g. sbatch --nodes 8 run_post_train_slurm.sh --train_video_csv prompts.csv), or use run_post_train.sh on one machine" >&2
  exit 2
fi
export MASTER_ADDR
MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"
export AUTO_RESUME=1  # a requeued job continues from the newest complete checkpoint; a first run starts fresh
stopping=0
trap 'stopping=1; scancel --signal=TERM "$SLURM_JOB_ID"' USR1
# every CPU of the node to the one task (srun's default is one CPU per task); each node's rank from SLURM_NODEID
srun --kill-on-bad-exit=1 --cpus-per-task="$SLURM_CPUS_ON_NODE" \
  bash -c 'NNODES=$SLURM_NNODES NODE_RANK=$SLURM_NODEID exec bash run_post_train_multinode.sh "$@"' _ "$@" &
step=$!
while kill -0 "$step" 2>/dev/null; do
  wait "$step"  # a trapped signal ends the wait early: wait again while the step runs
done
wait "$step"  # the step's exit status (the shell keeps it once the step has ended)
status=$?
if [ "$stopping" = 1 ] && [ "$status" = 0 ]; then
  scontrol requeue "$SLURM_JOB_ID"  # the checkpoint is written: continue in a new allocation
fi
exit "$status"
