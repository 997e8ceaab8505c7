//! A driver with no single point of failure, against a real etcd (Debian's `etcd-server`,
//! installed on first use; each test starts its own on free ports): the store's flags checked
//! before anything starts, an unreachable store named, a second driver refused while one is
//! active, a standby adopting the workers of a driver killed in steady training (no committed
//! step lost, training on while no driver is up), and workers whose driver never returns
//! exiting after the grace.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test that cannot set up fails loudly

#[path = "../../store/tests/support/etcd.rs"]
mod etcd;
mod support;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use etcd::Etcd;
use nix::sys::signal::Signal;
use support::{Job, Line, check_counter, example, running_after, scratch, signal};

const SECRET: &str = "failover-test-secret";

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The flags of a job (of 4 slots, 2 at least, unless `extra` sets -np) with its state in
/// `etcd` under `prefix`, its rendezvous on `port`.
fn store_flags(etcd: &Etcd, prefix: &str, port: u16, extra: &[&str]) -> Vec<String> {
    let sizes: &[&str] = if extra.contains(&"-np") {
        &[]
    } else {
        &["-np", "4", "--min-np", "2"]
    };
    let mut f: Vec<String> = extra.iter().chain(sizes).map(|s| s.to_string()).collect();
    f.extend(
        [
            "--state-store",
            &etcd.url(prefix),
            "--rendezvous-port",
            &port.to_string(),
        ]
        .iter()
        .map(|s| s.to_string()),
    );
    if !extra.contains(&"--state-store-ttl") {
        f.extend(["--state-store-ttl".to_string(), "2".to_string()]);
    }
    f
}

/// `horovodrun <flags> --host-discovery-script <dir>/discover.sh … elastic_counter <args>`.
fn horovodrun(dir: &Path, flags: &[String], counter: &[&str]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_horovodrun"));
    cmd.args(flags)
        .args(["--host-discovery-script"])
        .arg(dir.join("discover.sh"))
        .args(["--discovery-interval", "0.2"])
        .arg(example("elastic_counter"))
        .args(counter)
        .env("HVD_SECRET", SECRET);
    cmd
}

/// The spool where a job under `prefix` keeps its local workers' output.
fn spool(prefix: &str) -> PathBuf {
    let name: String = format!("/{prefix}")
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect();
    std::env::temp_dir().join(format!("hvd-spool{name}"))
}

fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

