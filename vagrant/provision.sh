#!/usr/bin/env bash
# The one recipe for a Debian trixie machine that runs probing's privileged
# suite on kernel 6.12 and Python 3.13. Two callers, one script:
#   make vm-test   runs it inside the image's root filesystem while building
#                  the image (vagrant/vm-test.sh, in a chroot, once per cache);
#   vagrant up     runs it inside the box (vagrant/Vagrantfile).
# As root. Idempotent: a second run checks and returns.
#
#   provision.sh [--pyproject PATH] [--venv DIR]
#
# It installs Debian's packages (kernel and headers, Python 3.13, BCC, bpftool,
# a C compiler, Debian's CPU build of torch with Gloo) and a venv, DIR
# (default /opt/probing-venv), that sees those system packages and holds
# probing's other dependencies read from pyproject.toml. probing itself is not
# installed here: vagrant/run-tests.sh installs the checkout being tested.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
pyproject="$here/../pyproject.toml"
venv=/opt/probing-venv
while [ $# -gt 0 ]; do
  case "$1" in
    --pyproject) pyproject=$2; shift 2 ;;
    --venv) venv=$2; shift 2 ;;
    *) printf 'provision: unknown argument %s (use --pyproject PATH, --venv DIR)\n' "$1" >&2; exit 2 ;;
  esac
done
say() { printf 'provision: %s\n' "$*"; }
die() { printf 'provision: %s\n' "$*" >&2; exit 1; }

[ -f "$pyproject" ] || die "no pyproject.toml at $pyproject: pass --pyproject PATH of the checkout"
[ "$(id -u)" = 0 ] || die "run as root (sudo bash $0)"
. /etc/os-release
[ "${VERSION_CODENAME:-}" = trixie ] || say "WARNING: this is ${PRETTY_NAME:-an unknown system}, not Debian trixie; going on"

# --- Debian's packages ---------------------------------------------------------------
# python3-torch is Debian's CPU build for the distribution's Python (3.13 on
# trixie), with Gloo: PyPI's Linux wheels of torch bring ~3 GB of CUDA wheels.
packages=(
  linux-image-amd64 linux-headers-amd64
  python3 python3-venv python3-bpfcc bpftool python3-torch
  gcc libc6-dev make
  ca-certificates iproute2 procps kmod psmisc
)
# a booted machine whose kernel is not the newest: BCC compiles against the
# running kernel's headers
krel=$(uname -r)
if [ -d /run/systemd/system ] && [ ! -d "/lib/modules/$krel/build" ]; then
  packages+=("linux-headers-$krel")
fi
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  say "installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -q --download-only --no-install-recommends "${missing[@]}"
  say "downloaded; unpacking and configuring"
  apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

# --- the venv ------------------------------------------------------------------------
# --system-site-packages: torch, BCC and numpy come from Debian, built for its Python.
py=/usr/bin/python3
if [ ! -x "$venv/bin/python" ]; then
  say "creating $venv with $($py --version)"
  $py -m venv --system-site-packages "$venv"
fi
deps=$("$venv/bin/python" - "$pyproject" <<'EOF'
import sys, tomllib
project = tomllib.load(open(sys.argv[1], "rb"))["project"]
print("\n".join(project["dependencies"] + project["optional-dependencies"]["test"]))
EOF
)
# hatchling and editables: the guest installs the checkout with no network;
# NVIDIA's CUDA runtime wheel (4 MB): the traced-stack tests launch through it
extra='hatchling\neditables\nnvidia-cuda-runtime-cu12\n'
want=$(printf "%s\n$extra" "$deps" | sha256sum | cut -c1-16)
stamp="$venv/.probing-provision"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  say "installing probing's dependencies into $venv"
  # not the linters and type checker of the test extra: the VM runs tests only
  mapfile -t reqs < <(printf "%s\n$extra" "$deps" | sed 's/ *#.*//' | grep -Ev '^(ruff|mypy|import-linter|types-)')
  "$venv/bin/python" -m pip install -q --disable-pip-version-check "${reqs[@]}"
  echo "$want" > "$stamp"
fi
"$venv/bin/python" -c 'import bcc, torch, datafusion, pytest' \
  || die "the venv $venv cannot import bcc, torch, datafusion and pytest: see the errors above"
say "ready: $("$venv/bin/python" --version), bcc $("$venv/bin/python" -c 'import bcc; print(bcc.__version__)'), torch $("$venv/bin/python" -c 'import torch; print(torch.__version__)')"
