//! Elastic `horovodrun` end to end: real `elastic_counter` workers on 127.0.0.x "hosts", a
//! discovery script reading a file the test rewrites, and chaos: killed workers, lost hosts,
//! added hosts, a failing or hanging discovery script, a stopped worker. Every test checks
//! the counter's invariants (no committed step lost or applied twice, every rank agreeing),
//! the driver's exit code and its message.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test that cannot set up fails loudly

mod support;

use std::io::{BufRead, BufReader, Read};
use std::process::{Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use serde_json::Value;
use support::{
    Job, Line, check_counter, example, http_get, rendezvous_of, scratch, signal, steps_rerun,
};

const HOSTS2: &[&str] = &["127.0.0.2:2", "127.0.0.3:2"];
const COUNTER: &[&str] = &["--steps", "250", "--commit-every", "5", "--step-ms", "10"];

#[test]
fn killing_a_random_worker_shrinks_the_job_and_loses_no_step() {
    let mut job = Job::start("kill1", HOSTS2, &["-np", "4", "--min-np", "2"], COUNTER);
    job.wait_step(20, 4);
    let victim = job.pid_of_rank(3);
    signal(victim, Signal::SIGKILL);
    job.wait_step(1, 2);
    let (code, err, lines) = job.finish();
    assert_eq!(code, 0, "{err}");
    assert_eq!(check_counter(&lines, 250), 2);
    assert!(
        err.contains("worker failed") && err.contains("blacklisted"),
        "{err}"
    );
}

#[test]
fn killing_rank_0_hands_the_state_to_the_oldest_survivor() {
    let mut job = Job::start("kill0", HOSTS2, &["-np", "4", "--min-np", "2"], COUNTER);
    job.wait_step(20, 4);
    let before = job.wait_step(20, 4).v["total"].as_u64().unwrap_or(0);
    signal(job.pid_of_rank(0), Signal::SIGKILL);
    let after = job.wait_step(1, 2);
    assert!(
        after.v["total"].as_u64().unwrap_or(0) >= before,
        "a committed step was lost"
    );
    let (code, err, lines) = job.finish();
    assert_eq!(code, 0, "{err}");
    assert_eq!(check_counter(&lines, 250), 2);
}

#[test]
fn two_hosts_lost_at_once() {
    let hosts = &["127.0.0.2:2", "127.0.0.3:2", "127.0.0.4:2"];
    let mut job = Job::start("kill2", hosts, &["-np", "6", "--min-np", "2"], COUNTER);
    job.wait_step(20, 6);
    for host in ["127.0.0.3", "127.0.0.4"] {
        let pid = job.pids_on(host)[0];
        signal(pid, Signal::SIGKILL);
    }
    job.wait_step(1, 2);
    let (code, err, lines) = job.finish();
    assert_eq!(code, 0, "{err}");
    assert_eq!(check_counter(&lines, 250), 2);
}

#[test]
fn added_hosts_join_without_rollback() {
    let mut job = Job::start(
        "add",
        &["127.0.0.2:2"],
        &["-np", "2", "--max-np", "6"],
        COUNTER,
    );
    job.wait_step(10, 2);
    job.set_hosts(&["127.0.0.2:2", "127.0.0.3:2", "127.0.0.4:2"]);
    job.wait_step(1, 6);
    let (code, err, lines) = job.finish();
    assert_eq!(code, 0, "{err}");
    assert_eq!(check_counter(&lines, 250), 6);
    assert_eq!(steps_rerun(&lines), 0, "a graceful change re-ran steps");
    // Every worker found Horovod's slot variables at spawn, for the slot it was started for:
    // the first two for the first round, the new ones for the round of six they joined.
    let starts: Vec<&Line> = lines.iter().filter(|l| l.v["event"] == "start").collect();
    assert_eq!(starts.len(), 6, "{starts:?}");
    for s in starts {
        let h = &s.v["horovod"];
        let n = |k: &str| h[k].as_str().and_then(|v| v.parse::<u64>().ok());
        let first_step = lines
            .iter()
            .find(|l| l.worker == s.worker && l.v["event"] == "step")
            .expect("a step of every worker");
        let host = h["hostname"].as_str().unwrap_or_default();
        let (size, local_rank) = (n("size"), n("local_rank"));
        if host == "127.0.0.2" {
            assert_eq!(size, Some(2), "{h}");
        } else {
            assert_eq!(size, Some(6), "{h}");
            assert_eq!(n("rank"), first_step.v["rank"].as_u64(), "{h}");
        }
        assert_eq!(n("local_size"), Some(2), "{h}");
        assert!(local_rank.is_some_and(|r| r < 2), "{h}");
        let cross = (n("cross_rank"), n("cross_size"));
        let want_cross = match host {
            "127.0.0.2" => (Some(0), Some(1)),
            "127.0.0.3" => (Some(1), Some(3)),
            _ => (Some(2), Some(3)),
        };
        assert_eq!(cross, want_cross, "{h}");
        assert_eq!(
            n("rank"),
            Some(n("cross_rank").unwrap_or(0) * 2 + local_rank.unwrap_or(0)),
            "{h}"
        );
    }
}

#[test]
fn hosts_removed_from_discovery_leave_gracefully() {
    let mut job = Job::start("remove", HOSTS2, &["-np", "2", "--max-np", "4"], COUNTER);
    job.wait_step(10, 4);
    job.set_hosts(&["127.0.0.3:2"]);
    job.wait_step(1, 2);
    let (code, err, lines) = job.finish();
    assert_eq!(code, 0, "{err}");
    assert_eq!(check_counter(&lines, 250), 2);
    assert_eq!(steps_rerun(&lines), 0, "a graceful removal rolled back");
    assert!(!err.contains("blacklisted"), "nothing failed: {err}");
}

#[test]
fn hosts_added_and_removed_in_one_poll() {
    let mut job = Job::start("swap", HOSTS2, &["-np", "2", "--max-np", "4"], COUNTER);
    job.wait_step(10, 4);
    job.set_hosts(&["127.0.0.2:2", "127.0.0.4:2"]);
    job.wait_for("a worker on the new host", |l| {
        l.v["event"] == "step" && l.worker >= 4
    });
    let (code, err, lines) = job.finish();
    assert_eq!(code, 0, "{err}");
    assert_eq!(check_counter(&lines, 250), 4);
    assert_eq!(steps_rerun(&lines), 0);
}

/// A spot fleet replaces every host at once: the hosts holding the committed state leave
/// discovery in the poll that brings the new ones, before any new worker joined. One old worker
/// trains on for one more round, whose sync takes the state from it, then exits 0.
#[test]
fn draining_every_host_that_holds_the_state_hands_it_over_first() {
    let flags = &["-np", "4", "--min-np", "2", "--max-np", "4"];
    let mut job = Job::start("drain-all", HOSTS2, flags, COUNTER);
    let before = job.wait_step(20, 4).v["total"].as_u64().unwrap_or(0);
    job.set_hosts(&["127.0.0.4:2", "127.0.0.5:2"]);
    job.wait_stderr("kept for one more round");
    let after = job.wait_for("a step of the new fleet alone", |l| {
        l.v["event"] == "step" && l.worker >= 4 && l.v["rank"] == 0
    });
    assert!(
        after.v["total"].as_u64().unwrap_or(0) > before,
        "the new fleet started from an older state: {} after {before}",
        after.v
    );
    let left = job.wait_stderr("the worker kept for the state left");
    let (code, err, lines) = job.finish();
    assert_eq!(code, 0, "{err}");
    assert_eq!(check_counter(&lines, 250), 4);
    assert_eq!(steps_rerun(&lines), 0, "a drain rolled back");
    assert!(left.contains("exited with code 0"), "{left}");
    assert!(
        !err.contains("state is lost") && !err.contains("blacklisted"),
        "{err}"
    );
    let done: Vec<u64> = lines
        .iter()
        .filter(|l| l.v["event"] == "done")
        .map(|l| l.worker)
        .collect();
    assert!(
        done.iter().all(|&w| w >= 4),
        "only the new fleet finishes: {done:?}"
    );
}

/// The old hosts leave just after the new fleet joined them in a round: its workers hold the
/// state already, and the old ones exit 0 at once.
#[test]
fn draining_the_old_hosts_after_the_new_fleet_joined() {
    let flags = &["-np", "4", "--min-np", "2", "--max-np", "8"];
    let mut job = Job::start("drain-joined", HOSTS2, flags, COUNTER);
    job.wait_step(20, 4);
    let fleet = ["127.0.0.4:2", "127.0.0.5:2"];
    job.set_hosts(&[HOSTS2, &fleet].concat());
    job.wait_step(1, 8);
    job.set_hosts(&fleet);
    job.wait_for("a step of the new fleet alone", |l| {
        l.v["event"] == "step" && l.v["size"] == 4 && l.worker >= 4
    });
    let (code, err, lines) = job.finish();
    assert_eq!(code, 0, "{err}");
    assert_eq!(check_counter(&lines, 250), 4);
    assert_eq!(steps_rerun(&lines), 0, "a drain rolled back");
    assert!(
        !err.contains("state is lost") && !err.contains("blacklisted"),
        "{err}"
    );
    assert!(!err.contains("kept for one more round"), "{err}");
}

#[test]
fn a_discovery_script_failing_on_its_first_run_fails_the_job() {
    let dir = scratch("disc-fail");
    std::fs::write(dir.join("mode"), "echo 'no inventory' >&2; exit 3\n").expect("mode");
    let job = Job::start_in(dir, HOSTS2, &["-np", "2"], "elastic_counter", COUNTER);
    let (code, err, _) = job.finish();
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("first run") && err.contains("3"), "{err}");
}

