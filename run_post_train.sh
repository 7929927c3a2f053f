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
# NGPU defaults to the number of visible GPUs (1 process on a CPU-only machine); CONFIG to the 8-GPU config.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
if [ -z "${NGPU:-}" ]; then
  NGPU=$(python3 -c "import torch; print(max(torch.cuda.device_count(), 1))" 2>/dev/null || echo 1)
fi
CONFIG="${CONFIG:-configs/single_node_8gpu.yaml}"
# On SIGTERM/SIGINT torchrun forwards the signal and kills the workers after this many seconds; post_train.py needs
# the rest of the current step plus a checkpoint (torch's default is 30 s).
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT="${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-1800}"
resume=()
if [ "${AUTO_RESUME:-0}" = "1" ]; then
  resume=(--resume_from_checkpoint latest)
fi
exec torchrun --standalone --nproc_per_node "$NGPU" post_train.py --config "$CONFIG" "${resume[@]}" "$@"
