#!/usr/bin/env bash
# Pack what a device machine needs to run ComfyUI headless for benchmarks/vs_comfy_core.py into .whl/comfyui.tar.xz
# (git-ignored): ComfyUI's tracked files (no tests, no .git) and the site-packages of those of its requirements the
# device machine lacks, taken from a ComfyUI Python 3.12 environment here (torch, transformers, numpy, safetensors,
# Pillow, tqdm, requests, filelock are on the device; av travels in .whl/site.tar.xz). Left out: the frontend, the
# workflow templates and the embedded docs (a headless API run serves none of them: the server starts with
# `--front-end-root` at an empty folder), and the CUDA-less wheels' optional extras.
#
#   bash benchmarks/pack_comfyui.sh /work/comfy/ComfyUI /work/comfy/venv
set -euo pipefail
COMFYUI=${1:?ComfyUI checkout}
VENV=${2:?its virtual environment}
SITE=$(echo "$VENV"/lib/python3*/site-packages)
STAGE=$(mktemp -d)
trap 'rm -rf "$STAGE"' EXIT
mkdir -p "$STAGE/ComfyUI" "$STAGE/site"
# (files the checkout tracks but does not hold, e.g. large tokenizer files of other models, are skipped)
git -C "$COMFYUI" ls-files | grep -v '^tests' | while read -r f; do
  [ -e "$COMFYUI/$f" ] && (cd "$COMFYUI" && cp --parents "$f" "$STAGE/ComfyUI/")
done
# ComfyUI's requirements.txt, less what the device has and what a headless API run does not import.
for pkg in comfy_kitchen comfy_aimdo torchsde trampoline einops sentencepiece aiohttp aiohappyeyeballs aiosignal \
           frozenlist multidict propcache yarl yaml _yaml scipy scipy.libs psutil alembic mako sqlalchemy greenlet \
           blake3 simpleeval spandrel kornia kornia_rs pydantic pydantic_core pydantic_settings annotated_types \
           typing_inspection dotenv; do
  for path in "$SITE/$pkg" "$SITE/$pkg".*.so "$SITE/$pkg"-*.dist-info "$SITE/$pkg.py"; do
    [ -e "$path" ] && cp -r "$path" "$STAGE/site/"
  done
done
# comfy_kitchen imports its HIP backend (57 MB) only under a ROCm build of torch; its CUDA backend (169 MB) stays.
rm -rf "$STAGE/site/comfy_kitchen/backends/hip"
mkdir -p .whl
tar -cJf .whl/comfyui.tar.xz -C "$STAGE" ComfyUI site
ls -l .whl/comfyui.tar.xz
