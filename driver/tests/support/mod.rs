//! Helpers for the tests that run elastic `horovodrun` jobs of the example programs: a scratch
//! discovery script, the job's counter lines, its worker processes, and the counter's invariants.

#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)] // each test file uses a part

// failover.rs loads this file a second time, through the etcd support.
#[allow(clippy::duplicate_mod)]
#[path = "../../../store/tests/support/stale.rs"]
mod stale;

pub mod pyenv;

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex, mpsc};
use std::thread;
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use serde_json::Value;

pub fn example(name: &str) -> String {
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

/// One line a worker printed: the worker id from the output prefix and the JSON event (or,
/// for a line that is not JSON, the text as a JSON string).
#[derive(Debug, Clone)]
pub struct Line {
    /// The worker id.
    pub worker: u64,
    /// The event.
    pub v: Value,
    /// When the test read it from `horovodrun`'s output.
    pub at: Instant,
}

pub struct Job {
    /// The `horovodrun` process.
    pub child: Child,
    dir: PathBuf,
    lines: mpsc::Receiver<Line>,
    /// Counter lines seen so far.
    pub seen: Vec<Line>,
    stderr: Option<thread::JoinHandle<()>>,
    /// `horovodrun`'s stderr so far.
    err: Arc<Mutex<String>>,
    /// Processes whose children are the job's workers: `horovodrun`, or the agents.
    pub parents: Vec<u32>,
}

/// A scratch directory with `hosts` (what discovery prints) and `discover.sh`. A [`Job`]
/// started in it removes it when the job is finished ([`Job::finish`]) or dropped, except
/// when dropped by a failing test: that one's stays, to be read.
pub fn scratch(name: &str) -> PathBuf {
    // Those of dead test processes, once per test binary.
    static SWEPT: std::sync::Once = std::sync::Once::new();
    SWEPT.call_once(|| stale::sweep(&std::env::temp_dir(), "hvd-elastic-"));
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

/// Writes `dir/bin/ssh`, an `ssh` for made-up hosts that runs here: it skips ssh's options,
/// leaves the host in `$host` and the remote command in `$@`, then runs the shell lines `run`.
pub fn fake_ssh(dir: &Path, run: &str) {
    let bin = dir.join("bin");
    std::fs::create_dir_all(&bin).expect("bin dir");
    let ssh = bin.join("ssh");
    let script = format!(
        "#!/bin/sh\nwhile [ $# -gt 0 ]; do\n  case \"$1\" in\n    -o|-p|-i) shift 2 ;;\n    \
         -*) shift ;;\n    *) break ;;\n  esac\ndone\nhost=$1; shift\n{run}"
    );
    std::fs::write(&ssh, script).expect("ssh");
    let mut perm = std::fs::metadata(&ssh).expect("meta").permissions();
    std::os::unix::fs::PermissionsExt::set_mode(&mut perm, 0o755);
    std::fs::set_permissions(&ssh, perm).expect("chmod");
}

impl Job {
    /// Starts `horovodrun <flags> --host-discovery-script … elastic_counter <counter>` with
    /// discovery printing `hosts`.
    pub fn start(name: &str, hosts: &[&str], flags: &[&str], counter: &[&str]) -> Self {
        let dir = scratch(name);
        Self::start_in(dir, hosts, flags, "elastic_counter", counter)
    }

    /// Starts `program` (an example) with `args` under elastic horovodrun in `dir`.
    pub fn start_in(
        dir: PathBuf,
        hosts: &[&str],
        flags: &[&str],
        program: &str,
        args: &[&str],
    ) -> Self {
        Self::start_env(dir, hosts, flags, program, args, &[])
    }

    /// [`Job::start_in`] with more environment variables for `horovodrun`.
    pub fn start_env(
        dir: PathBuf,
        hosts: &[&str],
        flags: &[&str],
        program: &str,
        args: &[&str],
        env: &[(&str, &str)],
    ) -> Self {
        std::fs::write(dir.join("hosts"), hosts.join("\n") + "\n").expect("hosts");
        let script = dir.join("discover.sh").display().to_string();
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_horovodrun"));
        cmd.args(flags)
            .args([
                "--host-discovery-script",
                &script,
                "--discovery-interval",
                "0.2",
            ])
            .arg(example(program))
            .args(args)
            .envs(env.iter().copied());
        Self::spawn(dir, cmd)
    }

    /// Runs `cmd` (a `horovodrun` command line) as the job; `dir` is removed at its end.
    pub fn spawn(dir: PathBuf, mut cmd: Command) -> Self {
        let mut child = cmd
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
                // A line that is not JSON (a script's own print) is kept as a string.
                let v = serde_json::from_str(json).unwrap_or_else(|_| json.into());
                if let Ok(worker) = worker.parse() {
                    let at = Instant::now();
                    if tx.send(Line { worker, v, at }).is_err() {
                        break;
                    }
                }
            }
        });
        let log = Arc::new(Mutex::new(String::new()));
        let sink = log.clone();
        let stderr = thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok(n) = err.read(&mut buf) {
                if n == 0 {
                    break;
                }
                sink.lock()
                    .unwrap()
                    .push_str(&String::from_utf8_lossy(&buf[..n]));
            }
        });
        let parents = vec![child.id()];
        Self {
            child,
            dir,
            lines,
            seen: Vec::new(),
            stderr: Some(stderr),
            err: log,
            parents,
        }
    }

    pub fn set_hosts(&self, hosts: &[&str]) {
        let tmp = self.dir.join("hosts.tmp");
        std::fs::write(&tmp, hosts.join("\n") + "\n").expect("hosts");
        std::fs::rename(tmp, self.dir.join("hosts")).expect("rename");
    }

    /// Shell lines the discovery script runs before printing the hosts.
    pub fn set_mode(&self, sh: &str) {
        std::fs::write(self.dir.join("mode"), sh).expect("mode");
    }

    /// Waits up to a minute for a line matching `pred`; returns it.
    pub fn wait_for(&mut self, what: &str, pred: impl Fn(&Line) -> bool) -> Line {
        match self.try_wait_for(pred, Duration::from_secs(60)) {
            Some(l) => l,
            None => panic!(
                "never saw {what}; lines: {:?}\nhorovodrun's stderr:\n{}",
                self.tail(),
                self.err_tail()
            ),
        }
    }

    /// Takes every line read so far into `seen`, without waiting.
    pub fn take_available(&mut self) {
        while let Ok(l) = self.lines.try_recv() {
            self.seen.push(l);
        }
    }

    /// Waits up to `within` for a line matching `pred`; `None` when none came.
    pub fn try_wait_for(&mut self, pred: impl Fn(&Line) -> bool, within: Duration) -> Option<Line> {
        if let Some(l) = self.seen.iter().find(|l| pred(l)) {
            return Some(l.clone());
        }
        let deadline = Instant::now() + within;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let l = self.lines.recv_timeout(left).ok()?;
            self.seen.push(l.clone());
            if pred(&l) {
                return Some(l);
            }
        }
    }

    pub fn wait_step(&mut self, step: u64, size: u64) -> Line {
        self.wait_for(&format!("step {step} at size {size}"), |l| {
            l.v["event"] == "step" && l.v["step"].as_u64() >= Some(step) && l.v["size"] == size
        })
    }

    /// How often `what` occurs in `horovodrun`'s stderr so far.
    pub fn stderr_count(&self, what: &str) -> usize {
        self.err.lock().map_or(0, |e| e.matches(what).count())
    }

    /// Waits up to a minute until `what` occurs `n` times in `horovodrun`'s stderr.
    pub fn wait_stderr_count(&self, what: &str, n: usize) {
        let deadline = Instant::now() + Duration::from_secs(60);
        while self.stderr_count(what) < n {
            assert!(
                Instant::now() < deadline,
                "{what:?} logged {} times, not {n}:\n{}",
                self.stderr_count(what),
                self.err_tail()
            );
            thread::sleep(Duration::from_millis(20));
        }
    }

    /// The last 8 KiB of `horovodrun`'s stderr so far, for a failure message.
    pub fn err_tail(&self) -> String {
        let err = self.err.lock().map(|e| e.clone()).unwrap_or_default();
        let mut from = err.len().saturating_sub(8 << 10);
        while !err.is_char_boundary(from) {
            from += 1;
        }
        err[from..].to_string()
    }

    pub fn tail(&self) -> Vec<String> {
        let n = self.seen.len();
        self.seen[n.saturating_sub(20)..]
            .iter()
            .map(|l| format!("[{}] {}", l.worker, l.v))
            .collect()
    }

    /// Worker processes of this job: (pid, worker id, host).
    pub fn workers(&self) -> Vec<(i32, u64, String)> {
        let parents: Vec<String> = self.parents.iter().map(u32::to_string).collect();
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
            if !fields
                .get(1)
                .is_some_and(|p| parents.iter().any(|q| q == p))
                || fields.first() == Some(&"Z")
            {
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

    /// Where every worker's threads stood, for the message of a hang: their stacks written by
    /// gdb (when this machine has it) to a file in the temp dir, whose path it returns, or why
    /// there are none.
    pub fn stacks(&self) -> String {
        let workers = self.workers();
        let mut out = String::new();
        for (pid, id, host) in &workers {
            let bt = Command::new("gdb")
                .args([
                    "-p",
                    &pid.to_string(),
                    "-batch",
                    "-ex",
                    "thread apply all bt",
                ])
                .stdin(Stdio::null())
                .output();
            match bt {
                Ok(o) => {
                    out.push_str(&format!("==== worker {id} on {host} (pid {pid})\n"));
                    out.push_str(&String::from_utf8_lossy(&o.stdout));
                }
                Err(e) => return format!("no worker stacks: gdb: {e}"),
            }
        }
        let path = std::env::temp_dir().join(format!("hvd-hang-stacks-{}.txt", std::process::id()));
        match std::fs::write(&path, out) {
            Ok(()) => format!("{} workers' stacks in {}", workers.len(), path.display()),
            Err(e) => format!("no worker stacks: {}: {e}", path.display()),
        }
    }

    /// All of `horovodrun`'s stderr so far, written to a file in the temp dir for a failure
    /// message (whose tail alone may have lost the first error); returns where it is.
    pub fn save_stderr(&self) -> String {
        let err = self.err.lock().map(|e| e.clone()).unwrap_or_default();
        let path = std::env::temp_dir().join(format!("hvd-stderr-{}.txt", std::process::id()));
        match std::fs::write(&path, err) {
            Ok(()) => format!("horovodrun's whole stderr in {}", path.display()),
            Err(e) => format!("horovodrun's stderr not saved: {}: {e}", path.display()),
        }
    }

    /// The pid of the worker that printed rank `rank` most recently.
    pub fn pid_of_rank(&self, rank: u64) -> i32 {
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

    pub fn pids_on(&self, host: &str) -> Vec<i32> {
        self.workers()
            .iter()
            .filter(|w| w.2 == host)
            .map(|w| w.0)
            .collect()
    }

    /// Waits until `horovodrun` logs a line containing `what`; returns that line.
    pub fn wait_stderr(&self, what: &str) -> String {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let err = self.err.lock().unwrap().clone();
            if let Some(l) = err.lines().find(|l| l.contains(what)) {
                return l.to_string();
            }
            assert!(
                Instant::now() < deadline,
                "horovodrun never logged {what:?}; its log:\n{err}"
            );
            thread::sleep(Duration::from_millis(20));
        }
    }

    /// The port `--status-port 0` picked, from the driver's log line.
    pub fn status_port(&self) -> u16 {
        let line = self.wait_stderr("status endpoint listening");
        line.rsplit_once(':')
            .and_then(|(_, p)| p.split_whitespace().next()?.parse().ok())
            .expect("the port in the log line")
    }

    /// Waits for horovodrun to exit; returns its code, stderr and every counter line.
    pub fn finish(self) -> (i32, String, Vec<Line>) {
        self.finish_within(Duration::from_secs(90))
    }

    /// [`Job::finish`] that fails when `within` passes with no line from the job (it hung),
    /// or four times `within` in all (it crawls): a job slowed by a loaded machine but still
    /// stepping is not a hang.
    pub fn finish_within(mut self, within: Duration) -> (i32, String, Vec<Line>) {
        let started = Instant::now();
        let mut heard = started;
        let status = loop {
            if let Some(st) = self.child.try_wait().expect("wait") {
                break st;
            }
            while let Ok(l) = self.lines.try_recv() {
                self.seen.push(l);
                heard = Instant::now();
            }
            let (quiet, all) = (heard.elapsed(), started.elapsed());
            if quiet > within || all > within * 4 {
                let stacks = self.stacks();
                let _ = self.child.kill();
                panic!(
                    "horovodrun did not exit: no line for {quiet:?}, {all:?} in all ({stacks}); \
                     lines: {:?}\nhorovodrun's stderr:\n{}",
                    self.tail(),
                    self.err_tail()
                );
            }
            thread::sleep(Duration::from_millis(20));
        };
        while let Ok(l) = self.lines.recv_timeout(Duration::from_secs(2)) {
            self.seen.push(l);
        }
        if let Some(h) = self.stderr.take() {
            let _ = h.join();
        }
        let err = self.err.lock().unwrap().clone();
        // HVD_TEST_LOG_DIR keeps every job's driver log, for counting across a whole suite
        // (how often a worker was declared frozen, say).
        if let Some(logs) = std::env::var_os("HVD_TEST_LOG_DIR") {
            let name = self
                .dir
                .file_name()
                .map_or_else(|| "job".into(), |n| n.to_string_lossy().into_owned());
            let _ = std::fs::create_dir_all(&logs);
            let _ = std::fs::write(
                std::path::Path::new(&logs).join(format!("{name}.log")),
                &err,
            );
        }
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
        if !thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// What a worker's environment says of its job: the rendezvous address and the job secret.
pub fn rendezvous_of(pid: i32) -> (String, String) {
    let env = std::fs::read(format!("/proc/{pid}/environ")).expect("the worker's environment");
    let var = |name: &str| {
        env.split(|&b| b == 0)
            .find_map(|kv| kv.strip_prefix(format!("{name}=").as_bytes()))
            .map(|v| String::from_utf8_lossy(v).into_owned())
            .unwrap_or_else(|| panic!("{name} is not in worker {pid}'s environment"))
    };
    (
        var(hvd_rendezvous::ENV_RENDEZVOUS_ADDR),
        var(hvd_rendezvous::ENV_SECRET),
    )
}

/// Whether `pid` runs (a zombie does not).
pub fn alive(pid: i32) -> bool {
    u32::try_from(pid).is_ok_and(stale::running)
}

/// The pids of the processes whose parent is one of `parents`.
pub fn children_of(parents: &[u32]) -> Vec<i32> {
    let parents: Vec<String> = parents.iter().map(u32::to_string).collect();
    std::fs::read_dir("/proc")
        .expect("proc")
        .flatten()
        .filter_map(|e| e.file_name().to_string_lossy().parse::<i32>().ok())
        .filter(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
                s.rsplit_once(')')
                    .and_then(|(_, r)| r.split_whitespace().nth(1).map(str::to_string))
                    .is_some_and(|p| parents.contains(&p))
            })
        })
        .collect()
}

