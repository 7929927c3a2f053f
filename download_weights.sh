#!/usr/bin/env bash
# Download the real weights into ./ckpts (or $CKPTS) with the Hugging Face CLI (`pip install -U huggingface_hub`;
# `hf auth login` first if a repo asks for it). Nothing in the project downloads at run time; tests never need this.
#
#   ./download_weights.sh                 # diffusers layout of HunyuanVideo-1.5 480p t2v (primary) + VideoReward
#   ./download_weights.sh authors         # the authors' layout instead (tencent/HunyuanVideo-1.5 + Glyph/ByT5/Qwen)
#   ./download_weights.sh reward          # only the reward model (VideoReward + its Qwen2-VL-2B-Instruct base)
#
# Resulting layouts (sage_grpo/models/loading.py auto-detects them under --pretrained_model_root):
#   ckpts/HunyuanVideo-1.5-Diffusers-480p_t2v/{model_index.json,transformer,vae,text_encoder,tokenizer,...}
#   ckpts/{transformer/480p_t2v,vae,scheduler,text_encoder/{llm,byt5-small,Glyph-SDXL-v2}}        (authors)
#   ckpts/VideoReward, ckpts/Qwen2-VL-2B-Instruct                                                  (reward)
set -euo pipefail
CKPTS="${CKPTS:-ckpts}"
VERSION="${VERSION:-480p_t2v}"
what="${1:-diffusers}"
command -v hf >/dev/null || { echo "error: the 'hf' CLI is missing: pip install -U huggingface_hub" >&2; exit 1; }
mkdir -p "$CKPTS"

diffusers_layout() {
  # ~33 GB: transformer (8.3B, bf16), VAE, Qwen2.5-VL-7B text tower, Glyph ByT5, tokenizers.
  hf download "hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-${VERSION}" \
    --local-dir "$CKPTS/HunyuanVideo-1.5-Diffusers-${VERSION}"
}

authors_layout() {
  # The authors' checkpoint: transformer/<version>, vae, scheduler (their key names; converted on load).
  hf download tencent/HunyuanVideo-1.5 --include "transformer/${VERSION}/*" "vae/*" "scheduler/*" "config.json" \
    --local-dir "$CKPTS"
  # Text encoders as the authors' checkpoints-download.md places them.
  hf download Qwen/Qwen2.5-VL-7B-Instruct --local-dir "$CKPTS/text_encoder/llm"
  hf download google/byt5-small --local-dir "$CKPTS/text_encoder/byt5-small"
  # Glyph-SDXL-v2 (checkpoints/byt5_model.pt + assets/*.json) is published on ModelScope:
  #   modelscope download --model AI-ModelScope/Glyph-SDXL-v2 --local_dir "$CKPTS/text_encoder/Glyph-SDXL-v2"
  if command -v modelscope >/dev/null; then
    modelscope download --model AI-ModelScope/Glyph-SDXL-v2 --local_dir "$CKPTS/text_encoder/Glyph-SDXL-v2"
  else
    echo "note: install modelscope (pip install modelscope) or fetch Glyph-SDXL-v2 by hand into $CKPTS/text_encoder/Glyph-SDXL-v2" >&2
  fi
}

reward() {
  hf download KlingTeam/VideoReward --local-dir "$CKPTS/VideoReward"
  hf download Qwen/Qwen2-VL-2B-Instruct --local-dir "$CKPTS/Qwen2-VL-2B-Instruct"
}

case "$what" in
  diffusers) diffusers_layout; reward ;;
  authors) authors_layout; reward ;;
  reward) reward ;;
  *) echo "usage: $0 [diffusers|authors|reward]" >&2; exit 2 ;;
esac
echo "done: weights under $CKPTS"
