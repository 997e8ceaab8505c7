#!/usr/bin/env bash
# Spot-instance simulation: an elastic horovodrun job on loopback "hosts" that come and go the
# way spot instances do, with an exactness check at the end. See examples/spot/README.md.
#
#   examples/spot/spot.sh [--release|--debug] [--python]      (from the repository root)
#
# --python trains the PyTorch counter (python/tests/elastic_train.py: a TorchState with a model
# and a DistributedOptimizer) instead of the Rust one; it needs the hvd package installed in
# $HVD_PYTHON (default python3): pip install ./python.
#
# Timeline (each step waits for training to be seen at the expected size, with a timeout):
#   start  127.0.0.2:2 + 127.0.0.3:2                        size 4
#   (a)    spot host 127.0.0.4:2 appears                    scale-up        4 -> 6
#   (b)    127.0.0.3 gets a two-minute preemption notice,   graceful        6 -> 4
#          so it is taken out of discovery
#   (c)    127.0.0.4 is preempted without notice: its       failure,        4 -> 2
#          workers are SIGKILLed, then it leaves discovery  rollback to the last commit
#   (d)    replacement spot host 127.0.0.5:2 appears        scale-up        2 -> 4
# Exits 0 on PASS; non-zero when horovodrun failed or an invariant does not hold.
set -euo pipefail

usage() {
    echo "usage: examples/spot/spot.sh [--release|--debug] [--python]   (run it from the repository root)"
}

profile=release
python=""
for arg in "$@"; do
    case "$arg" in
        --release) profile=release ;;
        --debug) profile=debug ;;
        --python) python=${HVD_PYTHON:-python3} ;;
        -h | --help) usage; exit 0 ;;
        *) usage >&2; exit 64 ;;
    esac
done

# ---- knobs -------------------------------------------------------------------------------------
STEPS=600
COMMIT_EVERY=10
STEP_MS=20
SETTLE_STEPS=40       # rank-0 steps to see at each expected size before the next event
WAIT_TIMEOUT=20       # seconds to wait for each expected size
START_TIMEOUT=60      # the same for the first round, which waits for the workers' imports too
FINISH_TIMEOUT=90     # seconds to wait for horovodrun to end after the last event
EXPECTED_SIZES="4 6 4 2 4"

# ---- preflight ---------------------------------------------------------------------------------
if [[ ! -f Cargo.toml || ! -x examples/spot/discover.sh ]]; then
    echo "spot.sh: run this from the repository root: examples/spot/spot.sh" >&2
    exit 64
fi
hvdrun="target/$profile/horovodrun"
counter="target/$profile/examples/elastic_counter"
if [[ ! -x $hvdrun || ! -x $counter ]]; then
    build="cargo build --release --workspace --bins --examples"
    [[ $profile == debug ]] && build="cargo build --workspace --bins --examples"
    echo "spot.sh: $hvdrun or $counter is missing; build them first:" >&2
    echo "    $build" >&2
    exit 1
fi
command -v python3 >/dev/null || { echo "spot.sh: python3 is needed for the summary" >&2; exit 1; }
if [[ -n $python ]]; then
    "$python" -c "import hvd.torch" 2>/dev/null || {
        echo "spot.sh: --python needs the hvd package in $python: pip install ./python" >&2
        exit 1
    }
    counter_cmd=("$python" python/tests/elastic_train.py)
    # A Python worker's start (importing torch) takes seconds on a busy machine: more steps keep
    # training going until the last scale-up has settled.
    STEPS=900
else
    counter_cmd=("$counter")
fi
[[ -n ${EPOCHREALTIME:-} ]] || { echo "spot.sh: needs bash 5 or later" >&2; exit 1; }
[[ -r /proc/self/environ ]] || { echo "spot.sh: needs Linux /proc to find worker processes" >&2; exit 1; }

