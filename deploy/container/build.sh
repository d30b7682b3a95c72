#!/usr/bin/env bash
# The agent's image, localhost/probing-agent:<version>, with no image pulled
# from a registry (docs/deploy.md). As root, on a Debian/Ubuntu host:
#
#   deploy/container/build.sh            # or: make image
#
# 1. The wheel of this checkout (pip wheel; the distribution probing-trace).
# 2. A Debian trixie root filesystem made with mmdebstrap (as make vm-test's
#    VM image is): Python 3.13, Debian's BCC (python3-bpfcc), and a venv,
#    /opt/probing, that sees them and holds the wheel and its dependencies
#    (from PyPI), its injection library built; a tarball.
# 3. deploy/container/Containerfile: FROM scratch, that tarball; built by
#    podman (buildah where podman is missing).
#
# Environment: PROBING_IMAGE (default localhost/probing-agent:<version>),
# PROBING_IMAGE_MIRROR (Debian mirror), PROBING_IMAGE_WORK (default build/image).
set -euo pipefail

repo=$(cd "$(dirname "$0")/../.." && pwd)
say() { printf 'image: %s\n' "$*"; }
die() { printf 'image: %s\n' "$*" >&2; exit "${2:-1}"; }
version=$(python3 -c 'import sys, tomllib; print(tomllib.load(open(sys.argv[1], "rb"))["project"]["version"])' "$repo/pyproject.toml")
image=${PROBING_IMAGE:-localhost/probing-agent:$version}
mirror=${PROBING_IMAGE_MIRROR:-http://deb.debian.org/debian}
work=${PROBING_IMAGE_WORK:-$repo/build/image}

[ "$(id -u)" = 0 ] || die "run as root: mmdebstrap makes the root filesystem as root (sudo make image)" 2
need=()
command -v mmdebstrap >/dev/null || need+=(mmdebstrap)
command -v podman >/dev/null || command -v buildah >/dev/null || need+=(podman)
if [ ${#need[@]} -gt 0 ]; then
  command -v apt-get >/dev/null || die "install ${need[*]}, then retry" 2
  say "installing ${need[*]}"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
t0=$SECONDS
rm -rf "$work"
mkdir -p "$work"

# --- 1. the wheel ----------------------------------------------------------------------
py=python3
[ -x "$repo/.venv/bin/python" ] && py=$repo/.venv/bin/python
"$py" -m pip wheel -q --no-deps -w "$work" "$repo"
wheel=$(ls "$work"/probing_trace-*.whl)
say "built $(basename "$wheel") after $(( SECONDS - t0 )) s"

# --- 2. the root filesystem ----------------------------------------------------------------
# pip in the root filesystem trusts what this host trusts (a proxy's CA)
ca=${PIP_CERT:-${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}}
pip_env='env -u PIP_FIND_LINKS -u PIP_CONFIG_FILE -u PIP_CONSTRAINT -u SSL_CERT_DIR PIP_CERT=/root/host-ca.crt SSL_CERT_FILE=/root/host-ca.crt PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1'
say "making the root filesystem (Debian trixie) with mmdebstrap"
mmdebstrap --variant=apt --mode=root --components=main \
  --include=python3,python3-venv,python3-bpfcc,gcc,libc6-dev,ca-certificates \
  --dpkgopt=force-unsafe-io \
  --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
  --dpkgopt='path-exclude=/usr/share/info/*' --dpkgopt='path-exclude=/usr/share/locale/*' \
  --aptopt='Acquire::Languages "none"' \
  --customize-hook="upload '$wheel' /root/$(basename "$wheel")" \
  --customize-hook="upload '$ca' /root/host-ca.crt" \
  --customize-hook='chroot "$1" python3 -m venv --system-site-packages /opt/probing' \
  --customize-hook="chroot \"\$1\" $pip_env /opt/probing/bin/pip install -q /root/$(basename "$wheel")" \
  --customize-hook='chroot "$1" /opt/probing/bin/python -m probing.inject.build' \
  --customize-hook='chroot "$1" /opt/probing/bin/python -c "import bcc, probing; print(\"image: bcc\", bcc.__version__, \"probing\", probing.__version__)"' \
  --customize-hook='chroot "$1" env DEBIAN_FRONTEND=noninteractive apt-get purge -y -qq gcc libc6-dev' \
  --customize-hook='chroot "$1" env DEBIAN_FRONTEND=noninteractive apt-get autoremove -y -qq --purge' \
  --customize-hook='rm -rf "$1"/root/* "$1"/root/.cache "$1"/var/cache/apt/archives/*.deb "$1"/var/lib/apt/lists/*' \
  trixie "$work/rootfs.tar" "$mirror" 2>&1 | grep -v '^I: \|^W: \(skipping\|cannot\)' || true
[ -s "$work/rootfs.tar" ] || die "mmdebstrap made no root filesystem (above): check that $mirror and pypi.org are reachable"
say "root filesystem $(du -m "$work/rootfs.tar" | cut -f1) MB after $(( SECONDS - t0 )) s"

# --- 3. the image ------------------------------------------------------------------------
cp "$repo/deploy/container/Containerfile" "$work/"
if command -v podman >/dev/null; then
  podman build --pull=never -t "$image" -f "$work/Containerfile" "$work"
else
  buildah build --pull=never -t "$image" -f "$work/Containerfile" "$work"
fi
rm -f "$work/rootfs.tar"
say "$image built in $(( SECONDS - t0 )) s"
