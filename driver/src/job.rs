//! Runs one static job: starts a worker per slot, relays their output, serves the rendezvous,
//! and stops everything when one fails, when the user interrupts, or when the start times out.

use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;
use std::process::{ExitStatus, Stdio};
use std::time::Duration;

use hvd_rendezvous::{self as rv, SlotInfo};
use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncWriteExt, BufReader};
use tokio::process::Command;
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::mpsc;
use tokio::time::{Instant, sleep_until};

use crate::hosts;
use crate::rendezvous::{self, Registration};

/// Grace between SIGTERM and SIGKILL when stopping workers.
const TERM_GRACE: Duration = Duration::from_millis(1000);

/// Everything needed to start the workers.
#[derive(Debug, Clone)]
pub struct JobSpec {
    /// One entry per worker, by rank.
    pub slots: Vec<SlotInfo>,
    /// Which slots run on this machine.
    pub local: Vec<bool>,
    /// The training command.
    pub command: Vec<String>,
    /// SSH port for remote hosts.
    pub ssh_port: Option<u16>,
    /// SSH identity for remote hosts.
    pub ssh_identity: Option<PathBuf>,
    /// Directory for per-rank log files.
    pub output_dir: Option<PathBuf>,
    /// How long every worker has to register.
    pub start_timeout: Duration,
    /// Interface the workers bind to.
    pub network_interface: Option<String>,
    /// Address workers use to reach the driver's rendezvous (host part), and where it binds.
    pub rendezvous_host: String,
    /// Bind address of the rendezvous listener.
    pub rendezvous_bind: String,
}

/// How a job ended.
#[derive(Debug)]
pub enum Outcome {
    /// Every worker exited 0.
    Success,
    /// A worker failed; the others were stopped.
    WorkerFailed {
        /// Its rank.
        rank: usize,
        /// Its host.
        host: String,
        /// Its exit status.
        status: ExitStatus,
    },
    /// A worker could not be started.
    SpawnFailed {
        /// Its rank.
        rank: usize,
        /// Its host.
        host: String,
        /// Why.
        error: String,
    },
    /// Not every worker registered in time.
    StartTimeout {
        /// Ranks that never registered.
        missing: Vec<usize>,
        /// The timeout.
        waited: Duration,
    },
    /// The driver got SIGINT or SIGTERM.
    Interrupted(Signal),
}

/// What the tasks around the job tell its loop.
#[derive(Debug)]
pub enum Event {
    /// A worker registered.
    Registered(Registration),
    /// A worker exited.
    Exited {
        /// Its rank.
        rank: usize,
        /// How.
        status: ExitStatus,
    },
}

fn worker_env(
    spec: &JobSpec,
    s: &SlotInfo,
    rendezvous: &str,
    secret: &str,
) -> Vec<(String, String)> {
    let mut env: Vec<(String, String)> = [
        (rv::ENV_RANK, s.rank.to_string()),
        (rv::ENV_SIZE, s.size.to_string()),
        (rv::ENV_LOCAL_RANK, s.local_rank.to_string()),
        (rv::ENV_LOCAL_SIZE, s.local_size.to_string()),
        (rv::ENV_CROSS_RANK, s.cross_rank.to_string()),
        (rv::ENV_CROSS_SIZE, s.cross_size.to_string()),
        (rv::ENV_HOSTNAME, s.host.clone()),
        (rv::ENV_RENDEZVOUS_ADDR, rendezvous.to_string()),
        (rv::ENV_SECRET, secret.to_string()),
        (
            rv::ENV_START_TIMEOUT,
            spec.start_timeout.as_secs_f64().to_string(),
        ),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    if spec.local[s.rank] {
        env.push((rv::ENV_BIND_ADDR.into(), hosts::local_bind_addr(&s.host)));
    }
    if let Some(i) = &spec.network_interface {
        env.push((rv::ENV_NETWORK_INTERFACE.into(), i.clone()));
    }
    env
}

/// Relays one pipe of one worker, a line at a time, prefixed `[rank]<stdout>:` as horovodrun
/// does, and copies it to the rank's log file when one is asked for.
async fn relay(
    rank: usize,
    stream_name: &'static str,
    pipe: impl AsyncRead + Unpin,
    log: Option<PathBuf>,
) {
    let mut lines = BufReader::new(pipe);
    let mut file = match log {
        Some(p) => match tokio::fs::File::create(&p).await {
            Ok(f) => Some(f),
            Err(e) => {
                tracing::error!(rank, path = %p.display(), error = %e, "cannot write the rank's log file");
                None
            }
        },
        None => None,
    };
    let prefix = format!("[{rank}]<{stream_name}>:");
    let mut buf = Vec::new();
    loop {
        buf.clear();
        match lines.read_until(b'\n', &mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(_) => {}
        }
        if !buf.ends_with(b"\n") {
            buf.push(b'\n');
        }
        if let Some(f) = file.as_mut() {
            if let Err(e) = f.write_all(&buf).await {
                tracing::error!(rank, error = %e, "writing the rank's log file failed; console only");
                file = None;
            }
        }
        let mut line = Vec::with_capacity(prefix.len() + buf.len());
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
    }
}

/// A random secret for this job.
pub fn new_secret() -> std::io::Result<String> {
    use std::io::Read;
    let mut b = [0u8; 16];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut b)?;
    Ok(b.iter().map(|x| format!("{x:02x}")).collect())
}

