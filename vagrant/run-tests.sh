#!/usr/bin/env bash
# Inside the VM, as root, after vagrant/provision.sh: installs this checkout
# into the provisioned Python 3.13 venv and runs probing's privileged tests.
# The `make vm-test` guest runs it from its PID 1 (vagrant/vm-init.sh); with
# Vagrant: vagrant ssh -c 'sudo bash /probing/vagrant/run-tests.sh'.
#
#   PROBING_VM_TESTS=paths|smoke|systemd|full|ARG,ARG,...  bash vagrant/run-tests.sh   (default: paths)
#
# smoke: Python 3.13's _Py_DebugOffsets, BCC, injection, out-of-process
#        stacks, BPF frame walking on traced calls and a traced Gloo job (CI).
# systemd: the smoke and the agent's unit run by systemd as PID 1 (CI's VM run;
#        the guest booted with init=/lib/systemd/systemd: vagrant/vm-systemd.sh)
# paths: the smoke and diagnose naming a straggler (each rank's probe and
#        one probe's cluster query): every path a new kernel or Python breaks.
# full:  tests/privileged/ and tests/test_pyframes.py, less the tests that
#        need NVIDIA's CUDA runtime and NCCL wheels (host-only: see docs/vm.md).
# Prints "kernel <release>", the Python version and pytest's summary line; the
# exit status is pytest's.
set -euo pipefail

src=$(cd "$(dirname "$0")/.." && pwd)
venv=${PROBING_VENV:-/opt/probing-venv}
work=${PROBING_VM_WORK:-/root/probing}
tests=${PROBING_VM_TESTS:-paths}
say() { printf 'run-tests: %s\n' "$*"; }
# seconds since the guest booted, for the log's timings
up() { local u; read -r u _ </proc/uptime; echo "${u%.*}"; }

[ -x "$venv/bin/python" ] || { echo "run-tests: no venv at $venv: run vagrant/provision.sh first" >&2; exit 2; }
[ "$(id -u)" = 0 ] || { echo "run-tests: run as root (sudo bash $0)" >&2; exit 2; }

say "started at uptime $(up) s"
# a copy, so nothing the install or the tests write lands in the host's checkout;
# not what .gitignore keeps out of git: after `make test` CI's checkout holds
# .venv-jobs (2.6 GB, 49,000 files: the host's job environments, no use to the
# guest's Python) and .mypy_cache, minutes over 9p under TCG; the rest is ~2.5 MB
rm -rf "$work"
mkdir -p "$work"
tar -C "$src" --exclude=./.venv --exclude=./.venv-jobs --exclude=./.git \
  --exclude='*/__pycache__' --exclude='*.pyc' --exclude=./.pytest_cache --exclude=./.hypothesis \
  --exclude=./.ruff_cache --exclude=./.mypy_cache --exclude=./.import_linter_cache \
  --exclude=./build --exclude=./dist --exclude='./*.egg-info' --exclude=./benchmarks/out \
  --exclude=./tests/artifacts --exclude=./vagrant/.vagrant --exclude=./probing/inject/_lib \
  -cf - . | tar -C "$work" -xf -
cd "$work"
say "checkout copied at $(up) s"
# installed into the venv as `pip install -e` would (its path, probing's own
# .pth hook, the `probing` command), without pip: under TCG pip alone takes ~20 s
site=$(ls -d "$venv"/lib/python3*/site-packages | tail -1)
echo "$work" >"$site/_probing_checkout.pth"
cp probing/_hook/probing.pth "$site/probing.pth"
printf '#!%s\nimport sys\nfrom probing.__main__ import main\nsys.exit(main())\n' "$venv/bin/python" >"$venv/bin/probing"
chmod 755 "$venv/bin/probing"
say "installed into $venv at $(up) s"
"$venv/bin/python" -m probing.inject.build >/dev/null
say "injection library built at $(up) s"
[ -e /sys/kernel/tracing/uprobe_events ] || mount -t tracefs nodev /sys/kernel/tracing

smoke=(
  tests/test_pyframes.py
  tests/privileged/test_bcc_setup.py
  tests/privileged/test_inject.py::test_inject_busy_loop_answers_sql_and_computes_right
  tests/privileged/test_pystacks.py::test_traced_calls_carry_the_stack_traceback_sees
  tests/privileged/test_pystacks.py::test_stack_of_a_thread_holding_the_gil
  tests/privileged/test_trace.py::test_gloo_job_every_rank_matches
)
# 4 Gloo ranks under TCG for over a minute: not in CI's smoke
diagnose=(
  tests/privileged/test_verdicts.py::test_a_ddp_jobs_step_lateness_and_loss_are_its_own
)
# NVIDIA's CUDA runtime and NCCL wheels are ~300 MB more per image: host-only
host_only=(
  tests/privileged/test_trace.py::test_a_runtime_launch_is_one_launch_named_by_the_runtime
  tests/privileged/test_trace.py::test_cuda_runtime_and_driver_calls_decode_exactly
  tests/privileged/test_trace.py::test_nccl_calls_decode_exactly
)
case "$tests" in
  smoke) args=("${smoke[@]}") ;;
  systemd) args=("${smoke[@]}" tests/privileged/test_systemd.py) ;;  # booted with systemd
  paths) args=("${smoke[@]}" "${diagnose[@]}") ;;
  full)
    args=(tests/test_pyframes.py tests/privileged)
    for t in "${host_only[@]}"; do args+=(--deselect "$t"); done ;;
  *) IFS=, read -r -a args <<<"$tests" ;;
esac

# Debian's torch is built without libuv, which torch's TCPStore asks for by default
export USE_LIBUV=0
# a crash in any Python the tests start prints its Python stack
export PYTHONFAULTHANDLER=1
# no stack sampling (python.samples) in the guest: under TCG, switching the
# scheduler's tracepoints on while threads run once panicked the 6.12 guest
# ("Oops: int3" at a text-poke site in __schedule, docs/vm.md)
export PROBING_SAMPLE_HZ=${PROBING_SAMPLE_HZ:-0}
echo "kernel $(uname -r)"
"$venv/bin/python" --version
versions=$(dpkg-query -W -f='${Package} ${Version}, ' python3-bpfcc python3-torch 2>/dev/null || true)
slowdown=${PROBING_TEST_SLOWDOWN:-1}
say "${versions}tests: $tests, waits stretched x$slowdown"
# pytest-timeout's 300 s a test, stretched like the tests' own waits
per_test=$(awk -v s="$slowdown" 'BEGIN { printf "%d", 300 * (s > 1 ? s : 1) }')
# the CLI's wait for a probe's answer (30 s), stretched the same way
PROBING_ANSWER_TIMEOUT_S=$(awk -v s="$slowdown" 'BEGIN { printf "%d", 30 * (s > 1 ? s : 1) }')
export PROBING_ANSWER_TIMEOUT_S
rc=0
PROBING_REQUIRE_PRIVILEGED=1 PROBING_TEST_SLOWDOWN=$slowdown "$venv/bin/python" -m pytest -q -rs \
  -p no:cacheprovider --color=no --timeout "$per_test" --durations=15 "${args[@]}" || rc=$?
exit "$rc"
