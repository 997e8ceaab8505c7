//! The driver's `GET /metrics` over a real job: the exposition passes `promtool check
//! metrics`, and its counters move as the job loses a worker and gains a host.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test that cannot set up fails loudly

#[path = "support/promtool.rs"]
mod promtool;
mod support;

use std::io::{Read, Write};
use std::time::Duration;

use nix::sys::signal::Signal;
use support::{Job, check_counter, signal};

/// The body of `GET path` on `port`, which must answer 200.
fn get(port: u16, path: &str) -> String {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(s, "GET {path} HTTP/1.1\r\nHost: localhost\r\n\r\n").unwrap();
    let mut resp = String::new();
    s.read_to_string(&mut resp)
        .expect("an answer, then the connection closed");
    let (head, body) = resp.split_once("\r\n\r\n").expect("a head");
    assert!(head.starts_with("HTTP/1.1 200 "), "{head}");
    body.to_string()
}

/// The value of `series` (name and labels) in an exposition.
fn value(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .unwrap_or_else(|| panic!("no {series} in\n{text}"))
        .parse()
        .unwrap()
}

/// Scrapes `/metrics` on `port` until `done` holds of it (for up to 60 s); returns that scrape.
fn scrape_until(port: u16, done: impl Fn(&str) -> bool) -> String {
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let m = get(port, "/metrics");
        if done(&m) {
            return m;
        }
        assert!(std::time::Instant::now() < deadline, "never came:\n{m}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn counters_move_as_the_job_rescales_and_promtool_passes_every_scrape() {
    // Installed (once) before the job starts, which must still be training when it is killed.
    promtool::promtool();
    let mut job = Job::start(
        "metrics",
        &["127.0.0.2:2", "127.0.0.3:2"],
        &[
            "-np",
            "4",
            "--min-np",
            "2",
            "--max-np",
            "4",
            "--status-port",
            "0",
            "--heartbeat-timeout",
            "2",
        ],
        &["--steps", "1000", "--commit-every", "5", "--step-ms", "10"],
    );
    let port = job.status_port();
    job.wait_step(20, 4);
    let before = get(port, "/metrics");
    promtool::assert_clean(&before);
    assert_eq!(value(&before, "hvd_generation"), 1.0);
    assert_eq!(value(&before, "hvd_workers"), 4.0);
    assert_eq!(value(&before, "hvd_hosts"), 2.0);
    assert_eq!(value(&before, "hvd_job_phase{phase=\"Running\"}"), 1.0);
    assert_eq!(value(&before, "hvd_resets_total"), 0.0);
    assert_eq!(value(&before, "hvd_round_duration_seconds_count"), 1.0);
    assert!(value(&before, "hvd_discovery_runs_total") >= 1.0);
    assert!(value(&before, "hvd_discovery_duration_seconds_count") >= 1.0);

    // Rank 0's rates, reported with its answers to the pings (every half second here).
    let rates = scrape_until(port, |m| {
        [
            "hvd_training_steps_per_second",
            "hvd_allreduces_per_second",
            "hvd_allreduce_bytes_per_second",
        ]
        .iter()
        .all(|rate| value(m, rate) > 0.0)
    });
    promtool::assert_clean(&rates);
    // A commit every 5 steps of 10 ms: at most 20 a second; an allreduce every step.
    let steps = value(&rates, "hvd_training_steps_per_second");
    assert!(steps <= 25.0, "{steps} commits a second");
    assert!(
        value(&rates, "hvd_allreduces_per_second") >= steps,
        "{rates}"
    );

    // A worker killed: a failure, a blacklisted host, a recovery and a round of two.
    signal(job.pids_on("127.0.0.3")[0], Signal::SIGKILL);
    job.wait_step(1, 2);
    let failed = get(port, "/metrics");
    promtool::assert_clean(&failed);
    assert_eq!(value(&failed, "hvd_generation"), 2.0);
    assert_eq!(value(&failed, "hvd_workers"), 2.0);
    assert_eq!(value(&failed, "hvd_resets_total"), 1.0);
    assert_eq!(value(&failed, "hvd_round_duration_seconds_count"), 2.0);
    assert_eq!(value(&failed, "hvd_recovery_duration_seconds_count"), 1.0);
    assert!(value(&failed, "hvd_worker_failures_total") >= 1.0);
    assert_eq!(value(&failed, "hvd_blacklisted_hosts"), 1.0);

    // A host added: a round of four again, without a failure.
    job.set_hosts(&["127.0.0.2:2", "127.0.0.3:2", "127.0.0.4:2"]);
    // Lines of the first round may still be unread: the driver's own word is awaited.
    let grown = scrape_until(port, |m| {
        value(m, "hvd_generation") >= 3.0 && value(m, "hvd_job_phase{phase=\"Running\"}") == 1.0
    });
    promtool::assert_clean(&grown);
    assert_eq!(value(&grown, "hvd_generation"), 3.0);
    assert_eq!(value(&grown, "hvd_workers"), 4.0);
    assert_eq!(value(&grown, "hvd_hosts"), 2.0);
    assert_eq!(value(&grown, "hvd_resets_total"), 2.0);
    assert_eq!(value(&grown, "hvd_round_duration_seconds_count"), 3.0);
    assert_eq!(value(&grown, "hvd_recovery_duration_seconds_count"), 1.0);
    assert_eq!(value(&grown, "hvd_driver_failovers_total"), 0.0);
    // The new host came from a discovery run.
    assert!(value(&grown, "hvd_discovery_runs_total") > value(&before, "hvd_discovery_runs_total"));
    let (code, err, lines) = job.finish();
    assert_eq!(code, 0, "{err}");
    assert_eq!(check_counter(&lines, 1000), 4);
}