#[test]
fn later_discovery_failures_hangs_and_garbage_keep_the_last_host_set() {
    let mut job = Job::start(
        "disc-later",
        HOSTS2,
        &["-np", "4", "--min-np", "2", "--discovery-timeout", "0.5"],
        &["--steps", "300", "--commit-every", "5", "--step-ms", "10"],
    );
    job.wait_step(10, 4);
    job.set_mode("exit 4\n");
    job.wait_step(60, 4);
    job.set_mode("sleep 30\n");
    job.wait_step(110, 4);
    job.set_mode("echo 'h:1:2'; exit 0\n");
    job.wait_step(160, 4);
    job.set_mode("");
    let (code, err, lines) = job.finish();
    assert_eq!(code, 0, "{err}");
    assert_eq!(check_counter(&lines, 300), 4);
    assert!(err.contains("exit status: 4"), "{err}");
    assert!(err.contains("did not finish within 500ms; killed"), "{err}");
    assert!(err.contains("h:1:2"), "the bad line is named: {err}");
}

#[test]
fn below_min_np_waits_and_recovers_when_the_host_comes_back() {
    let mut job = Job::start(
        "below-min",
        HOSTS2,
        &[
            "-np",
            "4",
            "--min-np",
            "4",
            "--blacklist-cooldown-range",
            "1",
            "2",
        ],
        COUNTER,
    );
    job.wait_step(20, 4);
    signal(job.pids_on("127.0.0.3")[0], Signal::SIGKILL);
    let (code, err, lines) = job.finish();
    assert_eq!(code, 0, "{err}");
    assert_eq!(check_counter(&lines, 250), 4);
    assert!(err.contains("cooldown is over"), "{err}");
    assert!(
        lines.iter().all(|l| l.v["size"] != 2),
        "never trained below --min-np"
    );
}

#[test]
fn elastic_timeout_names_the_slots_it_had_and_needed() {
    let mut job = Job::start(
        "etimeout",
        HOSTS2,
        &["-np", "4", "--min-np", "4", "--elastic-timeout", "2"],
        COUNTER,
    );
    job.wait_step(10, 4);
    signal(job.pids_on("127.0.0.3")[0], Signal::SIGKILL);
    let t = Instant::now();
    let (code, err, _) = job.finish();
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("2 available, 4 needed"), "{err}");
    assert!(
        t.elapsed() < Duration::from_secs(10),
        "took {:?}",
        t.elapsed()
    );
}

#[test]
fn more_resets_than_the_limit_fail_the_job() {
    let hosts = &["127.0.0.2:1", "127.0.0.3:1", "127.0.0.4:1"];
    let mut job = Job::start(
        "reset-limit",
        hosts,
        &["-np", "3", "--min-np", "1", "--reset-limit", "1"],
        COUNTER,
    );
    job.wait_step(10, 3);
    signal(job.pids_on("127.0.0.4")[0], Signal::SIGKILL);
    job.wait_step(1, 2);
    signal(job.pids_on("127.0.0.3")[0], Signal::SIGKILL);
    let (code, err, _) = job.finish();
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("more than --reset-limit 1"), "{err}");
}

