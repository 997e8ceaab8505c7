//! Runs one static job: starts a worker per slot, relays their output, serves the rendezvous,
//! and stops everything when one fails, when one is frozen (answers no ping for the heartbeat
//! timeout: a static job has no recovery, so it fails instead of hanging), when the user
//! interrupts, or when the start times out.

use std::path::PathBuf;
use std::process::ExitStatus;
use std::time::Duration;

use hvd_rendezvous::{self as rv, SlotInfo};
use nix::sys::signal::Signal;
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::mpsc;
use tokio::time::{Instant, MissedTickBehavior, sleep_until};

use crate::hosts;
use crate::launch::{
    Ended, Exit, Handle, LaunchMode, Launcher, new_secret, rank_dir, stop_workers,
};
use crate::liveness::{self, Heartbeats};
use crate::rendezvous::{self, Registration, Wire};

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
    /// Bind address of the rendezvous listener; `None` listens on every interface, IPv6 and
    /// IPv4 (workers on other hosts may reach this one either way).
    pub rendezvous_bind: Option<String>,
    /// More variables for every worker (the timeline's).
    pub extra_env: Vec<(String, String)>,
    /// How workers are started.
    pub launch: LaunchMode,
    /// A registered worker silent for longer fails the job (`--heartbeat-timeout`).
    pub heartbeat_timeout: Duration,
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
    /// A worker's agent was lost while the worker ran.
    WorkerLost {
        /// Its rank.
        rank: usize,
        /// Its host.
        host: String,
        /// What happened.
        error: String,
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
    /// A worker answered nothing, not even the driver's pings, for longer than the heartbeat
    /// timeout: frozen (stopped, a paused VM, stuck in the kernel).
    Unresponsive {
        /// Its rank.
        rank: usize,
        /// Its host.
        host: String,
        /// How long it was silent.
        silent: Duration,
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
    env.extend(spec.extra_env.iter().cloned());
    env
}

/// Runs the job to its end.
///
/// # Errors
/// Failures of the driver itself (binding the rendezvous listener, installing signal handlers).
pub async fn run(spec: JobSpec) -> anyhow::Result<Outcome> {
    let size = spec.slots.len();
    let secret = new_secret()?;
    let listener = match &spec.rendezvous_bind {
        Some(addr) => tokio::net::TcpListener::bind((addr.as_str(), 0)).await?,
        None => hvd_serve::bind_any(0, "rendezvous").await?,
    };
    let rendezvous = format!("{}:{}", spec.rendezvous_host, listener.local_addr()?.port());
    tracing::debug!(%rendezvous, "rendezvous listening");
    let (wire_tx, mut wire_rx) = mpsc::channel::<Wire>(size * 2 + 8);
    let server = tokio::spawn(rendezvous::serve(
        listener,
        secret.clone(),
        Some(size as u64),
        wire_tx,
    ));
    let mut sigint = signal(SignalKind::interrupt())?;
    let mut sigterm = signal(SignalKind::terminate())?;
    let (tx, mut rx) = mpsc::channel::<Exit>(size + 8);
    let mut launcher = Launcher::new(
        spec.command.clone(),
        spec.ssh_port,
        spec.ssh_identity.clone(),
        &spec.launch,
        tx,
    )?;
    let mut handles: Vec<Option<Handle>> = vec![None; size];
    let mut relays = Vec::new();
    let mut outcome = None;
    for s in &spec.slots {
        let env = worker_env(&spec, s, &rendezvous, &secret);
        let log = spec
            .output_dir
            .as_ref()
            .map(|d| d.join(rank_dir(s.rank, size)));
        let label = s.rank.to_string();
        match launcher.spawn(s.rank as u64, &label, &s.host, spec.local[s.rank], env, log) {
            Ok(w) => {
                handles[s.rank] = Some(w.handle);
                relays.extend(w.relays);
            }
            Err(error) => {
                outcome = Some(Outcome::SpawnFailed {
                    rank: s.rank,
                    host: s.host.clone(),
                    error,
                });
                break;
            }
        }
    }
    drop(launcher);

    let started = Instant::now();
    let deadline = started + spec.start_timeout;
    let mut conns = Conns {
        slots: &spec.slots,
        started,
        regs: (0..size).map(|_| None).collect(),
        heard: Heartbeats::new(spec.heartbeat_timeout),
        world_sent: false,
    };
    let mut running = handles.iter().filter(|h| h.is_some()).count();
    let mut exited = vec![false; size];
    let mut pings = tokio::time::interval(liveness::ping_period(spec.heartbeat_timeout));
    pings.set_missed_tick_behavior(MissedTickBehavior::Delay);
    while outcome.is_none() && running > 0 {
        let silence = conns.heard.next_silence().map_or(
            started + Duration::from_secs(3600 * 24 * 365),
            Instant::from_std,
        );
        tokio::select! {
            Some(ev) = wire_rx.recv() => conns.wire(ev),
            _ = pings.tick() => conns.ping(),
            () = sleep_until(silence) => {
                // Answers already queued count: a driver held up must not blame the workers.
                while let Ok(ev) = wire_rx.try_recv() {
                    conns.wire(ev);
                }
                let frozen = conns.heard.take_silent(Instant::now().into_std());
                if let Some(&(rank, silent)) = frozen.first() {
                    let rank = rank as usize;
                    let host = spec.slots[rank].host.clone();
                    tracing::warn!(rank, %host, silent_s = silent.as_secs_f64(), "worker stopped answering the driver (frozen?); a static job can't go on without it");
                    outcome = Some(Outcome::Unresponsive { rank, host, silent });
                }
            }
            ev = rx.recv() => match ev {
                Some(Exit { worker, end }) => {
                    let rank = worker as usize;
                    if rank >= size || exited[rank] {
                        continue;
                    }
                    exited[rank] = true;
                    conns.heard.forget(worker);
                    running -= 1;
                    let host = spec.slots[rank].host.clone();
                    match end {
                        Ended::Status(status) if status.success() => tracing::debug!(rank, "worker exited 0"),
                        Ended::Status(status) => outcome = Some(Outcome::WorkerFailed { rank, host, status }),
                        Ended::NotStarted(error) => outcome = Some(Outcome::SpawnFailed { rank, host, error }),
                        Ended::Lost(error) => outcome = Some(Outcome::WorkerLost { rank, host, error }),
                    }
                }
                None => break,
            },
            () = sleep_until(deadline), if !conns.world_sent => {
                let missing = (0..size).filter(|&r| conns.regs[r].is_none()).collect();
                outcome = Some(Outcome::StartTimeout { missing, waited: spec.start_timeout });
            }
            _ = sigint.recv() => outcome = Some(Outcome::Interrupted(Signal::SIGINT)),
            _ = sigterm.recv() => outcome = Some(Outcome::Interrupted(Signal::SIGTERM)),
        }
    }
    if running > 0 {
        let targets: Vec<(u64, Handle)> = handles
            .iter()
            .enumerate()
            .filter(|(r, _)| !exited[*r])
            .filter_map(|(r, h)| h.clone().map(|h| (r as u64, h)))
            .collect();
        stop_workers(&targets, &mut rx).await;
    }
    drop(handles); // closes the agent connections: nothing of this job is left to run there
    server.abort();
    drop(conns); // closes the rendezvous connections
    for r in relays {
        // Output of a killed worker's children may hold a pipe open: don't wait on it forever.
        let _ = tokio::time::timeout(Duration::from_millis(500), r).await;
    }
    Ok(outcome.unwrap_or(Outcome::Success))
}

/// The rendezvous connections of a static job: who registered, and when each was last heard
/// from while its connection is open.
struct Conns<'a> {
    slots: &'a [SlotInfo],
    started: Instant,
    regs: Vec<Option<Registration>>,
    heard: Heartbeats,
    world_sent: bool,
}

