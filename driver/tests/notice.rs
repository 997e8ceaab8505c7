//! Notices end to end: a host that is going away leaves the job gracefully. Real
//! `elastic_counter` workers on 127.0.0.x "hosts" get a SIGTERM (as a drained node, an evicted
//! pod or systemd would send it); the driver takes the host out without a rollback or a
//! blacklisting, the worker exits 0 once the round without it formed, and the counter proves
//! that no committed step was lost or applied twice. A second SIGTERM, the grace running out,
//! and the launcher's own SIGTERM end a worker at once.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test that cannot set up fails loudly

mod support;

use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::sync::{Arc, Mutex};
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

/// A cloud's metadata server on loopback, answering as its documentation shows: nothing to
/// report, until [`FakeCloud::preempt`] names a host, whose workers (the User-Agent names their
/// host) then read a notice.
struct FakeCloud {
    base: String,
    preempted: Arc<Mutex<Option<String>>>,
}

impl FakeCloud {
    /// GCE's (`Metadata-Flavor: Google` both ways) or AWS's (an IMDSv2 token first).
    fn start(cloud: &'static str) -> Self {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let base = format!("http://{}", l.local_addr().unwrap());
        let preempted: Arc<Mutex<Option<String>>> = Arc::default();
        let p = Arc::clone(&preempted);
        thread::spawn(move || {
            for s in l.incoming().flatten() {
                let p = Arc::clone(&p);
                thread::spawn(move || {
                    let mut r = BufReader::new(s.try_clone().unwrap());
                    let mut head = Vec::new();
                    loop {
                        let mut line = String::new();
                        if r.read_line(&mut line).unwrap_or(0) == 0 || line.trim().is_empty() {
                            break;
                        }
                        head.push(line.trim().to_string());
                    }
                    let Some(request) = head.first() else { return };
                    let has = |h: &str| head.iter().any(|l| l.eq_ignore_ascii_case(h));
                    let host = head
                        .iter()
                        .find_map(|l| l.split_once("(host ").map(|(_, h)| h.trim_end_matches(')')))
                        .unwrap_or_default();
                    let noticed = p.lock().unwrap().as_deref() == Some(host);
                    let (status, extra, body) = match (cloud, request.as_str()) {
                        ("gce", r)
                            if r.starts_with("GET /computeMetadata/v1/instance/preempted ") =>
                        {
                            if has("metadata-flavor: google") {
                                let b = if noticed { "TRUE" } else { "FALSE" };
                                (200, "Metadata-Flavor: Google\r\n", b.to_string())
                            } else {
                                (403, "", "Missing Metadata-Flavor:Google header.".into())
                            }
                        }
                        ("aws", r) if r.starts_with("PUT /latest/api/token ") => {
                            (200, "", "AQAEAtoken==".to_string())
                        }
                        ("aws", _) if !has("x-aws-ec2-metadata-token: AQAEAtoken==") => {
                            (401, "", String::new())
                        }
                        ("aws", r)
                            if r.starts_with("GET /latest/meta-data/spot/instance-action ")
                                && noticed =>
                        {
                            let at = support::rfc3339_in(Duration::from_secs(120));
                            (
                                200,
                                "",
                                format!(r#"{{"action": "terminate", "time": "{at}"}}"#),
                            )
                        }
                        _ => (404, "", "Not Found".to_string()),
                    };
                    let mut s = s;
                    let _ = write!(
                        s,
                        "HTTP/1.1 {status} X\r\n{extra}Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
                        body.len()
                    );
                });
            }
        });
        Self { base, preempted }
    }

    fn preempt(&self, host: &str) {
        *self.preempted.lock().unwrap() = Some(host.to_string());
    }
}

/// The counter's job with the notice checks every notice test makes: the host left at
/// size 2 with nothing rolled back, failed or blacklisted, the log naming the source.
/// `deadline` bounds the deadline in seconds the driver logged with the notice.
fn assert_left_gracefully(job: Job, source: &str, deadline: std::ops::RangeInclusive<f64>) {
    let (code, err, lines) = job.finish();
    assert_eq!(code, 0, "{err}");
    assert_eq!(check_counter(&lines, 300), 2);
    assert_eq!(steps_rerun(&lines), 0, "a notice rolls nothing back");
    assert!(
        err.contains("host gave notice") && err.contains(&format!("source={source}")),
        "the log names the source: {err}"
    );
    let logged: f64 = err
        .lines()
        .find(|l| l.contains("host gave notice"))
        .and_then(|l| l.split("deadline_s=").nth(1))
        .and_then(|d| d.split_whitespace().next())
        .and_then(|d| d.parse().ok())
        .unwrap_or_else(|| panic!("no deadline logged with the notice: {err}"));
    assert!(
        deadline.contains(&logged),
        "deadline {logged} s, not in {deadline:?}: {err}"
    );
    assert!(
        err.contains("preemption notice: leaving the job gracefully"),
        "{err}"
    );
    assert!(!err.contains("worker failed"), "nothing failed: {err}");
    assert!(!err.contains("host blacklisted"), "{err}");
}

#[test]
fn a_gce_preemption_notice_takes_its_host_out_gracefully() {
    let cloud = FakeCloud::start("gce");
    let mut job = Job::start_env(
        support::scratch("notice-gce"),
        HOSTS2,
        &["-np", "4", "--min-np", "2", "--preemption-watch", "gce"],
        "elastic_counter",
        COUNTER,
        &[
            ("HVD_METADATA_ENDPOINT", &cloud.base),
            ("HVD_PREEMPTION_POLL", "0.1"),
        ],
    );
    job.wait_step(20, 4);
    let t = Instant::now();
    cloud.preempt("127.0.0.3");
    let first = job.wait_step(1, 2);
    eprintln!(
        "GCE notice → training at size 2 after {:?} (polled every 100 ms)",
        first.at.saturating_duration_since(t)
    );
    assert_left_gracefully(job, "gce", 30.0..=30.0);
}

#[test]
fn an_aws_notice_read_under_an_agent_takes_its_host_out_gracefully() {
    let cloud = FakeCloud::start("aws");
    let secret = format!("notice-aws-{}", std::process::id());
    let env = [
        ("HVD_METADATA_ENDPOINT", cloud.base.as_str()),
        ("HVD_PREEMPTION_POLL", "0.1"),
    ];
    let (agents, port) = support::agents_with(
        &["127.0.0.2", "127.0.0.3"],
        &secret,
        &["--preemption-watch", "aws"],
        &env,
    );
    let port = port.to_string();
    let mut job = Job::start_env(
        support::scratch("notice-aws"),
        HOSTS2,
        &[
            "--launcher",
            "agent",
            "--agent-port",
            &port,
            "-np",
            "4",
            "--min-np",
            "2",
        ],
        "elastic_counter",
        COUNTER,
        &[("HVD_AGENT_SECRET", &secret)],
    );
    job.parents = agents.iter().map(support::Agent::pid).collect();
    job.wait_step(20, 4);
    cloud.preempt("127.0.0.3");
    job.wait_step(1, 2);
    // AWS's two minutes, less the moments the notice took to be read.
    assert_left_gracefully(job, "aws", 100.0..=120.0);
}

#[test]
fn a_static_job_refuses_to_watch_for_preemption() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_horovodrun"))
        .args([
            "-np",
            "1",
            "-H",
            "127.0.0.2:1",
            "--preemption-watch",
            "gce",
            "true",
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_ne!(out.status.code(), Some(0), "{err}");
    assert!(
        err.contains("--preemption-watch apply to elastic jobs"),
        "{err}"
    );
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_horovodrun"))
        .args([
            "-np",
            "1",
            "--min-np",
            "1",
            "-H",
            "127.0.0.2:1",
            "--preemption-watch",
            "ibm",
            "true",
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(64), "{err}");
    assert!(err.contains("'ibm' is not a cloud hvd watches"), "{err}");
}