#[test]
fn a_blacklisted_host_returns_after_its_cooldown() {
    let mut job = Job::start(
        "cooldown",
        &["127.0.0.2:1", "127.0.0.3:1"],
        &[
            "-np",
            "2",
            "--min-np",
            "1",
            "--blacklist-cooldown-range",
            "1",
            "4",
        ],
        &["--steps", "400", "--commit-every", "5", "--step-ms", "10"],
    );
    job.wait_step(10, 2);
    signal(job.pids_on("127.0.0.3")[0], Signal::SIGKILL);
    job.wait_step(1, 1);
    job.wait_step(1, 2).v["step"].as_u64();
    let (code, err, lines) = job.finish();
    assert_eq!(code, 0, "{err}");
    assert_eq!(check_counter(&lines, 400), 2);
    assert!(
        err.contains("failures=1"),
        "the transition names the failure count: {err}"
    );
}

#[test]
fn a_worker_stopped_during_a_round_is_declared_failed_and_the_round_goes_on() {
    let hosts = &["127.0.0.2:2", "127.0.0.3:1", "127.0.0.4:1"];
    // The round's timeout is what this tests: the heartbeat is set out of its way.
    let flags = [
        "-np",
        "4",
        "--min-np",
        "2",
        "--start-timeout",
        "3",
        "--heartbeat-timeout",
        "30",
    ];
    let mut job = Job::start("sigstop", hosts, &flags, COUNTER);
    job.wait_step(20, 4);
    // One worker hangs, another dies: the round the death starts must not wait for the hung one.
    // The death comes once the others wait in a call the hung one never entered, so no
    // survivor reads from the dead one's connection: the driver must tell them.
    signal(job.pids_on("127.0.0.4")[0], Signal::SIGSTOP);
    thread::sleep(Duration::from_millis(500));
    signal(job.pids_on("127.0.0.3")[0], Signal::SIGKILL);
    let t = Instant::now();
    job.wait_step(1, 2);
    let took = t.elapsed();
    eprintln!("training went on at size 2 {took:?} after the death");
    let (code, err, lines) = job.finish();
    assert_eq!(code, 0, "{err}");
    assert_eq!(check_counter(&lines, 250), 2);
    assert!(
        err.contains("telling the round's other members to abort"),
        "{err}"
    );
    // The two on 127.0.0.2 answer the abort; the stopped one cannot.
    let answered: Vec<&str> = err
        .lines()
        .filter(|l| l.contains("worker answered the abort"))
        .collect();
    assert_eq!(answered.len(), 2, "{err}");
    assert!(
        answered.iter().all(|l| l.contains("host=127.0.0.2")),
        "{err}"
    );
    assert!(err.contains("did not join the round in time"), "{err}");
    assert!(took < Duration::from_secs(10), "recovery took {took:?}");
}

#[test]
fn process_sets_are_rebuilt_for_the_new_round() {
    let dir = scratch("sets");
    std::fs::write(dir.join("hosts"), "127.0.0.2:2\n127.0.0.3:2\n").expect("hosts");
    let script = dir.join("discover.sh").display().to_string();
    let probe = example("hvd_probe");
    let mut child = Command::new(env!("CARGO_BIN_EXE_horovodrun"))
        .args([
            "-np",
            "4",
            "--min-np",
            "2",
            "--host-discovery-script",
            &script,
        ])
        .args([&probe, "--elastic-set-steps", "200"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn");
    let out = child.stdout.take().expect("stdout");
    let mut lines = BufReader::new(out).lines().map_while(Result::ok);
    let mut seen = Vec::new();
    for l in lines.by_ref() {
        let four = l.contains("\"set_step\"") && l.contains("\"size\":4");
        seen.push(l);
        if four && seen.len() > 20 {
            break;
        }
    }
    let me = child.id().to_string();
    let victim = std::fs::read_dir("/proc")
        .expect("proc")
        .flatten()
        .filter_map(|e| e.file_name().to_string_lossy().parse::<i32>().ok())
        .find(|pid| {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            let ppid = stat
                .rsplit_once(')')
                .and_then(|(_, r)| r.split_whitespace().nth(1).map(String::from));
            let env = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
            ppid.as_deref() == Some(me.as_str())
                && env
                    .split(|&b| b == 0)
                    .any(|kv| kv == b"HOROVOD_HOSTNAME=127.0.0.3")
        })
        .expect("a worker on 127.0.0.3");
    signal(victim, Signal::SIGKILL);
    seen.extend(lines);
    let status = child.wait().expect("wait");
    let mut err = String::new();
    if let Some(mut e) = child.stderr.take() {
        let _ = e.read_to_string(&mut err);
    }
    let _ = std::fs::remove_dir_all(&dir);
    assert!(status.success(), "{err}");
    let after: Vec<&String> = seen
        .iter()
        .filter(|l| l.contains("\"set_step\"") && l.contains("\"size\":2"))
        .collect();
    assert!(
        !after.is_empty(),
        "no step of the set after the reset: {seen:?}"
    );
    assert!(
        after.iter().all(|l| l.contains("\"set_sum\":1")),
        "{after:?}"
    );
}

#[test]
fn the_background_engine_survives_a_reset() {
    let mut job = Job::start_in(
        scratch("engine"),
        HOSTS2,
        &["-np", "4", "--min-np", "2"],
        "engine_soak",
        &[
            "--seconds",
            "4",
            "--tensors",
            "20",
            "--elems",
            "5000",
            "--report-every",
            "5",
        ],
    );
    job.wait_for("engine steps at size 4", |l| {
        l.v["event"] == "mem" && l.v["size"] == 4
    });
    signal(job.pids_on("127.0.0.3")[0], Signal::SIGKILL);
    job.wait_for("engine steps at size 2", |l| {
        l.v["event"] == "mem" && l.v["size"] == 2
    });
    let (code, err, lines) = job.finish();
    assert_eq!(code, 0, "{err}");
    let done: Vec<&Value> = lines
        .iter()
        .filter(|l| l.v["event"] == "done")
        .map(|l| &l.v)
        .collect();
    assert_eq!(done.len(), 2, "{done:?}");
    assert_eq!(done[0]["steps"], done[1]["steps"], "{done:?}");
}

#[test]
fn the_status_endpoint_reports_rounds_workers_and_blacklisted_hosts() {
    let mut job = Job::start(
        "status",
        HOSTS2,
        &[
            "-np",
            "4",
            "--min-np",
            "2",
            "--status-port",
            "0",
            "--blacklist-cooldown-range",
            "100",
            "200",
        ],
        COUNTER,
    );
    let port = job.status_port();
    job.wait_step(20, 4);
    let (code, body) = http_get(port, "GET", "/status");
    assert_eq!(code, 200, "{body}");
    let mut v: Value = serde_json::from_str(&body).expect("JSON");
    let first = v["rounds"][0]["at_ms"]
        .as_u64()
        .expect("the first round's time");
    let log = v["log"].take();
    assert!(
        log.as_array().is_some_and(|l| l.iter().any(|l| l
            .as_str()
            .is_some_and(|l| l.contains("round complete; training at the new size round=1")))),
        "the driver's recent lines: {log}"
    );
    assert_eq!(
        v,
        serde_json::json!({
            "phase": "Running", "generation": 1, "workers": 4,
            "hosts": [{"host": "127.0.0.2", "slots": 2}, {"host": "127.0.0.3", "slots": 2}],
            "blacklisted": [], "resets": 0,
            "rounds": [{"generation": 1, "at_ms": first, "workers": 4, "causes": []}],
            "noticed": [], "lateness": [], "log": null
        })
    );
    signal(job.pids_on("127.0.0.3")[0], Signal::SIGKILL);
    job.wait_step(1, 2);
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_millis() as u64;
    let v: Value = serde_json::from_str(&http_get(port, "GET", "/status").1).expect("JSON");
    assert_eq!(v["phase"], "Running", "{v}");
    assert_eq!(
        (
            v["generation"].as_u64(),
            v["workers"].as_u64(),
            v["resets"].as_u64()
        ),
        (Some(2), Some(2), Some(1)),
        "{v}"
    );
    assert_eq!(
        v["hosts"],
        serde_json::json!([{"host": "127.0.0.2", "slots": 2}])
    );
    assert_eq!(v["blacklisted"][0]["host"], "127.0.0.3", "{v}");
    let cause = &v["rounds"][1]["causes"][0];
    assert_eq!(
        (
            &cause["kind"],
            &cause["host"],
            v["rounds"][1]["workers"].as_u64()
        ),
        (
            &serde_json::json!("failure"),
            &serde_json::json!("127.0.0.3"),
            Some(2)
        ),
        "{v}"
    );
    let until = v["blacklisted"][0]["until_ms"]
        .as_u64()
        .expect("a cooldown end");
    assert!(
        until > now_ms + 90_000 && until < now_ms + 310_000,
        "{until} vs {now_ms}"
    );
    assert_eq!(http_get(port, "GET", "/nope").0, 404);
    assert_eq!(http_get(port, "DELETE", "/status").0, 405);
    let (code, err, lines) = job.finish();
    assert_eq!(code, 0, "{err}");
    assert_eq!(check_counter(&lines, 250), 2);
}

/// Waits until none of `pids` is alive (a zombie counts as gone); fails naming those left.
fn assert_gone(pids: &[i32]) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let alive: Vec<i32> = pids
            .iter()
            .copied()
            .filter(|p| {
                std::fs::read_to_string(format!("/proc/{p}/stat")).is_ok_and(|s| {
                    !s.rsplit_once(')')
                        .is_some_and(|(_, r)| r.trim_start().starts_with('Z'))
                })
            })
            .collect();
        if alive.is_empty() {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "processes left after the job: {alive:?}"
        );
        thread::sleep(Duration::from_millis(100));
    }
}

