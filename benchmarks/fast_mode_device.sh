#!/usr/bin/env bash
# The fast-mode set on one GPU machine, started detached by the first device call (benchmarks/RUNNING.md): the kernel,
# the step cache and whole evaluations (fast_mode.py, with the GPU to itself), then the full-size staging with
# `pytest -m gpu` beside it and `vflash compare` at full size (full_size_h200.sh's fast_mode_e2e).
#
#   [FAST_ARGS="--phases kernel step_cache evaluation"] bash benchmarks/fast_mode_device.sh COMMIT [MINUTES]
#
# Run from the repository root of the device copy with `.whl/site.tar.xz` carried. Results and logs go to
# $R/results (default /root/run/results), ending with the line "done at ..." in $R/results/done.log.
set -u
COMMIT=${1:?the commit measured}
MINUTES=${2:-24}
R=${R:-/root/run}
START=$(date +%s)
mkdir -p "$R/site" "$R/results"
[ -e "$R/site/diffusers" ] || tar -xJf .whl/site.tar.xz -C "$R/site"
# From a copy: each later device call syncs the tree it was started from, under a running job.
rm -rf "$R/fast-repo" && cp -r . "$R/fast-repo" && cd "$R/fast-repo" || exit 1
ln -sfn "$PWD/vflash_core" "$R/site/vflash_core"
ln -sfn "$PWD/kernels" "$R/site/vflash_kernels"
ln -sfn "$PWD/nodes" "$R/site/vflash_nodes"
PYTHONPATH=$R/site:$PWD VFLASH_RESULTS=$R/results VFLASH_COMMIT=$COMMIT PYTHONUNBUFFERED=1 \
    python3 benchmarks/fast_mode.py ${FAST_ARGS:---phases kernel step_cache evaluation} > "$R/results/fast_mode.log" 2>&1
rm -rf /tmp/vflash-bench  # fast_mode.py's 4-block model: the staging needs the disk
SET="end_to_end fast_mode_e2e" bash benchmarks/full_size_h200.sh "$COMMIT" $(( MINUTES - ($(date +%s) - START) / 60 )) \
    --skip disk weight_io vflash_resident bitwise vflash_encoder_offload vflash_block_ring
