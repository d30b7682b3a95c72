#!/bin/bash
# `make vm-test VM_TESTS=systemd`: the guest booted with systemd as PID 1
# (init=/lib/systemd/systemd), the checkout mounted by systemd itself
# (systemd.mount-extra=) and this script run as the kernel command line's
# service (systemd.run=), after which systemd powers the machine off. It runs
# vagrant/run-tests.sh's systemd set: the smoke, and tests/privileged/test_systemd.py
# (the agent's unit installed, started, killed and brought back by systemd); prints
# "probing-vm: exit N" on the console, as vagrant/vm-init.sh does.
exec >/dev/console 2>&1
PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export PATH HOME=/root LANG=C.UTF-8
echo "probing-vm: init (systemd $(systemctl --version | head -1 | cut -d' ' -f2) as PID 1)"
slowdown=1
for arg in $(cat /proc/cmdline); do
  case "$arg" in probing.slowdown=*) slowdown=${arg#probing.slowdown=} ;; esac
done
rc=0
PROBING_VM_TESTS=systemd PROBING_TEST_SLOWDOWN=$slowdown \
  bash /mnt/probing/vagrant/run-tests.sh || rc=$?
echo "probing-vm: exit $rc"
sync
