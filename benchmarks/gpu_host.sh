#!/usr/bin/env bash
# On a GPU host without network, in a copy of this repository that carries .whl/ (made by
# benchmarks/wheels.sh): install the wheels beside the host's torch, run the named benchmarks
# (`gpu-tests` = pytest -m gpu, which also runs predict_check), then pack every report and every
# result.json (with each memory_by_module.csv and oom_snapshot.pickle) into ONE archive, for hosts that hand back only a few files:
#   ABLATE_GIT_SHA=<commit> bash benchmarks/gpu_host.sh gpu-tests gpt2_large_ladder leanest
#                                        # -> $OUT/results.tgz (or outputs/); the commit where no .git came along
# A quoted name carries its benchmark's overrides: "gpt2_large_ladder samples=2560" (gpu-tests: pytest's
# arguments, quoted as in a shell: "gpu-tests -k 'fp8 or offload'").
# A benchmark that fails does not stop the others; finished grid points are skipped on a rerun. The
# archive is rewritten after each benchmark, so a command killed at its time limit still hands back
# everything that finished before. ABLATE_DEADLINE_S=<seconds> stops the benchmark running at that
# point (its whole process group) and skips the rest, leaving time to pack what finished.
set -uo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1
if ! git rev-parse HEAD >/dev/null 2>&1 && [ -z "${ABLATE_GIT_SHA:-}" ]; then
  echo "warning: no .git here: set ABLATE_GIT_SHA=<commit> so the results name the code they ran" >&2
fi
dest="${OUT:-outputs}"
mkdir -p "$dest"
pack() {  # written beside and then renamed: a kill mid-write leaves the previous archive whole
  tar czf "$dest/results.tgz.part" benchmarks/results $(find outputs \( -name result.json -o -name memory_by_module.csv -o -name oom_snapshot.pickle \) 2>/dev/null) &&
    mv "$dest/results.tgz.part" "$dest/results.tgz" && ls -l "$dest/results.tgz"
}
past_deadline() {  # within 20 s of ABLATE_DEADLINE_S: too late to start or go on
  [ -n "${ABLATE_DEADLINE_S:-}" ] && (( SECONDS >= ABLATE_DEADLINE_S - 20 ))
}
limit() {  # the seconds left before the deadline, as a `timeout` prefix (none without a deadline)
  [ -z "${ABLATE_DEADLINE_S:-}" ] && return
  echo timeout --kill-after=10 $(( ABLATE_DEADLINE_S - SECONDS ))
}
status=0
for name in "$@"; do
  if past_deadline; then
    echo "== $name: skipped, past the deadline of ${ABLATE_DEADLINE_S}s"; status=1; continue
  fi
  echo "== $name ($(date -u +%H:%M:%S))"
  read -r script args <<<"$name"  # "gpt2_large_ladder samples=2560": a benchmark with its overrides
  if [ "$script" = gpu-tests ]; then  # "gpu-tests tests/test_gpu.py -k fp8": pytest's arguments
    # A deadline kill prints no summary: -v names each test as it ends, and tests/conftest.py writes
    # each failure's report to gpu-failures.log as it happens. --timeout (pytest-timeout, on the
    # GPU image) fails a test stuck past 5 minutes instead of letting it eat the call; --durations:
    # which tests take the device time, for planning the next session's calls. -n (pytest-xdist, on
    # the image): ABLATE_GPU_TEST_WORKERS tests at once (4; 1 for one at a time). They spend most
    # of their time starting processes and compiling on the host's CPUs, and each measures its own
    # process's allocator, so running side by side changes no assertion; 22 tests one at a time took
    # over 9 minutes on a GPU host, most of a 15-minute device allowance.
    rm -f benchmarks/results/gpu-failures.log
    per_test=$(python3 -c "import pytest_timeout" 2>/dev/null && echo --timeout=300)
    workers=${ABLATE_GPU_TEST_WORKERS:-4}
    (( workers > 1 )) && python3 -c "import xdist" 2>/dev/null && per_test="$per_test -n $workers"
    eval "picked=($args)"  # the quotes in "-k 'fp8 or offload'" keep the expression one argument
    ABLATE_TEST_FAILURES=benchmarks/results/gpu-failures.log $(limit) python3 -m pytest -v -m gpu \
      -p no:cacheprovider --durations=0 $per_test "${picked[@]}" 2>&1 | tee "benchmarks/results/gpu-tests.log" || status=1
  else
    $(limit) python3 "benchmarks/$script.py" $args || status=1
  fi
  # Past the deadline the sweep's launcher records its stopped point and would go on to the next:
  # end it, so that nothing runs (or writes) after the archive below.
  past_deadline && pkill -KILL -f "[-]m ablate" && sleep 1
  pack
done
exit $status
