#!/bin/sh
# Host discovery script for the spot-instance demo (see README.md): prints the current fleet,
# one `host:slots` a line, from the state file that examples/spot/spot.sh rewrites as spot hosts
# come and go. horovodrun runs it every --discovery-interval seconds.
#
#   SPOT_STATE   the state file (default: ${TMPDIR:-/tmp}/hvd-spot-<uid>/hosts)
#
# It creates nothing. A missing state file means no fleet yet and prints nothing; an unreadable
# one is an error (non-zero exit), so horovodrun keeps the last host set instead of seeing an
# empty fleet. spot.sh replaces the file atomically (write, then rename), so a read never sees
# half a fleet.
set -eu

state="${SPOT_STATE:-${TMPDIR:-/tmp}/hvd-spot-$(id -u)/hosts}"

if [ ! -e "$state" ]; then
    exit 0
fi
exec cat -- "$state"