fn output(mut cmd: Command) -> (i32, String) {
    let out = cmd
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn the_store_s_flags_are_checked_and_an_unreachable_store_is_named() {
    let dir = scratch("store-flags");
    std::fs::write(dir.join("hosts"), "127.0.0.1:2\n").unwrap();
    let dead = format!("127.0.0.1:{}", free_port());
    let port = free_port().to_string();
    let run = |flags: &[&str], secret: bool| {
        let flags: Vec<String> = flags.iter().map(|s| s.to_string()).collect();
        let mut cmd = horovodrun(&dir, &flags, &["--steps", "5"]);
        if !secret {
            cmd.env_remove("HVD_SECRET");
        }
        cmd.env_remove("HVD_STATE_STORE");
        output(cmd)
    };
    let url = format!("etcd://{dead}/jobs/flags");
    for (flags, secret, says) in [
        (
            vec![
                "-np",
                "2",
                "--min-np",
                "1",
                "--state-store",
                &url,
                "--rendezvous-port",
                &port,
            ],
            false,
            "HVD_SECRET",
        ),
        (
            vec!["-np", "2", "--min-np", "1", "--state-store", &url],
            true,
            "--rendezvous-port",
        ),
        (
            vec!["-np", "2", "--min-np", "1", "--standby"],
            true,
            "--standby needs --state-store",
        ),
        (
            vec![
                "-np",
                "2",
                "--min-np",
                "1",
                "--state-store",
                "http://x:1/p",
                "--rendezvous-port",
                &port,
            ],
            true,
            "etcd://",
        ),
        (
            vec![
                "-np",
                "2",
                "--min-np",
                "1",
                "--state-store",
                &url,
                "--rendezvous-port",
                &port,
            ],
            true,
            &dead,
        ),
    ] {
        let t = Instant::now();
        let (code, err) = run(&flags, secret);
        assert_ne!(code, 0, "{flags:?}: {err}");
        assert!(err.contains(says), "{flags:?} should say {says:?}: {err}");
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "{flags:?} took {:?}",
            t.elapsed()
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// While a driver is active, another one started on the same store is refused with the
/// active one named; the first finishes its job, and the finished job leaves no record.
#[test]
fn a_second_driver_is_refused_while_one_is_active() {
    let e = Etcd::start();
    let prefix = format!("jobs/refused-{}", std::process::id());
    let dir = scratch("store-refused");
    std::fs::write(dir.join("hosts"), "127.0.0.2:2\n127.0.0.3:2\n").unwrap();
    let flags = store_flags(&e, &prefix, free_port(), &[]);
    let counter = ["--steps", "120", "--commit-every", "5", "--step-ms", "20"];
    let mut job = Job::spawn(dir.clone(), horovodrun(&dir, &flags, &counter));
    job.wait_for("training at size 4", |l| {
        l.v["event"] == "step" && l.v["size"] == 4
    });
    let second = scratch("store-refused-2");
    std::fs::copy(dir.join("discover.sh"), second.join("discover.sh")).unwrap();
    std::fs::write(second.join("hosts"), "127.0.0.2:2\n").unwrap();
    let other_port = free_port();
    let other = store_flags(&e, &prefix, other_port, &[]);
    let (code, err) = output(horovodrun(&second, &other, &counter));
    assert_ne!(code, 0, "{err}");
    assert!(
        err.contains("another driver") && err.contains("--standby"),
        "{err}"
    );
    let (code, err, lines) = job.finish();
    assert_eq!(code, 0, "{err}");
    assert_eq!(check_counter(&lines, 120), 4);
    assert!(
        !spool(&prefix).exists(),
        "the finished job left its output spool behind"
    );
    let _ = std::fs::remove_dir_all(&second);
    // The record is gone: a new driver on the prefix starts a new job (it is refused only
    // for its flags, not for a record or a leader left behind).
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let left = rt.block_on(async {
        let url: hvd_store::StoreUrl = e.url(&prefix).parse().unwrap();
        let s = hvd_store::Store::connect(&url, Duration::from_secs(5), None)
            .await
            .unwrap();
        (s.load().await.unwrap(), s.leader().await.unwrap())
    });
    assert_eq!(
        left,
        (None, None),
        "the finished job left its record or leader behind"
    );
}

/// The active driver is SIGKILLed in steady training: the standby takes over within the
/// lease's TTL and a second, every worker is adopted, training never stops meanwhile, and the
/// job finishes with every committed step applied once.
#[test]
fn a_standby_adopts_the_workers_of_a_killed_driver() {
    let e = Etcd::start();
    let prefix = format!("jobs/standby-{}", std::process::id());
    let dir = scratch("store-standby");
    std::fs::write(dir.join("hosts"), "127.0.0.2:2\n127.0.0.3:2\n").unwrap();
    let port = free_port();
    let steps = 400;
    let counter = ["--steps", "400", "--commit-every", "5", "--step-ms", "20"];
    let mut active = Job::spawn(
        dir.clone(),
        horovodrun(&dir, &store_flags(&e, &prefix, port, &[]), &counter),
    );
    let before = active.wait_for("training at size 4", |l| {
        l.v["event"] == "step" && l.v["size"] == 4 && l.v["step"].as_u64() >= Some(40)
    });
    let standby_dir = scratch("store-standby-2");
    let mut standby = Job::spawn(
        standby_dir,
        horovodrun(
            &dir,
            &store_flags(&e, &prefix, port, &["--standby"]),
            &counter,
        ),
    );
    standby.wait_stderr("standing by");
    active.take_available();
    let at_kill = active
        .seen
        .iter()
        .filter_map(|l| l.v["step"].as_u64())
        .max()
        .unwrap_or(0);
    let killed = Instant::now();
    signal(active.child.id() as i32, Signal::SIGKILL);
    let took_over = standby.wait_stderr("taking over the job");
    let mut adopted = Vec::new();
    while adopted.len() < 4 {
        let err = standby.err_tail();
        adopted = err
            .lines()
            .filter(|l| l.contains("adopted a worker"))
            .map(str::to_string)
            .collect();
        assert!(
            killed.elapsed() < Duration::from_secs(20),
            "not every worker was adopted: {err}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let failover = killed.elapsed();
    println!(
        "failover: every worker adopted {failover:?} after the SIGKILL (ttl 2 s); {took_over}"
    );
    assert!(failover <= Duration::from_secs(4), "{failover:?}");
    // Training went on while no driver was up: rank 0's steps (stamped by the counter) show
    // no gap anywhere near the failover's length around it.
    let killed_ms = unix_ms() - killed.elapsed().as_millis() as u64;
    let window = (killed_ms - 1000)..(killed_ms + failover.as_millis() as u64 + 500);
    let end = window.end;
    standby.wait_for("rank 0 stepping past the adoption", |l| {
        l.v["event"] == "step" && l.v["rank"] == 0 && l.v["at_ms"].as_u64() >= Some(end)
    });
    active.take_available();
    let mut at: Vec<u64> = active
        .seen
        .iter()
        .chain(&standby.seen)
        .filter(|l| l.v["event"] == "step" && l.v["rank"] == 0)
        .filter_map(|l| l.v["at_ms"].as_u64())
        .collect();
    at.retain(|t| window.contains(t));
    at.sort_unstable();
    let gap = at.windows(2).map(|w| w[1] - w[0]).max().unwrap_or(u64::MAX);
    println!(
        "steps at the kill: {at_kill}; longest gap between rank 0's steps around the failover: \
         {gap} ms ({} steps at 20 ms)",
        at.len()
    );
    assert!(
        gap < 1000,
        "training paused for {gap} ms during a {failover:?} failover"
    );
    assert!(before.v["step"].as_u64() <= Some(at_kill));
    let (code, err, lines) = standby.finish();
    assert_eq!(code, 0, "{err}");
    let lines = relayed(&mut active, lines);
    assert_eq!(check_counter(&lines, steps), 4);
    assert!(
        !lines.iter().any(|l| l.v["event"] == "reset"),
        "the failover reset the workers"
    );
    assert_every_step_relayed(&lines, steps);
    assert!(
        !spool(&prefix).exists(),
        "the finished job left its output spool behind"
    );
}

/// What both drivers relayed: the active one's lines until its death, then the standby's.
fn relayed(active: &mut Job, standby: Vec<Line>) -> Vec<Line> {
    active.take_available();
    let mut lines = std::mem::take(&mut active.seen);
    lines.extend(standby);
    lines
}

/// Every step of every rank reached the drivers' output (the standby went on relaying where
/// the killed driver stopped, lines written while no driver was up included).
fn assert_every_step_relayed(lines: &[Line], steps: u64) {
    assert_steps_relayed(lines, steps, 0);
}

/// Every step of every rank reached the drivers' output, but for at most `lost` a rank (the
/// lines in flight on a connection when its driver was killed).
fn assert_steps_relayed(lines: &[Line], steps: u64, lost: usize) {
    for rank in 0..4u64 {
        let seen: std::collections::BTreeSet<u64> = lines
            .iter()
            .filter(|l| l.v["event"] == "step" && l.v["rank"] == rank)
            .filter_map(|l| l.v["step"].as_u64())
            .collect();
        let missing: Vec<u64> = (1..=steps).filter(|s| !seen.contains(s)).collect();
        if !missing.is_empty() {
            println!("rank {rank}: steps never relayed: {missing:?}");
        }
        assert!(
            missing.len() <= lost,
            "rank {rank}: steps never relayed: {missing:?}"
        );
    }
}

/// With no driver to take over, the workers of a killed driver train on for --driver-grace,
/// then exit, saying why; nothing is left running.
#[test]
fn workers_whose_driver_never_returns_exit_after_the_grace() {
    let e = Etcd::start();
    let prefix = format!("jobs/grace-{}", std::process::id());
    let dir = scratch("store-grace");
    std::fs::write(dir.join("hosts"), "127.0.0.2:2\n").unwrap();
    let flags = store_flags(
        &e,
        &prefix,
        free_port(),
        &["-np", "2", "--min-np", "1", "--driver-grace", "2"],
    );
    let mut job = Job::spawn(
        dir.clone(),
        horovodrun(&dir, &flags, &["--steps", "100000", "--step-ms", "20"]),
    );
    job.wait_for("training", |l| l.v["event"] == "step" && l.v["size"] == 2);
    let workers: Vec<i32> = job.workers().into_iter().map(|(pid, _, _)| pid).collect();
    assert_eq!(workers.len(), 2, "{workers:?}");
    let killed = Instant::now();
    signal(job.child.id() as i32, Signal::SIGKILL);
    // Still training a second later, then gone once the grace has passed.
    std::thread::sleep(Duration::from_secs(1));
    assert_eq!(
        running_after(&workers, Duration::ZERO).len(),
        2,
        "they did not wait"
    );
    let left = running_after(&workers, Duration::from_secs(10));
    let gone = killed.elapsed();
    assert!(left.is_empty(), "still running after {gone:?}: {left:?}");
    println!("workers exited {gone:?} after their driver (grace 2 s)");
    assert!(gone >= Duration::from_secs(2), "{gone:?}");
    let said: String = (0..2)
        .map(|w| {
            std::fs::read_to_string(spool(&prefix).join(format!("worker.{w}.stderr")))
                .unwrap_or_default()
        })
        .collect();
    assert!(
        said.contains("found no driver within --driver-grace"),
        "{said}"
    );
    drop(job);
    let _ = std::fs::remove_dir_all(spool(&prefix));
}

/// etcd goes away mid-job: the job trains on while the driver holds still (it cannot know
/// whether a standby took over), and when etcd returns the driver carries on, writes its
/// record again and finishes the job.
#[test]
fn losing_etcd_mid_job_holds_the_driver_still_and_the_job_trains_on() {
    let mut e = Etcd::start();
    let prefix = format!("jobs/outage-{}", std::process::id());
    let dir = scratch("store-outage");
    std::fs::write(dir.join("hosts"), "127.0.0.2:2\n127.0.0.3:2\n").unwrap();
    let counter = ["--steps", "500", "--commit-every", "5", "--step-ms", "20"];
    let mut job = Job::spawn(
        dir.clone(),
        horovodrun(&dir, &store_flags(&e, &prefix, free_port(), &[]), &counter),
    );
    job.wait_for("training at size 4", |l| {
        l.v["event"] == "step" && l.v["size"] == 4
    });
    e.kill();
    job.wait_stderr("holding still");
    job.take_available();
    let held = job
        .seen
        .iter()
        .filter_map(|l| l.v["step"].as_u64())
        .max()
        .unwrap_or(0);
    job.wait_for("steps while the driver holds still", |l| {
        l.v["step"].as_u64() >= Some(held + 25)
    });
    e.resume();
    job.wait_stderr("answers again");
    let (code, err, lines) = job.finish();
    assert_eq!(code, 0, "{err}");
    assert!(
        err.contains("written again") || err.contains("answers again"),
        "{err}"
    );
    assert_eq!(check_counter(&lines, 500), 4);
}

/// Starts an active driver and a standby for one job; returns both, the job's prefix and its
/// scratch directory (whose `hosts` the discovery prints).
fn active_and_standby(
    e: &Etcd,
    name: &str,
    hosts: &[&str],
    counter: &[&str],
    extra: &[&str],
    env: &[(&str, &str)],
) -> (Job, Job, String, PathBuf) {
    let prefix = format!("jobs/{name}-{}", std::process::id());
    let dir = scratch(name);
    std::fs::write(dir.join("hosts"), hosts.join("\n") + "\n").unwrap();
    let port = free_port();
    let mut cmd = horovodrun(&dir, &store_flags(e, &prefix, port, extra), counter);
    cmd.envs(env.iter().copied());
    let active = Job::spawn(dir.clone(), cmd);
    active.wait_stderr("this driver is the active one");
    let mut flags = extra.to_vec();
    flags.push("--standby");
    let mut cmd = horovodrun(&dir, &store_flags(e, &prefix, port, &flags), counter);
    cmd.envs(env.iter().copied());
    let standby = Job::spawn(scratch(&format!("{name}-standby")), cmd);
    standby.wait_stderr("standing by");
    (active, standby, prefix, dir)
}

/// The driver dies in the middle of a recovery (a worker was just killed): the standby takes
/// over, finds the dead worker gone, and the job finishes at the smaller size with every
/// committed step applied once.
#[test]
fn a_driver_killed_during_a_recovery_is_replaced_and_the_recovery_completes() {
    let e = Etcd::start();
    let counter = ["--steps", "300", "--commit-every", "5", "--step-ms", "20"];
    let (mut active, standby, prefix, _dir) = active_and_standby(
        &e,
        "store-recovery",
        &["127.0.0.2:2", "127.0.0.3:2"],
        &counter,
        &["--heartbeat-timeout", "3"],
        &[],
    );
    active.wait_for("training at size 4", |l| {
        l.v["event"] == "step" && l.v["size"] == 4 && l.v["step"].as_u64() >= Some(20)
    });
    let victim = active.pids_on("127.0.0.3")[0];
    signal(victim, Signal::SIGKILL);
    signal(active.child.id() as i32, Signal::SIGKILL);
    let (code, err, lines) = standby.finish();
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("taking over the job"), "{err}");
    let lines = relayed(&mut active, lines);
    let size = check_counter(&lines, 300);
    assert!(size == 2 || size == 3, "finished at size {size}");
    assert!(!spool(&prefix).exists(), "the output spool was left behind");
}

/// The driver dies right after discovery found a new host: the standby takes over and the
/// job grows to it and finishes with every committed step applied once.
#[test]
fn a_driver_killed_during_a_scale_up_is_replaced_and_the_job_grows() {
    let e = Etcd::start();
    let counter = ["--steps", "400", "--commit-every", "5", "--step-ms", "20"];
    let (mut active, standby, prefix, _dir) = active_and_standby(
        &e,
        "store-grow",
        &["127.0.0.2:2"],
        &counter,
        &[
            "-np",
            "2",
            "--min-np",
            "2",
            "--max-np",
            "4",
            "--heartbeat-timeout",
            "3",
        ],
        &[],
    );
    active.wait_for("training at size 2", |l| {
        l.v["event"] == "step" && l.v["size"] == 2
    });
    active.set_hosts(&["127.0.0.2:2", "127.0.0.3:2"]);
    active.wait_stderr("worker started");
    std::thread::sleep(Duration::from_millis(300));
    signal(active.child.id() as i32, Signal::SIGKILL);
    standby.wait_stderr("taking over the job");
    let (code, err, lines) = standby.finish();
    assert_eq!(code, 0, "{err}");
    let lines = relayed(&mut active, lines);
    assert_eq!(check_counter(&lines, 400), 4, "{err}");
    assert!(!spool(&prefix).exists(), "the output spool was left behind");
}

/// Workers started through `hvd-agent` outlive their SIGKILLed driver: the agents keep them
/// (and what they print) for the grace and hand them to the standby, which relays their
/// output on and finishes the job with every committed step applied once.
#[test]
fn agents_hand_the_workers_of_a_killed_driver_to_the_standby() {
    let e = Etcd::start();
    let secret = format!("handover-{}", std::process::id());
    let (agents, agent_port) = support::agents(&["127.0.0.2", "127.0.0.3"], &secret);
    let agent_port = agent_port.to_string();
    let counter = ["--steps", "400", "--commit-every", "5", "--step-ms", "20"];
    let (mut active, standby, _prefix, _dir) = active_and_standby(
        &e,
        "store-agents",
        &["127.0.0.2:2", "127.0.0.3:2"],
        &counter,
        &[
            "--launcher",
            "agent",
            "--agent-port",
            &agent_port,
            "--heartbeat-timeout",
            "3",
        ],
        &[(support::SECRET_VAR, &secret)],
    );
    active.wait_for("training at size 4", |l| {
        l.v["event"] == "step" && l.v["size"] == 4 && l.v["step"].as_u64() >= Some(40)
    });
    let killed = Instant::now();
    signal(active.child.id() as i32, Signal::SIGKILL);
    for a in &agents {
        a.wait_log("run on for its successor", 1);
    }
    standby.wait_stderr("taking over the job");
    while standby.stderr_count("handed over a worker") < 4
        || standby.stderr_count("adopted a worker") < 4
    {
        assert!(
            killed.elapsed() < Duration::from_secs(20),
            "not every worker was handed over and adopted: {}",
            standby.err_tail()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    println!(
        "every agent-run worker handed over and adopted {:?} after the SIGKILL (ttl 2 s)",
        killed.elapsed()
    );
    let (code, err, lines) = standby.finish();
    assert_eq!(code, 0, "{err}");
    let lines = relayed(&mut active, lines);
    assert_eq!(check_counter(&lines, 400), 4, "{err}");
    assert!(
        !lines.iter().any(|l| l.v["event"] == "reset"),
        "the failover reset the workers"
    );
    assert_steps_relayed(&lines, 400, 2);
    for a in &agents {
        assert!(a.log().contains("job claimed"), "{}", a.log());
    }
}

/// SIGTERM (a drained node, an evicted pod) makes a driver with a store hand the job over:
/// it writes its record, gives the lease up and exits 75 leaving the workers; the standby
/// takes over at once, without waiting for the lease to lapse, and finishes the job. SIGINT
/// still stops a job.
#[test]
fn sigterm_hands_the_job_to_the_standby_at_once() {
    let e = Etcd::start();
    let counter = ["--steps", "300", "--commit-every", "5", "--step-ms", "20"];
    let (mut active, standby, prefix, _dir) = active_and_standby(
        &e,
        "store-sigterm",
        &["127.0.0.2:2", "127.0.0.3:2"],
        &counter,
        // A lease that would take long to lapse: the handover must not wait for it.
        &["--state-store-ttl", "30"],
        &[],
    );
    active.wait_for("training at size 4", |l| {
        l.v["event"] == "step" && l.v["size"] == 4 && l.v["step"].as_u64() >= Some(20)
    });
    let termed = Instant::now();
    signal(active.child.id() as i32, Signal::SIGTERM);
    standby.wait_stderr("taking over the job");
    let took = termed.elapsed();
    println!("standby took over {took:?} after the SIGTERM (ttl 30 s)");
    assert!(took < Duration::from_secs(10), "{took:?}");
    let status = active.child.wait().unwrap();
    assert_eq!(status.code(), Some(75), "{}", active.err_tail());
    let (code, err, lines) = standby.finish();
    assert_eq!(code, 0, "{err}");
    let lines = relayed(&mut active, lines);
    assert_eq!(check_counter(&lines, 300), 4, "{err}");
    assert!(!spool(&prefix).exists(), "the output spool was left behind");
}
