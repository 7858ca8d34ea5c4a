#!/usr/bin/env bash
# Every GPU path of Ember in one command, on a machine with one or more NVIDIA GPUs:
#
#     bash bench/gpu_check.sh
#
# 1. the tests marked cuda (pytest -m cuda);
# 2. bench/gpt.py: GPT-2 small in fp32, bf16-mixed and bf16-mixed + compile, tokens/s and MFU of Ember
#    against the hand-written loop (GPT_ARGS="--batch-size 8" passes options, for a GPU with less memory);
# 3. smoke runs of DDP, FSDP, manual optimization and, where torchft is installed (ember[ft]), fault
#    tolerance, in two processes (bench/gpu_smoke.py): with two or more GPUs a GPU each, and also dp and
#    bench/memory.py (DDP against FSDP, memory per rank); with one GPU both processes share it, started by
#    `ember run` and joined over Gloo (NCCL refuses two ranks on one device). Fault tolerance's two replica
#    groups (`ember run --replica-groups 2`) share GPU 0 in either case, over Gloo.
#
# It ends with one table: each item, pass/fail, and its key figure; the logs of failed items are shown
# above it. The exit status is 1 if any item failed. On a machine without a GPU it says so and exits 0.
# It needs python3 with torch, pytest and pytest-timeout (pip install -e '.[dev]' installs what the tests
# use; PYTHON=... picks another interpreter). Ember is imported from this checkout, and nothing is
# downloaded. Each item has a time limit (seconds), which CHECK_TIMEOUT=... overrides. A machine whose
# nvidia-smi lists GPUs that torch does not see (a CPU-only build of torch, a driver too old for it) is a
# failure, not a machine without a GPU.

set -u
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 1
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1  # a command stopped at its time limit still leaves what it printed in its log
PYTHON="${PYTHON:-python3}"

if ! GPUS="$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null)"; then
    echo "gpu_check: cannot import torch with $PYTHON (set PYTHON=... to the interpreter that has it)"
    exit 1
fi
if [ "$GPUS" -eq 0 ]; then
    LISTED="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')"
    if [ "${LISTED:-0}" -gt 0 ]; then
        echo "gpu_check: nvidia-smi lists $LISTED GPU(s), but torch $("$PYTHON" -c 'import torch; print(torch.__version__, "(CUDA", torch.version.cuda, end=")")') with $PYTHON sees none: install a CUDA build of torch that this driver runs"
        exit 1
    fi
    echo "gpu_check: skipped: no GPU (torch.cuda.device_count() is 0 with $PYTHON)"
    exit 0
fi

LOGS="$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")"
ROWS=()    # "item|pass or FAIL|key figure"
FAILED=0

# run NAME SECONDS COMMAND...: run COMMAND with its output in $LOGS/NAME.log; its status is kept in $STATUS.
run() {
    local name="$1" seconds="${CHECK_TIMEOUT:-$2}"
    shift 2
    echo "gpu_check: $name ..." >&2
    timeout --kill-after=30 "$seconds" "$@" >"$LOGS/$name.log" 2>&1
    STATUS=$?
    if [ "$STATUS" -eq 124 ] || [ "$STATUS" -eq 137 ]; then
        echo "(timed out after $seconds s)" >>"$LOGS/$name.log"
    fi
}

# trim: strip the spaces around each line of stdin.
trim() { sed -e 's/^ *//' -e 's/ *$//'; }

# row NAME FIGURE: record the last command's result.
row() {
    local verdict=pass
    if [ "$STATUS" -ne 0 ]; then
        verdict=FAIL
        FAILED=1
        echo "===== $1 failed (exit status $STATUS); the end of $LOGS/$1.log:"
        tail -n 40 "$LOGS/$1.log"
        echo
    fi
    ROWS+=("$1|$verdict|$2")
}

# ------------------------------------------------------------------------------------ the tests
# One process (no -n workers: the tests share the GPUs); -rfEs lists what failed or was skipped, and why.
run cuda-tests 1800 "$PYTHON" -m pytest -m cuda -q -rfEs -p no:cacheprovider -o addopts="" tests
# pytest exits 5 when every test was deselected: no cuda test at all is a failure here too.
row cuda-tests "$(grep -E '[0-9]+ (passed|failed|errors?|skipped|deselected)' "$LOGS/cuda-tests.log" | tail -n 1 | tr -d '=' | trim)"

