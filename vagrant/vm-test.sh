#!/usr/bin/env bash
# `make vm-test`: probing's privileged suite in a Debian trixie VM (kernel 6.12,
# Python 3.13), booted with qemu on this machine. As root.
#
#   vagrant/vm-test.sh [paths|smoke|full|systemd|PYTEST-ARGS...]     (default: paths)
#   vagrant/vm-test.sh --image-path      (where the image for this recipe is cached)
#
# 1. The image: built once from Debian's packages with mmdebstrap, running
#    vagrant/provision.sh (the recipe the Vagrantfile runs too) in its root
#    filesystem, then kept in $PROBING_VM_CACHE (default /var/cache/probing-vm)
#    under a key of the recipe; later runs boot it from there.
# 2. The boot: a throw-away qcow2 overlay on the cached image, the checkout
#    shared read-only over 9p, KVM when a guest boots under it, else TCG
#    ($PROBING_VM_ACCEL=kvm|tcg forces one).
# 3. In the guest vagrant/vm-init.sh runs vagrant/run-tests.sh: it installs this
#    checkout into the image's Python 3.13 venv and runs the tests as root,
#    printing "kernel <release>", "Python 3.13.x" and pytest's summary line.
# The exit status is the guest's pytest status (non-zero on any failure).
#
# Environment: PROBING_VM_CACHE, PROBING_VM_ACCEL (auto|kvm|tcg),
# PROBING_VM_MEM (MiB, default 4096), PROBING_VM_SMP (default 2),
# PROBING_VM_TIMEOUT (s, for the tests' boot; default 3600),
# PROBING_VM_MIRROR (Debian mirror), PROBING_VM_REBUILD=1 (build anew),
# PROBING_VM_SLOWDOWN (how much the tests' waits stretch: 10 under TCG, 2 KVM).
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
cache=${PROBING_VM_CACHE:-/var/cache/probing-vm}
accel=${PROBING_VM_ACCEL:-auto}
mem=${PROBING_VM_MEM:-4096}
smp=${PROBING_VM_SMP:-2}
limit=${PROBING_VM_TIMEOUT:-3600}
mirror=${PROBING_VM_MIRROR:-http://deb.debian.org/debian}
say() { printf 'vm-test: %s\n' "$*"; }
die() { printf 'vm-test: %s\n' "$*" >&2; exit "${2:-1}"; }

tests=paths
if [ $# -gt 0 ]; then
  case "$1" in
    paths|smoke|full|systemd) tests=$1 ;;
    -h|--help) sed -n '2,22p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    --image-path) tests=image-path ;;
    *) tests=$(IFS=,; echo "$*") ;;
  esac
fi
case "$tests" in *" "*) die "test arguments may not contain spaces: $tests (give them as separate words)" 2 ;; esac

# --- the image ---------------------------------------------------------------------
# The key: the recipe, PID 1, build_image below and the dependency lists (not the rest of
# pyproject.toml, so editing probing's own code never rebuilds the image).
key=$( {
  cat "$repo/vagrant/provision.sh" "$repo/vagrant/vm-init.sh"
  sed -n '/^build_image() {/,/^}/p' "$repo/vagrant/vm-test.sh"  # how the image is built
  python3 - "$repo/pyproject.toml" <<'EOF'
import sys, tomllib
p = tomllib.load(open(sys.argv[1], "rb"))["project"]
print(p["dependencies"], p["optional-dependencies"]["test"])
EOF
} | sha256sum | cut -c1-12)
image="$cache/trixie-$key"
[ "$tests" = image-path ] && { echo "$image"; exit 0; }

# --- the host ------------------------------------------------------------------------
[ "$(id -u)" = 0 ] || die "run as root: building the image and sharing the checkout need it (sudo make vm-test)" 2
[ "$(uname -m)" = x86_64 ] || die "only x86_64 hosts are supported (this is $(uname -m))" 2

