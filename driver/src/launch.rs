//! The launch layer the static and the elastic job share: starting worker processes on this
//! machine, through `ssh` or through the `hvd-agent` on their host ([`Launcher`]), relaying their
//! output (`[rank]<stdout>:` lines, log files, spool files a successor driver goes on from),
//! reporting each one's end once ([`Exit`]), and stopping them ([`Handle`], [`stop_workers`]).

use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;
use std::process::{ExitStatus, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncWriteExt, BufReader, DuplexStream};
use tokio::process::Command;
use tokio::sync::mpsc;
use tokio::time::{Instant, sleep_until};

use crate::agent::{Agents, Remote};
use crate::hosts;

/// Grace between SIGTERM and SIGKILL when stopping workers.
const TERM_GRACE: Duration = Duration::from_millis(1000);

/// How workers are started (`--launcher`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LaunchMode {
    /// Local processes for this machine's names and loopback addresses, `ssh` for the rest.
    Auto,
    /// Every worker through the `hvd-agent` on its host.
    Agent {
        /// The agents' port.
        port: u16,
        /// The secret shared with the agents.
        secret: String,
    },
}

/// A worker process ended (or never began).
#[derive(Debug)]
pub struct Exit {
    /// The worker's id (its rank, in a static job).
    pub worker: u64,
    /// How it ended.
    pub end: Ended,
}

/// How a worker ended.
#[derive(Debug)]
pub enum Ended {
    /// Its process ended with this status.
    Status(ExitStatus),
    /// It was never started: why (an agent that is unreachable or refused to start it).
    NotStarted(String),
    /// It started, but its agent was lost: what happened. The agent stops it (or it exits when
    /// its rendezvous connection closes).
    Lost(String),
}

/// How far a spool file has been relayed: the end of the last whole line printed, kept in a
/// file beside it so a driver that takes over goes on from there.
struct Mark {
    path: PathBuf,
    at: u64,
    written: Instant,
}

impl Mark {
    /// Records that `n` more bytes were printed; writes the offset at most every 50 ms (a
    /// mark behind the truth repeats lines after a takeover, it never loses one).
    async fn advance(&mut self, n: usize, force: bool) {
        self.at += n as u64;
        if force || self.written.elapsed() >= Duration::from_millis(50) {
            self.written = Instant::now();
            if let Err(e) = tokio::fs::write(&self.path, self.at.to_string()).await {
                tracing::debug!(path = %self.path.display(), error = %e, "cannot mark what was relayed");
            }
        }
    }
}

/// Whether relayed lines start with the local time (`--prefix-output-with-timestamp`).
static TIMESTAMPED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Makes every relayed line start with the local time, as Horovod's
/// `--prefix-output-with-timestamp` does (`Tue Nov 24 10:00:00 2026[0]<stdout>:…`).
pub fn set_timestamped_output(on: bool) {
    TIMESTAMPED.store(on, std::sync::atomic::Ordering::Relaxed);
}

/// The local time as C's `asctime` writes it (Horovod's output prefix), or UTC where the
/// time zone cannot be read.
fn asctime_now() -> String {
    let now = jiff::Timestamp::now();
    let zoned = now.to_zoned(jiff::tz::TimeZone::try_system().unwrap_or(jiff::tz::TimeZone::UTC));
    zoned.strftime("%a %b %e %H:%M:%S %Y").to_string()
}

/// Relays one pipe of one worker, a line at a time, prefixed `[rank]<stdout>:` as horovodrun
/// does (after the local time with `--prefix-output-with-timestamp`), and copies it to the
/// rank's log file when one is asked for.
async fn relay(
    label: String,
    stream_name: &'static str,
    pipe: impl AsyncRead + Unpin,
    log: Option<PathBuf>,
    mut mark: Option<Mark>,
    append: bool,
) {
    let mut lines = BufReader::new(pipe);
    let resumed = append || mark.as_ref().is_some_and(|m| m.at > 0);
    let mut file = match log {
        Some(p) => match tokio::fs::OpenOptions::new()
            .create(true)
            .write(true)
            .append(resumed)
            .truncate(!resumed)
            .open(&p)
            .await
        {
            Ok(f) => Some(f),
            Err(e) => {
                tracing::error!(worker = %label, path = %p.display(), error = %e, "cannot write the rank's log file");
                None
            }
        },
        None => None,
    };
    let prefix = format!("[{label}]<{stream_name}>:");
    let mut buf = Vec::new();
    loop {
        buf.clear();
        match lines.read_until(b'\n', &mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(_) => {}
        }
        let consumed = buf.len();
        let whole = buf.ends_with(b"\n");
        if !whole {
            buf.push(b'\n');
        }
        if let Some(f) = file.as_mut()
            && let Err(e) = f.write_all(&buf).await
        {
            tracing::error!(worker = %label, error = %e, "writing the rank's log file failed; console only");
            file = None;
        }
        let mut line = Vec::with_capacity(prefix.len() + buf.len() + 24);
        if TIMESTAMPED.load(std::sync::atomic::Ordering::Relaxed) {
            line.extend_from_slice(asctime_now().as_bytes());
        }
        line.extend_from_slice(prefix.as_bytes());
        line.extend_from_slice(&buf);
        // One write per line keeps lines of different ranks from interleaving.
        let res = if stream_name == "stdout" {
            std::io::Write::write_all(&mut std::io::stdout().lock(), &line)
        } else {
            std::io::Write::write_all(&mut std::io::stderr().lock(), &line)
        };
        if res.is_err() {
            break; // our own output is closed; nothing else to do with the line
        }
        if let (Some(m), true) = (mark.as_mut(), whole) {
            m.advance(consumed, false).await;
        }
    }
    if let Some(m) = mark.as_mut() {
        m.advance(0, true).await;
    }
}