/// Waits up to `within` until none of `pids` runs; returns the ones still running.
pub fn running_after(pids: &[i32], within: Duration) -> Vec<i32> {
    let deadline = Instant::now() + within;
    loop {
        let running: Vec<i32> = pids.iter().copied().filter(|&p| alive(p)).collect();
        if running.is_empty() || Instant::now() >= deadline {
            return running;
        }
        thread::sleep(Duration::from_millis(50));
    }
}

pub fn signal(pid: i32, sig: Signal) {
    kill(Pid::from_raw(pid), sig).expect("signal worker");
}

/// The counter's invariants over a finished job's lines; returns the final world size.
pub fn check_counter(lines: &[Line], steps: u64) -> u64 {
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

/// Every rank that finished trained its model with exactly one SGD step per training step:
/// its weight (in the counter programs' `done` line) is `-steps`.
pub fn assert_weights(lines: &[Line], steps: u32) {
    let done: Vec<_> = lines.iter().filter(|l| l.v["event"] == "done").collect();
    assert!(!done.is_empty(), "no rank finished");
    for d in done {
        assert_eq!(d.v["weight"], -f64::from(steps), "{}", d.v);
    }
}

pub fn steps_rerun(lines: &[Line]) -> usize {
    let mut seen = BTreeSet::new();
    lines
        .iter()
        .filter(|l| l.v["event"] == "step")
        .filter(|l| !seen.insert((l.worker, l.v["step"].as_u64())))
        .count()
}

/// Committed steps a job lost, from its counter lines: a new world resumes from its rank 0's
/// state, and rank 0 restores its own last commit after a failure (or keeps its current step
/// after a host update), so a `reset` line of rank 0 below the last step that worker
/// committed lost the steps between.
pub fn committed_steps_lost(lines: &[Line]) -> u64 {
    let mut last_commit: BTreeMap<u64, u64> = BTreeMap::new();
    let mut lost = 0;
    for l in lines {
        let step = l.v["step"].as_u64().unwrap_or(0);
        match l.v["event"].as_str() {
            Some("commit") => {
                last_commit.insert(l.worker, step);
            }
            Some("reset") if l.v["rank"] == 0 => {
                let committed = last_commit.get(&l.worker).copied().unwrap_or(0);
                lost += committed.saturating_sub(step);
            }
            _ => {}
        }
    }
    lost
}

/// The steps (and the final totals) that do not follow from a state the job had, described:
/// step `k` at size `n` with total `t` needs a step `k − 1` printed with total `t − n` (or
/// `t == n` for the first step), and each `done` a step of its count printed with its total.
/// A step applied twice, or to a state missing one, breaks the chain.
pub fn steps_off_the_chain(lines: &[Line]) -> Vec<String> {
    let field = |l: &Line, k: &str| l.v[k].as_u64().unwrap_or(u64::MAX);
    let mut states: BTreeSet<(u64, u64)> = BTreeSet::from([(0, 0)]);
    for l in lines.iter().filter(|l| l.v["event"] == "step") {
        states.insert((field(l, "step"), field(l, "total")));
    }
    let mut off = Vec::new();
    for l in lines {
        let (step, total) = (field(l, "step"), field(l, "total"));
        let follows = match l.v["event"].as_str() {
            Some("step") => total
                .checked_sub(field(l, "size"))
                .is_some_and(|before| states.contains(&(step.wrapping_sub(1), before))),
            Some("done") => states.contains(&(field(l, "steps"), total)),
            _ => true,
        };
        if !follows {
            off.push(format!("[{}] {}", l.worker, l.v));
        }
    }
    off
}

/// Asserts that `hvd_probe --lines N` printed each of its lines, on each of `ranks` ranks, with
/// the rank prefixes `horovodrun` relays them with.
pub fn assert_probe_lines(stdout: &str, stderr: &str, ranks: usize, lines: usize) {
    for r in 0..ranks {
        for i in 0..lines {
            assert!(
                stdout.contains(&format!("[{r}]<stdout>:out line {i} from rank {r}\n")),
                "{stdout}"
            );
            assert!(
                stderr.contains(&format!("[{r}]<stderr>:err line {i} from rank {r}\n")),
                "{stderr}"
            );
        }
    }
}

/// The variable that gives `hvd-agent` and `horovodrun --launcher agent` their secret.
pub const SECRET_VAR: &str = "HVD_AGENT_SECRET";

/// A running `hvd-agent`, killed when dropped; its log is collected as it runs.
pub struct Agent {
    child: Child,
    log: Arc<Mutex<String>>,
}

impl Agent {
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn log(&self) -> String {
        self.log.lock().unwrap().clone()
    }

    /// Waits until the log contains `what` `n` times.
    pub fn wait_log(&self, what: &str, n: usize) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while self.log().matches(what).count() < n {
            assert!(
                Instant::now() < deadline,
                "agent never logged {what:?}: {}",
                self.log()
            );
            thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Agent {
    /// SIGTERM first, so the agent stops the processes it runs; SIGKILL if it takes too long.
    fn drop(&mut self) {
        let pid = Pid::from_raw(self.child.id() as i32);
        if kill(pid, Signal::SIGTERM).is_ok() {
            let deadline = Instant::now() + Duration::from_secs(5);
            while Instant::now() < deadline {
                if !matches!(self.child.try_wait(), Ok(None)) {
                    return;
                }
                thread::sleep(Duration::from_millis(20));
            }
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn agent_binary() -> PathBuf {
    let exe = std::env::current_exe().expect("test exe");
    let p = exe
        .parent()
        .and_then(|d| d.parent())
        .expect("target dir")
        .join("hvd-agent");
    assert!(
        p.exists(),
        "{} is missing: run the tests with `cargo test --workspace`, which builds it",
        p.display()
    );
    p
}

/// Starts an agent on `listen`; `None` when it could not listen there.
pub fn start_agent(listen: &str, secret: &str) -> Option<(Agent, String)> {
    start_agent_with(listen, secret, &[], &[])
}

/// [`start_agent`] with more arguments and environment variables.
pub fn start_agent_with(
    listen: &str,
    secret: &str,
    args: &[&str],
    env: &[(&str, &str)],
) -> Option<(Agent, String)> {
    let mut child = Command::new(agent_binary())
        .args(["--listen", listen])
        .args(args)
        .envs(env.iter().copied())
        .env(SECRET_VAR, secret)
        .env("RUST_LOG", "info")
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn hvd-agent");
    let err = child.stderr.take().expect("stderr");
    let log = Arc::new(Mutex::new(String::new()));
    let (tx, rx) = mpsc::channel();
    let sink = log.clone();
    thread::spawn(move || {
        for l in BufReader::new(err).lines().map_while(Result::ok) {
            if let Some((_, a)) = l.split_once("addr=") {
                let _ = tx.send(a.split_whitespace().next().unwrap_or_default().to_string());
            }
            let mut s = sink.lock().unwrap();
            s.push_str(&l);
            s.push('\n');
        }
    });
    let agent = Agent { child, log };
    let addr = rx.recv_timeout(Duration::from_secs(20)).ok()?;
    Some((agent, addr))
}

/// One agent on each of `ips`, all on one free port; returns them and the port.
pub fn agents(ips: &[&str], secret: &str) -> (Vec<Agent>, u16) {
    agents_with(ips, secret, &[], &[])
}

/// [`agents`] with more arguments and environment variables for each.
pub fn agents_with(
    ips: &[&str],
    secret: &str,
    args: &[&str],
    env: &[(&str, &str)],
) -> (Vec<Agent>, u16) {
    for _ in 0..10 {
        let (first, addr) =
            start_agent_with(&format!("{}:0", ips[0]), secret, args, env).expect("first agent");
        let port: u16 = addr.rsplit_once(':').unwrap().1.parse().unwrap();
        let mut all = vec![first];
        for ip in &ips[1..] {
            match start_agent_with(&format!("{ip}:{port}"), secret, args, env) {
                Some((a, _)) => all.push(a),
                None => break, // the port is taken there; try another
            }
        }
        if all.len() == ips.len() {
            return (all, port);
        }
    }
    panic!("no port free on all of {ips:?}");
}

/// `method path` on `port` of this machine; returns the status code and the body.
pub fn http_get(port: u16, method: &str, path: &str) -> (u16, String) {
    use std::io::Write;
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    write!(s, "{method} {path} HTTP/1.1\r\nHost: localhost\r\n\r\n").expect("request");
    let mut resp = String::new();
    s.read_to_string(&mut resp).expect("response");
    let (head, body) = resp.split_once("\r\n\r\n").expect("a head");
    let code = head
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .expect("a status code");
    (code, body.to_string())
}

/// The UTC time `d` from now as RFC 3339 with whole seconds (`2026-11-28T19:41:05Z`): how AWS'
/// metadata and Kubernetes write a time.
pub fn rfc3339_in(d: Duration) -> String {
    let t = (std::time::SystemTime::now() + d)
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let (days, secs) = (t / 86_400, t % 86_400);
    // Civil date from days since the epoch (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        secs / 3600,
        secs / 60 % 60,
        secs % 60
    )
}

/// The `epoch` lines of an elastic example (`examples/python/*_elastic.py`), checked: there
/// are `epochs` of them, every epoch trained every sample (`missing` 0 across every rank and
/// reset), and the model learnt (accuracy above 0.9).
pub fn trained_epochs(lines: &[Line], epochs: usize) -> Vec<&Value> {
    let found: Vec<&Value> = lines
        .iter()
        .filter(|l| l.v["event"] == "epoch")
        .map(|l| &l.v)
        .collect();
    assert_eq!(found.len(), epochs, "{found:?}");
    for e in &found {
        assert_eq!(e["missing"], 0, "{e}");
        assert!(e["accuracy"].as_f64().is_some_and(|a| a > 0.9), "{e}");
    }
    found
}