state_dir=$(mktemp -d "${TMPDIR:-/tmp}/hvd-spot.XXXXXX")
export SPOT_STATE="$state_dir/hosts"
out="$state_dir/stdout.log"   # horovodrun's stdout: every worker line, [id]<stdout>:{json}
err="$state_dir/driver.log"   # horovodrun's stderr: the driver's decisions, worker stderr

# ---- clean-up ----------------------------------------------------------------------------------
hvd_pid=""
cleanup() {
    if [[ -n $hvd_pid ]] && kill -0 "$hvd_pid" 2>/dev/null; then
        echo "spot.sh: stopping horovodrun (pid $hvd_pid)" >&2
        kill -TERM "$hvd_pid" 2>/dev/null || true
        for _ in $(seq 30); do
            kill -0 "$hvd_pid" 2>/dev/null || break
            sleep 0.1
        done
        kill -KILL "$hvd_pid" 2>/dev/null || true
        echo "spot.sh: logs kept in $state_dir" >&2
    fi
}
trap cleanup EXIT
trap 'echo; echo "spot.sh: interrupted" >&2; exit 130' INT
trap 'echo "spot.sh: terminated" >&2; exit 143' TERM

# ---- helpers -----------------------------------------------------------------------------------
t0_us=${EPOCHREALTIME//[.,]/}
elapsed() { # seconds since the job started, one decimal
    local d=$(( ${EPOCHREALTIME//[.,]/} - t0_us ))
    printf '%d.%d' $(( d / 1000000 )) $(( d % 1000000 / 100000 ))
}
banner() { printf '\n== t=%ss: %s ==\n' "$(elapsed)" "$*"; }
alive() { kill -0 "$hvd_pid" 2>/dev/null; }

# The fleet, as discover.sh prints it. Rewritten whole and renamed into place, so a discovery
# run never reads half a file.
fleet=()
write_fleet() {
    printf '%s\n' "${fleet[@]}" >"$SPOT_STATE.tmp"
    mv -f "$SPOT_STATE.tmp" "$SPOT_STATE"
    echo "   fleet: ${fleet[*]:-(none)}"
}
fleet_add() { fleet+=("$1"); write_fleet; }
fleet_remove() {
    local h keep=()
    for h in "${fleet[@]}"; do [[ ${h%%:*} == "$1" ]] || keep+=("$h"); done
    fleet=("${keep[@]}")
    write_fleet
}

# Live view: the driver's new stderr lines, time-stamped relative to the job's start. Only
# complete lines are shown (wc -l counts newlines), so a half-written line waits for the next call.
shown=0
t0_day=$(( t0_us / 1000 % 86400000 ))   # ms since midnight UTC, as the driver's timestamps
pump() {
    local n
    n=$(wc -l <"$err")
    (( n > shown )) || return 0
    sed -n "$((shown + 1)),${n}p" "$err" | LC_ALL=C awk -v t0="$t0_day" '
        $1 ~ /^[0-9]+-[0-9]+-[0-9]+T[0-9:.]+Z$/ {
            split(substr($1, 12, length($1) - 12), a, ":")
            t = (a[1] * 3600 + a[2] * 60 + a[3]) - t0 / 1000
            if (t < -43200) t += 86400
            msg = $0; sub(/^[^ ]+ +[A-Z]+ +/, "", msg)
            # Workers acknowledging a host update, one line each, are noise here (the log file
            # has them); a worker asking for a round because a peer died is shown.
            if (msg ~ /^worker asks for a new round.*reason=hosts updated/) next
            printf "   %6.2fs %-5s %s\n", t, $2, msg
            next
        }
        { printf "           %s\n", $0 }'
    shown=$n
}

# await SIZE DESCRIPTION [TIMEOUT]: waits until rank 0 has printed SETTLE_STEPS step lines at
# world size SIZE after line $mark of the stdout log, at most TIMEOUT seconds (WAIT_TIMEOUT).
# Returns 1 on timeout, 2 when horovodrun has ended (a problem only if the size was never seen).
mark=0
problems=()
# seen SIZE: "COUNT LAST": rank 0's step lines at world size SIZE after line $mark, and the last step.
seen() {
    LC_ALL=C awk -v m="$mark" -v s="$1" '
        NR > m && /"event":"step"/ && /"rank":0[,}]/ && $0 ~ ("\"size\":" s "[,}]") {
            c++; x = $0; sub(/.*"step":/, "", x); sub(/[,}].*/, "", x); last = x
        }
        END { print c + 0, last + 0 }' "$out"
}
await() {
    local size=$1 what=$2 timeout=${3:-$WAIT_TIMEOUT} count last
    local deadline=$(( SECONDS + timeout ))
    while :; do
        pump
        read -r count last <<<"$(seen "$size")"
        if (( count >= SETTLE_STEPS )); then
            echo "   ok: training at size $size ($count steps seen, now at step $last)"
            return 0
        fi
        if ! alive; then
            pump
            read -r count last <<<"$(seen "$size")"
            if (( count > 0 )); then
                # Training reached the size and then ran out of steps: the summary checks the rest.
                echo "   ok: training at size $size ($count steps seen before training ended, last step $last)"
                return 2
            fi
            problems+=("horovodrun ended while waiting for $what (size $size)")
            echo "   !! horovodrun ended while waiting for $what (size $size)"
            return 2
        fi
        if (( SECONDS >= deadline )); then
            problems+=("timed out after ${timeout}s waiting for $what (size $size; saw $count steps)")
            echo "   !! timed out after ${timeout}s waiting for $what (size $size; saw $count steps)"
            return 1
        fi
        sleep 0.1
    done
}
set_mark() { mark=$(wc -l <"$out"); }

# worker_pids HOST: "pid worker-id" of every child of horovodrun whose environment says it runs
# on HOST (HOROVOD_HOSTNAME), read from /proc.
worker_pids() {
    local host=$1 d stat rest fields env id
    for d in /proc/[0-9]*; do
        { stat=$(<"$d/stat"); } 2>/dev/null || continue
        rest=${stat##*) }                  # after the command name, which may hold spaces
        read -r -a fields <<<"$rest"       # fields[0]: state, fields[1]: ppid
        [[ ${fields[1]:-} == "$hvd_pid" ]] || continue
        env=$(tr '\0' '\n' <"$d/environ" 2>/dev/null) || continue
        grep -qx "HOROVOD_HOSTNAME=$host" <<<"$env" || continue
        id=$(sed -n 's/^HVD_WORKER_ID=//p' <<<"$env")
        echo "${d#/proc/} ${id:-?}"
    done
}

# await_log REGEX SECS: waits until the driver's log matches.
await_log() {
    local deadline=$(( SECONDS + $2 ))
    until grep -qE "$1" "$err"; do
        pump
        (( SECONDS < deadline )) && alive || return 1
        sleep 0.05
    done
    pump
}

# ---- the job -----------------------------------------------------------------------------------
echo "spot.sh: state and logs in $state_dir"
fleet=(127.0.0.2:2 127.0.0.3:2)
write_fleet
: >"$out"
: >"$err"
cmd=("$hvdrun" -np 4 --min-np 2 --max-np 6
    --host-discovery-script examples/spot/discover.sh --discovery-interval 0.5
    --blacklist-cooldown-range 2 10 --status-port 0
    "${counter_cmd[@]}" --steps "$STEPS" --commit-every "$COMMIT_EVERY" --step-ms "$STEP_MS")
echo "   \$ ${cmd[*]}"
t0_us=${EPOCHREALTIME//[.,]/}
t0_day=$(( t0_us / 1000 % 86400000 ))
"${cmd[@]}" >"$out" 2>"$err" &
hvd_pid=$!

banner "start: on-demand fleet 127.0.0.2:2 + 127.0.0.3:2, expecting size 4"
set_mark
await 4 "the first round" "$START_TIMEOUT" && ok=0 || ok=$?
port=$(sed -n 's/.*status endpoint listening.*:\([0-9][0-9]*\)$/\1/p' "$err" | head -n 1)
[[ -n $port ]] && echo "   the job's status page, while it runs: http://127.0.0.1:$port/"

if (( ok != 2 )); then
    banner "(a) new spot host 127.0.0.4:2 appears (scale-up 4 → 6)"
    set_mark
    fleet_add 127.0.0.4:2
    await 6 "the scale-up to 127.0.0.4" && ok=0 || ok=$?
fi

if (( ok != 2 )); then
    banner "(b) preemption WITH notice: 127.0.0.3 gets a two-minute warning → drained from discovery (graceful 6 → 4)"
    set_mark
    fleet_remove 127.0.0.3
    await 4 "the graceful removal of 127.0.0.3" && ok=0 || ok=$?
fi

if (( ok != 2 )); then
    banner "(c) preemption WITHOUT notice: 127.0.0.4 vanishes (SIGKILL its workers → failure, rollback, 4 → 2)"
    set_mark
    victims=$(worker_pids 127.0.0.4)
    if [[ -z $victims ]]; then
        problems+=("found no worker process of 127.0.0.4 under horovodrun (pid $hvd_pid)")
        echo "   !! found no worker process of 127.0.0.4 under horovodrun (pid $hvd_pid)"
    else
        while read -r pid id; do
            echo "   kill -KILL $pid   (worker $id on 127.0.0.4)"
            kill -KILL "$pid" 2>/dev/null || true
        done <<<"$victims"
    fi
    # The cloud's API stops listing the dead instance a moment later.
    await_log 'worker failed.*127\.0\.0\.4' 5 || true
    fleet_remove 127.0.0.4
    await 2 "recovery on 127.0.0.2 alone" && ok=0 || ok=$?
fi

if (( ok != 2 )); then
    banner "(d) replacement spot host 127.0.0.5:2 appears (scale-up 2 → 4)"
    set_mark
    fleet_add 127.0.0.5:2
    await 4 "the scale-up to 127.0.0.5" && ok=0 || ok=$?
fi

banner "waiting for training to finish ($STEPS steps)"
deadline=$(( SECONDS + FINISH_TIMEOUT ))
while alive && (( SECONDS < deadline )); do
    pump
    sleep 0.1
done
if alive; then
    problems+=("horovodrun still running ${FINISH_TIMEOUT}s after the last event; stopped")
    echo "   !! horovodrun still running ${FINISH_TIMEOUT}s after the last event; stopping it"
    kill -TERM "$hvd_pid" 2>/dev/null || true
fi
hvd_rc=0
wait "$hvd_pid" || hvd_rc=$?
hvd_pid=""
pump
elapsed_total=$(elapsed)

# ---- summary -----------------------------------------------------------------------------------
banner "summary (horovodrun exited $hvd_rc after ${elapsed_total}s)"
summary_rc=0
python3 - "$out" "$err" "$STEPS" "$COMMIT_EVERY" "$EXPECTED_SIZES" <<'PY' || summary_rc=$?
import json, re, sys

out, err, steps, commit_every, expected = sys.argv[1:6]
steps, commit_every = int(steps), int(commit_every)
expected = [int(x) for x in expected.split()]

events = []
for line in open(out, errors="replace"):
    m = re.match(r"^\[(\d+)\]<stdout>:(\{.*\})\s*$", line)
    if m:
        try:
            events.append(json.loads(m.group(2)))
        except ValueError:
            pass

# Rounds as rank 0 saw them: its first step starts round 1, each of its resets the next. Only
# rank 0's lines are used: lines of different workers may be relayed slightly out of order.
rounds = []
for ev in events:
    if ev.get("rank") != 0:
        continue
    kind = ev.get("event")
    if kind == "step":
        if not rounds:
            rounds.append({"size": ev["size"], "resumed": 0, "furthest": 0})
        r = rounds[-1]
        r.setdefault("first", ev["step"])
        r["last"] = ev["step"]
    elif kind == "reset":
        prev = rounds[-1].get("last", 0) if rounds else 0
        rounds.append({"size": ev["size"], "resumed": ev["step"], "furthest": prev})

labels = ["start", "(a) +127.0.0.4", "(b) -127.0.0.3, notice", "(c) 127.0.0.4 killed",
          "(d) +127.0.0.5"]
sizes = [r["size"] for r in rounds]
print("world sizes over time: size " + " → ".join(map(str, sizes)))
for i, r in enumerate(rounds):
    label = labels[i] if len(rounds) == len(labels) else f"round {i + 1}"
    span = f"steps {r.get('first', '-')}–{r.get('last', '-')}"
    if i == 0:
        print(f"  {label:<24} size {r['size']}  {span}")
    else:
        back = r["furthest"] - r["resumed"]
        print(f"  {label:<24} size {r['size']}  {span:<16} resumed at step {r['resumed']} "
              f"(rank 0 had reached {r['furthest']}: rolled back {back})")

done = [ev for ev in events if ev.get("event") == "done"]
print("final done lines:")
for ev in sorted(done, key=lambda e: e.get("rank", -1)):
    print("  " + json.dumps(ev, separators=(",", ":")))

# The total rank 0 reports must be the sum of the world size over each step as last executed
# (a rolled-back step counts once, at the size it was redone at).
size_of = {}
for ev in events:
    if ev.get("event") == "step" and ev.get("rank") == 0:
        size_of[ev["step"]] = ev["size"]

driver = open(err, errors="replace").read()
checks = []
def check(ok, what):
    checks.append(ok)
    print(f"  [{'ok' if ok else 'FAIL'}] {what}")

print("checks:")
check(bool(done), "training finished (done lines present)")
if done:
    n = done[0].get("size")
    keys = ("size", "steps", "total", "history_sum")
    check(all(all(ev.get(k) == done[0].get(k) for k in keys) for ev in done),
          "all ranks' done lines agree on size, steps, total, history_sum")
    check(sorted(ev.get("rank") for ev in done) == list(range(n or 0)),
          f"one done line per rank of the final world (size {n})")
    check(all(ev.get("total") == ev.get("history_sum") for ev in done), "total == history_sum")
    check(all(ev.get("steps") == steps for ev in done), f"steps == {steps}")
    want = sum(size_of.get(s, 0) for s in range(1, steps + 1))
    check(set(size_of) == set(range(1, steps + 1)) and done[0].get("total") == want,
          f"total == Σ world size over the {steps} steps as executed ({want})")
check(sizes == expected, "world sizes follow the timeline: "
      + " → ".join(map(str, expected)))
if sizes == expected:
    graceful = [rounds[i]["furthest"] - rounds[i]["resumed"] for i in (1, 2, 4)]
    check(graceful == [0, 0, 0], "scale-ups and the noticed preemption resumed without rollback")
    back = rounds[3]["furthest"] - rounds[3]["resumed"]
    check(0 <= back <= commit_every and rounds[3]["resumed"] % commit_every == 0,
          f"the unnoticed preemption rolled back to the last commit ({back} step(s), "
          f"≤ --commit-every {commit_every})")
check(re.search(r'host blacklisted.*host="?127\.0\.0\.4\b', driver) is not None,
      "127.0.0.4 was blacklisted after its workers died")
check(re.search(r'blacklisted.*host="?127\.0\.0\.3\b', driver) is None,
      "127.0.0.3 (removed with notice) was not blacklisted")
sys.exit(0 if all(checks) else 1)
PY

for p in "${problems[@]}"; do echo "  [FAIL] $p"; done
echo "logs: $out (workers), $err (driver)"
if (( hvd_rc == 0 && summary_rc == 0 )) && (( ${#problems[@]} == 0 )); then
    echo "PASS"
    exit 0
fi
(( hvd_rc == 0 )) || echo "horovodrun exited $hvd_rc; see $err"
echo "FAIL"
exit 1
