#!/bin/bash
# PID 1 of the `make vm-test` guest (installed as /usr/local/sbin/probing-vm-init
# when the image is built; booted with init=). No systemd: it mounts what the
# suite needs, mounts the host's checkout (9p tag "probing", read-only), runs
# vagrant/run-tests.sh from it, prints "probing-vm: exit N" on the serial
# console and powers the machine off. vagrant/vm-test.sh reads that line.
PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export PATH HOME=/root LANG=C.UTF-8
finish() {
  echo "probing-vm: exit $1"
  sync
  echo o > /proc/sysrq-trigger
  sleep 60
}
mount -t proc proc /proc
dmesg -n 1  # kernel messages stay in dmesg, off the console
echo "probing-vm: init"
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev 2>/dev/null
mkdir -p /dev/pts /dev/shm
mount -t devpts devpts /dev/pts
mount -t tmpfs tmpfs /dev/shm
mount -t tmpfs tmpfs /run
mount -t tmpfs tmpfs /tmp
mount -o remount,rw /
mount -t tracefs nodev /sys/kernel/tracing
mount -t debugfs nodev /sys/kernel/debug
mount -t bpf bpf /sys/fs/bpf
mount -t cgroup2 cgroup2 /sys/fs/cgroup
echo 1 > /proc/sys/kernel/sysrq
hostname probing-vm
ip link set lo up
modprobe -a 9pnet_virtio 9p 2>/dev/null
mkdir -p /mnt/probing
if ! mount -t 9p -o trans=virtio,version=9p2000.L,ro,msize=1048576 probing /mnt/probing; then
  echo "probing-vm: could not mount the checkout (9p tag probing)"
  finish 3
fi
# the command line's probing.tests= (smoke|full|a pytest argument list,
# comma-separated) and probing.slowdown= (how much slower than the host the
# guest runs: the tests' waits are stretched by it)
tests=smoke slowdown=1
for arg in $(cat /proc/cmdline); do
  case "$arg" in
    probing.tests=*) tests=${arg#probing.tests=} ;;
    probing.slowdown=*) slowdown=${arg#probing.slowdown=} ;;
  esac
done
PROBING_VM_TESTS=$tests PROBING_TEST_SLOWDOWN=$slowdown bash /mnt/probing/vagrant/run-tests.sh
finish $?
