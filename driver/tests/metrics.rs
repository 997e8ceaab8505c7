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

/// The sum of every `hvd_refused_connections_total` series of `service`.
fn refused(text: &str, service: &str) -> f64 {
    let prefix = format!("hvd_refused_connections_total{{service=\"{service}\",");
    text.lines()
        .filter(|l| l.starts_with(&prefix))
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
        .sum()
}

/// A flood of strangers at a running job's rendezvous, bounded (a few seconds of 100 idle
/// connections and 6 threads sending garbage, on loopback) while a worker is killed: the job
/// recovers and finishes exactly; the driver logs the first refusal of each reason from the
/// address and then counts per reason, a handful of lines instead of one per connection, and
/// `/metrics` counts every refusal by reason.
#[test]
fn a_flood_of_strangers_is_counted_not_logged_one_by_one() {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    promtool::promtool();
    let mut job = Job::start(
        "flood",
        &["127.0.0.2:2", "127.0.0.3:2"],
        &["-np", "4", "--min-np", "2", "--status-port", "0"],
        &["--steps", "500", "--commit-every", "5", "--step-ms", "10"],
    );
    let port = job.status_port();
    job.wait_step(10, 4);
    let (addr, _) = support::rendezvous_of(job.pid_of_rank(1));
    let stop = AtomicBool::new(false);
    let sent = AtomicU64::new(0);
    let idle: Vec<std::net::TcpStream> = (0..100)
        .map(|_| std::net::TcpStream::connect(&addr).expect("an idle connection"))
        .collect();
    std::thread::scope(|s| {
        for _ in 0..6 {
            s.spawn(|| {
                // At most 400 connections a thread: the flood is bounded whatever the speed.
                for _ in 0..400 {
                    if stop.load(Ordering::SeqCst) {
                        break;
                    }
                    let Ok(mut c) = std::net::TcpStream::connect(&addr) else {
                        continue;
                    };
                    let _ = c.set_read_timeout(Some(Duration::from_secs(5)));
                    let _ = c.write_all(b"GET / HTTP/1.0\r\n\r\n");
                    let _ = c.read_to_end(&mut Vec::new());
                    sent.fetch_add(1, Ordering::SeqCst);
                }
            });
        }
        std::thread::sleep(Duration::from_secs(2));
        signal(job.pids_on("127.0.0.3")[0], Signal::SIGKILL);
        std::thread::sleep(Duration::from_secs(2));
        stop.store(true, Ordering::SeqCst);
    });
    drop(idle);
    let garbage = sent.load(Ordering::SeqCst) as f64;
    assert!(
        garbage >= 50.0,
        "only {garbage} garbage connections were made"
    );
    // Every garbage sender and every idle connection is counted.
    let scraped = scrape_until(port, |m| refused(m, "rendezvous") >= garbage + 100.0);
    promtool::assert_clean(&scraped);
    let not_hello = "hvd_refused_connections_total{service=\"rendezvous\",reason=\"not_hello\"}";
    // A garbage sender whose connection broke before its line arrived counts as silent.
    let hellos = value(&scraped, not_hello);
    assert!(
        hellos <= garbage && hellos >= garbage * 0.9,
        "{garbage} sent:\n{scraped}"
    );
    // And summarized in the log within the interval.
    job.wait_stderr("rendezvous connections refused since the last count");
    let (code, err, lines) = job.finish();
    assert_eq!(code, 0, "{err}");
    assert_eq!(check_counter(&lines, 500), 2);
    let one_by_one = err.matches("rendezvous connection refused").count();
    let counted = err
        .matches("rendezvous connections refused since the last count")
        .count();
    eprintln!(
        "flood: {garbage} garbage and 100 idle connections refused; {one_by_one} lines for \
         single refusals, {counted} count lines"
    );
    assert!(
        one_by_one <= 4,
        "{one_by_one} refusals logged one by one for {garbage} garbage connections:\n{err}"
    );
    assert!(counted <= 12, "{counted} count lines:\n{err}");
}
