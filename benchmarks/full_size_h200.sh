#!/usr/bin/env bash
# The full-size set on one nvidia-h200 machine, started detached by the first device call (benchmarks/RUNNING.md):
# `pytest -m gpu` beside the staging, then the benchmarks of SET in order, all within MINUTES of this start.
#
#   [SET="end_to_end memory_caps"] [CAPS_ARGS="..."] [HOST_ARGS="..."] [FAST_ARGS="..."] [E2E_ARGS="..."] bash benchmarks/full_size_h200.sh COMMIT [MINUTES] [extra end_to_end.py arguments...]
#
# SET names any of fast_mode, end_to_end, memory_caps, host_memory, service_throughput, fast_mode_e2e (default:
# end_to_end memory_caps; the last two use the receipt end_to_end.py staged, so they follow end_to_end, whose phases
# `--skip` can leave out). fast_mode (fast_mode.py with FAST_ARGS, default its kernel, step-cache and evaluation phases)
# times with the GPU to itself, so it goes first and the tests start after it. fast_mode_e2e runs fast_mode.py's e2e
# phase with E2E_ARGS (default: the Turbo4 receipt at 5 s and sparse-attention; a keyframe profile staged by
# end_to_end.py --profile has its own receipt, /root/e2e/pipeline-PROFILE.json). Run from the repository root of the
# device copy with `.whl/site.tar.xz` carried. Results and logs go to $R/results (default /root/run/results), ending
# with the line "done at ..." in $R/results/done.log; the work folders are /root/e2e (disk) and /dev/shm/vflash
# (tmpfs), kept so a second run resumes the staging.
set -u
COMMIT=${1:?the commit measured}
MINUTES=${2:-24}
shift $(( $# < 2 ? $# : 2 ))
SET=${SET:-end_to_end memory_caps}
R=${R:-/root/run}
END=$(( $(date +%s) + MINUTES * 60 ))
mkdir -p "$R/site" "$R/results"
[ -e "$R/site/diffusers" ] || tar -xJf .whl/site.tar.xz -C "$R/site"
rm -rf "$R/repo" && cp -r . "$R/repo" && cd "$R/repo" || exit 1
# The packages as pip would install them: vflash_core takes the repository root off sys.path when it imports (the
# root's kernels/ would shadow the PyPI package of that name), so a spawned process (a service worker) finds
# vflash_core only through this folder.
ln -sfn "$R/repo/vflash_core" "$R/site/vflash_core"
ln -sfn "$R/repo/kernels" "$R/site/vflash_kernels"
ln -sfn "$R/repo/nodes" "$R/site/vflash_nodes"
# The machine's host memory: its RAM can start small and grow, so MemTotal is not read for the staging plan.
# flash-attn-4 and its CUDA DSL, where a call unpacked them into $R/fa4 (two parts over two calls, RUNNING.md); the
# DSL's own packages folder is what its .pth file would add in site-packages.
FA4_PATH=; [ -d "$R/fa4/flash_attn" ] && FA4_PATH=$R/fa4:$R/fa4/nvidia_cutlass_dsl/dsl_packages:
export PYTHONPATH=$FA4_PATH$R/site:$R/repo VFLASH_RESULTS=$R/results VFLASH_COMMIT=$COMMIT PYTHONUNBUFFERED=1 VFLASH_HOST_MEMORY_GIB=${VFLASH_HOST_MEMORY_GIB:-125}
left() { echo $(( (END - $(date +%s)) / 60 )); }
WORK="--work /root/e2e --shm /dev/shm/vflash"

tests=
start_tests() {  # `pytest -m gpu` in the background, once
    [ -n "$tests" ] && return
    ( python3 -m pytest -q -m gpu tests/ -p no:cacheprovider > "$R/results/gpu_tests.log" 2>&1; echo "exit status $?" >> "$R/results/gpu_tests.log" ) &
    tests=$!
}
case " $SET " in *" memory_caps "*) reserve=10 ;; *) reserve=0 ;; esac
for bench in $SET; do
    [ "$bench" = fast_mode ] || start_tests
    case $bench in
        fast_mode) python3 benchmarks/fast_mode.py ${FAST_ARGS:---phases kernel step_cache evaluation} > "$R/results/fast_mode.log" 2>&1
            rm -rf /tmp/vflash-bench ;;  # its 4-block model: a staging after it needs the disk
        # end_to_end.py leaves memory_caps.py ~10 minutes when both run
        end_to_end) python3 benchmarks/end_to_end.py $WORK --deadline-minutes $(( $(left) - reserve )) "$@" > "$R/results/end_to_end.log" 2>&1 ;;
        memory_caps) wait $tests; python3 benchmarks/memory_caps.py $WORK --deadline-minutes "$(left)" ${CAPS_ARGS:-} > "$R/results/memory_caps.log" 2>&1 ;;
        service_throughput) wait $tests; python3 benchmarks/service_throughput.py --prepared-assets /root/e2e/pipeline.json --gpu 0 \
            --requests 8 --width 1344 --height 768 > "$R/results/service_throughput.log" 2>&1 ;;
        fast_mode_e2e) wait $tests; python3 benchmarks/fast_mode.py --phases e2e ${E2E_ARGS:---prepared-assets /root/e2e/pipeline.json} \
            --output-dir /root/compare > "$R/results/fast_mode_e2e.log" 2>&1
            cp /root/compare/comparison.json "$R/results/fast_mode_comparison.json" ;;
        host_memory) python3 benchmarks/host_memory.py $WORK --deadline-minutes "$(left)" ${HOST_ARGS:-} > "$R/results/host_memory.log" 2>&1 ;;
        *) echo "unknown benchmark $bench" >> "$R/results/done.log" ;;
    esac
done
start_tests
wait $tests
echo "done at $(date)" >> "$R/results/done.log"
