#!/usr/bin/env bash
# Everything probing needs on a fresh Debian/Ubuntu machine, as root:
# BCC (Debian's python3-bpfcc), kernel headers for BCC, tracefs, and a .venv
# with probing installed editable and BCC importable inside it.
# Idempotent: on a ready machine it checks and returns in seconds.
set -euo pipefail

cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
KREL=$(uname -r)
say() { printf 'setup: %s\n' "$*"; }

SUDO=""
if [ "$(id -u)" != 0 ]; then
  if command -v sudo >/dev/null; then SUDO="sudo"; else
    say "not root and no sudo: system packages, headers and tracefs are skipped"; SUDO="skip"; fi
fi
as_root() { if [ "$SUDO" = skip ]; then return 1; fi; $SUDO "$@"; }

# --- system packages -------------------------------------------------------
need=()
dpkg -s python3-bpfcc >/dev/null 2>&1 || need+=(python3-bpfcc)
command -v bpftool >/dev/null || need+=(bpftool)  # tests: `bpftool perf` shows attached uprobes
command -v chromium >/dev/null || need+=(chromium)  # tests: the web UI and Perfetto UI, headless
"$PYTHON" -c 'import venv, ensurepip' >/dev/null 2>&1 || need+=(python3-venv)
command -v gcc >/dev/null || need+=(gcc)
command -v make >/dev/null || need+=(make)
# tests: `vagrant validate` of vagrant/Vagrantfile (Debian trixie has no vagrant package)
command -v vagrant >/dev/null || ! apt-cache show vagrant >/dev/null 2>&1 || need+=(vagrant)

headers_ok() { [ -d "/lib/modules/$KREL/build/include" ]; }
have_header_src() { ls -d /usr/src/linux-headers-* >/dev/null 2>&1; }
updated=""
apt_update() { [ -n "$updated" ] || { as_root apt-get update -qq && updated=1; }; }
export DEBIAN_FRONTEND=noninteractive

if ! headers_ok && ! have_header_src; then
  apt_update
  arch=$(dpkg --print-architecture)
  # the running kernel's own headers when the archive has them, else the
  # distribution's default ones (Debian: linux-headers-<arch>, Ubuntu: -generic)
  for pkg in "linux-headers-$KREL" "linux-headers-$arch" linux-headers-generic; do
    if apt-cache show "$pkg" >/dev/null 2>&1; then need+=("$pkg"); break; fi
  done
fi

if [ ${#need[@]} -gt 0 ]; then
  say "installing ${need[*]}"
  apt_update
  as_root apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

# --- kernel headers where BCC looks for them ----------------------------------
if ! headers_ok; then
  arch=$(dpkg --print-architecture)
  build=$(ls -d /usr/src/linux-headers-*-"$arch" 2>/dev/null | sort -V | tail -1 || true)
  [ -n "$build" ] || build=$(ls -d /usr/src/linux-headers-*/ 2>/dev/null | grep -v common | sort -V | tail -1 || true)
  build=${build%/}
  common=$(ls -d /usr/src/linux-headers-*-common 2>/dev/null | sort -V | tail -1 || true)
  if [ -n "$build" ]; then
    say "linking $build as the headers of kernel $KREL"
    as_root mkdir -p "/lib/modules/$KREL"
    as_root ln -sfn "$build" "/lib/modules/$KREL/build"
    as_root ln -sfn "${common:-$build}" "/lib/modules/$KREL/source"
  else
    say "WARNING: no kernel headers found under /usr/src; BCC will not compile"
  fi
fi

# --- tracefs -------------------------------------------------------------------
if [ ! -e /sys/kernel/tracing/uprobe_events ]; then
  say "mounting tracefs"
  as_root mount -t tracefs nodev /sys/kernel/tracing 2>/dev/null || say "WARNING: could not mount tracefs"
fi
if [ -d /sys/kernel/debug ] && [ ! -e /sys/kernel/debug/tracing/uprobe_events ] && ! mountpoint -q /sys/kernel/debug; then
  as_root mount -t debugfs nodev /sys/kernel/debug 2>/dev/null || true
fi

# --- the virtualenv --------------------------------------------------------------
if [ ! -x "$VENV/bin/python" ]; then
  say "creating $VENV with $($PYTHON --version)"
  "$PYTHON" -m venv "$VENV"
fi
stamp="$VENV/.probing-setup"
want=$(cat pyproject.toml | sha256sum | cut -c1-16)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ] || ! "$VENV/bin/python" -c 'import probing, datafusion, pytest' 2>/dev/null; then
  say "installing probing (editable) and its test extras"
  # a distribution named `probing` (ours before it was `probing-trace`, or PyPI's
  # other project) owns the same `probing` command and package: removed first
  if "$VENV/bin/python" -c 'import importlib.metadata as m; m.distribution("probing")' 2>/dev/null; then
    "$VENV/bin/python" -m pip uninstall -y -q --disable-pip-version-check probing
  fi
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check -e '.[test]' 2>&1 | { grep -v "^WARNING: Location" || true; }
  echo "$want" > "$stamp"
fi

# --- what the trace tests run against: CPU torch (Gloo) and the real CUDA
# runtime and NCCL libraries from NVIDIA's wheels (their calls fail without
# a GPU, but uprobes fire and arguments decode). pip's cache keeps the
# ~350 MB NCCL wheel for the next run.
if ! "$VENV/bin/python" -c 'import torch, nvidia.nccl, nvidia.cuda_runtime' 2>/dev/null; then
  say "installing torch (CPU) and NVIDIA's CUDA runtime and NCCL wheels"
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check \
    "torch==${PROBING_TORCH_VERSION:-2.13.0}" nvidia-cuda-runtime-cu12 nvidia-nccl-cu12 2>&1 \
    | { grep -v "^WARNING: Location" || true; }
fi

# --- BCC inside the venv, without the rest of dist-packages ----------------------
site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
if ! "$VENV/bin/python" -c 'import bcc' 2>/dev/null; then
  bccdir=$(dpkg -L python3-bpfcc 2>/dev/null | grep '/bcc/__init__.py$' | head -1 | xargs -r dirname)
  if [ -n "$bccdir" ]; then
    say "linking BCC ($bccdir) into $site"
    ln -sfn "$bccdir" "$site/bcc"
  else
    say "WARNING: python3-bpfcc is not installed; BPF features are off"
  fi
fi
# (the job environments the test suite runs jobs in are `make test`'s: .ci/jobenvs.sh)

# --- the library `probing inject` loads into a target (built once per boot.c) ----------
"$VENV/bin/python" -m probing.inject.build >/dev/null || say "WARNING: could not build the injection library"

"$VENV/bin/python" -c 'import bcc' 2>/dev/null && say "ready: $("$VENV/bin/python" --version), bcc $("$VENV/bin/python" -c 'import bcc; print(bcc.__version__)')" || say "ready (without BCC)"