/// `--heartbeat-timeout` of the frozen-worker tests, and how long they allow past it.
const HEARTBEAT: &[&str] = &["--heartbeat-timeout", "2"];
const FROZEN_LIMIT: Duration = Duration::from_secs(2 + 6);
const SLOW_COUNTER: &[&str] = &["--steps", "250", "--commit-every", "5", "--step-ms", "20"];

#[test]
fn a_worker_frozen_between_steps_is_declared_failed_and_the_job_goes_on_without_its_host() {
    let flags = [&["-np", "4", "--min-np", "2"], HEARTBEAT].concat();
    let mut job = Job::start("frozen1", HOSTS2, &flags, SLOW_COUNTER);
    job.wait_step(20, 4);
    let pids: Vec<i32> = job.workers().iter().map(|w| w.0).collect();
    let victim = job.pid_of_rank(3);
    signal(victim, Signal::SIGSTOP);
    let t = Instant::now();
    job.wait_step(1, 2);
    let took = t.elapsed();
    eprintln!("training went on at size 2 {took:?} after the SIGSTOP");
    let (code, err, lines) = job.finish();
    assert_eq!(code, 0, "{err}");
    assert_eq!(check_counter(&lines, 250), 2);
    assert!(
        err.contains("stopped answering the driver (frozen?); declared failed and killed")
            && err.contains("host=127.0.0.3")
            && err.contains("blacklisted")
            && err.contains("(frozen?)"),
        "{err}"
    );
    assert!(took < FROZEN_LIMIT, "recovery took {took:?}");
    assert_gone(&pids);
}

#[test]
fn freezing_every_worker_of_a_host_fails_the_host_once() {
    let flags = [&["-np", "4", "--min-np", "2"], HEARTBEAT].concat();
    let mut job = Job::start("frozen-host", HOSTS2, &flags, SLOW_COUNTER);
    job.wait_step(20, 4);
    let pids: Vec<i32> = job.workers().iter().map(|w| w.0).collect();
    for pid in job.pids_on("127.0.0.2") {
        signal(pid, Signal::SIGSTOP);
    }
    let t = Instant::now();
    job.wait_step(1, 2);
    let took = t.elapsed();
    eprintln!("training went on at size 2 {took:?} after the SIGSTOPs");
    let (code, err, lines) = job.finish();
    assert_eq!(code, 0, "{err}");
    assert_eq!(check_counter(&lines, 250), 2);
    let declared: Vec<&str> = err
        .lines()
        .filter(|l| l.contains("stopped answering the driver"))
        .collect();
    assert_eq!(
        declared.len(),
        1,
        "the host fails once; its other worker is stopped with it: {err}"
    );
    assert!(declared[0].contains("host=127.0.0.2"), "{err}");
    assert!(took < FROZEN_LIMIT, "recovery took {took:?}");
    assert_gone(&pids);
}

#[test]
fn a_survivor_frozen_while_the_round_reforms_is_declared_failed_by_its_silence() {
    let hosts = &["127.0.0.2:2", "127.0.0.3:1", "127.0.0.4:1"];
    // A start timeout far beyond the heartbeat's: only the silence can catch the frozen one.
    let flags = [
        &["-np", "4", "--min-np", "2", "--start-timeout", "60"],
        HEARTBEAT,
    ]
    .concat();
    let mut job = Job::start("frozen-reform", hosts, &flags, COUNTER);
    job.wait_step(20, 4);
    let pids: Vec<i32> = job.workers().iter().map(|w| w.0).collect();
    signal(job.pids_on("127.0.0.4")[0], Signal::SIGKILL);
    signal(job.pids_on("127.0.0.3")[0], Signal::SIGSTOP);
    let t = Instant::now();
    job.wait_step(1, 2);
    let took = t.elapsed();
    eprintln!("training went on at size 2 {took:?} after the death and the freeze");
    let (code, err, lines) = job.finish();
    assert_eq!(code, 0, "{err}");
    assert_eq!(check_counter(&lines, 250), 2);
    assert!(
        err.contains("stopped answering the driver") && err.contains("host=127.0.0.3"),
        "{err}"
    );
    assert!(!err.contains("did not join the round in time"), "{err}");
    assert!(took < FROZEN_LIMIT, "recovery took {took:?}");
    assert_gone(&pids);
}