# --- the host's tools ------------------------------------------------------------
need=()
command -v qemu-system-x86_64 >/dev/null || need+=(qemu-system-x86)
command -v qemu-img >/dev/null || need+=(qemu-utils)
command -v mmdebstrap >/dev/null || need+=(mmdebstrap)
command -v mkfs.ext4 >/dev/null || need+=(e2fsprogs)
if [ ${#need[@]} -gt 0 ]; then
  command -v apt-get >/dev/null || die "install ${need[*]} (a Debian/Ubuntu host has them as packages), then retry" 2
  say "installing ${need[*]}"
  export DEBIAN_FRONTEND=noninteractive
  { apt-get update -qq && apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null; } \
    || die "could not install ${need[*]}: install them, then retry" 2
fi


# --- the image ---------------------------------------------------------------------
# remove_build DIR...: a stopped build's directories, unmounting first what
# its chroot may still have mounted (never deleting through /proc, /sys, /dev)
remove_build() {
  local d m
  for d in "$@"; do
    [ -e "$d" ] || continue
    for m in $(awk -v d="$d/" 'index($2, d) == 1 { print $2 }' /proc/mounts | sort -r); do
      umount -l "$m" 2>/dev/null || true
    done
    rm -rf --one-file-system "$d"
  done
}

build_image() {
  tmp="$cache/.build-$key.$$"
  remove_build "$cache"/.build-*  # an earlier build that was stopped
  mkdir -p "$tmp"
  trap 'remove_build "$tmp"; rm -f "$tmp.log" "$tmp.time"' EXIT
  # pip in the image's root filesystem trusts what this host trusts (a proxy's CA)
  local ca=${PIP_CERT:-${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}}
  say "building the Debian trixie image in $image (once; about 10 minutes, log: $tmp.log)"
  local t0=$SECONDS
  # dpkg without fsync and without docs, man pages and translations; an
  # initramfs with only what this qemu guest's root needs (virtio_blk, ext4):
  # a fifth of the default's size, built in seconds, booted in seconds under TCG
  local initramfs_conf='mkdir -p "$1/etc/initramfs-tools/conf.d" "$1/etc/initramfs-tools/hooks"
printf "MODULES=list\nCOMPRESS=gzip\n" >"$1/etc/initramfs-tools/conf.d/probing-vm.conf"
printf "#!/bin/sh\n[ \"\$1\" = prereqs ] && exit 0\n. /usr/share/initramfs-tools/hook-functions\nforce_load virtio_blk\nforce_load ext4\n" >"$1/etc/initramfs-tools/hooks/probing-vm"
chmod 755 "$1/etc/initramfs-tools/hooks/probing-vm"'
  if ! /usr/bin/time -v -o "$tmp.time" timeout 2400 mmdebstrap --variant=apt --mode=root --components=main \
      --include=ca-certificates \
      --dpkgopt=force-unsafe-io \
      --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
      --dpkgopt='path-exclude=/usr/share/info/*' --dpkgopt='path-exclude=/usr/share/locale/*' \
      --aptopt='Acquire::Languages "none"' \
      --essential-hook="$initramfs_conf" \
      --customize-hook="upload '$repo/vagrant/provision.sh' /root/provision.sh" \
      --customize-hook="upload '$repo/pyproject.toml' /root/pyproject.toml" \
      --customize-hook="upload '$ca' /root/host-ca.crt" \
      --customize-hook='chroot "$1" env -u PIP_FIND_LINKS -u PIP_CONFIG_FILE -u SSL_CERT_DIR PIP_CERT=/root/host-ca.crt SSL_CERT_FILE=/root/host-ca.crt REQUESTS_CA_BUNDLE=/root/host-ca.crt bash /root/provision.sh --pyproject /root/pyproject.toml' \
      --customize-hook='rm -f "$1/root/host-ca.crt"' \
      --customize-hook="upload '$repo/vagrant/vm-init.sh' /usr/local/sbin/probing-vm-init" \
      --customize-hook='chmod 755 "$1/usr/local/sbin/probing-vm-init"' \
      --customize-hook='rm -rf "$1/root/.cache" "$1/var/cache/apt/archives/"*.deb' \
      trixie "$tmp/root" "$mirror" 2>&1 | perl -pe 'BEGIN { $|=1; $t0=time } printf "%4d ", time-$t0' >"$tmp.log"; then
    tail -20 "$tmp.log" >&2
    mv -f "$tmp.log" "$cache/build-failed.log"
    die "building the image failed (above; whole log: $cache/build-failed.log). Check that $mirror and pypi.org are reachable, then run make vm-test again"
  fi
  local kernel initrd
  kernel=$(ls "$tmp"/root/boot/vmlinuz-* | sort -V | tail -1)
  initrd=$(ls "$tmp"/root/boot/initrd.img-* | sort -V | tail -1)
  [ -f "$kernel" ] && [ -f "$initrd" ] || die "the image has no kernel or initrd under /boot: see $tmp.log"
  cp "$kernel" "$tmp/vmlinuz"
  cp "$initrd" "$tmp/initrd.img"
  say "root filesystem ready after $(( SECONDS - t0 )) s"
  local used
  used=$(du -sm "$tmp/root" | cut -f1)
  mkfs.ext4 -q -F -L probing-root -d "$tmp/root" "$tmp/rootfs.img" "$(( used * 3 / 2 + 2048 ))M"
  say "ext4 image written after $(( SECONDS - t0 )) s"
  rm -rf "$tmp/root"
  mv "$tmp.time" "$tmp/build-time.txt" 2>/dev/null || true
  mv "$tmp.log" "$tmp/build.log"
  echo "$(( SECONDS - t0 ))" > "$tmp/build-seconds"
  rm -rf "$image"
  mv "$tmp" "$image"
  trap - EXIT
  say "image built in $(( SECONDS - t0 )) s"
}

mkdir -p "$cache"
if [ "${PROBING_VM_REBUILD:-0}" = 1 ] || [ ! -f "$image/rootfs.img" ]; then
  build_image
else
  say "image from the cache: $image"
fi
for old in "$cache"/trixie-*; do  # earlier recipes' images
  [ "$old" = "$image" ] || [ ! -d "$old" ] || rm -rf "$old"
done
[ "${PROBING_VM_BUILD_ONLY:-0}" = 1 ] && exit 0

# --- the boot ------------------------------------------------------------------------
run=$(mktemp -d "${TMPDIR:-/tmp}/probing-vm.XXXXXX")
qpid=""
tailer=""
# the console follower is a subshell running tail | sed: its children go with it
stop_tailer() {
  [ -n "$tailer" ] || return 0
  pkill -P "$tailer" 2>/dev/null || true
  kill "$tailer" 2>/dev/null || true
  wait "$tailer" 2>/dev/null || true
  tailer=""
}
cleanup() { [ -z "$qpid" ] || kill "$qpid" 2>/dev/null || true; stop_tailer; rm -rf "$run"; }
trap cleanup EXIT
log="$run/console.log"

# init_args: PID 1 of the guest. Ours (vagrant/vm-init.sh), or for the systemd
# test systemd itself, which mounts the checkout (systemd.mount-extra=), runs
# vagrant/vm-systemd.sh as the command line's service and then powers off
init_args() {
  if [ "$tests" = systemd ]; then
    printf '%s ' init=/lib/systemd/systemd systemd.unit=kernel-command-line.service \
      systemd.mount-extra=probing:/mnt/probing:9p:trans=virtio,version=9p2000.L,ro,msize=1048576 \
      systemd.run=/mnt/probing/vagrant/vm-systemd.sh \
      systemd.run_success_action=poweroff systemd.run_failure_action=poweroff \
      systemd.show_status=0
  else
    printf 'init=/usr/local/sbin/probing-vm-init'
  fi
}

# boot ACCEL SECONDS: start the guest in the background; $qpid, $log
boot() {
  rm -f "$run/overlay.qcow2" "$log"
  qemu-img create -q -f qcow2 -F raw -b "$image/rootfs.img" "$run/overlay.qcow2"
  # TCG: no AVX2 (QEMU 7.2's emulation of it crashed Debian numpy's argsort at
  # random; numpy, pyarrow and torch take their SSE paths instead)
  local cpu=max,-avx2 slowdown=${PROBING_VM_SLOWDOWN:-10}
  [ "$1" = kvm ] && cpu=host slowdown=${PROBING_VM_SLOWDOWN:-2}
  timeout --kill-after=10 "$2" qemu-system-x86_64 \
    -accel "$1" -cpu "$cpu" -smp "$smp" -m "$mem" \
    -nodefaults -nographic -no-reboot -display none \
    -serial "file:$log" -monitor none \
    -kernel "$image/vmlinuz" -initrd "$image/initrd.img" \
    -append "root=/dev/vda rootfstype=ext4 rw console=ttyS0 panic=-1 $(init_args) probing.tests=$tests probing.slowdown=$slowdown" \
    -drive "file=$run/overlay.qcow2,if=virtio,format=qcow2,cache=unsafe" \
    -virtfs "local,path=$repo,mount_tag=probing,security_model=none,readonly=on" \
    -device virtio-rng-pci \
    >"$run/qemu.out" 2>&1 &
  qpid=$!
}

# wait_for PATTERN SECONDS: 0 once the console log has the pattern, 1 when the
# guest stopped or the time ran out first
wait_for() {
  local deadline=$(( SECONDS + $2 ))
  while [ $SECONDS -lt $deadline ]; do
    grep -q "$1" "$log" 2>/dev/null && return 0
    kill -0 "$qpid" 2>/dev/null || return 1
    sleep 1
  done
  return 1
}

# KVM, when it works: a nested KVM guest (this repository's own CI machine,
# itself a VM) hangs right after the firmware, before the kernel prints its
# banner, so a guest whose kernel has not spoken in time falls back to TCG.
chosen=""
kvm_wait=${PROBING_VM_KVM_WAIT:-10}
# a host whose nested KVM hung once (same host kernel and qemu) goes straight to TCG
kvm_hangs="$cache/kvm-hangs"
host_id="$(uname -r) $(qemu-system-x86_64 --version | head -1)"
if [ "$accel" = auto ] && [ "$(cat "$kvm_hangs" 2>/dev/null)" = "$host_id" ]; then
  say "KVM hung here before ($kvm_hangs): using TCG (remove that file to try KVM again)"
  accel=tcg
fi
if [ "$accel" != tcg ] && [ -w /dev/kvm ]; then
  boot kvm "$limit"
  if wait_for "Linux version" "$kvm_wait"; then
    chosen=kvm
  else
    kill "$qpid" 2>/dev/null || true; wait "$qpid" 2>/dev/null || true; qpid=""
    cp "$log" "$cache/kvm-console.log" 2>/dev/null || true
    [ "$accel" = kvm ] && die "the KVM guest's kernel did not start in $kvm_wait s (console: $cache/kvm-console.log); run with PROBING_VM_ACCEL=tcg"
    echo "$host_id" >"$kvm_hangs"
    say "KVM: the guest's kernel did not start in $kvm_wait s (console: $cache/kvm-console.log); using TCG"
  fi
elif [ "$accel" = kvm ]; then
  die "PROBING_VM_ACCEL=kvm but /dev/kvm is not usable here; unset it to fall back to TCG" 2
fi
if [ -z "$chosen" ]; then
  boot tcg "$limit"
  chosen=tcg
fi
say "booting $(basename "$image") with $chosen (-smp $smp, -m ${mem}M), tests: $tests"

# the guest's own output, from PID 1 on, while it runs
follow() {
  t0=$SECONDS
  ( tail -n +1 -F "$log" 2>/dev/null | sed -u -n '/probing-vm: init/,$p' ) &
  tailer=$!
  wait "$qpid" || true
  qpid=""
  sleep 1
  stop_tailer
  say "guest ran $(( SECONDS - t0 )) s with $chosen"
  cp "$log" "$cache/last-console.log" 2>/dev/null || true
  status=$(sed -n 's/^probing-vm: exit \([0-9]*\).*/\1/p' "$log" | tail -1)
}
follow
# TCG's known crash (docs/vm.md): the guest kernel patching a jump label in
# __schedule while the other vCPU runs it ("Oops: int3", a panic), QEMU's
# cross-modifying code, not probing's. It is rare: boot once more.
if [ -z "$status" ] && [ "$chosen" = tcg ] && grep -aq "Oops: int3" "$log"; then
  cp "$log" "$cache/int3-console.log" 2>/dev/null || true
  say "the guest's kernel hit TCG's int3 text-poke crash (console: $cache/int3-console.log; docs/vm.md): booting once more"
  boot tcg "$limit"
  follow
fi
if [ -z "$status" ]; then
  tail -5 "$run/qemu.out" >&2 || true
  die "the guest stopped without a result (hung, killed after $limit s, or crashed): its console is in $cache/last-console.log; raise PROBING_VM_TIMEOUT or look there"
fi
[ "$status" = 0 ] || say "the tests failed in the guest (exit $status); its console: $cache/last-console.log"
exit "$status"
