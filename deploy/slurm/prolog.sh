#!/bin/sh
# Slurm Prolog: make sure this node's probing agent runs before the job's
# tasks start, so that every task srun starts (SLURM_PROCID in its
# environment) is attached, traced and watched with nothing in the job's
# script. docs/deploy.md, "Slurm". In slurm.conf:
#   Prolog=/etc/slurm/probing-prolog.sh
#   Epilog=/etc/slurm/probing-epilog.sh
#   PrologFlags=Alloc            # at allocation, before the first step
#
# - A node whose agent answers (the systemd unit, a DaemonSet, an earlier
#   job's Prolog): nothing to do.
# - A systemd node with probing-agent.service installed: the unit is started.
# - Any other node: `probing agent` is started here, detached (a session of
#   its own, stdin closed, its log lines appended to $AGENT_LOG), with a
#   clean environment and the agent's settings file (the systemd unit's).
#   One agent a node, however many jobs start together: it holds a lock on
#   $AGENT_LOCK for as long as it lives, and a Prolog that finds the lock
#   held starts none.
# - Then it waits up to $AGENT_WAIT_S for the agent's GET /health.
#
# It never fails: a Prolog that exits non-zero drains the node and requeues
# the job. Whatever goes wrong is written to $AGENT_LOG and the job runs,
# unwatched. Slurm gives a Prolog no PATH and none of the job's environment.
#
# Settings (sh NAME=value lines, read by the Epilog too): probing-slurm.env
# beside slurm.conf, else /etc/probing/slurm.env; the defaults are below.
PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export PATH
AGENT_BIN=/opt/probing/bin/probing      # probing, in its own environment
AGENT_CONFIG=/etc/probing/agent.env     # PROBING_AGENT_* lines (docs/config.md)
AGENT_ARGS=                             # more options of `probing agent`
AGENT_LOG=/var/log/probing-agent.log
AGENT_LOCK=/run/probing-agent.lock
AGENT_WAIT_S=10
# the settings: beside slurm.conf (Slurm says where), else in /etc/probing
settings="$(dirname "${SLURM_CONF:-/etc/slurm/slurm.conf}")/probing-slurm.env"
[ -r "$settings" ] || settings=/etc/probing/slurm.env
# shellcheck source=/dev/null
[ -r "$settings" ] && . "$settings"

say() {
    echo "probing prolog $(date '+%F %T') job ${SLURM_JOB_ID:-?}: $*" >>"$AGENT_LOG" 2>/dev/null
}

setting() {  # setting NAME DEFAULT: a PROBING_AGENT_* value from $AGENT_CONFIG
    v=$(sed -n "s/^[[:space:]]*$1=//p" "$AGENT_CONFIG" 2>/dev/null | tail -n 1 | tr -d "\"' ")
    echo "${v:-$2}"
}

port=$(setting PROBING_AGENT_PORT 9978)
host=$(setting PROBING_AGENT_HOST 127.0.0.1)
case "$host" in 0.0.0.0 | "" | "::" | "[::]") host=127.0.0.1 ;; esac
python="$(dirname "$AGENT_BIN")/python"

healthy() {  # healthy SECONDS: the agent's /health answers within SECONDS
    "$python" - "http://$host:$port/health" "$1" <<'EOF' 2>/dev/null
import sys, time, urllib.request
deadline = time.monotonic() + float(sys.argv[2])
while True:
    try:
        urllib.request.urlopen(sys.argv[1], timeout=2).close()
        sys.exit(0)
    except OSError:
        if time.monotonic() > deadline:
            sys.exit(1)
        time.sleep(0.1)
EOF
}

if [ ! -x "$AGENT_BIN" ]; then
    say "no $AGENT_BIN: install probing there, or set AGENT_BIN in $settings"
    exit 0
fi
healthy 0 && exit 0

if [ -d /run/systemd/system ] && systemctl cat probing-agent.service >/dev/null 2>&1; then
    systemctl start probing-agent.service >/dev/null 2>&1 \
        || say "systemctl start probing-agent.service failed: see journalctl -u probing-agent"
else
    set --
    [ -r "$AGENT_CONFIG" ] && set -- --config "$AGENT_CONFIG"
    (
        # held: an agent lives (or another Prolog is starting one)
        flock -n 9 || exit 0
        say "starting $AGENT_BIN agent $* $AGENT_ARGS (its log: $AGENT_LOG)"
        # the agent keeps fd 9, and with it the lock, for as long as it lives
        # shellcheck disable=SC2086
        env -i PATH="$PATH" LANG=C.UTF-8 HOME=/root \
            setsid "$AGENT_BIN" agent "$@" $AGENT_ARGS </dev/null >>"$AGENT_LOG" 2>&1 &
    ) 9>>"$AGENT_LOCK"
fi
healthy "$AGENT_WAIT_S" || say "the agent did not answer on $host:$port in ${AGENT_WAIT_S} s"
exit 0
