//! The I/O around the elastic core: polls discovery, starts and stops worker processes,
//! serves the rendezvous connections, and carries out the core's actions.
//!
//! It also keeps every registered worker's heartbeat: it pings each a few times per
//! `--heartbeat-timeout` on its rendezvous connection, where a thread of the worker's own
//! answers, and tells the core of one that has said nothing at all for longer
//! ([`Input::Unresponsive`]): a frozen process keeps its connections open, and only this
//! tells it from a slow one.

use std::collections::HashMap;
use std::io::Write as _;
use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use hvd_discovery::kubernetes::{self, PodSelector};
use hvd_discovery::{HostSpec, ScriptDiscovery};
use hvd_rendezvous::{self as rv, DriverMsg, HostsUpdate, NoticeSource, Placement};
use nix::sys::signal::Signal;
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::mpsc;
use tokio::time::{Instant, MissedTickBehavior, sleep_until};

use super::control::{Control, StoreSpec};
use super::core::{Action, Config, Core, ExitInfo, Input, Round, WorkerId};
use crate::hosts;
use crate::launch::{Ended, Exit, Handle, LaunchMode, Launcher, new_secret, stop_workers};
use crate::liveness::{self, Heartbeats, StragglerPolicy, Stragglers};
use crate::metrics::{Metrics, Observer};
use crate::rendezvous::{self, Registration, Wire};
use crate::status::{self, Published};
use hvd_serve::status::RankLateness;

/// Where the hosts come from.
#[derive(Debug, Clone)]
pub enum Source {
    /// `--host-discovery-script`, run every interval.
    Script(ScriptDiscovery),
    /// `-H` or `--hostfile`: a fixed set that failures shrink and cooldowns restore.
    Fixed(Vec<HostSpec>),
    /// `--discovery kubernetes`: the Ready pods matching a selector, from a watch on the API
    /// server (no polling).
    Kubernetes(PodSelector),
}

/// Everything an elastic job needs.
#[derive(Debug, Clone)]
pub struct ElasticSpec {
    /// The core's parameters.
    pub core: Config,
    /// Host source.
    pub source: Source,
    /// Time between discovery polls.
    pub interval: Duration,
    /// The training command.
    pub command: Vec<String>,
    /// SSH port for remote hosts.
    pub ssh_port: Option<u16>,
    /// SSH identity for remote hosts.
    pub ssh_identity: Option<PathBuf>,
    /// Directory for per-worker log files.
    pub output_dir: Option<PathBuf>,
    /// Interface the workers bind to.
    pub network_interface: Option<String>,
    /// Address remote workers use to reach the driver (host part).
    pub rendezvous_host: String,
    /// How long a worker has to register (passed to workers as their connect timeout).
    pub start_timeout: Duration,
    /// More variables for every worker (the timeline's).
    pub extra_env: Vec<(String, String)>,
    /// How workers are started.
    pub launch: LaunchMode,
    /// Port of the `GET /status` and `GET /metrics` endpoint, if one is wanted (0: any free
    /// port).
    pub status_port: Option<u16>,
    /// A registered worker silent for longer is declared failed (`--heartbeat-timeout`).
    pub heartbeat_timeout: Duration,
    /// What makes a rank a straggler, and whether its host is evicted.
    pub stragglers: StragglerPolicy,
    /// The rendezvous port (`--rendezvous-port`; any free one without).
    pub rendezvous_port: Option<u16>,
    /// Where the job's state is kept so that another driver can take over (`--state-store`).
    pub store: Option<StoreSpec>,
}

/// How the job ended: the code `horovodrun` exits with and what it prints.
#[derive(Debug)]
pub struct Ending {
    /// Exit code.
    pub code: u8,
    /// Message for the person who ran the job.
    pub message: String,
}

fn describe(end: Ended) -> ExitInfo {
    let status = match end {
        Ended::Status(s) => s,
        Ended::NotStarted(e) => {
            return ExitInfo {
                success: false,
                description: format!("could not be started: {e}"),
            };
        }
        Ended::Lost(e) => {
            return ExitInfo {
                success: false,
                description: e,
            };
        }
    };
    let description = match (status.code(), status.signal()) {
        (Some(c), _) => format!("exited with code {c}"),
        (None, Some(s)) => format!(
            "was killed by signal {s} ({})",
            Signal::try_from(s).map_or("?", Signal::as_str)
        ),
        _ => "ended abnormally".into(),
    };
    ExitInfo {
        success: status.success(),
        description,
    }
}