/// A random secret for this job.
pub fn new_secret() -> std::io::Result<String> {
    use std::io::Read;
    let mut b = [0u8; 16];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut b)?;
    Ok(b.iter().map(|x| format!("{x:02x}")).collect())
}

/// Starts worker processes, locally, through ssh or through agents, and relays their output.
/// Each started worker's end is reported once on `exits`.
#[derive(Debug)]
pub struct Launcher {
    /// The training command.
    pub command: Vec<String>,
    /// SSH port for remote hosts.
    pub ssh_port: Option<u16>,
    /// SSH identity for remote hosts.
    pub ssh_identity: Option<PathBuf>,
    /// Working directory the remote workers change to.
    pub cwd: PathBuf,
    /// Where exits are reported.
    pub exits: mpsc::Sender<Exit>,
    /// With `--launcher agent`: the agents every worker is started through.
    pub agents: Option<Agents>,
    /// Where local workers write their output when it must outlive this driver (a job with a
    /// state store): a file per worker and stream, which the driver tails. Through a pipe, a
    /// worker would die on its next line once the driver is gone.
    pub spool: Option<PathBuf>,
}

/// The directory of rank `rank`'s logs under `--output-filename` in a job of `size` ranks:
/// `rank.<rank>`, the rank padded with zeros to the width of the highest rank so the
/// directories sort in rank order, as Horovod names them.
pub fn rank_dir(rank: usize, size: usize) -> String {
    let width = size.saturating_sub(1).max(1).to_string().len();
    format!("rank.{rank:0width$}")
}

/// The file of `stream` (`stdout`, `stderr`) of worker `id` in a spool directory.
pub fn spool_file(dir: &std::path::Path, id: u64, stream: &str) -> PathBuf {
    dir.join(format!("worker.{id}.{stream}"))
}

/// Relays the lines a worker writes to `path` (as [`relay`] does a pipe's) until `ended` is
/// set and the file is read to its end. It starts where the last relay of the file stopped
/// (kept in `<path>.relayed`), so a driver that takes over a worker repeats at most the lines
/// of the predecessor's last 50 ms and loses none the worker wrote while no driver was up.
pub fn tail(
    label: String,
    stream_name: &'static str,
    path: PathBuf,
    ended: Arc<AtomicBool>,
    log: Option<PathBuf>,
) -> tokio::task::JoinHandle<()> {
    use tokio::io::{AsyncReadExt, AsyncSeekExt};
    let (mut tx, rx) = tokio::io::duplex(64 * 1024);
    let mut mark_name = path.clone().into_os_string();
    mark_name.push(".relayed");
    let mark_path = PathBuf::from(mark_name);
    let at: u64 = std::fs::read_to_string(&mark_path)
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0);
    tokio::spawn(async move {
        let mut f = match tokio::fs::File::open(&path).await {
            Ok(f) => f,
            Err(e) => {
                tracing::error!(path = %path.display(), error = %e, "cannot read a worker's output");
                return;
            }
        };
        if f.seek(std::io::SeekFrom::Start(at)).await.is_err() {
            return;
        }
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            // Read after checking: what the worker wrote before it ended is all there.
            let done = ended.load(Ordering::SeqCst);
            match f.read(&mut buf).await {
                Ok(0) | Err(_) if done => return,
                Ok(0) | Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
                Ok(n) => {
                    if tx.write_all(&buf[..n]).await.is_err() {
                        return;
                    }
                }
            }
        }
    });
    let mark = Mark {
        path: mark_path,
        at,
        written: Instant::now(),
    };
    tokio::spawn(relay(label, stream_name, rx, log, Some(mark), false))
}

