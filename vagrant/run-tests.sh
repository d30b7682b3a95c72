#!/usr/bin/env bash
# Inside the Vagrant VM, as root: the same command CI runs.
set -euo pipefail
cd /probing
bash .ci/run