struct Driver {
    spec: ElasticSpec,
    core: Core,
    t0: Instant,
    secret: String,
    port: u16,
    own_host: String,
    launcher: Launcher,
    /// Workers started and not yet ended.
    handles: HashMap<WorkerId, Handle>,
    /// The host of every worker ever started.
    hosts_of: HashMap<WorkerId, String>,
    regs: HashMap<WorkerId, Registration>,
    /// When each registered worker whose connection is open was last heard from (any
    /// message counts); a worker leaves it when it is declared silent, closes its connection
    /// or exits.
    heard: Heartbeats,
    relays: Vec<tokio::task::JoinHandle<()>>,
    ending: Option<Ending>,
    /// Workers a predecessor started that have not reconnected yet, and until when they may.
    awaiting: HashMap<WorkerId, Instant>,
    /// Workers adopted from a predecessor (not this driver's children): their output files'
    /// tails stop when they are gone, and their end is learnt from their connection.
    adopted: HashMap<WorkerId, Arc<AtomicBool>>,
    /// Turns what the loop sees into the metrics.
    observer: Observer,
    /// Which ranks are stragglers, from rank 0's reports.
    stragglers: Stragglers,
    /// When a straggler's host was last evicted: one host per window at most.
    evicted_at: Option<Instant>,
    /// Rank 0's last lateness report, for the status page, and the round it is of.
    lateness: (u64, Arc<[RankLateness]>),
    /// The core's rounds as last published, and the round they end with.
    rounds: (u64, Arc<[Round]>),
}

impl Driver {
    fn now(&self) -> Duration {
        self.t0.elapsed()
    }

    fn feed(&mut self, input: Input) {
        let mut queue = vec![input];
        while let Some(input) = queue.pop() {
            let now = self.now();
            self.observer.input(now, &input, &self.core);
            for action in self.core.handle(now, input) {
                if let Some(more) = self.apply(action) {
                    queue.push(more);
                }
            }
        }
    }

    /// Takes over a worker a predecessor started, now connected to this driver.
    fn adopt(&mut self, reg: Registration) {
        let id = reg.worker;
        let host = self.core.worker_host(id).unwrap_or(&reg.host).to_string();
        tracing::info!(worker = id, %host, pid = reg.pid, round = ?reg.resume, "adopted a worker of the previous driver");
        let ended = Arc::new(AtomicBool::new(false));
        // Through agents, a worker is the agent's to hand over (see `handed`), even on this
        // machine.
        let by_agent = self.launcher.agents.is_some();
        if !by_agent && hosts::is_local(&host, &self.own_host) {
            if let Ok(pid) = i32::try_from(reg.pid) {
                // Started in a process group of its own, as every local worker is.
                self.handles.insert(id, Handle::Group(pid));
            }
            if let Some(dir) = self.launcher.spool.clone() {
                for name in ["stdout", "stderr"] {
                    let path = crate::launch::spool_file(&dir, id, name);
                    let log = self
                        .spec
                        .output_dir
                        .as_ref()
                        .map(|d| d.join(format!("worker.{id}")).join(name));
                    if path.exists() {
                        self.relays.push(crate::launch::tail(
                            id.to_string(),
                            name,
                            path,
                            Arc::clone(&ended),
                            log,
                        ));
                    }
                }
            }
        }
        // A worker an agent handed over ends by the agent's word, with its real status.
        if !matches!(self.handles.get(&id), Some(Handle::Agent(_))) {
            self.adopted.insert(id, ended);
        }
        self.hosts_of.insert(id, host);
        self.regs.insert(id, reg);
        self.heard.watch(id, Instant::now().into_std());
        self.feed(Input::Registered(id));
    }

    /// A worker of a predecessor that its host's agent kept and handed to this driver: its
    /// stops now go through the agent and its output and exit come from it.
    fn handed(&mut self, (remote, out, err): crate::agent::Handed) {
        let id = remote.id();
        if !self.core.is_live(id) {
            tracing::info!(
                worker = id,
                "an agent handed over a worker this job no longer has; stopping it"
            );
            remote.stop(Duration::ZERO);
            return;
        }
        let log = self
            .spec
            .output_dir
            .as_ref()
            .map(|d| d.join(format!("worker.{id}")));
        self.relays.extend(crate::launch::relay_remote(
            &id.to_string(),
            out,
            err,
            log,
            true,
        ));
        self.handles.insert(id, Handle::Agent(remote));
        if let Some(ended) = self.adopted.remove(&id) {
            ended.store(true, Ordering::SeqCst);
        }
    }

    /// Workers of a predecessor that did not reconnect in time are counted as failed.
    fn give_up_on_missing(&mut self) {
        let now = Instant::now();
        let mut late: Vec<WorkerId> = self
            .awaiting
            .iter()
            .filter(|&(_, &until)| until <= now)
            .map(|(&w, _)| w)
            .collect();
        late.sort_unstable();
        for worker in late {
            self.awaiting.remove(&worker);
            self.feed(Input::Exited {
                worker,
                exit: ExitInfo {
                    success: false,
                    description: "did not reconnect to the driver that took over the job".into(),
                },
            });
        }
    }

