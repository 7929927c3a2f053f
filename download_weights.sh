#!/usr/bin/env bash
# Download the real weights into ./ckpts (or $CKPTS) with the Hugging Face CLI (`pip install -U huggingface_hub`,
# >= 1.0; `hf auth login` first if a repo asks for it; HF_ENDPOINT names a mirror). Nothing in the project downloads
# at run time. Only the files the loaders read are fetched; a stopped download resumes when run again.
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
#   ckpts/{transformer/480p_t2v,vae,text_encoder/{llm,byt5-small,Glyph-SDXL-v2}}                  (authors)
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
    -h|--help) sed -n '2,22p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
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

endpoint="${HF_ENDPOINT:-https://huggingface.co}"
endpoint="${endpoint%/}"

# fetch REPO DEST [PATTERN...]: `hf download REPO --include PATTERN... --local-dir DEST`, printed, and executed
# unless --dry-run. One --include per pattern: `hf download` (huggingface_hub >= 1) takes the words after the first
# pattern for file names. A dry run of hf first (metadata only) turns a refusal into one line: a repository that
# answers 401/403 (gated or private), an unknown one, an unreachable endpoint. Then the download itself, with hf's
# progress bars; a stop midway ends in one line after hf's own report (run again: hf keeps the finished files and
# resumes the rest), and so does a PATTERN that matched no file of the repository.
fetch() {
  local repo="$1" dest="$2" p out
  shift 2
  local args=(download "$repo")
  for p in "$@"; do args+=(--include "$p"); done
  args+=(--local-dir "$dest")
  printf '%q ' hf "${args[@]}"; echo
  [ "$dry_run" = 0 ] || return 0
  # HF_DEBUG: hf's traceback names the exception and the HTTP status (its one-line message does not)
  if ! out="$(HF_DEBUG=1 hf "${args[@]}" --dry-run 2>&1)"; then refused "$repo" "$out"; fi
  if ! hf "${args[@]}"; then
    echo "error: the download of $repo into $dest stopped before the end (hf's message above); run the same" \
         "command again: the finished files are kept and the rest resumes" >&2
    exit 1
  fi
  for p in "$@"; do
    matched "$dest" "$p" && continue
    case "$p" in
      *"$VERSION"*) echo "error: $repo at $endpoint has no file matching '$p': VERSION=$VERSION is not published" \
                         "there (yet)" >&2 ;;
      *) echo "error: $repo at $endpoint has no file matching '$p'" >&2 ;;
    esac
    exit 1
  done
}

# matched DIR PATTERN: a downloaded file under DIR (hf's .cache/ aside) whose path below DIR matches the glob PATTERN
# (`*` crosses `/`, as in hf's --include).
matched() {
  local f
  while IFS= read -r -d '' f; do
    # shellcheck disable=SC2053  # PATTERN is a glob on purpose
    [[ "${f#"$1"/}" == $2 ]] && return 0
  done < <(find "$1" -name .cache -prune -o -type f -print0 2>/dev/null)
  return 1
}

# refused REPO OUTPUT: one line for a failed dry run of REPO, from hf's OUTPUT (its exception names, else its words).
refused() {
  local repo="$1" out="$2" code
  code="$(grep -oE '\b40[13] (Client Error|Unauthorized|Forbidden)' <<<"$out" | head -n 1 | cut -c1-3 || true)"
  local login="log in with \`hf auth login\` (a token of that account), then run this again"
  if grep -qE "GatedRepoError|requires approval|Cannot access gated repo" <<<"$out"; then
    echo "error: $repo refused access (HTTP ${code:-401/403}: a gated repository): accept its terms at" \
         "$endpoint/$repo, $login" >&2
  elif grep -qE "RepositoryNotFoundError|Repository Not Found|(Model|Repository) '[^']*' not found" <<<"$out"; then
    echo "error: no repository $repo at $endpoint (check the name; a private one needs \`hf auth login\`)" >&2
  elif [ -n "$code" ] || grep -qE "Unauthorized|Forbidden" <<<"$out"; then
    echo "error: $repo refused access (HTTP ${code:-401/403}): $login" >&2
  elif grep -qE "ConnectError|ConnectTimeout|Connection refused|name resolution|not known|timed out" <<<"$out"; then
    echo "error: $endpoint does not answer (offline, or a wrong HF_ENDPOINT); run this again when it does" >&2
  elif grep -q "No such option" <<<"$out"; then
    echo "error: this hf CLI is too old for this script (no --dry-run): pip install -U huggingface_hub" >&2
  else
    out="$(sed 's/\x1b\[[0-9;]*m//g' <<<"$out" | grep -v '^[[:space:]]*$' || true)"
    echo "error: hf download $repo failed: $(grep '^Error: ' <<<"$out" | tail -n 1 | cut -c8- | grep . ||
      tail -n 1 <<<"$out")" >&2
  fi
  exit 1
}

