#!/bin/sh
# Slurm Epilog: leave nothing of the job's probes behind on this node.
# docs/deploy.md, "Slurm". In slurm.conf: Epilog=/etc/slurm/probing-epilog.sh
#
# The agent probed the job's tasks; their probes are served by the engine of
# the job's user (python -m probing.node.service, one a user and install),
# which keeps what an exited process recorded for PROBING_KEEP_DEAD_S (10
# min: its chunks on /dev/shm, its peer port) and then lives on for
# PROBING_ENGINE_IDLE_S. At the job's end this Epilog, as root:
# - stops every engine of the job's user that has no live process left (an
#   engine that still serves another job of the user on this node stays;
#   the ended job's probes in it retire after PROBING_KEEP_DEAD_S);
# - removes the job user's probe sockets of processes that no longer exist.
# The agent stays: it is the node's, not the job's. Set EPILOG_STOP_ENGINES=no
# in probing-slurm.env to keep a crashed job's data for a post-mortem query.
#
# It never fails: an Epilog that exits non-zero drains the node. What it did,
# and what went wrong, is written to $AGENT_LOG.
PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export PATH
AGENT_BIN=/opt/probing/bin/probing
AGENT_LOG=/var/log/probing-agent.log
EPILOG_STOP_ENGINES=yes
# the settings: beside slurm.conf (Slurm says where), else in /etc/probing
settings="$(dirname "${SLURM_CONF:-/etc/slurm/slurm.conf}")/probing-slurm.env"
[ -r "$settings" ] || settings=/etc/probing/slurm.env
# shellcheck source=/dev/null
[ -r "$settings" ] && . "$settings"

say() {
    echo "probing epilog $(date '+%F %T') job ${SLURM_JOB_ID:-?}: $*" >>"$AGENT_LOG" 2>/dev/null
}

uid=${SLURM_JOB_UID:-}
python="$(dirname "$AGENT_BIN")/python"
case "$uid" in "" | *[!0-9]*) say "no SLURM_JOB_UID: nothing to do"; exit 0 ;; esac
[ -x "$python" ] || exit 0

[ "$EPILOG_STOP_ENGINES" = yes ] && "$python" - "$uid" <<'EOF' 2>&1 | while read -r line; do say "$line"; done
import sys

from probing.cli.commands import engine
from probing.errors import ProbingError
from probing.guest import place

uid = int(sys.argv[1])
directory = place.user_dir(uid)
for e in engine.engines(directory):
    if e.processes:
        print(f"engine {e.pid} of uid {uid} kept: it serves {e.processes} live processes")
        continue
    try:
        engine.stop(e.pid, directory)
        print(f"engine {e.pid} of uid {uid} stopped (it held {e.dead} exited processes)")
    except ProbingError as err:
        print(f"engine {e.pid} of uid {uid} not stopped: {err}")
EOF

# the sockets (<pid>.sock, .guest, .trace) of processes that no longer exist
gone=0
for f in "${PROBING_RUNTIME_DIR:-/tmp}/probing-$uid"/[0-9]*.*; do
    case "$f" in *.sock | *.guest | *.trace) ;; *) continue ;; esac
    pid=${f##*/}
    pid=${pid%%.*}
    case "$pid" in *[!0-9]*) continue ;; esac
    [ -e "$f" ] && [ ! -d "/proc/$pid" ] && rm -f "$f" && gone=$((gone + 1))
done
[ "$gone" = 0 ] || say "removed $gone probe sockets of exited processes of uid $uid"
exit 0