# ------------------------------------------------------------------------------------ GPT-2 small
# shellcheck disable=SC2086  # GPT_ARGS is split into its options
run gpt 1800 "$PYTHON" bench/gpt.py ${GPT_ARGS:-}
# One row per mode: the last five fields of a table line are hand tok/s, MFU, Ember tok/s, MFU, Ember/hand.
MODES="$(awk 'NF >= 6 && $NF ~ /^[0-9.]+x$/ {
    label = $1; for (i = 2; i <= NF - 5; i++) label = label " " $i
    printf "gpt %s|pass|Ember %d tok/s (MFU %s), hand-written %d tok/s (MFU %s): Ember/hand %s\n",
           label, $(NF - 2), $(NF - 1), $(NF - 4), $(NF - 3), $NF }' "$LOGS/gpt.log")"
if [ -n "$MODES" ]; then  # the modes that finished, also when a later one failed
    while IFS= read -r line; do
        ROWS+=("$line")
    done <<<"$MODES"
fi
if [ "$STATUS" -ne 0 ] || [ -z "$MODES" ]; then
    [ "$STATUS" -eq 0 ] && STATUS=1  # it ran, but printed no figures
    row gpt "$(printf '%s of 3 modes measured' "$(printf '%s' "$MODES" | grep -c .)")"
fi

# ------------------------------------------------------------------------------------ two processes
if [ "$GPUS" -ge 2 ]; then
    run memory 1200 "$PYTHON" bench/memory.py --accelerator cuda
    # The table's rows: | strategy | parameters + optimizer state | peak allocated |, per rank.
    row memory "$(awk -F'|' '$2 ~ /DDP|FSDP/ { gsub(/^ +| +$/, "", $2); gsub(/^ +| +$/, "", $3);
        gsub(/^ +| +$/, "", $4); printf "%s%s: %s held, %s peak", sep, $2, $3, $4; sep = "; " }' "$LOGS/memory.log")"
    SMOKE=("$PYTHON" bench/gpu_smoke.py)  # it starts a process per GPU itself
    SMOKES="ddp fsdp dp manual"
else
    ROWS+=("memory|skipped|needs two GPUs (two processes)")
    ROWS+=("smoke-dp|skipped|needs two GPUs (one process drives both)")
    # Both processes on GPU 0: a launcher starts them, as the script cannot ask for more devices than it sees.
    SMOKE=("$PYTHON" -m ember run --nproc-per-node 2 bench/gpu_smoke.py --backend gloo)
    SMOKES="ddp fsdp manual"
fi
if "$PYTHON" -c 'import torchft' >/dev/null 2>&1; then
    SMOKES="$SMOKES ft"
else
    ROWS+=("smoke-ft|skipped|torchft is not installed (pip install -e '.[ft]')")
fi
for smoke in $SMOKES; do
    if [ "$smoke" = ft ]; then  # two replica groups of one process, both on GPU 0, joined over Gloo
        mkdir -p "$LOGS/ft"
        run smoke-ft 600 "$PYTHON" -m ember run --replica-groups 2 bench/gpu_smoke.py --backend gloo --out "$LOGS/ft" ft
    else
        run "smoke-$smoke" 600 "${SMOKE[@]}" "$smoke"
    fi
    row "smoke-$smoke" "$(grep -E '^smoke: ' "$LOGS/smoke-$smoke.log" | tail -n 1 | cut -d: -f3- | trim)"
done

# ------------------------------------------------------------------------------------ the table
echo
echo "gpu_check on $GPUS GPU(s): $("$PYTHON" -c 'import torch; print(torch.cuda.get_device_name(0), "- torch", torch.__version__)')"
printf '%-34s %-8s %s\n' "item" "result" "key figure"
printf '%-34s %-8s %s\n' "----" "------" "----------"
for entry in "${ROWS[@]}"; do
    IFS='|' read -r name verdict figure <<<"$entry"
    printf '%-34s %-8s %s\n' "$name" "$verdict" "${figure:-(none: see the log)}"
done
echo "logs: $LOGS"
exit "$FAILED"
