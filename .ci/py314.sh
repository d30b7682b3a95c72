#!/usr/bin/env bash
# The CPython 3.14 job environment (tests/privileged/test_py314.py,
# tests/test_guest.py): Debian unstable's python3.14 and its python3-torch
# (CPU, Gloo) in a root filesystem made with mmdebstrap, as the VM image is
# (vagrant/vm-test.sh). As root; called by .ci/jobenvs.sh.
#
#   .ci/py314.sh ENV_DIR     the job env: ENV_DIR/bin/python runs the job
#   .ci/py314.sh --root      where the root filesystem for this recipe is cached
#
# 1. The root filesystem: built once into $PROBING_PY314_CACHE (default
#    /var/cache/probing-py314) under a key of this script; later calls reuse
#    it. Only what the job needs is installed: no apt, no recommends, no
#    docs. torch comes from Debian: PyPI's x86_64 torch for 3.14 is the CUDA
#    build, ~0.5 GB and ~3 GB of NVIDIA wheels more to import.
# 2. The job env, ENV_DIR: a venv made in the chroot at ENV_DIR itself (it
#    sees the system's torch), and ENV_DIR/bin/python, which runs that venv's
#    python in the chroot, in a mount namespace of its own that shares this
#    machine's /proc, /sys, /dev, /tmp, /run, the checkout and ENV_DIR at the
#    same paths (so `probing hook` writes where the job reads, and the guest's
#    sockets meet the engine's). Its pid is the job's: each step execs.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/.." && pwd)
cache=${PROBING_PY314_CACHE:-/var/cache/probing-py314}
mirror=${PROBING_VM_MIRROR:-http://deb.debian.org/debian}
say() { printf 'py314: %s\n' "$*"; }
die() { printf 'py314: %s\n' "$*" >&2; exit 1; }

key=$(sed -n '/^build_root() {/,/^}/p' "$0" | sha256sum | cut -c1-12)
root="$cache/sid-$key/root"
if [ "${1:-}" = --root ]; then echo "$root"; exit 0; fi
[ $# = 1 ] || die "usage: $0 ENV_DIR | --root"
envdir=$(mkdir -p "$1" && cd "$1" && pwd)

# remove DIR...: a stopped build's or an older recipe's directories, unmounting
# first what a stopped mmdebstrap may have left mounted in its chroot
remove() {
  local d m
  for d in "$@"; do
    [ -e "$d" ] || continue
    for m in $(awk -v d="$d/" 'index($2, d) == 1 { print $2 }' /proc/mounts | sort -r); do
      umount -l "$m" 2>/dev/null || true
    done
    rm -rf --one-file-system "$d"
  done
}

build_root() {
  local tmp="$cache/.build-$key.$$" t0=$SECONDS old
  mkdir -p "$cache"
  for old in "$cache"/.build-* "$cache"/sid-*; do  # stopped builds, older recipes
    [ "$old" = "$cache/sid-$key" ] || remove "$old"
  done
  mkdir -p "$tmp"
  say "building Debian unstable's python3.14 and torch into $root (once; log: $tmp.log)"
  trap 'remove "$tmp"' EXIT
  mmdebstrap --variant=essential --mode=root --components=main \
    --include=python3.14,python3-torch \
    --dpkgopt=force-unsafe-io \
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
    --dpkgopt='path-exclude=/usr/share/info/*' --dpkgopt='path-exclude=/usr/share/locale/*' \
    --aptopt='Acquire::Languages "none"' --aptopt='Acquire::Check-Valid-Until "false"' \
    --customize-hook='rm -rf "$1/var/cache/apt" "$1/var/lib/apt/lists"' \
    unstable "$tmp/root" "$mirror" >"$tmp.log" 2>&1 \
    || { tail -20 "$tmp.log" >&2; die "mmdebstrap failed (above; $tmp.log): check that $mirror is reachable"; }
  mv "$tmp/root" "$root.new" && mv "$root.new" "$root" && rm -rf "$tmp" "$tmp.log"
  trap - EXIT
  say "root filesystem ready after $(( SECONDS - t0 )) s ($(du -sm "$root" | cut -f1) MiB)"
}

[ "$(id -u)" = 0 ] || die "run as root: the root filesystem and its chroot need it"
if [ ! -x "$root/usr/bin/python3.14" ]; then
  command -v mmdebstrap >/dev/null || {
    apt-get update -qq && apt-get install -y -qq --no-install-recommends mmdebstrap >/dev/null
  } || die "install mmdebstrap, then retry"
  mkdir -p "$root"; rmdir "$root"
  build_root
fi

# the job env: the wrapper first (the venv is made through it)
[ "$(cat "$envdir/.ready" 2>/dev/null)" = "$root" ] && [ -x "$envdir/bin/python" ] && exit 0
mkdir -p "$envdir/bin"
cat >"$envdir/bin/python" <<EOF
#!/bin/bash
# CPython 3.14 of $root, run in a chroot (.ci/py314.sh)
exec unshare --mount --propagation private /bin/bash -c '
set -e
r=\$1; shift
for d in /proc /sys /dev /tmp /run "$repo" "$envdir" \${PROBING_RUNTIME_DIR:+"\$PROBING_RUNTIME_DIR"}; do
  mkdir -p "\$r\$d" && mount --rbind "\$d" "\$r\$d"
done
exec chroot "\$r" /bin/sh -c "cd \"\\\$0\" 2>/dev/null || cd /; exec \"\\\$@\"" "\$PWD" "\$@"
' py314 "$root" "$envdir/venv/bin/python" "\$@"
EOF
chmod 755 "$envdir/bin/python"
rm -rf "$envdir/venv"
mkdir -p "$root$envdir"
unshare --mount --propagation private \
  /bin/bash -c 'mount --bind "$2" "$1$2" && chroot "$1" python3.14 -m venv --without-pip --system-site-packages "$2/venv"' \
  py314 "$root" "$envdir"
"$envdir/bin/python" -c 'import sys, torch; print("py314: ready:", sys.version.split()[0], "torch", torch.__version__)'
echo "$root" >"$envdir/.ready"