    /// Handles one message of the rendezvous connections.
    fn wire(&mut self, w: Wire) {
        match w {
            Wire::Registered(reg) => {
                let id = reg.worker;
                if self.awaiting.remove(&id).is_some()
                    || (reg.resume.is_some()
                        && !self.handles.contains_key(&id)
                        && self.core.is_live(id))
                {
                    self.adopt(reg);
                } else if reg.resume.is_some() && self.handles.contains_key(&id) {
                    // One of this driver's workers whose connection dropped and came back.
                    tracing::info!(worker = id, "a worker reconnected");
                    self.heard.watch(id, Instant::now().into_std());
                    self.regs.insert(id, reg);
                } else if self.handles.contains_key(&id) && !self.core.is_live(id) {
                    // Removed while it was starting (its host gave notice): told now.
                    tracing::debug!(worker = id, host = %reg.host, "a removed worker connected; told to go");
                    reg.send(&DriverMsg::Removed {
                        reason: "the job has no place for this worker any more".into(),
                    });
                } else if self.handles.contains_key(&id) {
                    tracing::debug!(worker = id, host = %reg.host, addr = %reg.addr, pid = reg.pid, "worker connected");
                    self.regs.insert(id, reg);
                    self.heard.watch(id, Instant::now().into_std());
                    self.feed(Input::Registered(id));
                } else if self.hosts_of.contains_key(&id) {
                    // Counted as ended while it was still starting: its agent was lost (it
                    // lives on, orphaned) or its exit raced its registration. Kept, it would
                    // wait for a round that never includes it.
                    tracing::info!(worker = id, host = %reg.host, pid = reg.pid, "a worker that already ended registered; refused");
                    reg.send(&DriverMsg::Refused {
                        reason: format!(
                            "worker {id} has already ended for this job (declared failed, or \
                             its agent was lost)"
                        ),
                    });
                } else {
                    reg.send(&DriverMsg::Refused {
                        reason: format!("no worker {id} was started by this job"),
                    });
                }
            }
            Wire::Joined {
                worker,
                reason,
                generation,
            } => {
                self.heard_from(worker);
                tracing::debug!(worker, generation, "join request");
                self.feed(Input::Joined { worker, reason });
            }
            Wire::AbortSeen { worker, generation } => {
                self.heard_from(worker);
                self.feed(Input::AbortSeen { worker, generation });
            }
            Wire::Synced { worker, generation } => {
                self.heard_from(worker);
                tracing::debug!(worker, generation, "worker synced the state");
                self.feed(Input::Synced { worker, generation });
            }
            Wire::Pong { worker } => self.heard_from(worker),
            Wire::Notice {
                worker,
                source,
                within,
            } => {
                self.heard_from(worker);
                if let Some(host) = self.core.worker_host(worker) {
                    tracing::info!(worker, %host, %source, within_s = within.map(|d| d.as_secs_f64()), "worker gave notice");
                    let host = host.to_string();
                    self.feed(Input::Notice {
                        host,
                        source,
                        within,
                    });
                }
            }
            Wire::Left { worker, clean } => {
                // It can't answer pings any more; its exit (which follows) is what counts.
                self.heard.forget(worker);
                tracing::debug!(worker, clean, "worker connection closed");
                // An adopted worker is not this driver's child: its connection is its end.
                if let Some(ended) = self.adopted.remove(&worker) {
                    ended.store(true, Ordering::SeqCst);
                    self.handles.remove(&worker);
                    self.regs.remove(&worker);
                    let description = if clean {
                        "left after saying goodbye".to_string()
                    } else {
                        "closed its connection without saying goodbye".to_string()
                    };
                    self.feed(Input::Exited {
                        worker,
                        exit: ExitInfo {
                            success: clean,
                            description,
                        },
                    });
                }
            }
        }
    }

    fn heard_from(&mut self, worker: WorkerId) {
        self.heard.heard(worker, Instant::now().into_std());
    }

    /// Pings every registered worker whose connection is open.
    fn ping(&mut self) {
        self.heard.pinged(Instant::now().into_std());
        for id in self.heard.watched() {
            if let Some(r) = self.regs.get(&id) {
                r.send(&DriverMsg::Ping);
            }
        }
    }

