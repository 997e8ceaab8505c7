//! Elastic `horovodrun` end to end: real `elastic_counter` workers on 127.0.0.x "hosts", a
//! discovery script reading a file the test rewrites, and chaos: killed workers, lost hosts,
//! added hosts, a failing or hanging discovery script, a stopped worker. Every test checks
//! the counter's invariants (no committed step lost or applied twice, every rank agreeing),
//! the driver's exit code and its message.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test that cannot set up fails loudly

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader, Read};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use serde_json::Value;

fn example(name: &str) -> String {
    let exe = std::env::current_exe().expect("test exe");
    let dir = exe.parent().and_then(|d| d.parent()).expect("target dir");
    let p: PathBuf = dir.join("examples").join(name);
    assert!(
        p.exists(),
        "{} is missing: run the tests with `cargo test --workspace`, which builds the examples",
        p.display()
    );
    p.display().to_string()
}

/// One counter line: the worker id from the output prefix and the JSON event.
#[derive(Debug, Clone)]
struct Line {
    worker: u64,
    v: Value,
}

struct Job {
    child: Child,
    dir: PathBuf,
    lines: mpsc::Receiver<Line>,
    seen: Vec<Line>,
    stderr: Option<thread::JoinHandle<String>>,
}

/// A scratch directory with `hosts` (what discovery prints) and `discover.sh`.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("hvd-elastic-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scratch dir");
    let script = dir.join("discover.sh");
    std::fs::write(
        &script,
        format!(
            "#!/bin/sh\nif [ -f {d}/mode ]; then . {d}/mode; fi\ncat {d}/hosts\n",
            d = dir.display()
        ),
    )
    .expect("script");
    let mut perm = std::fs::metadata(&script).expect("meta").permissions();
    std::os::unix::fs::PermissionsExt::set_mode(&mut perm, 0o755);
    std::fs::set_permissions(&script, perm).expect("chmod");
    dir
}

impl Job {
    /// Starts `horovodrun <flags> --host-discovery-script … elastic_counter <counter>` with
    /// discovery printing `hosts`.
    fn start(name: &str, hosts: &[&str], flags: &[&str], counter: &[&str]) -> Self {
        let dir = scratch(name);
        Self::start_in(dir, hosts, flags, "elastic_counter", counter)
    }

    /// Starts `program` (an example) with `args` under elastic horovodrun in `dir`.
    fn start_in(
        dir: PathBuf,
        hosts: &[&str],
        flags: &[&str],
        program: &str,
        args: &[&str],
    ) -> Self {
        std::fs::write(dir.join("hosts"), hosts.join("\n") + "\n").expect("hosts");
        let script = dir.join("discover.sh").display().to_string();
        let mut child = Command::new(env!("CARGO_BIN_EXE_horovodrun"))
            .args(flags)
            .args([
                "--host-discovery-script",
                &script,
                "--discovery-interval",
                "0.2",
            ])
            .arg(example(program))
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn horovodrun");
        let out = child.stdout.take().expect("stdout");
        let mut err = child.stderr.take().expect("stderr");
        let (tx, lines) = mpsc::channel();
        thread::spawn(move || {
            for l in BufReader::new(out).lines().map_while(Result::ok) {
                let Some((prefix, json)) = l.split_once("<stdout>:") else {
                    continue;
                };
                let worker = prefix.trim_start_matches('[').trim_end_matches(']');
                if let (Ok(worker), Ok(v)) = (worker.parse(), serde_json::from_str(json)) {
                    if tx.send(Line { worker, v }).is_err() {
                        break;
                    }
                }
            }
        });
        let stderr = thread::spawn(move || {
            let mut s = String::new();
            let _ = err.read_to_string(&mut s);
            s
        });
        Self {
            child,
            dir,
            lines,
            seen: Vec::new(),
            stderr: Some(stderr),
        }
    }

    fn set_hosts(&self, hosts: &[&str]) {
        let tmp = self.dir.join("hosts.tmp");
        std::fs::write(&tmp, hosts.join("\n") + "\n").expect("hosts");
        std::fs::rename(tmp, self.dir.join("hosts")).expect("rename");
    }

    /// Shell lines the discovery script runs before printing the hosts.
    fn set_mode(&self, sh: &str) {
        std::fs::write(self.dir.join("mode"), sh).expect("mode");
    }

