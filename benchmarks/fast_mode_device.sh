#!/usr/bin/env bash
# The fast mode's full-size set with flash-attn-4 on one device machine, in three kinds of call (benchmarks/RUNNING.md):
# flash-attn-4 and the site are over one call's carry together, so flash-attn-4 comes in two parts, the second call at
# once after the first (within the machine's idle window).
#
#   bash benchmarks/fast_mode_device.sh parts COMMIT            # carry .whl .whl-fa4a: the site into /root/run/site,
#                                                               # flash-attn-4's first part into /root/run/fa4parts
#   bash benchmarks/fast_mode_device.sh set COMMIT [MINUTES]    # carry .whl-fa4b: flash-attn-4 into /root/run/fa4,
#                                                               # then full_size_h200.sh detached; polls MINUTES
#   bash benchmarks/fast_mode_device.sh poll COMMIT [MINUTES]   # polls; copies what is there to $OUT
#
# The set is SET (default "fast_mode end_to_end fast_mode_e2e") with FAST_ARGS (default: the 10 and 15 s evaluations at
# density caps 0.25 and 0.2), within SET_MINUTES (default 21) of its start; `pytest -m gpu tests/` runs beside the
# staging. The repository's fast_mode_<gpu>.json is put in /root/run/results first, so the records the set does not
# measure are kept.
set -u
STEP=${1:?parts, set or poll}
COMMIT=${2:?the commit measured}
MINUTES=${3:-9}
END=$(( $(date +%s) + MINUTES * 60 ))
R=${R:-/root/run}
mkdir -p "$R/site" "$R/results"

report() {
    df -h / /dev/shm | sed 's/^/  /'
    free -g | sed 's/^/  /'
    for log in /root/driver.log "$R"/results/*.log; do [ -e "$log" ] && { echo "== $log"; tail -c 2000 "$log"; }; done
    cp "$R"/results/* "${OUT:-/tmp}/" 2>/dev/null
}

case $STEP in
    parts)
        tar -xJf .whl/site.tar.xz -C "$R/site"
        mkdir -p "$R/fa4parts" && cp .whl-fa4a/part_aa "$R/fa4parts/"
        nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
        report
        ;;
    set)
        [ -e "$R/site/diffusers" ] && [ -e "$R/fa4parts/part_aa" ] || {
            echo "no site or first part on this machine: the parts call did not run here"; exit 1; }
        mkdir -p "$R/fa4" && cat "$R/fa4parts/part_aa" .whl-fa4b/part_ab | tar -xJ -C "$R/fa4" || exit 1
        cp benchmarks/results/fast_mode_h*.json "$R/results/"
        SET=${SET:-fast_mode end_to_end fast_mode_e2e} \
            FAST_ARGS=${FAST_ARGS:---phases evaluation --seconds 10 15 --evaluation-densities 0.25 0.2} \
            setsid nohup bash benchmarks/full_size_h200.sh "$COMMIT" "${SET_MINUTES:-21}" --skip disk weight_io \
            vflash_resident bitwise vflash_encoder_offload vflash_block_ring > /root/driver.log 2>&1 < /dev/null &
        ;;
    poll) ;;
    *) echo "unknown step $STEP"; exit 2 ;;
esac
if [ "$STEP" != parts ]; then
    while [ "$(date +%s)" -lt "$END" ] && ! grep -qs '^done at' "$R/results/done.log"; do sleep 10; done
    report
fi