    /// Rank 0's report of how much each rank holds the others up: the metric, and the
    /// stragglers it reveals, reported, and under `--straggler-policy evict` their hosts
    /// evicted (one a window).
    fn stragglers_in(&mut self, p: &crate::metrics::Progress) {
        if p.lateness_permille.is_empty() {
            return;
        }
        let hosts: Vec<String> = self
            .core
            .member_hosts()
            .iter()
            .map(|h| (*h).to_string())
            .collect();
        if hosts.len() != p.lateness_permille.len() {
            return; // a report from before the current round
        }
        let now = Instant::now();
        let found = self.stragglers.observe(
            now.into_std(),
            self.core.generation(),
            p.steps,
            &p.lateness_permille,
        );
        // Seconds a step the median rank waits for each rank.
        let period = self.stragglers.period().map_or(0.0, |d| d.as_secs_f64());
        let by_rank: Vec<(f64, &str)> = p
            .lateness_permille
            .iter()
            .map(|&pm| f64::from(pm) / 1000.0 * period)
            .zip(hosts.iter().map(String::as_str))
            .collect();
        self.observer.metrics().lateness(&by_rank);
        let ranks = by_rank
            .iter()
            .zip(&p.lateness_permille)
            .enumerate()
            .map(|(rank, (&(seconds, host), &pm))| RankLateness {
                rank: rank as u64,
                host: host.to_string(),
                seconds,
                factor: liveness::step_factor(f64::from(pm.min(1000)) / 1000.0),
            })
            .collect();
        self.lateness = (self.core.generation(), ranks);
        let policy = self.stragglers.policy();
        for s in found {
            let host = hosts[s.rank].clone();
            tracing::warn!(
                rank = s.rank,
                %host,
                factor = (s.factor * 100.0).round() / 100.0,
                held_up = (s.held_up * 100.0).round() / 100.0,
                window_s = policy.sustained.as_secs_f64(),
                "straggler: this rank's step takes factor times the median rank's"
            );
            let window_over = self
                .evicted_at
                .is_none_or(|t| now.saturating_duration_since(t) >= policy.sustained);
            if policy.evict && window_over {
                self.evicted_at = Some(now);
                self.feed(Input::Straggler {
                    host,
                    factor: s.factor,
                });
            }
        }
    }

    /// Tells the core of every worker silent for longer than the heartbeat timeout, once.
    fn declare_silent(&mut self) {
        for (worker, silent) in self.heard.take_silent(Instant::now().into_std()) {
            self.feed(Input::Unresponsive { worker, silent });
        }
    }