#[test]
fn a_new_worker_frozen_as_it_joins_is_declared_failed_and_the_job_goes_on() {
    let flags = [&["-np", "2", "--max-np", "4", "--verbose"], HEARTBEAT].concat();
    let mut job = Job::start("frozen-join", &["127.0.0.2:2"], &flags, SLOW_COUNTER);
    job.wait_step(20, 2);
    job.set_hosts(HOSTS2);
    // Frozen right after it registered: the round that adds its host is forming, or its
    // members are connecting and syncing.
    let line = job.wait_stderr("worker connected worker=3");
    let pid: i32 = line
        .split("pid=")
        .nth(1)
        .and_then(|p| p.split_whitespace().next()?.parse().ok())
        .expect("the pid in the log line");
    signal(pid, Signal::SIGSTOP);
    let t = Instant::now();
    job.wait_stderr("stopped answering the driver");
    let took = t.elapsed();
    eprintln!("the frozen new worker was declared failed {took:?} after the SIGSTOP");
    let pids: Vec<i32> = job.workers().iter().map(|w| w.0).collect();
    let (code, err, lines) = job.finish();
    assert_eq!(code, 0, "{err}");
    assert_eq!(check_counter(&lines, 250), 2);
    assert!(err.contains("host=127.0.0.3"), "{err}");
    assert!(took < FROZEN_LIMIT, "declared after {took:?}");
    assert_gone(&pids);
}

/// At `--heartbeat-timeout 1` a frozen worker is declared failed within about a second of
/// its freeze (its last answer came at most a ping period, 250 ms, before).
#[test]
fn at_a_one_second_heartbeat_a_frozen_worker_is_out_within_a_second() {
    let flags = ["-np", "4", "--min-np", "2", "--heartbeat-timeout", "1"];
    let mut job = Job::start("frozen-1s", HOSTS2, &flags, SLOW_COUNTER);
    job.wait_step(20, 4);
    let victim = job.pid_of_rank(3);
    signal(victim, Signal::SIGSTOP);
    let t = Instant::now();
    job.wait_stderr("stopped answering the driver");
    let took = t.elapsed();
    eprintln!("SIGSTOP → declared frozen after {took:?} at --heartbeat-timeout 1");
    job.wait_step(1, 2);
    let (code, err, lines) = job.finish();
    assert_eq!(code, 0, "{err}");
    assert_eq!(check_counter(&lines, 250), 2);
    assert!(took < Duration::from_millis(2000), "took {took:?}\n{err}");
}

/// Processes that keep every core busy (twice as many as cores, at the workers' priority)
/// while the job trains and one worker computes for four seconds between collectives: at
/// `--heartbeat-timeout 1` nobody is declared frozen.
#[test]
fn at_a_one_second_heartbeat_a_machine_under_full_load_declares_nobody_frozen() {
    let cores = std::thread::available_parallelism().map_or(2, usize::from);
    let hogs = CpuHogs::start(2 * cores);
    let flags = ["-np", "4", "--min-np", "2", "--heartbeat-timeout", "1"];
    let counter = [
        "--steps",
        "150",
        "--commit-every",
        "5",
        "--step-ms",
        "20",
        "--busy-at-step",
        "20",
        "--busy-ms",
        "4000",
        "--busy-rank",
        "3",
    ];
    let job = Job::start("loaded-1s", HOSTS2, &flags, &counter);
    let (code, err, lines) = job.finish_within(Duration::from_secs(120));
    drop(hogs);
    assert_eq!(code, 0, "{err}");
    assert_eq!(check_counter(&lines, 150), 4);
    assert!(
        !lines.iter().any(|l| l.v["event"] == "reset"),
        "nothing was reset"
    );
    assert!(!err.contains("stopped answering"), "{err}");
}

/// Busy-looping shell processes, killed when dropped.
struct CpuHogs(Vec<std::process::Child>);

impl CpuHogs {
    fn start(n: usize) -> Self {
        Self(
            (0..n)
                .map(|_| {
                    Command::new("sh")
                        .args(["-c", "while :; do :; done"])
                        .spawn()
                        .expect("a busy loop")
                })
                .collect(),
        )
    }
}

