//! Notices end to end: a host that is going away leaves the job gracefully. Real
//! `elastic_counter` workers on 127.0.0.x "hosts" get a SIGTERM (as a drained node, an evicted
//! pod or systemd would send it); the driver takes the host out without a rollback or a
//! blacklisting, the worker exits 0 once the round without it formed, and the counter proves
//! that no committed step was lost or applied twice. A second SIGTERM, the grace running out,
//! and the launcher's own SIGTERM end a worker at once.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test that cannot set up fails loudly

mod support;

use std::thread;
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use support::{Job, alive, check_counter, http_get, running_after, signal, steps_rerun};

const HOSTS2: &[&str] = &["127.0.0.2:2", "127.0.0.3:2"];
const COUNTER: &[&str] = &["--steps", "300", "--commit-every", "5", "--step-ms", "10"];

#[test]
fn a_sigterm_takes_the_workers_host_out_gracefully_and_rolls_nothing_back() {
    let mut job = Job::start(
        "notice-sigterm",
        HOSTS2,
        &["-np", "4", "--min-np", "2", "--status-port", "0"],
        COUNTER,
    );
    let port = job.status_port();
    job.wait_step(20, 4);
    let leaving = job.pids_on("127.0.0.3");
    assert_eq!(leaving.len(), 2, "{:?}", job.workers());
    let t = Instant::now();
    signal(leaving[0], Signal::SIGTERM);
    let first = job.wait_step(1, 2);
    let out = first.at.saturating_duration_since(t);
    eprintln!("SIGTERM → training at size 2 without 127.0.0.3 after {out:?}");
    assert!(
        running_after(&leaving, Duration::from_secs(10)).is_empty(),
        "the noticed host's workers exit once the round without them formed"
    );
    let (_, metrics) = http_get(port, "GET", "/metrics");
    let (code, err, lines) = job.finish();
    assert_eq!(code, 0, "{err}");
    assert_eq!(check_counter(&lines, 300), 2);
    assert_eq!(steps_rerun(&lines), 0, "a notice rolls nothing back");
    assert!(
        err.contains("host gave notice") && err.contains("source=sigterm"),
        "the log names the source: {err}"
    );
    assert!(err.contains("deadline_s=30"), "and the deadline: {err}");
    assert!(
        err.contains("SIGTERM: leaving the job gracefully"),
        "the worker says what it does: {err}"
    );
    assert_eq!(
        err.matches("removed from the job").count(),
        2,
        "both workers of the host were let go: {err}"
    );
    assert!(!err.contains("worker failed"), "nothing failed: {err}");
    assert!(
        !err.contains("host blacklisted"),
        "a notice blacklists nothing: {err}"
    );
    assert!(
        metrics.contains("hvd_preemption_notices_total{source=\"sigterm\"} 1"),
        "{metrics}"
    );
    assert!(metrics.contains("hvd_worker_failures_total 0"), "{metrics}");
}

#[test]
fn a_second_sigterm_ends_the_worker_at_once() {
    // Without 127.0.0.3 the job is below --min-np, so it never lets the worker go: only the
    // second SIGTERM ends it, long before its 30 s grace.
    let mut job = Job::start(
        "notice-twice",
        HOSTS2,
        &["-np", "4", "--min-np", "4", "--elastic-timeout", "3"],
        &[
            "--steps",
            "100000",
            "--commit-every",
            "5",
            "--step-ms",
            "10",
        ],
    );
    job.wait_step(20, 4);
    let victim = job.pid_of_rank(3);
    signal(victim, Signal::SIGTERM);
    job.wait_stderr("worker gave notice");
    thread::sleep(Duration::from_millis(300));
    assert!(alive(victim), "the first SIGTERM is a notice, not an end");
    signal(victim, Signal::SIGTERM);
    assert!(
        running_after(&[victim], Duration::from_secs(2)).is_empty(),
        "the second SIGTERM ends it at once"
    );
    let (code, err, _) = job.finish();
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("SIGTERM again: ending now"), "{err}");
    assert!(err.contains("was killed by signal 15 (SIGTERM)"), "{err}");
}

#[test]
fn a_worker_the_job_cannot_let_go_ends_when_its_grace_runs_out() {
    // Without 127.0.0.3 the job is below --min-np: the worker is never let go, and ends when
    // its grace (HVD_NOTICE_GRACE) runs out, as SIGTERM's default would.
    let dir = support::scratch("notice-grace");
    let mut job = Job::start_env(
        dir,
        HOSTS2,
        &["-np", "4", "--min-np", "4", "--elastic-timeout", "4"],
        "elastic_counter",
        &[
            "--steps",
            "100000",
            "--commit-every",
            "5",
            "--step-ms",
            "10",
        ],
        &[("HVD_NOTICE_GRACE", "1.5")],
    );
    job.wait_step(20, 4);
    let victim = job.pid_of_rank(3);
    let t = Instant::now();
    signal(victim, Signal::SIGTERM);
    assert!(
        running_after(&[victim], Duration::from_secs(10)).is_empty(),
        "the grace ran out"
    );
    let took = t.elapsed();
    assert!(
        took >= Duration::from_millis(1500),
        "ended before its grace: {took:?}"
    );
    let (code, err, _) = job.finish();
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("grace ran out before the job let this worker go"),
        "{err}"
    );
    assert!(err.contains("waiting for enough slots"), "{err}");
}

#[test]
fn the_launchers_sigterm_stops_elastic_workers_at_once() {
    let mut job = Job::start(
        "notice-launcher",
        HOSTS2,
        &["-np", "4", "--min-np", "2"],
        &[
            "--steps",
            "100000",
            "--commit-every",
            "5",
            "--step-ms",
            "10",
        ],
    );
    job.wait_step(20, 4);
    let pids: Vec<i32> = job.workers().iter().map(|w| w.0).collect();
    let t = Instant::now();
    signal(job.child.id() as i32, Signal::SIGINT);
    let left = running_after(&pids, Duration::from_secs(5));
    let took = t.elapsed();
    let (code, err, _) = job.finish();
    assert!(left.is_empty(), "still running: {left:?}\n{err}");
    assert_eq!(code, 130, "{err}");
    assert!(
        took < Duration::from_millis(900),
        "the driver's SIGTERM is a stop, not a notice: the workers took {took:?}\n{err}"
    );
    assert!(!err.contains("gave notice"), "{err}");
}
