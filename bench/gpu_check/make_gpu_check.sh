#!/bin/sh
# `make gpu-check ARGS=...` (the Makefile passes VENV, PY, STAMP, GPU_BUNDLE and RUN_DIR; not
# $(MAKE): a recipe that names it runs even under `make -n`).
#
# Which Python runs the check:
#   1. the project's venv, when it is installed and up to date (make -q $STAMP);
#   2. else the offline bundle (make gpu-bundle; build/gpu-bundle), when there is one: a GPU
#      machine with no network, or no room for a 500 MB venv, gets the bundle copied in;
#   3. else the venv is built as for `make test` (needs a package index) and runs it.
# Neither: "cannot run".
#
# make exits 2 whenever a recipe fails (GNU make manual, "How to Run make",
# https://gnu.org/s/make/manual/html_node/Running.html: "The exit status of
# make is always one of three values: 0, 2, 1 (with -q)"), so the check's own verdict, which
# make cannot pass on, is printed as the last line and written to $RUN_DIR/gpu-check.exit:
#   0 no difference, 1 the GPUs and the simulator differ, 2 gpu-check cannot run here.
# Anything else (a signal, a launcher that could not start) is "cannot run": no verdict.
set -u
if [ -x "$PY" ] && make --no-print-directory -q "$STAMP" >/dev/null 2>&1; then
    how=venv
elif [ -x "$GPU_BUNDLE/gpu-check" ]; then
    how=bundle
elif make --no-print-directory "$STAMP"; then
    how=venv
else
    how=none
fi

case $how in
venv)
    "$PY" -m bench.gpu_check "$@"
    rc=$?
    ;;
bundle)
    echo "gpu-check: no $VENV here (or not up to date): running gpu-check from the bundle" \
        "$GPU_BUNDLE" >&2
    "$GPU_BUNDLE/gpu-check" "$@"
    rc=$?
    ;;
none)
    echo "gpu-check: cannot run: no $VENV and it could not be built (no package index?)," \
        "and no bundle at $GPU_BUNDLE: run make gpu-bundle on a machine with the venv and" \
        "copy $GPU_BUNDLE into this checkout" >&2
    rc=2
    ;;
esac

mkdir -p "$RUN_DIR"
case $rc in
0) verdict="exit 0: no difference" ;;
1) verdict="exit 1: the GPUs and the simulator differ (see the report)" ;;
2) verdict="exit 2: gpu-check cannot run here (see above)" ;;
*)
    verdict="exit 2: gpu-check cannot run here (it ended with $rc: killed, or its launcher failed)"
    rc=2
    ;;
esac
echo "$rc" >"$RUN_DIR/gpu-check.exit"
echo "make gpu-check: $verdict; also in $RUN_DIR/gpu-check.exit" >&2
exit "$rc"