impl Drop for CpuHogs {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

#[test]
fn a_worker_busy_for_three_heartbeat_timeouts_is_not_declared_failed() {
    let flags = [&["-np", "4", "--min-np", "2"], HEARTBEAT].concat();
    let counter = [
        COUNTER,
        &[
            "--busy-at-step",
            "20",
            "--busy-ms",
            "6000",
            "--busy-rank",
            "3",
        ],
    ]
    .concat();
    let mut job = Job::start("busy", HOSTS2, &flags, &counter);
    job.wait_for("the busy step", |l| l.v["event"] == "busy");
    let pids: Vec<i32> = job.workers().iter().map(|w| w.0).collect();
    let t = Instant::now();
    job.wait_step(21, 4);
    let waited = t.elapsed();
    let (code, err, lines) = job.finish();
    assert_eq!(code, 0, "{err}");
    assert_eq!(check_counter(&lines, 250), 4);
    assert!(
        waited >= Duration::from_secs(5),
        "its peers waited for it: {waited:?}"
    );
    assert!(
        !lines.iter().any(|l| l.v["event"] == "reset"),
        "nothing was reset"
    );
    assert!(
        !err.contains("stopped answering") && !err.contains("blacklisted"),
        "{err}"
    );
    assert_gone(&pids);
}

/// The survivors of a failure join the next round when the driver aborts theirs, not when
/// their program reaches its next collective: every rank is 4 s into a computation between
/// two collectives when a worker is killed, and the round without it forms at once (well
/// before any survivor looks up), while no committed step is lost.
#[test]
fn survivors_join_the_next_round_while_their_program_still_computes() {
    let counter = [COUNTER, &["--busy-at-step", "20", "--busy-ms", "4000"]].concat();
    let mut job = Job::start("early", HOSTS2, &["-np", "4", "--min-np", "2"], &counter);
    job.wait_for("the busy step", |l| l.v["event"] == "busy");
    let formed = "round complete; training at the new size";
    assert_eq!(job.stderr_count(formed), 1, "{}", job.err_tail());
    signal(job.pid_of_rank(3), Signal::SIGKILL);
    let killed = Instant::now();
    job.wait_stderr_count(formed, 2);
    let joined = killed.elapsed();
    job.wait_step(21, 2);
    let resumed = killed.elapsed();
    let (code, err, lines) = job.finish();
    assert_eq!(code, 0, "{err}");
    assert_eq!(check_counter(&lines, 250), 2);
    assert!(
        joined < Duration::from_millis(2500) && resumed > joined + Duration::from_secs(1),
        "the next round formed {joined:?} after the kill, the survivors resumed after \
         {resumed:?}:\n{err}"
    );
}

/// The pids of `parent`'s children whose environment holds `var`.
fn children_with(parent: u32, var: &str) -> Vec<i32> {
    let parent = parent.to_string();
    std::fs::read_dir("/proc")
        .expect("proc")
        .flatten()
        .filter_map(|e| e.file_name().to_string_lossy().parse::<i32>().ok())
        .filter(|pid| {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            let ppid = stat
                .rsplit_once(')')
                .and_then(|(_, r)| r.split_whitespace().nth(1).map(String::from));
            let env = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
            ppid.as_deref() == Some(parent.as_str())
                && env.split(|&b| b == 0).any(|kv| kv == var.as_bytes())
        })
        .collect()
}

/// A static job of `elastic_counter` on one host with two slots.
fn static_job(name: &str, flags: &[&str], counter: &[&str], env: &[(&str, &str)]) -> Job {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_horovodrun"));
    cmd.args(["-np", "2", "-H", "127.0.0.2:2"])
        .args(flags)
        .arg(example("elastic_counter"))
        .args(counter)
        .envs(env.iter().copied());
    Job::spawn(scratch(name), cmd)
}

#[test]
fn a_frozen_worker_fails_a_static_job_naming_its_rank() {
    let mut job = static_job("frozen-static", HEARTBEAT, SLOW_COUNTER, &[]);
    job.wait_step(20, 2);
    let pids = children_with(job.child.id(), "HOROVOD_RANK=1");
    assert_eq!(pids.len(), 1, "{pids:?}");
    let all = [
        pids.clone(),
        children_with(job.child.id(), "HOROVOD_RANK=0"),
    ]
    .concat();
    signal(pids[0], Signal::SIGSTOP);
    let t = Instant::now();
    let (code, err, _) = job.finish();
    let took = t.elapsed();
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("rank 1 on host 127.0.0.2 stopped answering for")
            && err.contains("--heartbeat-timeout"),
        "{err}"
    );
    assert!(
        took < FROZEN_LIMIT,
        "the job ended {took:?} after the SIGSTOP"
    );
    assert_gone(&all);
}

#[test]
fn the_arrival_timeout_names_the_rank_that_did_not_arrive() {
    // Rank 1 is busy (alive, answering pings) for longer than its peer waits in a collective.
    let counter = [
        SLOW_COUNTER,
        &[
            "--busy-at-step",
            "5",
            "--busy-ms",
            "4000",
            "--busy-rank",
            "1",
        ],
    ]
    .concat();
    let job = static_job(
        "arrival",
        HEARTBEAT,
        &counter,
        &[("HVD_ARRIVAL_TIMEOUT", "1")],
    );
    let (code, err, lines) = job.finish();
    assert_ne!(code, 0, "{err}");
    assert!(lines.iter().any(|l| l.v["event"] == "busy"), "{err}");
    assert!(err.contains("rank 1 sent nothing for 1s"), "{err}");
    assert!(!err.contains("stopped answering"), "{err}");
}

/// The driver's last "round complete" line in `err` newer than `after`: (round, size).
fn last_round_complete(err: &str, after: u64) -> Option<(u64, u64)> {
    let field = |l: &str, k: &str| -> Option<u64> {
        l.split(k).nth(1)?.split_whitespace().next()?.parse().ok()
    };
    err.lines()
        .filter(|l| l.contains("round complete"))
        .filter_map(|l| Some((field(l, "round=")?, field(l, "size=")?)))
        .rfind(|&(r, _)| r > after)
}

/// The seconds since midnight at which the driver logged `line` (its RFC 3339 timestamp).
fn log_seconds(line: &str) -> Option<f64> {
    let time = line.split_whitespace().next()?.split('T').nth(1)?;
    let mut parts = time.trim_end_matches('Z').split(':');
    let (h, m, s) = (parts.next()?, parts.next()?, parts.next()?);
    Some(h.parse::<f64>().ok()? * 3600.0 + m.parse::<f64>().ok()? * 60.0 + s.parse::<f64>().ok()?)
}

