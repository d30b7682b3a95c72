#!/usr/bin/env bash
# Job environments that do not have probing (tests/privileged/test_guest_envs.py):
# other numpy and pyarrow versions, other Python minors (pyenv's CPython
# 3.10-3.13 where the machine has them; 3.14 in a chroot, .ci/py314.sh), and
# real frameworks for the jobs in tests/jobs/frameworks/ (versions pinned as
# pip resolved them). Idempotent: each env once.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=${PROBING_JOB_ENVS:-.venv-jobs}
say() { printf 'setup: %s\n' "$*"; }
python_of() {  # a CPython X.Y: pyenv's, else one on PATH
  local v=$1 p
  p=$(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/"$v".*/bin/python 2>/dev/null | sort -V | tail -1 || true)
  [ -n "$p" ] || p=$(command -v "python$v" || true)
  echo "$p"
}
make_env() {  # name, python version, packages...
  local name=$1 ver=$2; shift 2
  local dir="$ROOT/$name" want="$ver $*"
  [ -f "$dir/.ready" ] && [ "$(cat "$dir/.ready")" = "$want" ] && return 0
  local py; py=$(python_of "$ver")
  if [ -z "$py" ]; then say "no CPython $ver here: job env $name skipped"; return 0; fi
  say "job env $name: CPython $ver $*"
  rm -rf "$dir"
  "$py" -m venv "$dir"
  if [ $# -gt 0 ]; then
    "$dir/bin/python" -m pip install -q --disable-pip-version-check "$@" 2>&1 | { grep -v "^WARNING: Location" || true; }
  fi
  echo "$want" > "$dir/.ready"
}
make_env np126 3.11 "numpy==1.26.4"
make_env np126-pa15 3.11 "numpy==1.26.4" "pyarrow==15.0.2"
make_env py313 3.13
make_env py310 3.10
make_env hook312 3.12 "numpy==1.26.4"
make_env torch-np126 3.11 "numpy==1.26.4" "torch==${PROBING_TORCH_VERSION:-2.13.0}"
make_env frameworks 3.11 "numpy==1.26.4" "torch==${PROBING_TORCH_VERSION:-2.13.0}" \
  "transformers==5.24.0" "huggingface-hub==2.4.0" "tokenizers==0.23.3" "safetensors==0.8.0" \
  "accelerate==1.15.0" "pytorch-lightning==2.6.6" "lightning-utilities==0.15.3" "torchmetrics==1.9.0" \
  "megatron-core==0.16.1" \
  "deepspeed==0.19.8" "einops==0.8.2" "hjson==3.1.0" "msgpack==1.2.4" "ninja==1.13.2" "py-cpuinfo==9.0.0"
# CPython 3.14 (Debian unstable's, with its torch) in a chroot: root only
if [ "$(id -u)" != 0 ]; then
  say "not root: job env py314 (CPython 3.14 in a chroot, .ci/py314.sh) skipped"
elif [ -n "${PROBING_PY314_BACKGROUND:-}" ]; then
  say "job env py314: being built in the background (.ci/run; log: $ROOT/py314.log)"
else
  bash .ci/py314.sh "$ROOT/py314"
fi
