#!/usr/bin/env bash
# Single-node launcher (FSDP2 + Ulysses sp 2 with the default CONFIG). The authors' example for one 8-GPU node, whose
# flags this repository accepts unchanged:
#   torchrun --nproc_per_node=8 post_train.py --pretrained_model_root ./ckpts --learning_rate 1e-5 --batch_size 2 \
#     --num_generations 4 --max_steps 10000 --output_dir ./outputs --enable_gradient_checkpointing \
#     --sde_type sage_grpo --use_grad_balancing True --enable_timestep_permutation True --kl_weight 1e-5 \
#     --kl_coef 1e-7 --use_moving_KL True --update_ref_model_step 10 --use_dual_kl True \
#     --dual_kl_moving_weight 1.0 --dual_kl_step_weight 0.1 --reference_mode_offload True
# Usage:
#   NGPU=8 CONFIG=configs/single_node_8gpu.yaml bash run_post_train.sh [extra post_train.py flags ...]
#   AUTO_RESUME=1 bash run_post_train.sh ...     # continue from the newest complete checkpoint in output_dir
#   MAX_RESTARTS=3 bash run_post_train.sh ...    # torchrun restarts failed workers, each time from the newest checkpoint
# NGPU defaults to the number of visible GPUs (1 process on a CPU-only machine); CONFIG to the 8-GPU config;
# PYTHON to python3 (the environment with torch and this project); MAX_RESTARTS to 0 (on one node a failure is
# mostly one a restart repeats, a bug or out of memory: fix it and continue with AUTO_RESUME=1).
# SIGTERM or Ctrl-C: the workers finish the step, write a checkpoint and the launch exits 0.
# Under SLURM use run_post_train_slurm.sh (`CONFIG=configs/single_node_8gpu.yaml sbatch --nodes 1
# run_post_train_slurm.sh ...`): it gets the stop signal to the training processes before the time limit and
# requeues the job (docs/scaling.md, "SLURM").
# The flags are checked once, in one process, before torchrun starts (scripts/check_launch.py).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
PY="${PYTHON:-python3}"
source scripts/_launch_torch.sh  # torch's check, visible_gpus, TORCH_ELASTIC_SHUTDOWN_TIMEOUT
NGPU="${NGPU:-$visible_gpus}"
CONFIG="${CONFIG:-configs/single_node_8gpu.yaml}"
MAX_RESTARTS="${MAX_RESTARTS:-0}"
resume=()
if [ "${AUTO_RESUME:-0}" = "1" ] || [ "$MAX_RESTARTS" != "0" ]; then
  resume=(--resume_from_checkpoint latest)  # a restarted worker group continues from the newest checkpoint
fi
"$PY" scripts/check_launch.py --nnodes 1 --nproc_per_node "$NGPU" --config "$CONFIG" "${resume[@]}" "$@"
exec "$PY" -m sage_grpo.launch --standalone --nproc_per_node "$NGPU" --max-restarts "$MAX_RESTARTS" \
  post_train.py --config "$CONFIG" "${resume[@]}" "$@"