/// Issue 15, part 2: a member killed while a round's members connect costs a new round, not
/// the start timeout. Every member waits up to 300 ms (at random) before it connects
/// (`HVD_TEST_CONNECT_DELAY_MS`, read only for tests), so the connecting spans long enough to
/// kill a member at random points of it: some members still before their mesh, others waiting
/// in it for the victim, the victim itself dialing or accepting. Each iteration adds two fresh
/// one-slot hosts (removing the previous pair), waits for the round of four to complete, and
/// kills one of the two new workers 0 to 250 ms later; the other new worker is a survivor that
/// was still in `hvd::init`. With `--start-timeout 30`, training must resume at size 3 within
/// a few seconds every time.
#[test]
fn a_member_killed_while_a_round_connects_costs_a_new_round_not_the_start_timeout() {
    const ITERATIONS: u64 = 6;
    const STEPS: u64 = 1200;
    const RECOVERY_LIMIT: Duration = Duration::from_secs(12);
    let flags = [
        "-np",
        "2",
        "--min-np",
        "2",
        "--max-np",
        "4",
        "--start-timeout",
        "30",
    ];
    let steps = STEPS.to_string();
    let counter = ["--steps", &steps, "--commit-every", "5", "--step-ms", "5"];
    let mut job = Job::start_env(
        scratch("connect-kill"),
        &["127.0.0.2:2"],
        &flags,
        "elastic_counter",
        &counter,
        &[("HVD_TEST_CONNECT_DELAY_MS", "300")],
    );
    job.wait_step(10, 2);
    let mut seed = u64::from(std::process::id()) | 1;
    let mut random = |n: u64| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed % n
    };
    let mut last_round = 0;
    let mut took_all: Vec<Duration> = Vec::new();
    let mut during_connect = 0;
    let mut last_step = 0;
    for i in 0..ITERATIONS {
        if last_step + 400 > STEPS {
            // A slow machine: leave the job room to add the hosts and finish.
            break;
        }
        let pair = [
            format!("127.0.0.{}", 10 + 2 * i),
            format!("127.0.0.{}", 11 + 2 * i),
        ];
        job.set_hosts(&[
            "127.0.0.2:2",
            &format!("{}:1", pair[0]),
            &format!("{}:1", pair[1]),
        ]);
        let deadline = Instant::now() + Duration::from_secs(60);
        let round = loop {
            if let Some((r, size)) = last_round_complete(&job.err_tail(), last_round) {
                if size == 4 {
                    break r;
                }
                last_round = r;
            }
            assert!(
                Instant::now() < deadline,
                "iteration {i}: no round of 4 formed:\n{}",
                job.err_tail()
            );
            thread::sleep(Duration::from_millis(2));
        };
        last_round = round;
        let pick = usize::from(random(2) == 1);
        let (victim_host, survivor_host) = (&pair[pick], &pair[1 - pick]);
        let workers = job.workers();
        let on = |host: &str| {
            workers
                .iter()
                .find(|w| w.2 == host)
                .map(|w| (w.0, w.1))
                .expect("the new worker's process")
        };
        let (victim, victim_id) = on(victim_host);
        let (_, survivor) = on(survivor_host);
        let delay = Duration::from_millis(random(250));
        thread::sleep(delay);
        signal(victim, Signal::SIGKILL);
        let killed = Instant::now();
        // The other new worker's first step at size 3 is training resumed without the victim
        // (no line of it can predate this iteration).
        let resumed = job.wait_for(
            &format!("iteration {i}: training at size 3 after the kill"),
            |l| l.worker == survivor && l.v["event"] == "step" && l.v["size"] == 3,
        );
        last_step = resumed.v["step"].as_u64().unwrap_or(0);
        let took = killed.elapsed();
        let connected = job
            .seen
            .iter()
            .any(|l| l.worker == survivor && l.v["event"] == "step" && l.v["size"] == 4);
        during_connect += u64::from(!connected);
        eprintln!(
            "iteration {i}: round {round}, killed the worker on {victim_host} {delay:?} after the \
             round completed ({}); training resumed at size 3 {took:?} after the kill",
            if connected {
                "it had trained at size 4"
            } else {
                "before the round trained"
            }
        );
        assert!(
            took < RECOVERY_LIMIT,
            "iteration {i}: training resumed {took:?} after the kill (start timeout 30 s):\n{}",
            job.err_tail()
        );
        took_all.push(took);
        // From the driver's log: the death seen, to the round re-run without the victim.
        let err = job.err_tail();
        let at = |what: &str| {
            err.lines()
                .filter(|l| l.contains(what))
                .filter_map(log_seconds)
                .next_back()
        };
        if let (Some(failed), Some(rerun)) = (
            at(&format!("worker failed worker={victim_id} ")),
            last_round_complete(&err, round).and_then(|(r, _)| at(&format!("round={r} "))),
        ) {
            eprintln!(
                "iteration {i}: the driver saw the death and completed the next round {:.1} ms \
                 later",
                (rerun - failed) * 1e3
            );
        }
    }
    took_all.sort();
    eprintln!(
        "training resumed after a kill: min {:?}, median {:?}, max {:?}",
        took_all[0],
        took_all[took_all.len() / 2],
        took_all[took_all.len() - 1]
    );
    assert!(
        took_all.len() >= 3 && during_connect * 3 >= took_all.len() as u64,
        "{} iterations, {during_connect} kills while the round connected",
        took_all.len()
    );
    let (code, err, lines) = job.finish();
    assert_eq!(code, 0, "{err}");
    assert_eq!(check_counter(&lines, STEPS), 3);
    assert!(
        !err.contains("did not join the round in time"),
        "a survivor stalled:\n{err}"
    );
}

/// A connection to the driver's rendezvous, as an intruder holds it.
struct Intruder {
    w: std::net::TcpStream,
    r: BufReader<std::net::TcpStream>,
    wrote: Vec<Vec<u8>>,
}

impl Intruder {
    fn connect(addr: &str) -> Self {
        let w = std::net::TcpStream::connect(addr).expect("the driver's rendezvous");
        w.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        let r = BufReader::new(w.try_clone().unwrap());
        Self {
            w,
            r,
            wrote: Vec::new(),
        }
    }

    fn local(&self) -> String {
        self.w.local_addr().unwrap().to_string()
    }

    fn write(&mut self, line: &[u8]) {
        self.wrote.push(line.to_vec());
        std::io::Write::write_all(&mut self.w, line).unwrap();
    }

    /// The next line; empty once the driver closed the connection.
    fn line(&mut self) -> Vec<u8> {
        let mut buf = Vec::new();
        let _ = self.r.read_until(b'\n', &mut buf);
        buf
    }

    /// The handshake with `secret`: the session's halves, or why it failed.
    fn handshake(
        &mut self,
        secret: &str,
    ) -> Result<(hvd_rendezvous::Sealer, hvd_rendezvous::Opener), hvd_rendezvous::ProtocolError>
    {
        let (dialer, hello) = hvd_rendezvous::DialerAuth::start(secret)?;
        self.write(&hello);
        let challenge = self.line();
        let (proof, session) = dialer.finish(&challenge)?;
        self.write(&proof);
        Ok(session.split())
    }

    /// The reason of the refusal the driver answers with (sealed or not), or `None` when it
    /// closed the connection without one.
    fn refusal(&mut self, opener: Option<&mut hvd_rendezvous::Opener>) -> Option<String> {
        use hvd_rendezvous::{AuthMsg, DriverMsg, ProtocolError, decode_line, open_line};
        let line = self.line();
        if line.is_empty() {
            return None;
        }
        match opener {
            Some(o) => match open_line::<DriverMsg>(o, &line) {
                Ok(DriverMsg::Refused { reason }) | Err(ProtocolError::Refused(reason)) => {
                    Some(reason)
                }
                other => panic!("expected a refusal, got {other:?}"),
            },
            None => match decode_line::<AuthMsg>(&line) {
                Ok(AuthMsg::Refused { reason }) => Some(reason),
                other => panic!("expected a refusal, got {other:?}"),
            },
        }
    }
}

