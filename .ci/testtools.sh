#!/usr/bin/env bash
# Tools the test suite checks the deploy/ recipes with (not the demo's):
# promtool (Debian's prometheus package) for the alert rules and the
# /metrics exposition (promtool check rules, check metrics), systemd-analyze
# for the unit, a single-node Slurm (slurm-wlm: slurmctld, slurmd, srun; and
# munge) for the Slurm prolog. Idempotent; as root.
set -euo pipefail
say() { printf 'setup: %s\n' "$*"; }
need=()
command -v promtool >/dev/null || need+=(prometheus)
command -v systemd-analyze >/dev/null || need+=(systemd)
{ command -v slurmctld && command -v slurmd && command -v srun; } >/dev/null || need+=(slurm-wlm)
command -v munged >/dev/null || need+=(munge)
[ ${#need[@]} -gt 0 ] || exit 0
SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
for pkg in "${need[@]}"; do
  apt-cache show "$pkg" >/dev/null 2>&1 || { say "no $pkg package here: the deploy tests will say so"; exit 0; }
done
say "installing ${need[*]} (checks of deploy/)"
export DEBIAN_FRONTEND=noninteractive
install() { $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null; }
install || { $SUDO apt-get update -qq && install; }
# a Prometheus server is not wanted running on a test machine
$SUDO service prometheus stop >/dev/null 2>&1 || true
# nor Slurm's or munge's daemons: the Slurm test starts its own, on its own key
for svc in slurmd slurmctld munge; do $SUDO service "$svc" stop >/dev/null 2>&1 || true; done