/// Runs the job to its end.
///
/// # Errors
/// Failures of the driver itself (binding the rendezvous listener, installing signal handlers).
pub async fn run(spec: JobSpec) -> anyhow::Result<Outcome> {
    let size = spec.slots.len();
    let secret = new_secret()?;
    let listener = tokio::net::TcpListener::bind((spec.rendezvous_bind.as_str(), 0)).await?;
    let rendezvous = format!("{}:{}", spec.rendezvous_host, listener.local_addr()?.port());
    tracing::debug!(%rendezvous, "rendezvous listening");
    let (tx, mut rx) = mpsc::channel::<Event>(size * 2 + 8);
    let server = tokio::spawn(rendezvous::serve(
        listener,
        secret.clone(),
        size,
        tx.clone(),
    ));
    let mut sigint = signal(SignalKind::interrupt())?;
    let mut sigterm = signal(SignalKind::terminate())?;

    if let Some(dir) = &spec.output_dir {
        for s in &spec.slots {
            std::fs::create_dir_all(dir.join(format!("rank.{}", s.rank)))?;
        }
    }
    let cwd = std::env::current_dir()?;
    let mut pids: Vec<Option<i32>> = vec![None; size];
    let mut relays = Vec::new();
    let mut outcome = None;
    for s in &spec.slots {
        let env = worker_env(&spec, s, &rendezvous, &secret);
        let mut cmd = if spec.local[s.rank] {
            let mut c = Command::new(&spec.command[0]);
            c.args(&spec.command[1..]).envs(env);
            c
        } else {
            let argv = hosts::ssh_argv(
                &s.host,
                spec.ssh_port,
                spec.ssh_identity.as_deref(),
                &cwd,
                &env,
                &spec.command,
            );
            let mut c = Command::new(&argv[0]);
            c.args(&argv[1..]);
            c
        };
        // Its own process group, so stopping a worker stops whatever it started too.
        cmd.process_group(0)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => {
                outcome = Some(Outcome::SpawnFailed {
                    rank: s.rank,
                    host: s.host.clone(),
                    error: format!("{}: {e}", spec.command[0]),
                });
                break;
            }
        };
        pids[s.rank] = child.id().and_then(|p| i32::try_from(p).ok());
        tracing::debug!(rank = s.rank, host = %s.host, pid = ?pids[s.rank], "worker started");
        let log = |name: &str| {
            spec.output_dir
                .as_ref()
                .map(|d| d.join(format!("rank.{}", s.rank)).join(name))
        };
        if let Some(out) = child.stdout.take() {
            relays.push(tokio::spawn(relay(s.rank, "stdout", out, log("stdout"))));
        }
        if let Some(err) = child.stderr.take() {
            relays.push(tokio::spawn(relay(s.rank, "stderr", err, log("stderr"))));
        }
        let (tx, rank) = (tx.clone(), s.rank);
        tokio::spawn(async move {
            let status = match child.wait().await {
                Ok(st) => st,
                Err(e) => {
                    tracing::error!(rank, error = %e, "waiting for worker failed");
                    ExitStatus::from_raw(1 << 8)
                }
            };
            let _ = tx.send(Event::Exited { rank, status }).await; // the job may be over
        });
    }
    drop(tx);

    let started = Instant::now();
    let deadline = started + spec.start_timeout;
    let mut regs: Vec<Option<Registration>> = (0..size).map(|_| None).collect();
    let mut world_sent = false;
    let mut running = pids.iter().filter(|p| p.is_some()).count();
    let mut exited = vec![false; size];
    while outcome.is_none() && running > 0 {
        tokio::select! {
            ev = rx.recv() => match ev {
                Some(Event::Registered(reg)) => {
                    let rank = reg.rank;
                    if regs[rank].is_some() || world_sent {
                        tracing::warn!(rank, "second registration for a rank; ignored");
                        continue;
                    }
                    tracing::debug!(rank, addr = %reg.addr, pid = reg.pid, "worker registered");
                    regs[rank] = Some(reg);
                    if regs.iter().all(Option::is_some) {
                        if let Err(e) = rendezvous::send_world(&mut regs).await {
                            tracing::warn!(error = %e, "rank table not delivered");
                        }
                        world_sent = true;
                        tracing::info!(workers = size, took_ms = started.elapsed().as_millis() as u64, "all workers registered; rank table sent");
                    }
                }
                Some(Event::Exited { rank, status }) => {
                    exited[rank] = true;
                    running -= 1;
                    if status.success() {
                        tracing::debug!(rank, "worker exited 0");
                    } else {
                        outcome = Some(Outcome::WorkerFailed { rank, host: spec.slots[rank].host.clone(), status });
                    }
                }
                None => break,
            },
            () = sleep_until(deadline), if !world_sent => {
                let missing = (0..size).filter(|&r| regs[r].is_none()).collect();
                outcome = Some(Outcome::StartTimeout { missing, waited: spec.start_timeout });
            }
            _ = sigint.recv() => outcome = Some(Outcome::Interrupted(Signal::SIGINT)),
            _ = sigterm.recv() => outcome = Some(Outcome::Interrupted(Signal::SIGTERM)),
        }
    }
    if running > 0 {
        stop_workers(&pids, &mut exited, &mut running, &mut rx).await;
    }
    server.abort();
    drop(regs); // closes the rendezvous connections
    for r in relays {
        // Output of a killed worker's children may hold a pipe open: don't wait on it forever.
        let _ = tokio::time::timeout(Duration::from_millis(500), r).await;
    }
    Ok(outcome.unwrap_or(Outcome::Success))
}

/// SIGTERM to every running worker's process group, SIGKILL after a grace period.
async fn stop_workers(
    pids: &[Option<i32>],
    exited: &mut [bool],
    running: &mut usize,
    rx: &mut mpsc::Receiver<Event>,
) {
    tracing::info!(workers = *running, "stopping the remaining workers");
    for sig in [Signal::SIGTERM, Signal::SIGKILL] {
        for (rank, pid) in pids.iter().enumerate() {
            if let (Some(pid), false) = (pid, exited[rank]) {
                if let Err(e) = killpg(Pid::from_raw(*pid), sig) {
                    tracing::debug!(rank, error = %e, "signalling worker failed (already gone?)");
                }
            }
        }
        let until = Instant::now() + TERM_GRACE;
        while *running > 0 {
            tokio::select! {
                ev = rx.recv() => match ev {
                    Some(Event::Exited { rank, .. }) => {
                        exited[rank] = true;
                        *running -= 1;
                    }
                    Some(Event::Registered(_)) => {}
                    None => return,
                },
                () = sleep_until(until) => break,
            }
        }
        if *running == 0 {
            return;
        }
    }
}