/// Intruders at a running job's rendezvous: another job's secret, a recorded handshake
/// replayed, a tampered registration, a line sealed for another connection. Each is refused
/// and logged with its address, and the job trains on at its size, losing no step.
#[test]
fn intruders_at_the_rendezvous_are_refused_and_the_job_is_unharmed() {
    use hvd_rendezvous::{WorkerMsg, encode_line, seal_line};
    let counter = &["--steps", "300", "--commit-every", "5", "--step-ms", "10"];
    let mut job = Job::start("intruders", HOSTS2, &["-np", "4", "--min-np", "4"], counter);
    job.wait_step(10, 4);
    let (addr, secret) = rendezvous_of(job.pid_of_rank(1));
    let mut refused = Vec::new();

    // Another job's secret: the driver's proof fails the intruder's check; a proof sent
    // anyway is refused.
    let mut other = Intruder::connect(&addr);
    assert!(other.handshake("another job's secret").is_err());
    let forged = hvd_rendezvous::AuthMsg::Proof {
        proof: "5a".repeat(32),
    };
    other.write(&encode_line(&forged).unwrap());
    let why = other.refusal(None).expect("a refusal");
    assert!(why.contains("wrong job secret"), "{why}");
    refused.push(other.local());

    // A handshake recorded from a genuine connection, replayed on a new one.
    let mut genuine = Intruder::connect(&addr);
    let (mut sealer, _) = genuine.handshake(&secret).expect("the right secret");
    let mut replay = Intruder::connect(&addr);
    replay.write(&genuine.wrote[0]);
    let _challenge = replay.line();
    replay.write(&genuine.wrote[1]);
    let why = replay.refusal(None).expect("a refusal");
    assert!(why.contains("wrong job secret"), "{why}");
    refused.push(replay.local());

    // A registration sealed for the genuine connection, sent on another authenticated one.
    let reg = WorkerMsg::Register {
        worker: 1,
        addr: "127.0.0.9:1".into(),
        host: "127.0.0.9".into(),
        pid: 1,
        resume: None,
    };
    let foreign = seal_line(&mut sealer, &reg).unwrap();
    let mut third = Intruder::connect(&addr);
    let (_, mut opener) = third.handshake(&secret).unwrap();
    third.write(&foreign);
    let why = third.refusal(Some(&mut opener)).expect("a refusal");
    assert!(why.contains("failed its check"), "{why}");
    refused.push(third.local());

    // A registration tampered with on its way (it would have taken worker 1's place).
    let mut fourth = Intruder::connect(&addr);
    let (mut sealer, mut opener) = fourth.handshake(&secret).unwrap();
    let line = String::from_utf8(seal_line(&mut sealer, &reg).unwrap()).unwrap();
    fourth.write(line.replace("127.0.0.9", "127.0.0.8").as_bytes());
    let why = fourth.refusal(Some(&mut opener)).expect("a refusal");
    assert!(why.contains("failed its check"), "{why}");
    refused.push(fourth.local());
    drop(genuine);

    // The first refusal of each reason from this address is logged with the intruder's
    // address; the second of each (the replay, the tampered registration) is counted in the
    // summary that follows within a few seconds.
    let deadline = Instant::now() + Duration::from_secs(15);
    let wanted = [
        refused[0].clone(),
        refused[2].clone(),
        "reason=\"wrong_secret\" refused=1".to_string(),
        "reason=\"bad_registration\" refused=1".to_string(),
    ];
    for want in &wanted {
        while !job.err_tail().lines().any(|l| l.contains(want.as_str())) {
            assert!(
                Instant::now() < deadline,
                "{want} was not logged:\n{}",
                job.err_tail()
            );
            thread::sleep(Duration::from_millis(20));
        }
        let logged = job.wait_stderr(want);
        assert!(logged.contains("refused"), "{logged}");
    }
    for peer in [&refused[1], &refused[3]] {
        assert!(
            !job.err_tail().contains(peer.as_str()),
            "{peer} logged one by one"
        );
    }
    let (code, err, lines) = job.finish();
    assert_eq!(code, 0, "{err}");
    assert_eq!(check_counter(&lines, 300), 4, "the job kept its size");
    assert_eq!(steps_rerun(&lines), 0, "no reset: {err}");
    assert!(!err.contains("worker failed"), "{err}");
}

/// An elastic job of `elastic_counter` whose worker on 127.0.0.3 exits 0 at once, before it
/// ever joins a round; discovery first lists `hosts`.
fn exits_0_on_one_host(name: &str, hosts: &[&str], flags: &[&str], counter: &[&str]) -> Job {
    let dir = scratch(name);
    std::fs::write(dir.join("hosts"), hosts.join("\n") + "\n").unwrap();
    let worker = dir.join("worker.sh");
    std::fs::write(
        &worker,
        format!(
            "#!/bin/sh\nif [ \"$HOROVOD_HOSTNAME\" = 127.0.0.3 ]; then exit 0; fi\nexec {} \"$@\"\n",
            example("elastic_counter")
        ),
    )
    .unwrap();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_horovodrun"));
    cmd.args(flags)
        .arg("--host-discovery-script")
        .arg(dir.join("discover.sh"))
        .args(["--discovery-interval", "0.2", "sh"])
        .arg(&worker)
        .args(counter);
    Job::spawn(dir, cmd)
}

#[test]
fn a_new_worker_exiting_0_before_it_joins_is_finished_not_failed() {
    let counter = &["--steps", "500", "--commit-every", "5", "--step-ms", "10"];
    let flags = &["-np", "2", "--min-np", "1", "--max-np", "3"];
    let mut job = exits_0_on_one_host("exit0-new", &["127.0.0.2:2"], flags, counter);
    job.wait_step(20, 2);
    job.set_hosts(&["127.0.0.2:2", "127.0.0.3:1"]);
    job.wait_stderr("exited 0 before it joined a round");
    let (code, err, lines) = job.finish();
    assert_eq!(code, 0, "{err}");
    assert_eq!(check_counter(&lines, 500), 2, "the round went on as it was");
    assert!(!err.contains("blacklisted"), "{err}");
    assert!(!err.contains("worker failed"), "{err}");
}

#[test]
fn a_worker_exiting_0_before_the_first_round_ends_the_job_without_blacklisting() {
    // The worker on 127.0.0.2 waits for a first round that can't form as planned: a job one
    // of whose workers finished can't recover, so it ends, naming both.
    let flags = &["-np", "2", "--min-np", "1"];
    let hosts = &["127.0.0.2:1", "127.0.0.3:1"];
    let job = exits_0_on_one_host("exit0-first", hosts, flags, COUNTER);
    let (code, err, _) = job.finish();
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("on 127.0.0.2 waits for a round, but worker")
            && err.contains("on 127.0.0.3 exited 0 before it joined one"),
        "{err}"
    );
    assert!(!err.contains("blacklisted"), "{err}");
}