/// Relays an agent-run worker's two output streams, writing its log files in `log_dir`
/// (`--output-filename`) too when there are any: truncated for a worker just started,
/// appended to for one an agent handed over from a predecessor.
pub fn relay_remote(
    label: &str,
    out: DuplexStream,
    err: DuplexStream,
    log_dir: Option<PathBuf>,
    append: bool,
) -> Vec<tokio::task::JoinHandle<()>> {
    if let Some(d) = &log_dir
        && let Err(e) = std::fs::create_dir_all(d)
    {
        tracing::error!(dir = %d.display(), error = %e, "cannot create the rank's log directory");
    }
    let file = |name: &str| log_dir.as_ref().map(|d| d.join(name));
    vec![
        tokio::spawn(relay(
            label.to_string(),
            "stdout",
            out,
            file("stdout"),
            None,
            append,
        )),
        tokio::spawn(relay(
            label.to_string(),
            "stderr",
            err,
            file("stderr"),
            None,
            append,
        )),
    ]
}

/// A started worker.
#[derive(Debug)]
pub struct Spawned {
    /// How to stop it.
    pub handle: Handle,
    /// The tasks relaying its output.
    pub relays: Vec<tokio::task::JoinHandle<()>>,
}

/// How to stop a started worker.
#[derive(Debug, Clone)]
pub enum Handle {
    /// A process group of this machine (a local worker, or the ssh client of a remote one).
    Group(i32),
    /// A process whose pid was gone before it was known.
    Gone,
    /// A process an agent runs.
    Agent(Remote),
}

impl Handle {
    /// SIGTERM or SIGKILL to the worker's process group; through an agent, SIGTERM is a stop
    /// that the agent itself escalates to SIGKILL after [`TERM_GRACE`].
    pub fn signal(&self, sig: Signal) {
        match self {
            Handle::Group(pid) => {
                if sig == Signal::SIGKILL {
                    hvd_agent::dying::yield_cores(*pid);
                }
                if let Err(e) = killpg(Pid::from_raw(*pid), sig) {
                    tracing::debug!(pid, error = %e, "signalling worker failed (already gone?)");
                }
            }
            Handle::Gone => {}
            Handle::Agent(r) => r.stop(if sig == Signal::SIGKILL {
                Duration::ZERO
            } else {
                TERM_GRACE
            }),
        }
    }
}

impl Launcher {
    /// A launcher for `command`, started as `mode` says; exits go to `exits`.
    ///
    /// # Errors
    /// When the current directory can't be read.
    pub fn new(
        command: Vec<String>,
        ssh_port: Option<u16>,
        ssh_identity: Option<PathBuf>,
        mode: &LaunchMode,
        exits: mpsc::Sender<Exit>,
    ) -> std::io::Result<Self> {
        Ok(Self {
            command,
            ssh_port,
            ssh_identity,
            cwd: std::env::current_dir()?,
            exits,
            agents: match mode {
                LaunchMode::Auto => None,
                LaunchMode::Agent { port, secret } => Some(Agents::new(*port, secret.clone())),
            },
            spool: None,
        })
    }

