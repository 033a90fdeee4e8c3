#!/usr/bin/env bash
# Pack what a device machine needs to run ComfyUI headless for benchmarks/vs_comfy_core.py into
# .whl-comfy/comfyui.tar.xz (git-ignored; a folder of its own, so it travels in a call apart from .whl/):
#   ComfyUI/  its tracked files, less tests/ (and no .git)
#   site/     the contents of CPython 3.12 manylinux x86-64 wheels of ComfyUI's requirements and their own
#             dependencies that the device image lacks, at the versions the local ComfyUI environment has
# The local environment may be of another Python: only its package versions are read, never its files, so no
# compiled extension of the wrong Python travels.
#
#   bash benchmarks/pack_comfyui.sh /work/comfy/ComfyUI /work/comfy/venv
set -euo pipefail
COMFYUI=${1:?ComfyUI checkout}
VENV=${2:?its virtual environment}

# The device image's Python packages (its package list as read on a device machine on 2026-11-17). A requirement named here is taken from the image, whatever its version there.
DEVICE_IMAGE_PACKAGES="absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch
build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers
flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize
hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib
kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py
markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind
narwhals networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc
nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse
nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir
onnxruntime onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging
pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11
py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock
pytest-timeout pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors
scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham
simplejson six sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore
threadpoolctl tifffile tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics
torchvision tqdm transformers treescope triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig
werkzeug wheel wrapt xarray xxhash yarl zipp"
# av travels in .whl/site.tar.xz. A headless API run serves no frontend, templates or embedded docs (the server
# starts with `--front-end-root` at an empty folder), and only the GLSL node imports PyOpenGL and comfy-angle (it is
# skipped with a warning).
NOT_PACKED="av comfyui-frontend-package comfyui-workflow-templates comfyui-embedded-docs pyopengl comfy-angle"
# The device is x86-64 Linux with glibc 2.39 (Ubuntu 24.04's Python 3.12.3); pip matches a manylinux_2_N tag exactly.
PLATFORMS=(--platform manylinux1_x86_64 --platform manylinux2014_x86_64)
for n in $(seq 17 39); do PLATFORMS+=(--platform "manylinux_2_${n}_x86_64"); done

STAGE=$(mktemp -d)
trap 'rm -rf "$STAGE"' EXIT
mkdir -p "$STAGE/ComfyUI" "$STAGE/site" "$STAGE/wheels"
# (files the checkout tracks but does not hold, e.g. large tokenizer files of other models, are skipped)
git -C "$COMFYUI" ls-files | grep -v '^tests' | while read -r f; do
  [ -e "$COMFYUI/$f" ] && (cd "$COMFYUI" && cp --parents "$f" "$STAGE/ComfyUI/")
done

# name==version for each requirement (and, transitively, each of its dependencies) that the device lacks, with
# markers evaluated for CPython 3.12 on Linux x86-64 and no extras.
"$VENV/bin/python" - "$COMFYUI/requirements.txt" "$DEVICE_IMAGE_PACKAGES $NOT_PACKED" > "$STAGE/pins.txt" <<'EOF'
import importlib.metadata
import sys

from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

TARGET = {"python_version": "3.12", "python_full_version": "3.12.3", "implementation_name": "cpython",
          "platform_python_implementation": "CPython", "sys_platform": "linux", "platform_system": "Linux",
          "platform_machine": "x86_64", "os_name": "posix", "extra": ""}
requirements_txt, skipped = sys.argv[1], {canonicalize_name(n) for n in sys.argv[2].split()}


def applies(marker: Marker | None) -> bool:
    return marker is None or marker.evaluate(TARGET)


lines = (line.split("#")[0].strip() for line in open(requirements_txt))
pending = [Requirement(line) for line in lines if line]
pins: dict[str, str] = {}
while pending:
    req = pending.pop()
    name = canonicalize_name(req.name)
    if name in skipped or name in pins or not applies(req.marker):
        continue
    pins[name] = importlib.metadata.version(name)
    pending += [Requirement(r) for r in importlib.metadata.requires(name) or ()]
print("\n".join(f"{name}=={version}" for name, version in sorted(pins.items())))
EOF
echo "packing: $(tr '\n' ' ' < "$STAGE/pins.txt")"
"$VENV/bin/python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${PLATFORMS[@]}" -d "$STAGE/wheels" -r "$STAGE/pins.txt"
for wheel in "$STAGE"/wheels/*.whl; do unzip -qo "$wheel" -d "$STAGE/site"; done
# comfy_kitchen imports its HIP backend (57 MB) only under a ROCm build of torch; its CUDA backend (169 MB) stays.
rm -rf "$STAGE/site/comfy_kitchen/backends/hip"
mkdir -p .whl-comfy
tar -cJf .whl-comfy/comfyui.tar.xz -C "$STAGE" ComfyUI site
ls -l .whl-comfy/comfyui.tar.xz