    /// A worker's environment: its ids, the rendezvous, and the six numbers of the slot it is
    /// started for under Horovod's names (scripts read them before `init()`).
    fn worker_env(
        &self,
        id: WorkerId,
        host: &str,
        placement: &Placement,
        local: bool,
    ) -> Vec<(String, String)> {
        let rendezvous = if local {
            format!("127.0.0.1:{}", self.port)
        } else {
            format!("{}:{}", self.spec.rendezvous_host, self.port)
        };
        let mut env: Vec<(String, String)> = [
            (rv::ENV_ELASTIC, "1".to_string()),
            (rv::ENV_WORKER_ID, id.to_string()),
            (rv::ENV_HOSTNAME, host.to_string()),
            (rv::ENV_RANK, placement.rank.to_string()),
            (rv::ENV_SIZE, placement.size.to_string()),
            (rv::ENV_LOCAL_RANK, placement.local_rank.to_string()),
            (rv::ENV_LOCAL_SIZE, placement.local_size.to_string()),
            (rv::ENV_CROSS_RANK, placement.cross_rank.to_string()),
            (rv::ENV_CROSS_SIZE, placement.cross_size.to_string()),
            (rv::ENV_RENDEZVOUS_ADDR, rendezvous),
            (rv::ENV_SECRET, self.secret.clone()),
            (
                rv::ENV_START_TIMEOUT,
                self.spec.start_timeout.as_secs_f64().to_string(),
            ),
            (
                rv::ENV_ELASTIC_TIMEOUT,
                self.spec.core.elastic_timeout.as_secs_f64().to_string(),
            ),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        if local {
            env.push((rv::ENV_BIND_ADDR.into(), hosts::local_bind_addr(host)));
            if self.launcher.agents.is_none() {
                // This driver starts it: its SIGTERM is a stop, anyone else's a notice. An agent
                // names itself instead.
                env.push((rv::ENV_LAUNCHER_PID.into(), std::process::id().to_string()));
            }
        }
        if let Some(i) = &self.spec.network_interface {
            env.push((rv::ENV_NETWORK_INTERFACE.into(), i.clone()));
        }
        if let Some(s) = &self.spec.store {
            env.push((
                rv::ENV_DRIVER_GRACE.into(),
                s.grace.as_secs_f64().to_string(),
            ));
        }
        env.extend(self.spec.extra_env.iter().cloned());
        env
    }

    /// Carries out one action; returns an input to feed back (a worker that could not start).
    fn apply(&mut self, action: Action) -> Option<Input> {
        match action {
            Action::Start {
                worker,
                host,
                placement,
            } => {
                let local = hosts::is_local(&host, &self.own_host);
                let env = self.worker_env(worker, &host, &placement, local);
                let log = self
                    .spec
                    .output_dir
                    .as_ref()
                    .map(|d| d.join(format!("worker.{worker}")));
                self.hosts_of.insert(worker, host.clone());
                match self
                    .launcher
                    .spawn(worker, &worker.to_string(), &host, local, env, log)
                {
                    Ok(s) => {
                        tracing::info!(worker, %host, "worker started");
                        self.handles.insert(worker, s.handle);
                        self.relays.extend(s.relays);
                        None
                    }
                    Err(e) => Some(Input::Exited {
                        worker,
                        exit: ExitInfo {
                            success: false,
                            description: format!("could not be started: {e}"),
                        },
                    }),
                }
            }
            Action::Stop { worker } => {
                if let Some(h) = self.handles.get(&worker) {
                    // A failed or hung worker: no grace (a stopped process ignores SIGTERM).
                    h.signal(Signal::SIGKILL);
                }
                None
            }
            Action::Remove { worker, reason } => {
                if let Some(r) = self.regs.get(&worker) {
                    r.send(&DriverMsg::Removed { reason });
                }
                // A removed worker exits by itself; one that doesn't is stopped.
                if let Some(h) = self.handles.get(&worker).cloned() {
                    tokio::spawn(async move {
                        tokio::time::sleep(Duration::from_secs(10)).await;
                        h.signal(Signal::SIGKILL);
                    });
                }
                None
            }
            Action::World {
                worker,
                generation,
                placement,
                members,
                hosts,
                updates_through,
            } => {
                let peers: Vec<String> = members
                    .iter()
                    .map(|m| {
                        self.regs
                            .get(m)
                            .map_or_else(String::new, |r| r.addr.clone())
                    })
                    .collect();
                if let Some(r) = self.regs.get(&worker) {
                    r.send(&DriverMsg::World {
                        generation,
                        placement,
                        peers,
                        hosts,
                        updates_through,
                    });
                }
                None
            }
            Action::Abort {
                workers,
                generation,
                reason,
            } => {
                let msg = DriverMsg::Abort { generation, reason };
                for w in workers {
                    if let Some(r) = self.regs.get(&w) {
                        r.send(&msg);
                    }
                }
                None
            }
            Action::Notify {
                workers,
                update_id,
                added,
                removed,
            } => {
                let timestamp_ms = SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .map_or(0, |d| d.as_millis() as u64);
                let msg = DriverMsg::HostsUpdated(HostsUpdate {
                    update_id,
                    timestamp_ms,
                    added,
                    removed,
                });
                for w in workers {
                    if let Some(r) = self.regs.get(&w) {
                        r.send(&msg);
                    }
                }
                None
            }
            Action::Finish { code, message } => {
                self.ending = Some(Ending { code, message });
                None
            }
        }
    }
}

/// SIGTERM stops the job, or, for a driver with a state store, hands it over to a successor
/// (the signal a drained node or an evicted pod gets); SIGINT always stops the job.
fn on_sigterm(with_store: bool, interrupted: &mut Option<Signal>, handing_over: &mut bool) {
    if with_store {
        tracing::info!("SIGTERM: handing the job over to the next driver; the workers train on");
        *handing_over = true;
    } else {
        *interrupted = Some(Signal::SIGTERM);
    }
}

/// Another driver may be acting now: this one does nothing more and exits at once, leaving
/// its workers running for the driver that adopts them.
fn step_down(why: &str) -> ! {
    tracing::error!(%why, "stepping down: this driver no longer leads the job");
    let _ = writeln!(
        std::io::stderr(),
        "horovodrun: stepping down ({why}); the workers are left to the driver that takes over"
    );
    std::process::exit(75);
}

/// Forwards every host set (or failure) of a pod watch until the job ends; a pod Kubernetes is
/// about to take away is its host's notice first (the core counts a host's first notice only).
async fn watch_pods(sel: PodSelector, tx: mpsc::Sender<Input>, metrics: Metrics) {
    let (ktx, mut krx) = mpsc::channel(4);
    // Ends by itself once `krx` is dropped, when this task is aborted with the job.
    tokio::spawn(kubernetes::watch(sel, ktx));
    while let Some(result) = krx.recv().await {
        metrics.discovery_run(None, result.is_err());
        let mut inputs = Vec::new();
        match result {
            Ok(set) => {
                let now = SystemTime::now();
                inputs.extend(set.leaving.iter().map(|l| Input::Notice {
                    host: l.host.clone(),
                    source: NoticeSource::Kubernetes,
                    within: l.within(now),
                }));
                inputs.push(Input::Discovered(set.hosts));
            }
            Err(e) => inputs.push(Input::DiscoveryFailed(e.to_string())),
        }
        for input in inputs {
            if tx.send(input).await.is_err() {
                return;
            }
        }
    }
}

/// Polls the host source forever, sending each result; a pod watch sends as pods change.
async fn poll(source: Source, interval: Duration, tx: mpsc::Sender<Input>, metrics: Metrics) {
    loop {
        let input = match &source {
            Source::Fixed(h) => Input::Discovered(h.clone()),
            Source::Script(s) => {
                let began = Instant::now();
                let found = s.discover().await;
                metrics.discovery_run(Some(began.elapsed()), found.is_err());
                match found {
                    Ok(h) => Input::Discovered(h),
                    Err(e) => Input::DiscoveryFailed(e.to_string()),
                }
            }
            Source::Kubernetes(sel) => return watch_pods(sel.clone(), tx, metrics).await,
        };
        if tx.send(input).await.is_err() {
            return;
        }
        if matches!(source, Source::Fixed(_)) {
            return; // a fixed set never changes
        }
        tokio::time::sleep(interval).await;
    }
}

/// Worker ids a driver taking over skips: more than a predecessor can start between two of
/// its record's writes.
const UNRECORDED_IDS: u64 = 1000;

/// Runs an elastic job to its end.
///
/// # Errors
/// Failures of the driver itself (binding the rendezvous listener, installing signal handlers).
pub async fn run(spec: ElasticSpec) -> anyhow::Result<Ending> {
    // With a state store: become the active driver first (a standby waits here), then serve
    // the rendezvous on the port every driver of the job shares.
    let (mut control, record) = match &spec.store {
        Some(s) => {
            let address = format!(
                "{}:{}",
                spec.rendezvous_host,
                spec.rendezvous_port.unwrap_or(0)
            );
            let (c, r) = Control::elect(s, address).await?;
            (Some(c), r)
        }
        None => (None, None),
    };
    let secret = match &spec.store {
        Some(s) => s.secret.clone(),
        None => new_secret()?,
    };
    // Dual-stack, so that workers reach it in IPv6-only clusters too.
    let listener = hvd_serve::bind_any(spec.rendezvous_port.unwrap_or(0), "rendezvous").await?;
    let port = listener.local_addr()?.port();
    tracing::debug!(port, "rendezvous listening");
    let (wire_tx, mut wire_rx) = mpsc::channel::<Wire>(256);
    let (progress_tx, mut progress_rx) = mpsc::channel(16);
    let metrics = Metrics::new(control.as_ref().map_or(0, Control::failovers));
    let server = tokio::spawn(rendezvous::serve_reporting(
        listener,
        secret.clone(),
        progress_tx,
        wire_tx,
        metrics.clone(),
    ));
    let (disc_tx, mut disc_rx) = mpsc::channel::<Input>(4);
    let poller = tokio::spawn(poll(
        spec.source.clone(),
        spec.interval,
        disc_tx,
        metrics.clone(),
    ));
    let mut sigint = signal(SignalKind::interrupt())?;
    let mut sigterm = signal(SignalKind::terminate())?;
    let (core, t0, epoch) = match (&record, &control) {
        (Some(r), Some(c)) => {
            let mut core = Core::restore(spec.core.clone(), r.core.clone()).map_err(|e| {
                anyhow::anyhow!("the job's record holds no core this driver reads: {e}")
            })?;
            core.skip_worker_ids(UNRECORDED_IDS);
            let epoch = c.started();
            let age = SystemTime::now().duration_since(epoch).unwrap_or_default();
            let t0 = Instant::now().checked_sub(age).unwrap_or_else(Instant::now);
            tracing::info!(
                generation = core.generation(),
                workers = core.live_workers().len(),
                "taking over the job from the driver before"
            );
            (core, t0, epoch)
        }
        _ => (
            Core::new(spec.core.clone()),
            Instant::now(),
            SystemTime::now(),
        ),
    };
    let (status_tx, status_rx) = tokio::sync::watch::channel(Published {
        snapshot: core.snapshot(Duration::ZERO),
        epoch,
        lateness: Arc::new([]),
        rounds: core.rounds().iter().cloned().collect(),
    });
    let observer = Observer::new(metrics.clone(), t0.elapsed(), &core.snapshot(t0.elapsed()));
    let (stop_status, status_stopped) = tokio::sync::oneshot::channel::<()>();
    let status_server = match spec.status_port {
        Some(port) => {
            let listener = hvd_serve::bind_any(port, "status endpoint")
                .await
                .map_err(|e| anyhow::anyhow!("cannot serve --status-port {port}: {e}"))?;
            tracing::info!(addr = %listener.local_addr()?, "status endpoint listening: the page on GET /, GET /status and GET /metrics");
            let stopped = async {
                let _ = status_stopped.await;
            };
            Some(tokio::spawn(hvd_serve::serve(
                listener,
                status::router(status_rx, metrics),
                stopped,
            )))
        }
        None => None,
    };
    let (exit_tx, mut exit_rx) = mpsc::channel::<Exit>(256);
    let mut launcher = Launcher::new(
        spec.command.clone(),
        spec.ssh_port,
        spec.ssh_identity.clone(),
        &spec.launch,
        exit_tx,
    )?;
    if let Some(s) = &spec.store {
        let name: String = s
            .url
            .prefix
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
            .collect();
        launcher.spool = Some(std::env::temp_dir().join(format!("hvd-spool{name}")));
    }
    // Workers an agent keeps for this job and hands over (with a state store).
    let (handed_tx, mut handed_rx) = mpsc::unbounded_channel();
    if let (Some(s), Some(agents)) = (&spec.store, launcher.agents.as_mut()) {
        agents.claim = Some(crate::agent::Claim {
            job: s.url.prefix.clone(),
            grace: s.grace,
            handed: handed_tx.clone(),
        });
    }
    let own_host = nix::unistd::gethostname()
        .map(|h| h.to_string_lossy().into_owned())
        .unwrap_or_default();
    let heard = Heartbeats::new(spec.heartbeat_timeout);
    let stragglers = Stragglers::new(spec.stragglers);
    let mut d = Driver {
        core,
        spec,
        t0,
        secret,
        port,
        own_host,
        launcher,
        handles: HashMap::new(),
        hosts_of: HashMap::new(),
        regs: HashMap::new(),
        heard,
        relays: Vec::new(),
        ending: None,
        awaiting: HashMap::new(),
        adopted: HashMap::new(),
        observer,
        stragglers,
        evicted_at: None,
        lateness: (0, Arc::new([])),
        rounds: (0, Arc::new([])),
    };
    if record.is_some() {
        // Every live worker of the predecessor gets the heartbeat timeout to reconnect (they
        // redial every half second at most); one that stays away is counted as failed.
        let until = Instant::now() + d.spec.heartbeat_timeout;
        for w in d.core.live_workers() {
            if let Some(h) = d.core.worker_host(w) {
                d.hosts_of.insert(w, h.to_string());
                let l = &mut d.launcher;
                if let Some(agents) = l.agents.as_mut() {
                    agents.reclaim(h, &l.exits);
                }
            }
            d.awaiting.insert(w, until);
        }
    }
    let mut interrupted = None;
    let mut handing_over = false;
    let mut pings = tokio::time::interval(liveness::ping_period(d.spec.heartbeat_timeout));
    pings.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let far = Duration::from_secs(3600 * 24 * 365);
    while !d.core.finished() && interrupted.is_none() && !handing_over {
        if let Some(c) = control.as_mut().filter(|c| c.unsure()) {
            // Another driver may be acting: decide nothing until etcd answers. The workers
            // train on; what they say waits in the channels.
            tracing::warn!(
                "the state store cannot be reached: holding still, the workers train on"
            );
            tokio::select! {
                settled = c.settled() => match settled {
                    Ok(()) => {
                        tracing::info!("the state store answers again; carrying on");
                        // This driver pinged nobody while it held still: the silence was its own.
                        d.heard.restart(Instant::now().into_std());
                    }
                    Err(why) => step_down(&why),
                },
                _ = sigint.recv() => interrupted = Some(Signal::SIGINT),
                _ = sigterm.recv() => on_sigterm(control.is_some(), &mut interrupted, &mut handing_over),
            }
            continue;
        }
        let tick = d.core.next_deadline().map_or(d.t0 + far, |t| d.t0 + t);
        let silence = d.heard.next_silence().map_or(d.t0 + far, Instant::from_std);
        let missing = d.awaiting.values().min().copied().unwrap_or(d.t0 + far);
        let lost = async {
            match control.as_mut() {
                Some(c) => c.lost().await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            why = lost => step_down(&why),
            () = sleep_until(missing) => d.give_up_on_missing(),
            Some(input) = disc_rx.recv() => d.feed(input),
            Some(w) = wire_rx.recv() => d.wire(w),
            Some(h) = handed_rx.recv() => d.handed(h),
            Some(Exit { worker, end }) = exit_rx.recv() => {
                d.awaiting.remove(&worker);
                d.handles.remove(&worker);
                d.regs.remove(&worker);
                d.heard.forget(worker);
                d.feed(Input::Exited { worker, exit: describe(end) });
            }
            () = sleep_until(tick) => d.feed(Input::Tick),
            _ = pings.tick() => d.ping(),
            Some((worker, p)) = progress_rx.recv() => {
                let now = d.now();
                d.stragglers_in(&p);
                d.observer.progress(now, worker, p);
            }
            () = sleep_until(silence) => {
                // Answers already queued count: a driver that was itself held up must not
                // blame the workers for it.
                while let Ok(w) = wire_rx.try_recv() {
                    d.wire(w);
                }
                d.declare_silent();
            }
            _ = sigint.recv() => interrupted = Some(Signal::SIGINT),
            _ = sigterm.recv() => on_sigterm(control.is_some(), &mut interrupted, &mut handing_over),
        }
        let snapshot = d.core.snapshot(d.now());
        d.observer.snapshot(d.now(), &snapshot);
        // A report of an earlier round names ranks that may be gone.
        let lateness = match &d.lateness {
            (g, ranks) if *g == snapshot.generation => Arc::clone(ranks),
            _ => Arc::new([]),
        };
        if d.rounds.0 != snapshot.generation {
            d.rounds = (
                snapshot.generation,
                d.core.rounds().iter().cloned().collect(),
            );
        }
        status_tx.send_replace(Published {
            snapshot,
            epoch,
            lateness,
            rounds: Arc::clone(&d.rounds.1),
        });
        if let Some(c) = &control {
            c.publish(&d.core);
        }
    }
    if let Some(c) = control.take_if(|_| handing_over) {
        c.publish(&d.core);
        let why = match c.hand_over().await {
            Ok(()) => "SIGTERM".to_string(),
            Err(e) => format!("SIGTERM; {e:#}"),
        };
        step_down(&why);
    }
    poller.abort();
    let targets: Vec<(u64, Handle)> = d.handles.drain().collect();
    stop_workers(&targets, &mut exit_rx).await;
    drop(targets);
    d.launcher.agents = None; // closes the agent connections: nothing is left running there
    server.abort();
    let _ = stop_status.send(());
    if let Some(mut s) = status_server {
        // Its answers are short; one that hangs does not hold the job's end up.
        if tokio::time::timeout(Duration::from_secs(1), &mut s)
            .await
            .is_err()
        {
            tracing::debug!("the status endpoint did not stop in time");
            s.abort();
        }
    }
    d.regs.clear();
    for ended in d.adopted.values() {
        ended.store(true, std::sync::atomic::Ordering::SeqCst);
    }
    for r in d.relays.drain(..) {
        let _ = tokio::time::timeout(Duration::from_millis(500), r).await;
    }
    if let Some(c) = control {
        c.finish().await;
    }
    if let Some(dir) = &d.launcher.spool {
        // Every worker is gone and its output relayed: the spool has served.
        let _ = std::fs::remove_dir_all(dir);
    }
    let snap = d.core.snapshot(d.now());
    let ending = match interrupted {
        Some(sig) => Ending {
            code: 128 + sig as u8,
            message: format!("interrupted by {sig}; all workers were stopped"),
        },
        None => d.ending.unwrap_or(Ending {
            code: 1,
            message: "the job ended without a result".into(),
        }),
    };
    write_termination_message(
        std::path::Path::new(TERMINATION_LOG),
        &termination_message(&ending, snap.generation, snap.workers, snap.resets),
    );
    Ok(ending)
}

/// Where Kubernetes reads a container's last words (`terminationMessagePath`'s default).
const TERMINATION_LOG: &str = "/dev/termination-log";

/// The status report a driver that ended its job leaves as its last words: the operator
/// tells from it a job that ended from a driver that was lost (and must be replaced). Kept
/// small: Kubernetes keeps 4 KiB of it.
fn termination_message(end: &Ending, generation: u64, workers: usize, resets: u64) -> String {
    serde_json::json!({
        "phase": if end.code == 0 { "Succeeded" } else { "Failed" },
        "generation": generation,
        "workers": workers,
        "resets": resets,
        "message": end.message.chars().take(1024).collect::<String>(),
    })
    .to_string()
}

/// Writes `message` to `path` when that file exists (inside a Kubernetes container); never
/// creates it elsewhere.
fn write_termination_message(path: &std::path::Path, message: &str) {
    if !path.is_file() {
        return;
    }
    if let Err(e) = std::fs::write(path, message) {
        tracing::debug!(path = %path.display(), error = %e, "cannot write the termination message");
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    /// The last words name a terminal phase the operator reads as a job that ended, and are
    /// written only where the file already exists.
    #[test]
    fn the_termination_message_is_a_small_terminal_status_written_only_in_place() {
        let ok = Ending {
            code: 0,
            message: "every worker finished".into(),
        };
        let failed = Ending {
            code: 1,
            message: "x".repeat(10_000),
        };
        let v: serde_json::Value =
            serde_json::from_str(&termination_message(&ok, 3, 4, 1)).unwrap();
        assert_eq!(v["phase"], "Succeeded");
        assert_eq!(
            (v["generation"].as_u64(), v["resets"].as_u64()),
            (Some(3), Some(1))
        );
        let long = termination_message(&failed, 1, 2, 0);
        assert!(long.len() < 4096, "{}", long.len());
        let v: serde_json::Value = serde_json::from_str(&long).unwrap();
        assert_eq!(v["phase"], "Failed");
        let dir = std::env::temp_dir().join(format!("hvd-termlog-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let absent = dir.join("absent");
        write_termination_message(&absent, "{}");
        assert!(
            !absent.exists(),
            "created a termination log outside a container"
        );
        let present = dir.join("present");
        std::fs::write(&present, "").unwrap();
        write_termination_message(&present, "{\"phase\":\"Failed\"}");
        assert_eq!(
            std::fs::read_to_string(&present).unwrap(),
            "{\"phase\":\"Failed\"}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
