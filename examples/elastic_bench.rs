//! Measures elastic recovery on this machine with real processes: `horovodrun` running
//! `elastic_counter` on 127.0.0.x hosts, timed from outside by the lines the workers print.
//!
//! ```text
//! cargo build --release --workspace --bins --examples
//! target/release/examples/elastic_bench --runs 5
//! ```
//!
//! - recovery: 4 workers on 2 hosts; SIGKILL one worker → the first step the survivors
//!   complete at the new size;
//! - scale-up: 4 workers on 2 hosts; a third host appears in discovery → the first step at
//!   the new size (from the discovery change), and the training pause (last step at the old
//!   size → first at the new);
//! - rebuild: N−1 one-slot hosts, one more appears → the training pause at N workers, for N
//!   in 2, 4, 8, 16: re-rendezvous, ring rebuild and state sync together;
//! - frozen: 4 workers on 2 hosts under `--heartbeat-timeout T`; SIGSTOP one worker → the
//!   first step the survivors complete at size 2 (the frozen worker's host is failed as a
//!   whole). The target is T + 1 s.
//! - failover: 4 workers on 2 hosts with `--state-store` and a `--standby` driver; SIGKILL of
//!   the active driver → every worker adopted by the standby (the target is the lease's TTL
//!   + 1 s), and the longest gap between two steps meanwhile (the training pause);
//! - store: the rebuild pause at `--store-size` workers with the state store on, next to the
//!   same job without it, in alternating runs;
//! - notice: 4 workers on 2 hosts; SIGTERM to one worker (its host gives notice) → the first
//!   step at size 2, and the training pause (the longest gap between two steps around it),
//!   next to the same host leaving discovery (a scale-down), in alternating runs.
//!
//! The last two start their own etcd (Debian's `etcd-server`, installed when missing) on free
//! loopback ports. Every figure is the median over `--runs` jobs; the counter steps every
//! 10 ms. `--figures` picks some of them (`recovery,scale-up,rebuild,frozen,failover,store,notice`;
//! the default leaves out the two that need etcd). `--program` runs another counter
//! that prints the same lines and takes the same flags, such as the PyTorch one:
//! `--program "python python/tests/elastic_train.py --state-model resnet18"`.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Parser;
use serde_json::Value;

#[path = "../store/tests/support/etcd.rs"]
#[allow(clippy::expect_used, dead_code)] // the bench's etcd either starts or stops the bench
mod etcd;

/// The job secret of the bench's jobs (a job with a state store needs one given).
const SECRET: &str = "elastic-bench";
/// The lease TTL of the bench's jobs with a state store, in seconds.
const TTL: u64 = 2;

#[derive(Parser)]
struct Args {
    /// Jobs per figure (the median is reported).
    #[arg(long, default_value_t = 5)]
    runs: usize,
    /// Discovery interval passed to horovodrun, in seconds.
    #[arg(long, default_value_t = 1.0)]
    interval: f64,
    /// World sizes for the rebuild figure.
    #[arg(long, value_delimiter = ',', default_value = "2,4,8,16")]
    sizes: Vec<usize>,
    /// `--heartbeat-timeout` of the jobs, in seconds (the frozen figure waits for it).
    #[arg(long, default_value_t = 3.0)]
    heartbeat_timeout: f64,
    /// Figures to measure.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "recovery,scale-up,rebuild,frozen"
    )]
    figures: Vec<Figure>,
    /// The counter to run instead of `elastic_counter`: a command line, split on whitespace;
    /// it gets `--steps`, `--commit-every` and `--step-ms` after its own arguments.
    #[arg(long)]
    program: Option<String>,
    /// World size of the store figure (the rebuild pause with the state store on and off).
    #[arg(long, default_value_t = 16)]
    store_size: usize,
}

/// One figure of the bench.
#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Figure {
    Recovery,
    ScaleUp,
    Rebuild,
    Frozen,
    Failover,
    Store,
    Notice,
}