impl Conns<'_> {
    /// Handles one message of the rendezvous connections.
    fn wire(&mut self, ev: Wire) {
        let size = self.regs.len();
        let heard_from = |heard: &mut Heartbeats, worker: u64| {
            heard.heard(worker, Instant::now().into_std());
        };
        match ev {
            Wire::Registered(reg) => {
                let rank = reg.worker as usize;
                if self.regs[rank].is_some() || self.world_sent {
                    tracing::warn!(rank, "second registration for a rank; ignored");
                    return;
                }
                tracing::debug!(rank, addr = %reg.addr, pid = reg.pid, "worker registered");
                self.heard.watch(reg.worker, Instant::now().into_std());
                self.regs[rank] = Some(reg);
                if self.regs.iter().all(Option::is_some) {
                    send_world(self.slots, &self.regs);
                    self.world_sent = true;
                    tracing::info!(
                        workers = size,
                        took_ms = self.started.elapsed().as_millis() as u64,
                        "all workers registered; rank table sent"
                    );
                }
            }
            Wire::Joined { worker, reason, .. } => {
                heard_from(&mut self.heard, worker);
                tracing::warn!(rank = worker, %reason, "a worker of a static job asked for a new round; static jobs have one");
            }
            Wire::Notice { worker, source, .. } => {
                heard_from(&mut self.heard, worker);
                tracing::warn!(rank = worker, %source, "a worker of a static job gave notice that its host is going away; a static job can't go on without it");
            }
            // A static job never aborts a round.
            Wire::AbortSeen { worker, .. }
            | Wire::Synced { worker, .. }
            | Wire::Pong { worker } => {
                heard_from(&mut self.heard, worker);
            }
            Wire::Left { worker, .. } => {
                // It can't answer pings any more; its exit (which follows) is what counts.
                self.heard.forget(worker);
            }
        }
    }

    /// Pings every registered worker whose connection is open.
    fn ping(&mut self) {
        self.heard.pinged(Instant::now().into_std());
        for rank in self.heard.watched() {
            if let Some(Some(r)) = self.regs.get(rank as usize) {
                r.send(&rv::DriverMsg::Ping);
            }
        }
    }
}

/// Sends each registered worker its place and the rank table.
fn send_world(slots: &[SlotInfo], regs: &[Option<Registration>]) {
    let peers: Vec<String> = regs
        .iter()
        .map(|r| r.as_ref().map_or_else(String::new, |r| r.addr.clone()))
        .collect();
    let hosts: Vec<String> = slots.iter().map(|s| s.host.clone()).collect();
    for (slot, reg) in slots.iter().zip(regs) {
        if let Some(reg) = reg {
            reg.send(&rv::DriverMsg::World {
                generation: 0,
                placement: slot.placement(),
                peers: peers.clone(),
                hosts: hosts.clone(),
                updates_through: 0,
            });
        }
    }
}
