#!/usr/bin/env bash
# Download the real weights into ./ckpts (or $CKPTS) with the Hugging Face CLI (`pip install -U huggingface_hub`;
# `hf auth login` first if a repo asks for it). Nothing in the project downloads at run time; tests never need this.
#
#   ./download_weights.sh                 # diffusers layout of HunyuanVideo-1.5 480p t2v (primary) + VideoReward
#   ./download_weights.sh authors         # the authors' layout instead (tencent/HunyuanVideo-1.5 + Glyph/ByT5/Qwen)
#   ./download_weights.sh reward          # only the reward model (VideoReward + its Qwen2-VL-2B-Instruct base)
#   ./download_weights.sh metrics         # CLIPScore / PickScore weights for scripts/score_videos.py (Table 2)
#   ./download_weights.sh --dry-run ...   # print the commands only; downloads and creates nothing
#   VERSION=480p_i2v ./download_weights.sh authors   # another checkpoint (image-to-video: with its SigLIP)
#
# Resulting layouts (sage_grpo/models/loading.py auto-detects them under --pretrained_model_root):
#   ckpts/HunyuanVideo-1.5-Diffusers-480p_t2v/{model_index.json,transformer,vae,text_encoder,tokenizer,...}
#   ckpts/{transformer/480p_t2v,vae,scheduler,text_encoder/{llm,byt5-small,Glyph-SDXL-v2}}        (authors)
#   ckpts/vision_encoder/siglip/{image_encoder,feature_extractor}   (authors' layout of an i2v VERSION; the diffusers
#                                 repositories of the i2v versions ship them in image_encoder/, feature_extractor/)
#   ckpts/VideoReward, ckpts/Qwen2-VL-2B-Instruct                                                  (reward)
#   ckpts/clip-vit-large-patch14      <- openai/clip-vit-large-patch14          (--clip_model_path)      (metrics)
#   ckpts/PickScore_v1                <- yuvalkirstain/PickScore_v1             (--pickscore_model_path)
#   ckpts/CLIP-ViT-H-14-laion2B-s32B-b79K <- laion/CLIP-ViT-H-14-laion2B-s32B-b79K, tokenizer/processor files only
#                                                                               (--pickscore_processor_path)
set -euo pipefail
CKPTS="${CKPTS:-ckpts}"
VERSION="${VERSION:-480p_t2v}"
usage="usage: $0 [--dry-run] [diffusers|authors|reward|metrics]   (env: CKPTS=$CKPTS VERSION=$VERSION)"

dry_run=0
what=""
for arg in "$@"; do
  case "$arg" in
    --dry-run|-n) dry_run=1 ;;
    -h|--help) sed -n '2,21p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    diffusers|authors|reward|metrics)
      [ -z "$what" ] || { echo "error: give one target, got '$what' and '$arg'; $usage" >&2; exit 2; }
      what="$arg" ;;
    *) echo "error: unknown argument '$arg'; $usage" >&2; exit 2 ;;
  esac
done
what="${what:-diffusers}"

# The checkpoints diffusers can run (sage_grpo/models/tiny.py VARIANTS; tests/test_download_weights.py keeps the two
# lists equal), and the ones it cannot, with the reason.
VERSIONS="480p_t2v 480p_i2v 720p_t2v 720p_i2v 480p_t2v_distilled 480p_i2v_distilled 720p_t2v_distilled 720p_i2v_distilled 480p_i2v_step_distilled"
case "$VERSION" in
  *_sparse) echo "error: VERSION=$VERSION is not supported: sparse attention (SSTA) exists only in the authors' code, not in diffusers" >&2; exit 2 ;;
  *_sr_distilled) echo "error: VERSION=$VERSION is not supported: a super-resolution model, not in diffusers" >&2; exit 2 ;;
esac
case " $VERSIONS " in
  *" $VERSION "*) ;;
  *) echo "error: unknown VERSION=$VERSION; valid: $VERSIONS" >&2; exit 2 ;;
esac

# Every action goes through run: printed, and executed unless --dry-run.
run() {
  printf '%q ' "$@"; echo
  if [ "$dry_run" = 0 ]; then "$@"; fi
}

if [ "$dry_run" = 0 ]; then
  command -v hf >/dev/null || { echo "error: the 'hf' CLI is missing: pip install -U huggingface_hub" >&2; exit 1; }
fi

diffusers_layout() {
  # ~33 GB: transformer (8.3B, bf16), VAE, Qwen2.5-VL-7B text tower, Glyph ByT5, tokenizers.
  run hf download "hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-${VERSION}" \
    --local-dir "$CKPTS/HunyuanVideo-1.5-Diffusers-${VERSION}"
}

authors_layout() {
  # The authors' checkpoint: transformer/<version>, vae, scheduler (their key names; converted on load).
  run hf download tencent/HunyuanVideo-1.5 --include "transformer/${VERSION}/*" "vae/*" "scheduler/*" "config.json" \
    --local-dir "$CKPTS"
  # Text encoders as the authors' checkpoints-download.md places them.
  run hf download Qwen/Qwen2.5-VL-7B-Instruct --local-dir "$CKPTS/text_encoder/llm"
  run hf download google/byt5-small --local-dir "$CKPTS/text_encoder/byt5-small"
  case "$VERSION" in
    *i2v*)  # the I2V image encoder: FLUX.1-Redux-dev's SigLIP, where the authors' loader reads it (a gated repo:
            # accept its license on the hub and `hf auth login` first)
      run hf download black-forest-labs/FLUX.1-Redux-dev --include "image_encoder/*" "feature_extractor/*" \
        --local-dir "$CKPTS/vision_encoder/siglip" ;;
  esac
  # Glyph-SDXL-v2 (checkpoints/byt5_model.pt + assets/*.json) is published on ModelScope.
  if [ "$dry_run" = 1 ] || command -v modelscope >/dev/null; then
    run modelscope download --model AI-ModelScope/Glyph-SDXL-v2 --local_dir "$CKPTS/text_encoder/Glyph-SDXL-v2"
  else
    echo "note: install modelscope (pip install modelscope) or fetch Glyph-SDXL-v2 by hand into $CKPTS/text_encoder/Glyph-SDXL-v2" >&2
  fi
}

reward() {
  run hf download KlingTeam/VideoReward --local-dir "$CKPTS/VideoReward"
  run hf download Qwen/Qwen2-VL-2B-Instruct --local-dir "$CKPTS/Qwen2-VL-2B-Instruct"
}

metrics() {
  # ~5.6 GB: CLIP ViT-L/14 (CLIPScore), PickScore_v1 (a CLIP ViT-H/14), and the laion ViT-H/14 tokenizer/processor
  # that PickScore uses (its 4 GB weights are not needed). Safetensors weights only.
  run hf download openai/clip-vit-large-patch14 --include "*.json" "*.txt" "model.safetensors" \
    --local-dir "$CKPTS/clip-vit-large-patch14"
  run hf download yuvalkirstain/PickScore_v1 --include "*.json" "*.txt" "model.safetensors" \
    --local-dir "$CKPTS/PickScore_v1"
  run hf download laion/CLIP-ViT-H-14-laion2B-s32B-b79K --include "*.json" "*.txt" \
    --local-dir "$CKPTS/CLIP-ViT-H-14-laion2B-s32B-b79K"
}

run mkdir -p "$CKPTS"
case "$what" in
  diffusers) diffusers_layout; reward ;;
  authors) authors_layout; reward ;;
  reward) reward ;;
  metrics) metrics ;;
esac
if [ "$dry_run" = 1 ]; then echo "dry run: nothing was downloaded"; else echo "done: weights under $CKPTS"; fi