/// A job's state store: its etcd URL and the fixed rendezvous port a standby reuses.
struct StoreOpts {
    url: String,
    port: u16,
}

fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// A counter line, stamped when it arrived.
struct Line {
    at: Instant,
    v: Value,
}

struct Job {
    child: Child,
    dir: PathBuf,
    rx: mpsc::Receiver<Line>,
    seen: Vec<Line>,
    /// `horovodrun`'s arguments, for a standby.
    args: Vec<String>,
    /// The standby driver, once started.
    standby: Option<Standby>,
}

/// A second `horovodrun` waiting with `--standby`; its log lines, stamped.
struct Standby {
    child: Child,
    rx: mpsc::Receiver<(Instant, String)>,
    log: Vec<(Instant, String)>,
}

fn bin_dir() -> anyhow::Result<PathBuf> {
    let exe = std::env::current_exe()?;
    let dir = exe
        .parent()
        .and_then(Path::parent)
        .context("cannot locate the target directory")?;
    for need in ["horovodrun", "examples/elastic_counter"] {
        if !dir.join(need).exists() {
            bail!(
                "{} is missing: build with `cargo build --release --workspace --bins --examples`",
                dir.join(need).display()
            );
        }
    }
    Ok(dir.to_path_buf())
}

impl Job {
    fn start(
        name: &str,
        hosts: &[String],
        np: usize,
        max_np: usize,
        b: &Args,
        store: Option<&StoreOpts>,
    ) -> anyhow::Result<Self> {
        let bins = bin_dir()?;
        let dir = std::env::temp_dir().join(format!("hvd-bench-{}-{name}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        std::fs::write(dir.join("hosts"), hosts.join("\n") + "\n")?;
        let script = format!("cat {}", dir.join("hosts").display());
        let mut args: Vec<String> = vec![
            "-np".into(),
            np.to_string(),
            "--min-np".into(),
            "1".into(),
            "--max-np".into(),
            max_np.to_string(),
            "--host-discovery-script".into(),
            script,
            "--discovery-interval".into(),
            b.interval.to_string(),
            "--heartbeat-timeout".into(),
            b.heartbeat_timeout.to_string(),
        ];
        if let Some(s) = store {
            args.extend(
                [
                    "--state-store",
                    &s.url,
                    "--state-store-ttl",
                    &TTL.to_string(),
                    "--rendezvous-port",
                    &s.port.to_string(),
                    "--driver-grace",
                    "5",
                ]
                .map(String::from),
            );
        }
        match &b.program {
            Some(p) => args.extend(p.split_whitespace().map(String::from)),
            None => args.push(bins.join("examples/elastic_counter").display().to_string()),
        }
        args.extend(
            [
                "--steps",
                "100000",
                "--commit-every",
                "5",
                "--step-ms",
                "10",
            ]
            .map(String::from),
        );
        let mut child = Command::new(bins.join("horovodrun"))
            .args(&args)
            .env("HVD_SECRET", SECRET)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .context("starting horovodrun")?;
        let out = child.stdout.take().context("stdout")?;
        let (tx, rx) = mpsc::channel();
        thread::spawn(move || {
            for l in BufReader::new(out).lines().map_while(Result::ok) {
                let at = Instant::now();
                let Some((_, json)) = l.split_once("<stdout>:") else {
                    continue;
                };
                if let Ok(v) = serde_json::from_str(json)
                    && tx.send(Line { at, v }).is_err()
                {
                    break;
                }
            }
        });
        Ok(Self {
            child,
            dir,
            rx,
            seen: Vec::new(),
            args,
            standby: None,
        })
    }

    /// Starts a standby driver for this job (same arguments, `--standby`) and waits until it
    /// stands by.
    fn start_standby(&mut self) -> anyhow::Result<()> {
        let mut child = Command::new(bin_dir()?.join("horovodrun"))
            .arg("--standby")
            .args(&self.args)
            .env("HVD_SECRET", SECRET)
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .context("starting the standby horovodrun")?;
        let err = child.stderr.take().context("stderr")?;
        let (tx, rx) = mpsc::channel();
        thread::spawn(move || {
            for l in BufReader::new(err).lines().map_while(Result::ok) {
                if tx.send((Instant::now(), l)).is_err() {
                    break;
                }
            }
        });
        self.standby = Some(Standby {
            child,
            rx,
            log: Vec::new(),
        });
        self.standby_line("standing by", 1)?;
        Ok(())
    }

    /// Waits until the standby logged `n` lines containing `what`; returns when the last came.
    fn standby_line(&mut self, what: &str, n: usize) -> anyhow::Result<Instant> {
        let s = self.standby.as_mut().context("no standby")?;
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let hits: Vec<Instant> = s
                .log
                .iter()
                .filter(|(_, l)| l.contains(what))
                .map(|(at, _)| *at)
                .collect();
            if hits.len() >= n {
                return Ok(hits[n - 1]);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            let l = s
                .rx
                .recv_timeout(left)
                .with_context(|| format!("the standby did not log {n} × {what:?} within 60 s"))?;
            s.log.push(l);
        }
    }

    /// Waits for a step line at `size` arriving after `after`; returns it.
    fn step_at(&mut self, size: usize, after: Instant) -> anyhow::Result<(Instant, Value)> {
        let deadline = Instant::now() + Duration::from_secs(60);
        if let Some(l) = self
            .seen
            .iter()
            .find(|l| l.at >= after && l.v["event"] == "step" && l.v["size"] == size)
        {
            return Ok((l.at, l.v.clone()));
        }
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let l = self
                .rx
                .recv_timeout(left)
                .with_context(|| format!("no step at size {size} within 60 s"))?;
            let hit = l.at >= after && l.v["event"] == "step" && l.v["size"] == size;
            let found = (l.at, l.v.clone());
            self.seen.push(l);
            if hit {
                return Ok(found);
            }
        }
    }

    /// The last step line at `size` seen before `before`.
    fn last_step_before(&self, size: usize, before: Instant) -> Option<Instant> {
        self.seen
            .iter()
            .filter(|l| l.at < before && l.v["event"] == "step" && l.v["size"] == size)
            .map(|l| l.at)
            .max()
    }

    /// The training pause before `first`, the first step at a new size (seen at `t1`): from the
    /// last step at `old` size, by the counter's own stamps where it gives them (relayed from
    /// spool files, as under a state store, lines arrive in batches).
    fn pause(&self, old: usize, t1: Instant, first: &Value) -> anyhow::Result<f64> {
        if let Some(at) = first["at_ms"].as_u64() {
            let last = self
                .seen
                .iter()
                .filter(|l| l.v["event"] == "step" && l.v["size"] == old)
                .filter_map(|l| l.v["at_ms"].as_u64())
                .filter(|&t| t <= at)
                .max()
                .context("no step at the old size")?;
            return Ok((at - last) as f64 / 1000.0);
        }
        let last = self
            .last_step_before(old, t1)
            .context("no step at the old size")?;
        Ok((t1 - last).as_secs_f64())
    }

    fn set_hosts(&self, hosts: &[String]) -> anyhow::Result<()> {
        let tmp = self.dir.join("hosts.tmp");
        std::fs::write(&tmp, hosts.join("\n") + "\n")?;
        std::fs::rename(tmp, self.dir.join("hosts"))?;
        Ok(())
    }

    /// A worker process of this job on `host`.
    fn worker_on(&self, host: &str) -> Option<i32> {
        let me = self.child.id().to_string();
        std::fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
            let pid: i32 = e.file_name().to_string_lossy().parse().ok()?;
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
            let ppid = stat
                .rsplit_once(')')?
                .1
                .split_whitespace()
                .nth(1)?
                .to_string();
            let env = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
            let want = format!("HOROVOD_HOSTNAME={host}");
            (ppid == me && env.split(|&b| b == 0).any(|kv| kv == want.as_bytes())).then_some(pid)
        })
    }
}

