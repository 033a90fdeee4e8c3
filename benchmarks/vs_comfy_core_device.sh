#!/usr/bin/env bash
# vs_comfy_core.py at full size on one device machine, in three kinds of call (benchmarks/RUNNING.md): the two
# archives are over one call's carry together, so each comes in its own call, the second at once after the first.
#
#   bash benchmarks/vs_comfy_core_device.sh site COMMIT            # carry .whl: diffusers, av, ... into /root/site
#   bash benchmarks/vs_comfy_core_device.sh comfy COMMIT [MINUTES] # carry .whl-comfy: ComfyUI into /root/cf, then the
#                                                                  # files and the benchmark detached; polls MINUTES
#   bash benchmarks/vs_comfy_core_device.sh poll COMMIT [MINUTES]  # polls; copies what is there to $OUT
#
# BENCH_ARGS go to vs_comfy_core.py (default "--rows resident 24 32 fast --warm-runs 1"). Results go to /root/vs-results
# (vs_comfy_core_<gpu>.json, written after every side; the repository's copy is put there first, so that
# --keep-other-rows keeps its other pairs), logs to /root/vs-logs; the model files to /dev/shm/h3 (61.6 GiB of host
# memory), the work folders (Vflash's BF16 compile, 35.9 GiB) to /root/vs on the disk.
set -u
STEP=${1:?site, comfy or poll}
COMMIT=${2:?the commit measured}
MINUTES=${3:-9}
END=$(( $(date +%s) + MINUTES * 60 ))
REPO=/root/vsrepo
LOGS=/root/vs-logs
RESULTS=/root/vs-results
mkdir -p "$LOGS" "$RESULTS"

report() {
    df -h / /dev/shm | sed 's/^/  /'
    free -g | sed 's/^/  /'
    for log in "$LOGS"/*.log; do [ -e "$log" ] && { echo "== $log"; tail -c 2500 "$log"; }; done
    cp "$RESULTS"/*.json "$LOGS"/*.log "${OUT:-/tmp}/" 2>/dev/null
}

case $STEP in
    site)
        mkdir -p /root/site && tar -xJf .whl/site.tar.xz -C /root/site
        # A copy of this tree that later calls' copies do not touch while the benchmark runs from it.
        rm -rf "$REPO" && cp -r . "$REPO"
        cp benchmarks/results/vs_comfy_core_*.json "$RESULTS/" 2>/dev/null
        # The packages as pip would install them (vflash_core takes the repository root off sys.path).
        ln -sfn "$REPO/vflash_core" /root/site/vflash_core
        ln -sfn "$REPO/kernels" /root/site/vflash_kernels
        ln -sfn "$REPO/nodes" /root/site/vflash_nodes
        nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
        python3 -m pip list 2>/dev/null | grep -iE '^(torch|aiohttp|yarl|typing.extensions|numpy|scipy|einops|transformers|safetensors|psutil) '
        report
        ;;
    comfy)
        [ -d /root/site/diffusers ] || { echo "no /root/site: the site call did not run on this machine"; exit 1; }
        mkdir -p /root/cf && tar -xJf .whl-comfy/comfyui.tar.xz -C /root/cf
        cd "$REPO" || exit 1
        # Files, then the benchmark, detached: both outlive this call.
        PYTHONPATH=/root/cf/site:/root/site VFLASH_COMMIT=$COMMIT PYTHONUNBUFFERED=1 setsid nohup bash -c "
            cd /root/cf/ComfyUI && python3 $REPO/benchmarks/comfy_core_files.py /dev/shm/h3 --device cuda > $LOGS/write.log 2>&1
            echo \"exit \$?\" >> $LOGS/write.log
            cd $REPO && PYTHONPATH=/root/cf/site:/root/site:$REPO/benchmarks COMFYUI_PYTHON=python3 VFLASH_RESULTS=$RESULTS \
                python3 -P benchmarks/vs_comfy_core.py --comfyui /root/cf/ComfyUI --models /dev/shm/h3 --work /root/vs \
                ${BENCH_ARGS:---rows resident 24 32 fast --warm-runs 1} > $LOGS/bench.log 2>&1
            echo \"exit \$?\" >> $LOGS/bench.log" > /dev/null 2>&1 < /dev/null &
        ;;
    poll) ;;
    *) echo "unknown step $STEP"; exit 2 ;;
esac
if [ "$STEP" != site ]; then
    while [ "$(date +%s)" -lt "$END" ] && ! grep -q '^exit' "$LOGS/bench.log" 2>/dev/null; do sleep 10; done
    # The servers' own logs of the side running now (the newest work folder).
    newest=$(ls -td /root/vs/*/ 2>/dev/null | grep -vE 'no-frontend|vflash-compiled' | head -1)
    [ -n "$newest" ] && { echo "== ${newest}server.log"; tail -c 3000 "${newest}server.log"; }
    report
fi