if [ "$dry_run" = 0 ]; then
  command -v hf >/dev/null || { echo "error: the 'hf' CLI is missing: pip install -U huggingface_hub" >&2; exit 1; }
fi

diffusers_layout() {
  # ~33 GB: transformer (8.3B, bf16), VAE, Qwen2.5-VL-7B text tower, Glyph ByT5, tokenizers.
  fetch "hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-${VERSION}" "$CKPTS/HunyuanVideo-1.5-Diffusers-${VERSION}"
}

authors_layout() {
  # The authors' checkpoint: transformer/<version> and vae (their key names; converted on load). Not the other
  # versions, the upsamplers, nor scheduler/ (the version's flow shift comes from its row in sage_grpo/models/tiny.py).
  fetch tencent/HunyuanVideo-1.5 "$CKPTS" "transformer/${VERSION}/*" "vae/*"
  # Text encoders as the authors' checkpoints-download.md places them; of byt5-small only its config and tokenizer
  # files (the glyph weights are Glyph-SDXL-v2's byt5_model.pt; its .bin, .h5 and .msgpack weights go unread).
  fetch Qwen/Qwen2.5-VL-7B-Instruct "$CKPTS/text_encoder/llm"
  fetch google/byt5-small "$CKPTS/text_encoder/byt5-small" "*.json"
  case "$VERSION" in
    *i2v*)  # the I2V image encoder: FLUX.1-Redux-dev's SigLIP, where the authors' loader reads it (a gated repo:
            # accept its license on the hub and `hf auth login` first)
      fetch black-forest-labs/FLUX.1-Redux-dev "$CKPTS/vision_encoder/siglip" "image_encoder/*" "feature_extractor/*" ;;
  esac
  # Glyph-SDXL-v2 (checkpoints/byt5_model.pt + assets/*.json) is published on ModelScope.
  if [ "$dry_run" = 1 ] || command -v modelscope >/dev/null; then
    run modelscope download --model AI-ModelScope/Glyph-SDXL-v2 --local_dir "$CKPTS/text_encoder/Glyph-SDXL-v2"
  elif [ -f "$CKPTS/text_encoder/Glyph-SDXL-v2/checkpoints/byt5_model.pt" ]; then
    echo "note: Glyph-SDXL-v2 is already in $CKPTS/text_encoder/Glyph-SDXL-v2 (modelscope not installed: not refreshed)" >&2
  else
    echo "note: install modelscope (pip install modelscope) or fetch Glyph-SDXL-v2 by hand into $CKPTS/text_encoder/Glyph-SDXL-v2" >&2
    not_fetched+=("Glyph-SDXL-v2 into $CKPTS/text_encoder/Glyph-SDXL-v2 (needs modelscope: pip install modelscope, then run this again)")
  fi
}

reward() {
  fetch KlingTeam/VideoReward "$CKPTS/VideoReward"
  fetch Qwen/Qwen2-VL-2B-Instruct "$CKPTS/Qwen2-VL-2B-Instruct"
}

metrics() {
  # ~5.6 GB: CLIP ViT-L/14 (CLIPScore), PickScore_v1 (a CLIP ViT-H/14), and the laion ViT-H/14 tokenizer/processor
  # that PickScore uses (its 4 GB weights are not needed). Safetensors weights only.
  fetch openai/clip-vit-large-patch14 "$CKPTS/clip-vit-large-patch14" "*.json" "*.txt" "model.safetensors"
  fetch yuvalkirstain/PickScore_v1 "$CKPTS/PickScore_v1" "*.json" "*.txt" "model.safetensors"
  fetch laion/CLIP-ViT-H-14-laion2B-s32B-b79K "$CKPTS/CLIP-ViT-H-14-laion2B-s32B-b79K" "*.json" "*.txt"
}

not_fetched=()  # what a target needs and could not fetch here (the end says so, and exits 1)
run mkdir -p "$CKPTS"
case "$what" in
  diffusers) diffusers_layout; reward ;;
  authors) authors_layout; reward ;;
  reward) reward ;;
  metrics) metrics ;;
esac
if [ "$dry_run" = 1 ]; then echo "dry run: nothing was downloaded"
elif [ "${#not_fetched[@]}" -gt 0 ]; then
  printf 'error: incomplete: weights under %s, but not fetched: %s\n' "$CKPTS" "${not_fetched[*]}" >&2
  exit 1
else echo "done: weights under $CKPTS"; fi
