#!/usr/bin/env bash
# Tools the test suite checks the deploy/ recipes with (not the demo's): promtool
# (Debian's prometheus package) for the alert rules. Idempotent; as root.
set -euo pipefail
say() { printf 'setup: %s\n' "$*"; }
command -v promtool >/dev/null && exit 0
SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
if ! apt-cache show prometheus >/dev/null 2>&1; then
  say "no prometheus package here: the rules test will say so"; exit 0
fi
say "installing prometheus (promtool, for deploy/prometheus)"
export DEBIAN_FRONTEND=noninteractive
install() { $SUDO apt-get install -y -qq --no-install-recommends prometheus >/dev/null; }
install || { $SUDO apt-get update -qq && install; }
# a service we do not want running on a test machine
$SUDO systemctl disable --now prometheus >/dev/null 2>&1 || $SUDO service prometheus stop >/dev/null 2>&1 || true