    /// Starts worker `id` on `host` with `env`; its output lines carry `[label]`, and are also
    /// written to `log/{stdout,stderr}` when `log` is given.
    ///
    /// # Errors
    /// The reason the process could not be started.
    pub fn spawn(
        &mut self,
        id: u64,
        label: &str,
        host: &str,
        local: bool,
        env: Vec<(String, String)>,
        log: Option<PathBuf>,
    ) -> Result<Spawned, String> {
        if let Some(dir) = &log {
            std::fs::create_dir_all(dir)
                .map_err(|e| format!("creating the log directory {}: {e}", dir.display()))?;
        }
        let file = |name: &str| log.as_ref().map(|d| d.join(name));
        if let Some(agents) = self.agents.as_mut() {
            let cwd = Some(self.cwd.display().to_string());
            let (remote, out, err) =
                agents.start(host, id, self.command.clone(), env, cwd, &self.exits)?;
            tracing::debug!(worker = id, host, "worker handed to the agent");
            let relays = relay_remote(label, out, err, log.clone(), false);
            return Ok(Spawned {
                handle: Handle::Agent(remote),
                relays,
            });
        }
        let mut cmd = if local {
            let mut c = Command::new(&self.command[0]);
            c.args(&self.command[1..]).envs(env);
            c
        } else {
            let argv = hosts::ssh_argv(
                host,
                self.ssh_port,
                self.ssh_identity.as_deref(),
                &self.cwd,
                &env,
                &self.command,
            );
            let mut c = Command::new(&argv[0]);
            c.args(&argv[1..]);
            c
        };
        // Its own process group, so stopping a worker stops whatever it started too.
        cmd.process_group(0).stdin(Stdio::null()).kill_on_drop(true);
        let spool = self.spool.as_ref().filter(|_| local);
        let ended = Arc::new(AtomicBool::new(false));
        let mut relays = Vec::new();
        if let Some(dir) = spool {
            std::fs::create_dir_all(dir)
                .map_err(|e| format!("creating the output spool {}: {e}", dir.display()))?;
            for (name, out) in [("stdout", true), ("stderr", false)] {
                let path = spool_file(dir, id, name);
                let f = std::fs::File::create(&path)
                    .map_err(|e| format!("creating {}: {e}", path.display()))?;
                // A mark left by an earlier job under the same prefix means nothing here.
                let mut mark = path.clone().into_os_string();
                mark.push(".relayed");
                let _ = std::fs::remove_file(mark);
                if out {
                    cmd.stdout(Stdio::from(f));
                } else {
                    cmd.stderr(Stdio::from(f));
                }
                relays.push(tail(
                    label.to_string(),
                    name,
                    path,
                    Arc::clone(&ended),
                    file(name),
                ));
            }
        } else {
            cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
        }
        let mut child = cmd
            .spawn()
            .map_err(|e| format!("{}: {e}", self.command[0]))?;
        let pid = child.id().and_then(|p| i32::try_from(p).ok());
        tracing::debug!(worker = id, host, ?pid, "worker started");
        if let Some(out) = child.stdout.take() {
            relays.push(tokio::spawn(relay(
                label.to_string(),
                "stdout",
                out,
                file("stdout"),
                None,
                false,
            )));
        }
        if let Some(err) = child.stderr.take() {
            relays.push(tokio::spawn(relay(
                label.to_string(),
                "stderr",
                err,
                file("stderr"),
                None,
                false,
            )));
        }
        let exits = self.exits.clone();
        tokio::spawn(async move {
            // A failure is reported as soon as the worker starts dying; its wait follows
            // once the kernel has freed its memory.
            let early = hvd_agent::dying::ended_or_failing(&mut child, pid).await;
            if let Some(status) = early {
                tracing::debug!(worker = id, %status, "worker is dying");
                let _ = exits
                    .send(Exit {
                        worker: id,
                        end: Ended::Status(status),
                    })
                    .await;
            }
            let status = match child.wait().await {
                Ok(st) => st,
                Err(e) => {
                    tracing::error!(worker = id, error = %e, "waiting for worker failed");
                    ExitStatus::from_raw(1 << 8)
                }
            };
            ended.store(true, Ordering::SeqCst);
            if early.is_none() {
                // The job may be over; then nobody listens.
                let end = Ended::Status(status);
                let _ = exits.send(Exit { worker: id, end }).await;
            }
        });
        let handle = pid.map_or(Handle::Gone, Handle::Group);
        Ok(Spawned { handle, relays })
    }
}

/// SIGTERM to each `(worker, handle)`, SIGKILL after a grace period; returns once all have
/// exited or the grace after SIGKILL is over. Exits seen here are returned.
pub async fn stop_workers(targets: &[(u64, Handle)], rx: &mut mpsc::Receiver<Exit>) -> Vec<Exit> {
    let mut left: Vec<(u64, Handle)> = targets.to_vec();
    let mut seen = Vec::new();
    if left.is_empty() {
        return seen;
    }
    tracing::info!(workers = left.len(), "stopping workers");
    for sig in [Signal::SIGTERM, Signal::SIGKILL] {
        for (_, handle) in &left {
            handle.signal(sig);
        }
        let until = Instant::now() + TERM_GRACE;
        while !left.is_empty() {
            tokio::select! {
                ev = rx.recv() => match ev {
                    Some(exit) => {
                        left.retain(|(w, _)| *w != exit.worker);
                        seen.push(exit);
                    }
                    None => return seen,
                },
                () = sleep_until(until) => break,
            }
        }
        if left.is_empty() {
            break;
        }
    }
    seen
}

#[cfg(test)]
mod tests {
    use super::rank_dir;

    #[test]
    fn rank_directories_are_padded_to_the_highest_rank() {
        assert_eq!(rank_dir(0, 1), "rank.0");
        assert_eq!(rank_dir(3, 10), "rank.3");
        assert_eq!(rank_dir(3, 11), "rank.03");
        assert_eq!(rank_dir(10, 11), "rank.10");
        assert_eq!(rank_dir(7, 1000), "rank.007");
    }
}