    /// Waits for a line matching `pred`; returns it.
    fn wait_for(&mut self, what: &str, pred: impl Fn(&Line) -> bool) -> Line {
        if let Some(l) = self.seen.iter().find(|l| pred(l)) {
            return l.clone();
        }
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(l) => {
                    self.seen.push(l.clone());
                    if pred(&l) {
                        return l;
                    }
                }
                Err(_) => panic!("never saw {what}; lines: {:?}", self.tail()),
            }
        }
    }

    fn wait_step(&mut self, step: u64, size: u64) -> Line {
        self.wait_for(&format!("step {step} at size {size}"), |l| {
            l.v["event"] == "step" && l.v["step"].as_u64() >= Some(step) && l.v["size"] == size
        })
    }

    fn tail(&self) -> Vec<String> {
        let n = self.seen.len();
        self.seen[n.saturating_sub(20)..]
            .iter()
            .map(|l| format!("[{}] {}", l.worker, l.v))
            .collect()
    }

    /// Worker processes of this job: (pid, worker id, host).
    fn workers(&self) -> Vec<(i32, u64, String)> {
        let me = self.child.id().to_string();
        let mut out = Vec::new();
        for e in std::fs::read_dir("/proc").expect("proc").flatten() {
            let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else {
                continue;
            };
            let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
                continue;
            };
            let after = stat.rsplit_once(')').map_or("", |(_, r)| r);
            let fields: Vec<&str> = after.split_whitespace().collect();
            if fields.get(1) != Some(&me.as_str()) || fields.first() == Some(&"Z") {
                continue;
            }
            let env = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
            let mut id = None;
            let mut host = String::new();
            for kv in env.split(|&b| b == 0) {
                let kv = String::from_utf8_lossy(kv);
                if let Some(v) = kv.strip_prefix("HVD_WORKER_ID=") {
                    id = v.parse().ok();
                } else if let Some(v) = kv.strip_prefix("HOROVOD_HOSTNAME=") {
                    host = v.to_string();
                }
            }
            if let Some(id) = id {
                out.push((pid, id, host));
            }
        }
        out.sort_by_key(|w| w.1);
        out
    }

    /// The pid of the worker that printed rank `rank` most recently.
    fn pid_of_rank(&self, rank: u64) -> i32 {
        let id = self
            .seen
            .iter()
            .rev()
            .find(|l| l.v["event"] == "step" && l.v["rank"] == rank)
            .map(|l| l.worker)
            .expect("a step of that rank");
        self.workers()
            .iter()
            .find(|w| w.1 == id)
            .map(|w| w.0)
            .expect("its process")
    }

    fn pids_on(&self, host: &str) -> Vec<i32> {
        self.workers()
            .iter()
            .filter(|w| w.2 == host)
            .map(|w| w.0)
            .collect()
    }

    /// Waits for horovodrun to exit; returns its code, stderr and every counter line.
    fn finish(mut self) -> (i32, String, Vec<Line>) {
        let deadline = Instant::now() + Duration::from_secs(90);
        let status = loop {
            if let Some(st) = self.child.try_wait().expect("wait") {
                break st;
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                panic!("horovodrun did not exit; lines: {:?}", self.tail());
            }
            thread::sleep(Duration::from_millis(20));
        };
        while let Ok(l) = self.lines.recv_timeout(Duration::from_secs(2)) {
            self.seen.push(l);
        }
        let err = self
            .stderr
            .take()
            .and_then(|h| h.join().ok())
            .unwrap_or_default();
        let _ = std::fs::remove_dir_all(&self.dir);
        (
            status.code().unwrap_or(-1),
            err,
            std::mem::take(&mut self.seen),
        )
    }
}

impl Drop for Job {
    fn drop(&mut self) {
        // A failed test must not leave a job running; its workers follow their driver.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn signal(pid: i32, sig: Signal) {
    kill(Pid::from_raw(pid), sig).expect("signal worker");
}

/// The counter's invariants over a finished job's lines; returns the final world size.
fn check_counter(lines: &[Line], steps: u64) -> u64 {
    let done: Vec<&Value> = lines
        .iter()
        .filter(|l| l.v["event"] == "done")
        .map(|l| &l.v)
        .collect();
    assert!(!done.is_empty(), "no worker finished");
    let size = done[0]["size"].as_u64().expect("size");
    assert_eq!(
        done.len() as u64,
        size,
        "one done per rank of the final world: {done:?}"
    );
    let ranks: BTreeSet<u64> = done.iter().filter_map(|d| d["rank"].as_u64()).collect();
    assert_eq!(ranks, (0..size).collect(), "every rank finished once");
    for d in &done {
        assert_eq!(d["steps"], steps);
        assert_eq!(d["total"], d["history_sum"], "total == history_sum: {d}");
        assert_eq!(d["total"], done[0]["total"], "ranks agree: {done:?}");
        assert_eq!(d["size"], size);
    }
    // A step never runs at a size other than the world's: no more ranks print a
    // (step, size) pair than the size, within one stretch between resets of a worker.
    let mut per: BTreeMap<(u64, u64, u64), BTreeSet<u64>> = BTreeMap::new();
    for l in lines.iter().filter(|l| l.v["event"] == "step") {
        let (s, n, t) = (
            l.v["step"].as_u64().unwrap_or(0),
            l.v["size"].as_u64().unwrap_or(0),
            l.v["total"].as_u64().unwrap_or(0),
        );
        assert!(
            l.v["rank"].as_u64().unwrap_or(u64::MAX) < n,
            "rank below size: {}",
            l.v
        );
        per.entry((s, n, t))
            .or_default()
            .insert(l.v["rank"].as_u64().unwrap_or(0));
    }
    for ((s, n, _), ranks) in &per {
        assert!(
            ranks.len() as u64 <= *n,
            "step {s} at size {n} ran on ranks {ranks:?}"
        );
    }
    size
}

fn steps_rerun(lines: &[Line]) -> usize {
    let mut seen = BTreeSet::new();
    lines
        .iter()
        .filter(|l| l.v["event"] == "step")
        .filter(|l| !seen.insert((l.worker, l.v["step"].as_u64())))
        .count()
}

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
    let mut job = Job::start(
        "sigstop",
        hosts,
        &["-np", "4", "--min-np", "2", "--start-timeout", "3"],
        COUNTER,
    );
    job.wait_step(20, 4);
    // One worker hangs, another dies: the round the death starts must not wait for the hung one.
    signal(job.pids_on("127.0.0.4")[0], Signal::SIGSTOP);
    signal(job.pids_on("127.0.0.3")[0], Signal::SIGKILL);
    let t = Instant::now();
    job.wait_step(1, 2);
    let took = t.elapsed();
    let (code, err, lines) = job.finish();
    assert_eq!(code, 0, "{err}");
    assert_eq!(check_counter(&lines, 250), 2);
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