impl Drop for Job {
    fn drop(&mut self) {
        // SIGINT first: a driver with a state store leaves its workers behind on SIGKILL, and
        // hands them to a successor on SIGTERM.
        stop(&mut self.child);
        if let Some(mut s) = self.standby.take() {
            stop(&mut s.child);
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// SIGINT (which stops a job, store or not), a few seconds to stop its workers, then SIGKILL.
fn stop(c: &mut Child) {
    if let Ok(Some(_)) = c.try_wait() {
        return;
    }
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(c.id() as i32),
        nix::sys::signal::Signal::SIGINT,
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        if let Ok(Some(_)) = c.try_wait() {
            return;
        }
        thread::sleep(Duration::from_millis(20));
    }
    let _ = c.kill();
    let _ = c.wait();
}

fn hosts(first: u8, n: usize, slots: usize) -> Vec<String> {
    (0..n)
        .map(|i| format!("127.0.0.{}:{slots}", first as usize + i))
        .collect()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn fmt(v: &[f64]) -> String {
    v.iter()
        .map(|x| format!("{x:.3}"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// One recovery: seconds from the SIGKILL to the first step at the new size, and to the
/// killed worker's end (the kernel has freed its memory and closed its connections).
fn recovery(run: usize, b: &Args) -> anyhow::Result<(f64, f64)> {
    let mut job = Job::start(&format!("rec{run}"), &hosts(2, 2, 2), 4, 4, b, None)?;
    job.step_at(4, Instant::now())?;
    thread::sleep(Duration::from_millis(300));
    let pid = job
        .worker_on("127.0.0.3")
        .context("no worker on 127.0.0.3")?;
    let t0 = Instant::now();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGKILL,
    )?;
    let dead = died(pid, t0);
    let (t1, _) = job.step_at(2, t0)?;
    Ok(((t1 - t0).as_secs_f64(), (dead - t0).as_secs_f64()))
}

/// When process `pid`, killed at `killed`, has ended: its connections close only once its
/// last thread has exited, after the kernel has freed its memory, which is when its pidfd
/// becomes readable. Waited for in `poll`, so that measuring takes no core from the job
/// being measured (looking at `/proc` every millisecond took 5-10% of one).
fn died(pid: i32, killed: Instant) -> Instant {
    use rustix::event::{PollFd, PollFlags, Timespec, poll};
    use rustix::process::{Pid, PidfdFlags, pidfd_open};
    let Some(fd) = Pid::from_raw(pid).and_then(|p| pidfd_open(p, PidfdFlags::empty()).ok()) else {
        return Instant::now(); // already reaped: it ended before now
    };
    let left = Duration::from_secs(5).saturating_sub(killed.elapsed());
    let timeout = Timespec {
        tv_sec: left.as_secs() as i64,
        tv_nsec: i64::from(left.subsec_nanos()),
    };
    let mut fds = [PollFd::new(&fd, PollFlags::IN)];
    let _ = poll(&mut fds, Some(&timeout));
    Instant::now()
}

/// SIGSTOP of one worker → the first step at size 2, once the driver declared it frozen.
fn frozen(run: usize, b: &Args) -> anyhow::Result<f64> {
    let mut job = Job::start(&format!("frz{run}"), &hosts(2, 2, 2), 4, 4, b, None)?;
    job.step_at(4, Instant::now())?;
    // The runs spread the SIGSTOP over the driver's ping period (a quarter of the timeout):
    // how long before the freeze the worker last answered decides when it is declared.
    let phase = b.heartbeat_timeout / 4.0 * run as f64 / b.runs as f64;
    thread::sleep(Duration::from_secs_f64(0.3 + phase));
    let pid = job
        .worker_on("127.0.0.3")
        .context("no worker on 127.0.0.3")?;
    let t0 = Instant::now();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGSTOP,
    )?;
    let (t1, _) = job.step_at(2, t0)?;
    Ok((t1 - t0).as_secs_f64())
}

fn scale_up(run: usize, b: &Args) -> anyhow::Result<(f64, f64)> {
    let mut job = Job::start(&format!("up{run}"), &hosts(2, 2, 2), 4, 6, b, None)?;
    job.step_at(4, Instant::now())?;
    thread::sleep(Duration::from_millis(300));
    let t0 = Instant::now();
    job.set_hosts(&hosts(2, 3, 2))?;
    let (t1, _) = job.step_at(6, t0)?;
    let last = job
        .last_step_before(4, t1)
        .context("no step at the old size")?;
    Ok(((t1 - t0).as_secs_f64(), (t1 - last).as_secs_f64()))
}

fn rebuild(run: usize, n: usize, b: &Args, store: Option<&StoreOpts>) -> anyhow::Result<f64> {
    let name = format!("rb{n}-{run}{}", if store.is_some() { "-store" } else { "" });
    let mut job = Job::start(&name, &hosts(2, n - 1, 1), n - 1, n, b, store)?;
    job.step_at(n - 1, Instant::now())?;
    thread::sleep(Duration::from_millis(300));
    let t0 = Instant::now();
    job.set_hosts(&hosts(2, n, 1))?;
    let (t1, first) = job.step_at(n, t0)?;
    job.pause(n - 1, t1, &first)
}

/// One host leaving a job of 4 workers on 2 hosts: a worker of 127.0.0.3 gets a SIGTERM (its
/// host gives notice) or, without `notice`, 127.0.0.3 leaves discovery. Seconds from then to
/// the first step at size 2, and the training pause.
fn leave(run: usize, notice: bool, b: &Args) -> anyhow::Result<(f64, f64)> {
    let name = format!("leave{run}-{}", if notice { "notice" } else { "discovery" });
    let mut job = Job::start(&name, &hosts(2, 2, 2), 4, 4, b, None)?;
    job.step_at(4, Instant::now())?;
    thread::sleep(Duration::from_millis(300));
    let t0 = Instant::now();
    if notice {
        let pid = job
            .worker_on("127.0.0.3")
            .context("no worker on 127.0.0.3")?;
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid),
            nix::sys::signal::Signal::SIGTERM,
        )?;
    } else {
        job.set_hosts(&hosts(2, 1, 2))?;
    }
    let (t1, first) = job.step_at(2, t0)?;
    Ok(((t1 - t0).as_secs_f64(), job.pause(4, t1, &first)?))
}

/// The failover figures of one run: SIGKILL of the active driver → every worker adopted by
/// the standby (s), and the longest gap between two of rank 0's steps around it (ms).
fn failover(run: usize, b: &Args, e: &etcd::Etcd) -> anyhow::Result<(f64, f64)> {
    let prefix = format!("bench/failover-{}-{run}", std::process::id());
    let store = StoreOpts {
        url: e.url(&prefix),
        port: free_port()?,
    };
    let mut job = Job::start(&format!("fo{run}"), &hosts(2, 2, 2), 4, 4, b, Some(&store))?;
    job.step_at(4, Instant::now())?;
    job.start_standby()?;
    thread::sleep(Duration::from_millis(300));
    let t0 = Instant::now();
    let killed_ms = unix_ms();
    job.child.kill()?;
    job.child.wait()?;
    let t1 = job.standby_line("adopted a worker", 4)?;
    let adopted_ms = unix_ms();
    // Let rank 0 step on for a second past the adoption, then read what it wrote (its spool
    // file outlives both drivers' relays).
    thread::sleep(Duration::from_secs(1));
    let (from, to) = (killed_ms.saturating_sub(1000), adopted_ms + 1000);
    let mut at: Vec<u64> = spooled_steps(&prefix, 0)?
        .into_iter()
        .filter(|&t| t >= from && t <= to)
        .collect();
    at.sort_unstable();
    if at.len() < 2 {
        bail!("rank 0 stepped {} times around the failover", at.len());
    }
    let gap = at.windows(2).map(|w| w[1] - w[0]).max().unwrap_or(0);
    Ok(((t1 - t0).as_secs_f64(), gap as f64))
}

fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// The `at_ms` of every step line rank `rank` wrote to the spool of the job under `prefix`.
fn spooled_steps(prefix: &str, rank: u64) -> anyhow::Result<Vec<u64>> {
    let name: String = format!("/{prefix}")
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect();
    let spool = std::env::temp_dir().join(format!("hvd-spool{name}"));
    let mut at = Vec::new();
    for e in std::fs::read_dir(&spool).with_context(|| format!("{}", spool.display()))? {
        let path = e?.path();
        if path.extension().is_none_or(|x| x != "stdout") {
            continue;
        }
        for l in std::fs::read_to_string(&path)?.lines() {
            let Ok(v) = serde_json::from_str::<Value>(l) else {
                continue;
            };
            if v["event"] == "step" && v["rank"] == rank {
                at.extend(v["at_ms"].as_u64());
            }
        }
    }
    Ok(at)
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if args.runs == 0 || args.sizes.iter().any(|&n| n < 2) || args.store_size < 2 {
        bail!("--runs must be at least 1, and every --sizes entry and --store-size at least 2");
    }
    if !(args.heartbeat_timeout.is_finite() && args.heartbeat_timeout > 0.0) {
        bail!("--heartbeat-timeout must be a positive number of seconds");
    }
    println!(
        "# elastic_bench: medians of {} runs, counter at 10 ms/step, discovery every {} s, \
         heartbeat timeout {} s",
        args.runs, args.interval, args.heartbeat_timeout
    );
    let want = |f: Figure| args.figures.contains(&f);
    if want(Figure::Recovery) {
        let (rec, death): (Vec<f64>, Vec<f64>) = (0..args.runs)
            .map(|r| recovery(r, &args))
            .collect::<anyhow::Result<Vec<_>>>()?
            .into_iter()
            .unzip();
        println!(
            "recovery (SIGKILL 1 of 4 -> first step at size 2): {:.3} s  [{}]",
            median(rec.clone()),
            fmt(&rec)
        );
        println!(
            "  the killed worker ended (its memory freed, its connections closed) after: \
             {:.3} s  [{}]",
            median(death.clone()),
            fmt(&death)
        );
    }
    if want(Figure::ScaleUp) {
        scale_ups(&args)?;
    }
    if want(Figure::Rebuild) {
        for &n in &args.sizes {
            let v: Vec<f64> = (0..args.runs)
                .map(|r| rebuild(r, n, &args, None))
                .collect::<anyhow::Result<_>>()?;
            println!(
                "re-rendezvous + ring rebuild + sync at {n:>2} workers (pause): {:.3} s  [{}]",
                median(v.clone()),
                fmt(&v)
            );
        }
    }
    if want(Figure::Frozen) {
        let v: Vec<f64> = (0..args.runs)
            .map(|r| frozen(r, &args))
            .collect::<anyhow::Result<_>>()?;
        let (m, target) = (median(v.clone()), args.heartbeat_timeout + 1.0);
        println!(
            "frozen (SIGSTOP 1 of 4 -> first step at size 2): {m:.3} s  [{}]  target {target:.1} s \
             (heartbeat timeout + 1 s): {}",
            fmt(&v),
            if v.iter().all(|&x| x <= target) {
                "every run within"
            } else if m <= target {
                "median within, some runs over"
            } else {
                "over"
            }
        );
    }
    if want(Figure::Notice) {
        leaves(&args)?;
    }
    if want(Figure::Failover) || want(Figure::Store) {
        // On disk, as a deployment's etcd keeps its data.
        let e = etcd::Etcd::start_in(&std::env::temp_dir());
        if want(Figure::Failover) {
            failovers(&args, &e)?;
        }
        if want(Figure::Store) {
            store_cost(&args, &e)?;
        }
    }
    Ok(())
}

/// The failover figures: adoption time against the lease's TTL + 1 s, and the training pause.
fn failovers(args: &Args, e: &etcd::Etcd) -> anyhow::Result<()> {
    let v: Vec<(f64, f64)> = (0..args.runs)
        .map(|r| failover(r, args, e))
        .collect::<anyhow::Result<_>>()?;
    let (adopted, gaps): (Vec<f64>, Vec<f64>) = v.into_iter().unzip();
    let target = TTL as f64 + 1.0;
    println!(
        "failover (SIGKILL of the active driver -> every worker adopted by the standby, ttl \
         {TTL} s): {:.3} s  [{}]  target {target:.1} s: {}",
        median(adopted.clone()),
        fmt(&adopted),
        if adopted.iter().all(|&x| x <= target) {
            "every run within"
        } else {
            "over"
        }
    );
    println!(
        "failover: longest gap between two steps of rank 0 around it (10 ms steps): {:.0} ms  \
         [{}]",
        median(gaps.clone()),
        gaps.iter()
            .map(|g| format!("{g:.0}"))
            .collect::<Vec<_>>()
            .join(" ")
    );
    Ok(())
}

/// The rebuild pause at `--store-size` workers with the state store on and off, alternating.
fn store_cost(args: &Args, e: &etcd::Etcd) -> anyhow::Result<()> {
    let n = args.store_size;
    let (mut off, mut on) = (Vec::new(), Vec::new());
    for r in 0..args.runs {
        off.push(rebuild(r, n, args, None)?);
        let store = StoreOpts {
            url: e.url(&format!("bench/store-{}-{r}", std::process::id())),
            port: free_port()?,
        };
        on.push(rebuild(r, n, args, Some(&store))?);
    }
    let (m_off, m_on) = (median(off.clone()), median(on.clone()));
    println!(
        "rebuild pause at {n} workers, state store off: {m_off:.3} s  [{}]",
        fmt(&off)
    );
    println!(
        "rebuild pause at {n} workers, state store on:  {m_on:.3} s  [{}]  ({:+.1} ms)",
        fmt(&on),
        (m_on - m_off) * 1000.0
    );
    Ok(())
}

/// A host's notice next to the same host leaving discovery, in alternating runs: the time to
/// the first step without it (from the notice; from the discovery change) and the pauses.
fn leaves(args: &Args) -> anyhow::Result<()> {
    let (mut notice, mut gone) = (Vec::new(), Vec::new());
    for r in 0..args.runs {
        notice.push(leave(r, true, args)?);
        gone.push(leave(r, false, args)?);
    }
    let (n_out, n_pause): (Vec<f64>, Vec<f64>) = notice.into_iter().unzip();
    let (g_out, g_pause): (Vec<f64>, Vec<f64>) = gone.into_iter().unzip();
    println!(
        "notice (SIGTERM 1 of 4 -> first step at size 2): {:.3} s  [{}]",
        median(n_out.clone()),
        fmt(&n_out)
    );
    println!(
        "scale-down (its host leaves discovery -> first step at size 2): {:.3} s  [{}]",
        median(g_out.clone()),
        fmt(&g_out)
    );
    let (np, gp) = (median(n_pause.clone()), median(g_pause.clone()));
    println!(
        "training pause: notice {np:.3} s  [{}]; scale-down {gp:.3} s  [{}]; notice / scale-down \
         {:.2}",
        fmt(&n_pause),
        fmt(&g_pause),
        np / gp
    );
    Ok(())
}

/// The two scale-up figures.
fn scale_ups(args: &Args) -> anyhow::Result<()> {
    let up: Vec<(f64, f64)> = (0..args.runs)
        .map(|r| scale_up(r, args))
        .collect::<anyhow::Result<_>>()?;
    let (from_change, pause): (Vec<f64>, Vec<f64>) = up.into_iter().unzip();
    println!(
        "scale-up 4 -> 6, discovery change -> first step at 6: {:.3} s  [{}]",
        median(from_change.clone()),
        fmt(&from_change)
    );
    println!(
        "scale-up 4 -> 6, training pause: {:.3} s  [{}]",
        median(pause.clone()),
        fmt(&pause)
    );
    Ok(())
}
