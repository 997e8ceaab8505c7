//! The elastic driver's deterministic core: events in, actions out, no sockets, clocks or
//! processes. The I/O around it (discovery polls, worker processes, rendezvous connections)
//! feeds it [`Input`]s stamped with the time since the job started and carries out the
//! [`Action`]s it returns. Everything the job decides is decided here, so it can be tested
//! and simulated at any scale without starting a process.
//!
//! A worker process is a slot `(host, local_rank)` with a driver-given id that never changes.
//! A round assigns ranks over the available hosts in the order they first joined (new hosts
//! after old ones, ties broken by name), so rank 0 is always a worker of the previous round
//! and holds its newest committed state.
//!
//! A host that leaves discovery is drained: its workers leave gracefully. When that would
//! leave the next round with no worker holding the committed state (every host that held it
//! drained at once, the new ones not synced yet), one drained worker is kept as rank 0 of the
//! next round, so that round's sync takes the state from it; once a member that stays reports
//! its sync ([`Input::Synced`]), the workers move to a round without it and it exits 0. Only a
//! failure can lose the state.
//!
//! A host that gave notice ([`Input::Notice`]: a spot preemption warning, a SIGTERM to one of
//! its workers) is drained the same way, although discovery still lists it, and is not
//! blacklisted: it is kept out until its notice's deadline has passed.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque};
use std::time::Duration;

use hvd_discovery::{Blacklist, CooldownRange, HostSpec};
use hvd_rendezvous::{
    HostSlots, NOTICE_HOLD_DEFAULT, NoticeSource, Placement, SlotInfo, assign_static,
};
pub use hvd_serve::status::{CauseKind, ResetCause};

/// A worker process's driver-given id.
pub type WorkerId = u64;

/// The job's elastic parameters.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Config {
    /// Slots needed before training starts (`-np`).
    pub np: usize,
    /// Fewest workers training may continue with (`--min-np`).
    pub min_np: usize,
    /// Most workers started (`--max-np`).
    pub max_np: usize,
    /// How long the job waits for enough slots before failing (`--elastic-timeout`).
    pub elastic_timeout: Duration,
    /// How long a worker has to register or join a round before it is declared failed.
    pub round_timeout: Duration,
    /// Resets allowed before the job fails (`--reset-limit`); `None` is unlimited.
    pub reset_limit: Option<usize>,
    /// Blacklist cooldown (`--blacklist-cooldown-range`); `None` blacklists for good.
    pub cooldown: Option<CooldownRange>,
    /// Seed of the jitter added to cooldowns.
    pub seed: u64,
}

/// How a worker process ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExitInfo {
    /// Exit code 0.
    pub success: bool,
    /// "exited with code 3", "was killed by signal 9".
    pub description: String,
}

/// What happened, as the I/O around the core saw it.
#[derive(Debug, Clone, PartialEq)]
pub enum Input {
    /// A discovery poll succeeded with this host set.
    Discovered(Vec<HostSpec>),
    /// A discovery poll failed.
    DiscoveryFailed(String),
    /// A worker opened its rendezvous connection.
    Registered(WorkerId),
    /// A worker asks to join the next round.
    Joined {
        /// The worker.
        worker: WorkerId,
        /// Why, in its words.
        reason: String,
    },
    /// A worker completed the state sync of round `generation`: it holds the committed state.
    Synced {
        /// The worker.
        worker: WorkerId,
        /// The round.
        generation: u64,
    },
    /// A member answered the abort of round `generation`: it is alive, and joins at its next
    /// collective.
    AbortSeen {
        /// The worker.
        worker: WorkerId,
        /// The aborted round.
        generation: u64,
    },
    /// A registered worker has answered nothing, not even the driver's pings, for `silent`
    /// (more than `--heartbeat-timeout`): its process is frozen (stopped, a paused VM, stuck
    /// in the kernel) although its connection stays open. Sent once per worker.
    Unresponsive {
        /// The worker.
        worker: WorkerId,
        /// How long it has been silent.
        silent: Duration,
    },
    /// A host is going away: one of its workers got a SIGTERM, or a watcher read a cloud's
    /// preemption notice. The host is drained like one that left discovery, without a
    /// blacklisting, and kept out of the job until [`NOTICE_MARGIN`] after its deadline
    /// (`within`; `None`: [`NOTICE_HOLD_DEFAULT`]).
    Notice {
        /// The host.
        host: String,
        /// Who gave the notice.
        source: NoticeSource,
        /// How long the host has left, as the notice says.
        within: Option<Duration>,
    },
    /// A rank of the current round on `host` has been a straggler (`factor` times the median
    /// rank's step) for the policy's window, and `--straggler-policy evict` asks for its host
    /// to go: it is drained gracefully and blacklisted with the cooldown (so it may come back),
    /// unless that would leave fewer than `--min-np` slots.
    Straggler {
        /// The host.
        host: String,
        /// How many times the median rank's step the rank's takes.
        factor: f64,
    },
    /// A worker process ended.
    Exited {
        /// The worker.
        worker: WorkerId,
        /// How.
        exit: ExitInfo,
    },
    /// Time passed.
    Tick,
}

/// What the I/O around the core must do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Start worker `worker` on `host`, for the slot `placement` of the round being formed
    /// (its numbers are the worker's `HOROVOD_RANK`… at spawn, as Horovod's launcher sets
    /// them; the round it joins may renumber it).
    Start {
        /// Its id.
        worker: WorkerId,
        /// Where.
        host: String,
        /// The slot it is started for.
        placement: Placement,
    },
    /// Stop a worker (SIGTERM, then SIGKILL): it failed or hangs.
    Stop {
        /// The worker.
        worker: WorkerId,
    },
    /// Tell a worker it has no place in the job any more; it exits by itself.
    Remove {
        /// The worker.
        worker: WorkerId,
        /// Why.
        reason: String,
    },
    /// Send a member of a completed round its place and the rank table.
    World {
        /// The member.
        worker: WorkerId,
        /// The round.
        generation: u64,
        /// Its place.
        placement: Placement,
        /// Members by rank.
        members: Vec<WorkerId>,
        /// Hosts by rank.
        hosts: Vec<String>,
        /// The newest announcement this round accounts for.
        updates_through: u64,
    },
    /// Cancel round `generation`'s collectives in these members: another member failed, and
    /// a member waiting on a hung peer would never notice by itself.
    Abort {
        /// The members still running.
        workers: Vec<WorkerId>,
        /// The round.
        generation: u64,
        /// What failed.
        reason: String,
    },
    /// Announce a host change to these live workers.
    Notify {
        /// Who.
        workers: Vec<WorkerId>,
        /// Monotonic id of the announcement.
        update_id: u64,
        /// Hosts that joined.
        added: Vec<String>,
        /// Hosts that left.
        removed: Vec<String>,
    },
    /// The job is over: stop everything, print `message`, exit with `code`.
    Finish {
        /// Process exit code of `horovodrun`.
        code: u8,
        /// What a person reads.
        message: String,
    },
}

/// Where the job stands, as the status endpoint reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JobPhase {
    /// No round has completed yet.
    Pending,
    /// The workers of the last round are training.
    Running,
    /// A new round is being formed (after a failure or a host change).
    Rescaling,
    /// Every worker of the last round finished training and exited 0.
    Succeeded,
    /// The job failed.
    Failed,
}

/// A read-only view of the job for the status endpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Snapshot {
    /// Where the job stands.
    pub phase: JobPhase,
    /// The last completed round (0: none yet).
    pub generation: u64,
    /// Live (or finished) workers of the last round.
    pub workers: usize,
    /// The last round's hosts and how many of its workers each holds, in rank order.
    pub hosts: Vec<(String, usize)>,
    /// Hosts kept out now, by name, and when their cooldown ends (`None`: for good).
    pub blacklisted: Vec<(String, Option<Duration>)>,
    /// Resets so far (rounds after the first).
    pub resets: u64,
    /// Hosts kept out after a notice: name, who gave it, and when it is over.
    pub noticed: Vec<(String, NoticeSource, Duration)>,
}

/// A completed round, as the status page draws the job's history.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Round {
    /// Its number.
    pub generation: u64,
    /// When it completed (since the job began).
    pub at: Duration,
    /// Its workers.
    pub size: usize,
    /// What made the job leave the round before it; empty for the first.
    pub causes: Vec<ResetCause>,
}

/// How many completed rounds the core remembers for the status page.
pub const ROUNDS_KEPT: usize = 128;

/// How long past its notice's deadline a host is still kept out: a preempted machine leaves
/// discovery only once the cloud's API stops listing it, a poll or two after it went.
pub const NOTICE_MARGIN: Duration = Duration::from_secs(60);

/// A host's notice, as the core keeps it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
struct Noticed {
    source: NoticeSource,
    /// When the host may come back, if discovery still lists it.
    until: Duration,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
enum Phase {
    /// Spawned; no rendezvous connection yet.
    Starting,
    /// Connected and waiting for a rank table.
    Ready,
    /// Training as a member of round `generation`.
    Running,
    /// Exited 0 after training.
    Finished,
    /// Stopped or removed by the driver; its exit means nothing.
    Leaving,
    /// Gone.
    Exited,
}

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
struct Worker {
    host: String,
    local_rank: usize,
    phase: Phase,
    /// When it must be ready, if it is awaited.
    due: Option<Duration>,
    /// Holds the committed state: it reported a completed sync, or it trained in the first
    /// round (where every worker starts from the same state).
    holds_state: bool,
    /// Its host was drained, but it was kept in the last round to hand the state over.
    kept: bool,
}

impl Worker {
    fn live(&self) -> bool {
        matches!(self.phase, Phase::Starting | Phase::Ready | Phase::Running)
    }
}

/// The elastic driver's state. Feed it with [`Core::handle`]. It serializes whole
/// ([`Core::save`]), so that a successor driver carries on from the last decision.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub struct Core {
    cfg: Config,
    rng: u64,
    /// The last good discovery result.
    discovered: BTreeMap<String, usize>,
    have_hosts: bool,
    /// Available hosts in the order they first joined.
    order: Vec<String>,
    blacklist: Blacklist,
    workers: BTreeMap<WorkerId, Worker>,
    next_worker: WorkerId,
    /// Round number of the last completed round (0: none yet).
    generation: u64,
    resets: usize,
    /// Members of the last completed round, by rank.
    current: Vec<WorkerId>,
    /// A new round is needed.
    pending: bool,
    /// The last round whose members were told to abort (0: none): they are told once.
    aborted: u64,
    /// When the job began waiting for enough slots.
    waiting_since: Option<Duration>,
    /// The last host assignment announced, so each change is announced once.
    announced: Option<Vec<(String, usize)>>,
    next_update: u64,
    /// Hosts as of the last announcement, to name what was added and removed.
    announced_hosts: BTreeSet<String>,
    finished: bool,
    /// The exit code the job finished with.
    outcome: Option<u8>,
    /// When each blacklisted host's cooldown ends (`None`: for good), as of its last failure.
    cooldown_ends: BTreeMap<String, Option<Duration>>,
    /// Live workers by slot `(host, local_rank)`; rebuilt from `workers` on a restore.
    #[serde(skip)]
    live_at: HashMap<(String, usize), WorkerId>,
    /// The reason of the last failed discovery poll, while polls keep failing.
    discovery_error: Option<String>,
    /// The drained worker the pending round keeps for the state, as last logged.
    keeping: Option<WorkerId>,
    /// A worker failed before the first round completed: from then on the job recovers like
    /// after any failure, with `--min-np` slots, instead of waiting for `-np`.
    failed_early: bool,
    /// Hosts that gave notice, kept out of the job until their deadline.
    #[serde(default)]
    noticed: BTreeMap<String, Noticed>,
    /// What made the job leave its current round, as it happened; the next round takes them.
    #[serde(default)]
    causes: Vec<ResetCause>,
    /// The last [`ROUNDS_KEPT`] completed rounds.
    #[serde(default)]
    rounds: VecDeque<Round>,
}

fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl Core {
    /// A job that has started nothing yet.
    pub fn new(cfg: Config) -> Self {
        Self {
            rng: cfg.seed,
            blacklist: Blacklist::new(cfg.cooldown),
            cfg,
            discovered: BTreeMap::new(),
            have_hosts: false,
            order: Vec::new(),
            workers: BTreeMap::new(),
            next_worker: 0,
            generation: 0,
            resets: 0,
            current: Vec::new(),
            pending: true,
            aborted: 0,
            waiting_since: Some(Duration::ZERO),
            announced: None,
            next_update: 1,
            announced_hosts: BTreeSet::new(),
            finished: false,
            outcome: None,
            cooldown_ends: BTreeMap::new(),
            live_at: HashMap::new(),
            discovery_error: None,
            keeping: None,
            failed_early: false,
            noticed: BTreeMap::new(),
            causes: Vec::new(),
            rounds: VecDeque::new(),
        }
    }

    /// The whole state, as JSON: what a successor driver needs to carry on.
    ///
    /// # Errors
    /// Serialization failed (it cannot for this type; reported, not assumed).
    pub fn save(&self) -> Result<serde_json::Value, serde_json::Error> {
        serde_json::to_value(self)
    }

    /// A core carrying on from `saved` (written by [`Core::save`]) with the parameters `cfg`
    /// of the driver taking over.
    ///
    /// # Errors
    /// `saved` is not a saved core.
    pub fn restore(cfg: Config, saved: serde_json::Value) -> Result<Self, serde_json::Error> {
        let mut core: Self = serde_json::from_value(saved)?;
        core.cfg = cfg;
        core.index_slots();
        Ok(core)
    }

    /// Starts numbering new workers `gap` past the last one: a driver taking over from a
    /// record gives none of its workers the id of one its predecessor started after the record
    /// was last written (such a worker is then refused as a stranger, never mistaken for one).
    pub fn skip_worker_ids(&mut self, gap: WorkerId) {
        self.next_worker = self.next_worker.saturating_add(gap);
    }

    /// Whether the job is over.
    pub fn finished(&self) -> bool {
        self.finished
    }

    /// The number of the last completed round.
    #[cfg_attr(not(test), allow(dead_code))]
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// The host of a worker the job knows.
    pub fn worker_host(&self, id: WorkerId) -> Option<&str> {
        self.workers.get(&id).map(|w| w.host.as_str())
    }

    /// Whether `id` is a live worker (starting, ready or training).
    pub fn is_live(&self, id: WorkerId) -> bool {
        self.workers.get(&id).is_some_and(Worker::live)
    }

    /// Whether `host` gave a notice that still keeps it out of the job.
    pub fn is_noticed(&self, host: &str) -> bool {
        self.noticed.contains_key(host)
    }

    /// The hosts of the current round's members, by rank.
    pub fn member_hosts(&self) -> Vec<&str> {
        self.current
            .iter()
            .map(|m| self.workers.get(m).map_or("?", |w| w.host.as_str()))
            .collect()
    }

    /// Live workers of the job.
    pub fn live_workers(&self) -> Vec<WorkerId> {
        self.workers
            .iter()
            .filter(|(_, w)| w.live())
            .map(|(id, _)| *id)
            .collect()
    }

    /// Where the job stands at `now`, for the status endpoint.
    pub fn snapshot(&self, now: Duration) -> Snapshot {
        let phase = match (self.outcome, self.generation, self.pending) {
            (Some(0), _, _) => JobPhase::Succeeded,
            (Some(_), _, _) => JobPhase::Failed,
            (None, 0, _) => JobPhase::Pending,
            (None, _, true) => JobPhase::Rescaling,
            (None, _, false) => JobPhase::Running,
        };
        let mut hosts: Vec<(String, usize)> = Vec::new();
        let members = self
            .current
            .iter()
            .filter_map(|m| self.workers.get(m))
            .filter(|w| w.live() || w.phase == Phase::Finished);
        let mut workers = 0;
        for w in members {
            workers += 1;
            match hosts.iter_mut().find(|(h, _)| *h == w.host) {
                Some((_, n)) => *n += 1,
                None => hosts.push((w.host.clone(), 1)),
            }
        }
        let blacklisted = self
            .blacklist
            .blacklisted(now)
            .into_iter()
            .map(|h| (h.to_string(), self.cooldown_ends.get(h).copied().flatten()))
            .collect();
        let noticed = self
            .noticed
            .iter()
            .map(|(h, n)| (h.clone(), n.source, n.until))
            .collect();
        Snapshot {
            phase,
            generation: self.generation,
            workers,
            hosts,
            blacklisted,
            resets: self.resets as u64,
            noticed,
        }
    }

    /// The last [`ROUNDS_KEPT`] completed rounds, oldest first: they change only when a round
    /// completes.
    pub fn rounds(&self) -> &VecDeque<Round> {
        &self.rounds
    }

    /// The earliest time at which [`Input::Tick`] may change something.
    pub fn next_deadline(&self) -> Option<Duration> {
        let dues = self
            .workers
            .values()
            .filter(|w| w.live())
            .filter_map(|w| w.due);
        let wait = self.waiting_since.map(|t| t + self.cfg.elastic_timeout);
        let notices = self.noticed.values().map(|n| n.until);
        dues.chain(wait)
            .chain(self.blacklist.next_expiry())
            .chain(notices)
            .min()
    }

    /// Takes one input at time `now` (since the job began) and returns what to do.
    pub fn handle(&mut self, now: Duration, input: Input) -> Vec<Action> {
        let mut out = Vec::new();
        if self.finished {
            return out;
        }
        match input {
            Input::Discovered(hosts) => {
                if self.discovery_error.take().is_some() {
                    tracing::info!("host discovery works again");
                }
                self.discovered(now, hosts);
            }
            Input::DiscoveryFailed(reason) => {
                if self.have_hosts {
                    // Each new reason is logged once; a script failing the same way every
                    // poll would otherwise flood the log.
                    if self.discovery_error.as_deref() != Some(reason.as_str()) {
                        tracing::warn!(%reason, "host discovery failed; keeping the last host set and retrying");
                        self.discovery_error = Some(reason);
                    }
                } else {
                    self.finish(
                        &mut out,
                        1,
                        format!("host discovery failed on its first run: {reason}"),
                    );
                    return out;
                }
            }
            Input::Registered(id) => {
                if let Some(w) = self.workers.get_mut(&id)
                    && w.phase == Phase::Starting
                {
                    w.phase = Phase::Ready;
                    w.due = None;
                    tracing::debug!(worker = id, host = %w.host, "worker registered");
                }
            }
            Input::Joined { worker, reason } => self.joined(now, worker, &reason, &mut out),
            Input::AbortSeen { worker, generation } => self.abort_seen(now, worker, generation),
            Input::Synced { worker, generation } => self.synced(worker, generation),
            Input::Unresponsive { worker, silent } => {
                self.unresponsive(now, worker, silent, &mut out);
            }
            Input::Notice {
                host,
                source,
                within,
            } => self.notice(now, host, source, within, &mut out),
            Input::Straggler { host, factor } => self.straggler(now, &host, factor),
            Input::Exited { worker, exit } => self.exited(now, worker, &exit, &mut out),
            Input::Tick => {}
        }
        self.step(now, &mut out);
        out
    }

    fn jitter(&mut self) -> f64 {
        (splitmix(&mut self.rng) >> 11) as f64 / (1u64 << 53) as f64
    }

    fn finish(&mut self, out: &mut Vec<Action>, code: u8, message: String) {
        self.finished = true;
        self.outcome = Some(code);
        out.push(Action::Finish { code, message });
    }

    /// Notes why the job leaves its current round, for the round that follows it; a host's
    /// second word of the same kind adds nothing.
    fn cause(&mut self, kind: CauseKind, host: &str, detail: String) {
        if self.generation == 0 || self.causes.iter().any(|c| c.kind == kind && c.host == host) {
            return;
        }
        self.causes.push(ResetCause {
            kind,
            host: host.to_string(),
            detail,
        });
    }

    /// Whether a live member of the current round runs on `host`.
    fn hosts_member(&self, host: &str) -> bool {
        self.current.iter().any(|m| {
            self.workers
                .get(m)
                .is_some_and(|w| w.live() && w.host == host)
        })
    }

    /// Whether a host of the order offers slots (the order holds only usable hosts; a
    /// noticed one stays in it, in its place, but offers none until its notice is over).
    fn has_slots(&self, host: &str) -> bool {
        self.discovered.get(host).is_some_and(|&s| s > 0) && !self.noticed.contains_key(host)
    }

    /// `host` is going away: it offers no slots until `within` has passed, so the next plan
    /// drains it (its workers leave gracefully, the state handed over first where they hold
    /// the only copy). The first notice of a host counts; later ones change nothing.
    fn notice(
        &mut self,
        now: Duration,
        host: String,
        source: NoticeSource,
        within: Option<Duration>,
        out: &mut Vec<Action>,
    ) {
        if self.noticed.contains_key(&host) {
            return;
        }
        // Its workers outside the round hold nothing and are told to go (one still starting is
        // told when it connects). The round's members leave through the next round.
        let members: HashSet<WorkerId> = self.current.iter().copied().collect();
        for (id, w) in &mut self.workers {
            if w.host != host || members.contains(id) {
                continue;
            }
            if !matches!(w.phase, Phase::Starting | Phase::Ready) {
                continue;
            }
            out.push(Action::Remove {
                worker: *id,
                reason: "its host gave notice that it is going away".into(),
            });
            w.phase = Phase::Leaving;
            w.due = None;
        }
        let deadline = within.unwrap_or(NOTICE_HOLD_DEFAULT);
        let deadline_s = (deadline.as_secs_f64() * 10.0).round() / 10.0;
        let workers = self
            .workers
            .values()
            .filter(|w| w.host == host && w.live())
            .count();
        tracing::warn!(
            host = %host,
            %source,
            deadline_s,
            named_deadline = within.is_some(),
            workers,
            "host gave notice: it leaves the job gracefully (nothing rolled back, not blacklisted)"
        );
        if self.hosts_member(&host) {
            self.cause(
                CauseKind::Notice,
                &host,
                format!("{source} notice, deadline in {deadline_s} s"),
            );
        }
        self.noticed.insert(
            host,
            Noticed {
                source,
                until: now + deadline + NOTICE_MARGIN,
            },
        );
    }

    /// Evicts a straggler's host: blacklisted with the cooldown, its workers left to leave
    /// through the next round (nothing is stopped or rolled back), unless the slots left would
    /// be fewer than `--min-np`.
    fn straggler(&mut self, now: Duration, host: &str, factor: f64) {
        let factor = (factor * 100.0).round() / 100.0;
        if !self.order.iter().any(|h| h == host) || self.blacklist.is_blacklisted(host, now) {
            return;
        }
        let left = self.slots_available()
            - if self.has_slots(host) {
                self.discovered.get(host).copied().unwrap_or(0)
            } else {
                0
            };
        if left < self.cfg.min_np.max(1) {
            tracing::warn!(host = %host, factor, slots_left = left, min_np = self.cfg.min_np, "straggler kept: evicting its host would leave fewer than --min-np slots");
            return;
        }
        let jitter = self.jitter();
        if let Some(b) = self.blacklist.blacklist(host, now, jitter) {
            self.cooldown_ends.insert(host.to_string(), b.until);
            tracing::warn!(
                host = %host,
                factor,
                cooldown_s = b.until.map(|u| (u.saturating_sub(now).as_secs_f64() * 10.0).round() / 10.0),
                "straggler's host evicted: it leaves gracefully and is cooled down"
            );
        }
        if self.hosts_member(host) {
            self.cause(
                CauseKind::Straggler,
                host,
                format!("a rank's step took {factor} times the median rank's"),
            );
        }
        self.order.retain(|h| h != host);
    }

    /// Forgets the notices whose deadline has passed: a host discovery still lists may come
    /// back (a new machine under the old name, or a worker stopped on a host that stays).
    fn expire_notices(&mut self, now: Duration) {
        let over: Vec<String> = self
            .noticed
            .iter()
            .filter(|(_, n)| n.until <= now)
            .map(|(h, _)| h.clone())
            .collect();
        for host in over {
            if let Some(n) = self.noticed.remove(&host) {
                tracing::info!(host = %host, source = %n.source, "host's notice is over; it rejoins while discovery lists it");
            }
        }
    }

    fn discovered(&mut self, now: Duration, hosts: Vec<HostSpec>) {
        let new: BTreeMap<String, usize> = hosts.into_iter().map(|h| (h.host, h.slots)).collect();
        if self.have_hosts && new == self.discovered {
            return;
        }
        self.have_hosts = true;
        for (h, s) in &new {
            match self.discovered.get(h) {
                None => tracing::info!(host = %h, slots = s, "host discovered"),
                Some(old) if old != s => {
                    tracing::info!(host = %h, from = old, to = s, "host changed its slots");
                }
                _ => {}
            }
        }
        for h in self.discovered.keys().filter(|h| !new.contains_key(*h)) {
            tracing::info!(host = %h, "host left discovery");
        }
        self.discovered = new;
        self.order.retain(|h| self.discovered.contains_key(h));
        self.append_new_hosts(now);
    }

    /// Appends discovered, non-blacklisted hosts missing from the order, by name.
    fn append_new_hosts(&mut self, now: Duration) {
        let known: HashSet<&str> = self.order.iter().map(String::as_str).collect();
        let fresh: Vec<String> = self
            .discovered
            .keys()
            .filter(|h| !known.contains(h.as_str()) && !self.blacklist.is_blacklisted(h, now))
            .cloned()
            .collect();
        self.order.extend(fresh);
    }

    fn joined(&mut self, now: Duration, id: WorkerId, reason: &str, out: &mut Vec<Action>) {
        let Some(w) = self.workers.get_mut(&id) else {
            return;
        };
        match w.phase {
            Phase::Running | Phase::Starting | Phase::Ready => {
                tracing::info!(worker = id, host = %w.host, %reason, "worker asks for a new round");
                let asked = w.phase == Phase::Running && !self.pending;
                w.phase = Phase::Ready;
                w.due = None;
                if asked && self.causes.is_empty() {
                    let host = w.host.clone();
                    self.cause(
                        CauseKind::Requested,
                        &host,
                        format!("worker {id}: {reason}"),
                    );
                }
            }
            Phase::Finished | Phase::Leaving | Phase::Exited => return,
        }
        if !self.pending {
            self.pending = true;
        }
        // Every member must now join soon; one that doesn't is declared failed.
        self.expect_joins(now);
        if let Some(done) = self.finisher() {
            let msg = format!(
                "worker {id} on {} asked for a new round after {done} had finished (exited 0); \
                 the job can't both succeed and recover",
                self.workers.get(&id).map_or("?", |w| w.host.as_str())
            );
            self.finish(out, 1, msg);
        }
    }

    /// The first worker that exited 0 (`worker N on HOST`), if one did: from then on the job
    /// only winds down.
    fn finisher(&self) -> Option<String> {
        self.workers
            .iter()
            .find(|(_, w)| w.phase == Phase::Finished)
            .map(|(id, w)| format!("worker {id} on {}", w.host))
    }

    /// A worker that completed a sync holds the committed state; the first member that stays
    /// to do so releases a worker kept for the state.
    fn synced(&mut self, id: WorkerId, generation: u64) {
        if generation > self.generation {
            return; // no such round: a confused worker
        }
        let handover = !self.state_held_by_stayer();
        let Some(w) = self.workers.get_mut(&id) else {
            return;
        };
        if !w.live() || w.holds_state {
            return;
        }
        w.holds_state = true;
        tracing::debug!(worker = id, host = %w.host, round = generation, "worker synced the state");
        if handover && !w.kept && self.current.contains(&id) {
            let kept: Vec<WorkerId> = self.kept_members();
            if !kept.is_empty() {
                let host = self.workers.get(&id).map_or("?", |w| w.host.as_str());
                tracing::info!(
                    round = generation,
                    worker = id,
                    %host,
                    kept = ?kept,
                    "the state was handed over: the kept worker leaves with the next round"
                );
            }
        }
    }

    /// Live members of the last round kept there for the state although their host left.
    fn kept_members(&self) -> Vec<WorkerId> {
        self.current
            .iter()
            .copied()
            .filter(|m| self.workers.get(m).is_some_and(|w| w.live() && w.kept))
            .collect()
    }

    /// Whether a live member of the last round that was not kept for the state holds it.
    fn state_held_by_stayer(&self) -> bool {
        self.current.iter().any(|m| {
            self.workers
                .get(m)
                .is_some_and(|w| w.live() && !w.kept && w.holds_state)
        })
    }

    /// A member that answers the abort is alive, not hung: it may finish a long computation
    /// before its next collective fails, so it gets `--elastic-timeout` to join instead of
    /// `--start-timeout`.
    fn abort_seen(&mut self, now: Duration, id: WorkerId, generation: u64) {
        if generation != self.generation || !self.current.contains(&id) {
            return;
        }
        if let Some(w) = self.workers.get_mut(&id)
            && w.phase == Phase::Running
            && w.due.is_some()
        {
            tracing::info!(
                worker = id,
                host = %w.host,
                "worker answered the abort: alive, it joins at its next collective"
            );
            w.due = Some(now + self.cfg.elastic_timeout);
        }
    }

    fn exited(&mut self, now: Duration, id: WorkerId, exit: &ExitInfo, out: &mut Vec<Action>) {
        let Some(w) = self.workers.get_mut(&id) else {
            return;
        };
        let phase = w.phase;
        if matches!(phase, Phase::Exited | Phase::Finished) {
            // Its end was already counted (an adopted worker's connection closing and its
            // agent's report can both say so): a second word changes nothing.
            tracing::debug!(worker = id, exit = %exit.description, "a worker that ended was reported ended again");
            return;
        }
        let host = w.host.clone();
        let kept = w.kept;
        let member = self.current.contains(&id);
        // Exit 0 finishes the worker's slot, also before it joined a round: Horovod records
        // it as SUCCESS (`_handle_worker_exit` in `horovod/runner/elastic/driver.py`) and
        // blacklists no host for it. A member that asked for the next round and exits 0 leaves
        // a round that counts on it: that is a failure.
        let finished = exit.success
            && match phase {
                Phase::Running => true,
                Phase::Starting | Phase::Ready => !member,
                Phase::Finished | Phase::Leaving | Phase::Exited => false,
            };
        w.phase = if finished {
            Phase::Finished
        } else {
            Phase::Exited
        };
        w.due = None;
        match phase {
            Phase::Leaving if kept => {
                tracing::info!(worker = id, %host, exit = %exit.description, "the worker kept for the state left");
            }
            Phase::Leaving | Phase::Exited | Phase::Finished => {
                tracing::debug!(worker = id, %host, exit = %exit.description, "worker left");
            }
            Phase::Running if exit.success => {
                tracing::info!(worker = id, %host, "worker finished training and exited 0");
                if self.pending {
                    let msg = format!(
                        "worker {id} on {host} exited 0 while the job was recovering from a \
                         failure; not counted as success"
                    );
                    self.finish(out, 1, msg);
                } else if self.current.iter().all(|m| {
                    self.workers
                        .get(m)
                        .is_some_and(|w| w.phase == Phase::Finished)
                }) {
                    let msg = format!(
                        "all {} workers of round {} finished training and exited 0",
                        self.current.len(),
                        self.generation
                    );
                    self.finish(out, 0, msg);
                }
            }
            Phase::Starting | Phase::Ready if finished => {
                tracing::info!(
                    worker = id,
                    %host,
                    "worker exited 0 before it joined a round: its slot is finished, not failed"
                );
            }
            Phase::Starting | Phase::Ready | Phase::Running => {
                tracing::warn!(worker = id, %host, exit = %exit.description, "worker failed");
                let why = format!("worker {id} on {host} {}", exit.description);
                self.host_failed(now, id, &host, &why, CauseKind::Failure, out);
            }
        }
    }

    /// A frozen worker fails like a dead one, and is killed so that it can never come back as
    /// a member of an old round: its host is blacklisted and its round aborted and re-run.
    /// Its later exit (the kill) means nothing. A worker that is not registered (the start
    /// timeout covers it) or already leaving is left alone.
    fn unresponsive(
        &mut self,
        now: Duration,
        id: WorkerId,
        silent: Duration,
        out: &mut Vec<Action>,
    ) {
        let Some(w) = self.workers.get_mut(&id) else {
            return;
        };
        if !matches!(w.phase, Phase::Ready | Phase::Running) {
            return;
        }
        let host = w.host.clone();
        let silent_s = (silent.as_secs_f64() * 10.0).round() / 10.0;
        tracing::warn!(
            worker = id,
            %host,
            silent_s,
            "worker stopped answering the driver (frozen?); declared failed and killed"
        );
        w.phase = Phase::Leaving;
        w.due = None;
        out.push(Action::Stop { worker: id });
        let why = format!("worker {id} on {host} stopped answering for {silent_s:.1} s (frozen?)");
        self.host_failed(now, id, &host, &why, CauseKind::Frozen, out);
    }

    /// Blacklists `host` and stops its other workers: a host whose worker `failed` failed is
    /// not trusted. A new round is needed only when the last round lost a member; a new worker
    /// that never made it into a round leaves the running ones alone. The round's other
    /// members are told to abort (`why` says what failed) and must join the next round in time.
    /// After a worker exited 0, a failure fails the job instead: it can't both succeed and
    /// recover. A lost member is noted as the next round's cause, of `kind`.
    fn host_failed(
        &mut self,
        now: Duration,
        failed: WorkerId,
        host: &str,
        why: &str,
        kind: CauseKind,
        out: &mut Vec<Action>,
    ) {
        if let Some(done) = self.finisher() {
            let msg = format!("{why} after {done} had finished (exited 0); the job failed");
            self.finish(out, 1, msg);
            return;
        }
        if self.generation == 0 {
            self.failed_early = true;
        }
        let jitter = self.jitter();
        if let Some(b) = self.blacklist.blacklist(host, now, jitter) {
            self.cooldown_ends.insert(host.to_string(), b.until);
            match b.until {
                Some(until) => tracing::warn!(
                    host = %host,
                    failures = b.failures,
                    cooldown_s = (until.saturating_sub(now).as_secs_f64() * 10.0).round() / 10.0,
                    "host blacklisted"
                ),
                None => {
                    tracing::warn!(host = %host, failures = b.failures, "host blacklisted for good")
                }
            }
        }
        self.order.retain(|h| h != host);
        for (id, w) in &mut self.workers {
            if w.host == host && w.live() {
                tracing::info!(
                    worker = id,
                    host = %host,
                    "stopping the worker: its host is blacklisted"
                );
                w.phase = Phase::Leaving;
                w.due = None;
                out.push(Action::Stop { worker: *id });
            }
        }
        let lost_member = self.current.contains(&failed)
            || self.current.iter().any(|m| {
                self.workers
                    .get(m)
                    .is_some_and(|w| w.host == host && w.phase == Phase::Leaving)
            });
        if lost_member || self.generation == 0 {
            self.pending = true;
        }
        if lost_member {
            self.cause(kind, host, why.to_string());
        }
        if lost_member && self.generation > 0 {
            // A survivor blocked on a hung member never reads the dead one's connection: only
            // this tells it the round is over.
            let running = self.running_members();
            if !running.is_empty() && self.aborted < self.generation {
                self.aborted = self.generation;
                tracing::info!(
                    round = self.generation,
                    workers = ?running,
                    "telling the round's other members to abort"
                );
                out.push(Action::Abort {
                    workers: running,
                    generation: self.generation,
                    reason: format!("round {} lost a member: {why}", self.generation),
                });
            }
            self.expect_joins(now);
        }
    }

    /// The members of the last round still training in it.
    fn running_members(&self) -> Vec<WorkerId> {
        self.current
            .iter()
            .copied()
            .filter(|m| {
                self.workers
                    .get(m)
                    .is_some_and(|w| w.phase == Phase::Running)
            })
            .collect()
    }

    /// Gives every running member of the round `--start-timeout` to join the next round; one
    /// that does not (hung, stopped) is declared failed.
    fn expect_joins(&mut self, now: Duration) {
        let due = now + self.cfg.round_timeout;
        for m in &self.current {
            if let Some(w) = self.workers.get_mut(m)
                && w.phase == Phase::Running
                && w.due.is_none()
            {
                w.due = Some(due);
            }
        }
    }

    /// The assignment the available hosts give now; `None` below `--min-np`.
    fn target(&self) -> Option<Vec<SlotInfo>> {
        self.target_with(|_, slots| slots)
    }

    /// How many slots a round needs: `-np` for the job's first, `--min-np` for any after a
    /// failure (the first included, when a worker fails before it completes).
    fn slots_needed(&self) -> usize {
        if self.generation == 0 && !self.failed_early {
            self.cfg.np
        } else {
            self.cfg.min_np
        }
    }

    /// [`Core::target`] with each host's slots limited by `limit(host, discovered slots)`.
    fn target_with(&self, limit: impl Fn(&str, usize) -> usize) -> Option<Vec<SlotInfo>> {
        // Hosts with a surviving worker of the last round come first, so rank 0 holds its
        // newest commit; a host that came back (slots again, cooldown over) is new.
        let surviving: HashSet<&str> = self
            .current
            .iter()
            .filter_map(|m| self.workers.get(m))
            .filter(|w| w.live() || w.phase == Phase::Finished)
            .map(|w| w.host.as_str())
            .collect();
        let (old, new): (Vec<&String>, Vec<&String>) = self
            .order
            .iter()
            .filter(|h| self.has_slots(h))
            .partition(|h| surviving.contains(h.as_str()));
        let hosts: Vec<HostSlots> = old
            .into_iter()
            .chain(new)
            .map(|h| HostSlots {
                host: h.clone(),
                slots: limit(h, self.discovered.get(h).copied().unwrap_or(0)),
            })
            .filter(|h| h.slots > 0)
            .collect();
        let total: usize = hosts.iter().map(|h| h.slots).sum();
        if total < self.slots_needed().max(1) {
            return None;
        }
        assign_static(&hosts, total.min(self.cfg.max_np)).ok()
    }

    fn slots_of(t: &[SlotInfo]) -> Vec<(String, usize)> {
        t.iter().map(|s| (s.host.clone(), s.local_rank)).collect()
    }

    fn worker_at(&self, host: &str, local_rank: usize) -> Option<WorkerId> {
        self.live_at
            .get(&(host.to_string(), local_rank))
            .copied()
            .filter(|id| self.workers.get(id).is_some_and(Worker::live))
    }

    /// Rebuilds the slot index and forgets workers that are gone and matter to no round.
    fn reindex(&mut self) {
        let current: HashSet<WorkerId> = self.current.iter().copied().collect();
        self.workers
            .retain(|id, w| w.phase != Phase::Exited || current.contains(id));
        self.index_slots();
    }

    /// Rebuilds the index of live workers by slot.
    fn index_slots(&mut self) {
        self.live_at = self
            .workers
            .iter()
            .filter(|(_, w)| w.live())
            .map(|(id, w)| ((w.host.clone(), w.local_rank), *id))
            .collect();
    }

    fn start(&mut self, now: Duration, slot: &SlotInfo, out: &mut Vec<Action>) {
        let (host, local_rank) = (slot.host.as_str(), slot.local_rank);
        let id = self.next_worker;
        self.next_worker += 1;
        self.live_at.insert((host.to_string(), local_rank), id);
        self.workers.insert(
            id,
            Worker {
                host: host.to_string(),
                local_rank,
                phase: Phase::Starting,
                due: Some(now + self.cfg.round_timeout),
                holds_state: false,
                kept: false,
            },
        );
        out.push(Action::Start {
            worker: id,
            host: host.to_string(),
            placement: slot.placement(),
        });
    }

    fn slots_available(&self) -> usize {
        self.order
            .iter()
            .filter(|h| self.has_slots(h))
            .map(|h| self.discovered.get(h).copied().unwrap_or(0))
            .sum()
    }

    fn step(&mut self, now: Duration, out: &mut Vec<Action>) {
        self.reindex();
        for r in self.blacklist.expire(now) {
            tracing::info!(host = %r.host, failures = r.failures, "host's blacklist cooldown is over; it rejoins when discovery lists it");
        }
        self.expire_notices(now);
        self.append_new_hosts(now);
        self.expire_dues(now, out);
        if self.finished {
            return;
        }
        if self.finisher().is_some() {
            self.wind_down(out);
            return;
        }
        if self.pending {
            self.plan(now, out);
        }
        // Also right after a round that took only the connected workers: the slots it left
        // out get theirs started now, not at the next discovery poll.
        if !self.pending && !self.finished {
            self.prepare_change(now, out);
        }
    }

    /// After a worker exited 0 the job starts no worker and forms no round: as Horovod's
    /// registry stops the job once a worker succeeded and every other one has recorded its
    /// state (`_on_workers_recorded` in `horovod/runner/elastic/registration.py`), it ends once
    /// no worker is starting or training. Then it succeeded unless a worker waits for a round:
    /// that one can't train, since a round without the finished slots would be a recovery.
    fn wind_down(&mut self, out: &mut Vec<Action>) {
        let busy = self
            .workers
            .values()
            .any(|w| matches!(w.phase, Phase::Starting | Phase::Running));
        if busy {
            return;
        }
        let Some(done) = self.finisher() else {
            return;
        };
        let waiting = self
            .workers
            .iter()
            .find(|(_, w)| w.phase == Phase::Ready)
            .map(|(id, w)| format!("worker {id} on {}", w.host));
        match waiting {
            Some(w) => {
                let msg = format!(
                    "{w} waits for a round, but {done} exited 0 before it joined one; the job \
                     can't both succeed and recover"
                );
                self.finish(out, 1, msg);
            }
            None => {
                let n = self
                    .workers
                    .iter()
                    .filter(|(id, w)| w.phase == Phase::Finished && !self.current.contains(id))
                    .count();
                let msg = format!("every worker exited 0 ({n} before joining a round)");
                self.finish(out, 0, msg);
            }
        }
    }

    /// Declares failed every awaited worker that is late.
    fn expire_dues(&mut self, now: Duration, out: &mut Vec<Action>) {
        let late: Vec<(WorkerId, String, Phase)> = self
            .workers
            .iter()
            .filter(|(_, w)| w.live() && w.due.is_some_and(|d| d <= now))
            .map(|(id, w)| (*id, w.host.clone(), w.phase))
            .collect();
        for (id, host, phase) in late {
            if !self.workers.get(&id).is_some_and(Worker::live) {
                continue; // stopped already with an earlier late worker of its host
            }
            let what = if phase == Phase::Starting {
                "did not register"
            } else {
                "did not join the round"
            };
            tracing::warn!(
                worker = id,
                %host,
                timeout_s = self.cfg.round_timeout.as_secs_f64(),
                "worker {what} in time; declared failed"
            );
            if let Some(w) = self.workers.get_mut(&id) {
                w.phase = Phase::Leaving;
                w.due = None;
            }
            out.push(Action::Stop { worker: id });
            let why = format!("worker {id} on {host} {what} in time");
            self.host_failed(now, id, &host, &why, CauseKind::Failure, out);
        }
    }

    /// Plans or re-plans the pending round, and completes it once every member is ready.
    fn plan(&mut self, now: Duration, out: &mut Vec<Action>) {
        let Some(target) = self.target() else {
            let since = *self.waiting_since.get_or_insert(now);
            let need = self.slots_needed();
            if now.saturating_sub(since) >= self.cfg.elastic_timeout {
                let msg = format!(
                    "timed out after {:.0}s waiting for enough slots: {} available, {} needed \
                     (--elastic-timeout / HOROVOD_ELASTIC_TIMEOUT)",
                    self.cfg.elastic_timeout.as_secs_f64(),
                    self.slots_available(),
                    need
                );
                self.finish(out, 1, msg);
            }
            return;
        };
        if self.waiting_since.take().is_some() && self.generation > 0 {
            tracing::info!(slots = self.slots_available(), "enough slots again");
        }
        // Recovery does not wait for workers still starting: a round after the first takes
        // the slots whose workers are connected (on each host, its first slots up to the first
        // that is not), when they are enough; the others join through a later change.
        let wanted: HashSet<(String, usize)> = Self::slots_of(&target).into_iter().collect();
        let target = if self.generation > 0 {
            let ready = |host: &str, slots: usize| {
                (0..slots)
                    .take_while(|&k| {
                        self.worker_at(host, k).is_some_and(|id| {
                            self.workers
                                .get(&id)
                                .is_some_and(|w| matches!(w.phase, Phase::Ready | Phase::Running))
                        })
                    })
                    .count()
            };
            match self.target_with(ready) {
                Some(t) if !t.is_empty() => t,
                _ => target,
            }
        } else {
            target
        };
        let mut members = Vec::with_capacity(target.len());
        for s in &target {
            match self.worker_at(&s.host, s.local_rank) {
                Some(id) => members.push(id),
                None => {
                    self.start(now, s, out);
                    members.push(self.next_worker - 1);
                }
            }
        }
        let (target, members, keeper) = self.keep_for_state(target, members);
        if self.generation > 0 && !members.iter().any(|m| self.current.contains(m)) {
            self.finish(
                out,
                1,
                "no worker of the previous round survives: the committed state is lost".into(),
            );
            return;
        }
        // Live workers outside the round leave it.
        let outside: Vec<WorkerId> = self
            .workers
            .iter()
            .filter(|(id, w)| {
                w.live()
                    && !members.contains(id)
                    && !wanted.contains(&(w.host.clone(), w.local_rank))
            })
            .map(|(id, _)| *id)
            .collect();
        for id in outside {
            let mut reason = "its host left the job or the job shrank";
            if let Some(w) = self.workers.get_mut(&id) {
                w.phase = Phase::Leaving;
                w.due = None;
                if w.kept {
                    reason = "its host left the job; the workers that stay hold the state it kept";
                    tracing::info!(worker = id, host = %w.host, "the worker kept for the state leaves: the next round holds the state without it");
                } else {
                    tracing::info!(worker = id, host = %w.host, "worker has no place in the next round");
                }
            }
            out.push(Action::Remove {
                worker: id,
                reason: reason.into(),
            });
        }
        if !members
            .iter()
            .all(|m| self.workers.get(m).is_some_and(|w| w.phase == Phase::Ready))
        {
            return;
        }
        // Complete. Every member has joined, so every sync report it sent came before: a round
        // none of whose members holds the committed state (the survivors of the last round
        // joined it but died, with its holders, before they synced) would start over from the
        // program's initial state without a word.
        if self.generation > 0
            && !members.iter().any(|m| {
                self.current.contains(m) && self.workers.get(m).is_some_and(|w| w.holds_state)
            })
        {
            self.finish(
                out,
                1,
                "no surviving worker holds the committed state (the workers that do failed before \
                 the newer ones synced it): the committed state is lost"
                    .into(),
            );
            return;
        }
        if self.generation > 0 {
            self.resets += 1;
            if let Some(limit) = self.cfg.reset_limit.filter(|&l| self.resets > l) {
                let msg = format!(
                    "the job was reset {} times, more than --reset-limit {limit}",
                    self.resets
                );
                self.finish(out, 1, msg);
                return;
            }
        }
        self.generation += 1;
        self.pending = false;
        self.keeping = None;
        if self.rounds.len() == ROUNDS_KEPT {
            self.rounds.pop_front();
        }
        self.rounds.push_back(Round {
            generation: self.generation,
            at: now,
            size: target.len(),
            causes: std::mem::take(&mut self.causes),
        });
        let hosts: Vec<String> = target.iter().map(|s| s.host.clone()).collect();
        let first = self.generation == 1;
        for (s, &id) in target.iter().zip(&members) {
            if let Some(w) = self.workers.get_mut(&id) {
                w.phase = Phase::Running;
                w.due = None;
                w.kept = keeper == Some(id);
                // Every worker of the first round starts from the same state.
                w.holds_state |= first;
            }
            out.push(Action::World {
                worker: id,
                generation: self.generation,
                placement: s.placement(),
                members: members.clone(),
                hosts: hosts.clone(),
                updates_through: self.next_update - 1,
            });
        }
        self.current = members;
        // The round's host order becomes the job's: hosts keep the place they trained at. A
        // kept worker's host left discovery: back, it is new.
        let mut order: Vec<String> = Vec::with_capacity(self.order.len());
        let mut placed: HashSet<String> = HashSet::new();
        for h in target.iter().map(|s| &s.host) {
            if self.discovered.contains_key(h) && placed.insert(h.clone()) {
                order.push(h.clone());
            }
        }
        order.extend(self.order.iter().filter(|h| !placed.contains(*h)).cloned());
        self.order = order;
        self.announced = Some(Self::slots_of(&target));
        self.announced_hosts = hosts.into_iter().collect();
        tracing::info!(
            round = self.generation,
            size = target.len(),
            hosts = %self.announced_hosts.iter().cloned().collect::<Vec<_>>().join(","),
            "round complete; training at the new size"
        );
        if let Some(k) = keeper {
            tracing::info!(
                round = self.generation,
                worker = k,
                host = %target[0].host,
                "the round syncs from the worker kept for the state; it leaves once a worker that stays reports its sync"
            );
        }
    }

    /// When no member of the planned round holds the committed state, keeps a worker that
    /// does, although its host was drained (left discovery, or lost its slots): it becomes
    /// rank 0, and the round's last slot is left out if `--max-np` needs it (its worker joins
    /// the round after, when the kept one has left). Returns the round, and the kept worker.
    fn keep_for_state(
        &mut self,
        target: Vec<SlotInfo>,
        members: Vec<WorkerId>,
    ) -> (Vec<SlotInfo>, Vec<WorkerId>, Option<WorkerId>) {
        let current: HashSet<WorkerId> = self.current.iter().copied().collect();
        let held = members
            .iter()
            .any(|m| current.contains(m) && self.workers.get(m).is_some_and(|w| w.holds_state));
        if self.generation == 0 || held {
            return (target, members, None);
        }
        // A drained host's first worker (its slot stays local rank 0) that holds the state;
        // its host is in no slot of the round, so the hosts stay contiguous.
        let in_target: HashSet<&str> = target.iter().map(|s| s.host.as_str()).collect();
        let Some((keeper, host)) = self.current.iter().find_map(|m| {
            let w = self.workers.get(m)?;
            let drained = w.live()
                && w.holds_state
                && w.local_rank == 0
                && !in_target.contains(w.host.as_str());
            drained.then(|| (*m, w.host.clone()))
        }) else {
            return (target, members, None);
        };
        let mut hosts = vec![HostSlots { host, slots: 1 }];
        for s in &target {
            match hosts.last_mut() {
                Some(h) if h.host == s.host => h.slots += 1,
                _ => hosts.push(HostSlots {
                    host: s.host.clone(),
                    slots: 1,
                }),
            }
        }
        let n = (target.len() + 1).min(self.cfg.max_np);
        let Ok(kept_target) = assign_static(&hosts, n) else {
            return (target, members, None);
        };
        if self.keeping != Some(keeper) {
            self.keeping = Some(keeper);
            let w = self.workers.get(&keeper);
            tracing::info!(
                worker = keeper,
                host = %w.map_or("?", |w| w.host.as_str()),
                "the host of the worker left, but no worker of the next round holds the committed state yet: the worker is kept for one more round to hand it over"
            );
        }
        let kept_members = std::iter::once(keeper)
            .chain(members)
            .take(kept_target.len())
            .collect();
        (kept_target, kept_members, Some(keeper))
    }

    /// Outside a round: when the host set's assignment changed, starts the workers new slots
    /// need and, once they are all connected, tells the running workers to move.
    fn prepare_change(&mut self, now: Duration, out: &mut Vec<Action>) {
        if self.generation == 0 {
            return;
        }
        // A worker kept for the state leaves only once a member that stays holds the state.
        if !self.kept_members().is_empty() && !self.state_held_by_stayer() {
            return;
        }
        let target = self.target();
        let slots = target.as_deref().map(Self::slots_of);
        if slots == self.announced {
            return;
        }
        // A member on a noticed host must leave before its deadline: the change is announced
        // at once, without waiting for new workers to connect (they join a later round).
        let urgent = self.current.iter().any(|m| {
            self.workers
                .get(m)
                .is_some_and(|w| w.live() && self.noticed.contains_key(&w.host))
        });
        if let Some(t) = &target {
            let mut all_ready = true;
            for s in t {
                match self.worker_at(&s.host, s.local_rank) {
                    Some(id) => {
                        if self
                            .workers
                            .get(&id)
                            .is_some_and(|w| w.phase == Phase::Starting)
                        {
                            all_ready = false;
                        }
                    }
                    None => {
                        self.start(now, s, out);
                        all_ready = false;
                    }
                }
            }
            if !all_ready && !urgent {
                return;
            }
        }
        let hosts: BTreeSet<String> = target.iter().flatten().map(|s| s.host.clone()).collect();
        let added: Vec<String> = hosts.difference(&self.announced_hosts).cloned().collect();
        let removed: Vec<String> = self.announced_hosts.difference(&hosts).cloned().collect();
        let before: usize = self.announced.iter().flatten().map(|(_, n)| n).sum();
        let after: usize = slots.iter().flatten().map(|(_, n)| n).sum();
        for h in &added {
            self.cause(CauseKind::ScaleUp, h, "host added".into());
        }
        for h in &removed {
            // A host that gave notice or was evicted is already named for what it was.
            if !self.causes.iter().any(|c| c.host == *h) {
                self.cause(CauseKind::ScaleDown, h, "host left discovery".into());
            }
        }
        if added.is_empty() && removed.is_empty() {
            let kind = if after > before {
                CauseKind::ScaleUp
            } else {
                CauseKind::ScaleDown
            };
            self.cause(kind, "", format!("slots {before} -> {after}"));
        }
        let workers = self.running_members();
        let update_id = self.next_update;
        self.next_update += 1;
        tracing::info!(
            update_id,
            added = %added.join(","),
            removed = %removed.join(","),
            "hosts changed; asking the workers to move to a new round"
        );
        self.announced = slots;
        self.announced_hosts = hosts;
        out.push(Action::Notify {
            workers,
            update_id,
            added,
            removed,
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(np: usize, min_np: usize, max_np: usize) -> Config {
        Config {
            np,
            min_np,
            max_np,
            elastic_timeout: Duration::from_secs(600),
            round_timeout: Duration::from_secs(30),
            reset_limit: None,
            cooldown: None,
            seed: 7,
        }
    }

    fn hosts(spec: &[(&str, usize)]) -> Input {
        Input::Discovered(
            spec.iter()
                .map(|(h, s)| HostSpec {
                    host: (*h).into(),
                    slots: *s,
                })
                .collect(),
        )
    }

    fn secs(s: u64) -> Duration {
        Duration::from_secs(s)
    }

    fn started(actions: &[Action]) -> Vec<(WorkerId, String)> {
        actions
            .iter()
            .filter_map(|a| match a {
                Action::Start { worker, host, .. } => Some((*worker, host.clone())),
                _ => None,
            })
            .collect()
    }

    fn worlds(actions: &[Action]) -> Vec<(WorkerId, usize, usize)> {
        actions
            .iter()
            .filter_map(|a| match a {
                Action::World {
                    worker, placement, ..
                } => Some((*worker, placement.rank, placement.size)),
                _ => None,
            })
            .collect()
    }

    fn ok() -> ExitInfo {
        ExitInfo {
            success: true,
            description: "exited with code 0".into(),
        }
    }

    fn killed() -> ExitInfo {
        ExitInfo {
            success: false,
            description: "was killed by signal 9".into(),
        }
    }

    /// Starts a job on `spec` and registers every worker; returns the core and the ids.
    fn running(c: Config, spec: &[(&str, usize)]) -> (Core, Vec<WorkerId>) {
        let mut core = Core::new(c);
        let a = core.handle(secs(0), hosts(spec));
        let ids: Vec<WorkerId> = started(&a).into_iter().map(|(w, _)| w).collect();
        let mut last = Vec::new();
        for &id in &ids {
            last = core.handle(secs(1), Input::Registered(id));
        }
        assert_eq!(worlds(&last).len(), ids.len(), "{last:?}");
        (core, ids)
    }

    #[test]
    fn the_snapshot_follows_the_job_through_a_failure_and_its_end() {
        let mut c = cfg(4, 2, 4);
        c.cooldown = Some(hvd_discovery::CooldownRange::new(secs(10), secs(20)).unwrap());
        let mut core = Core::new(c);
        assert_eq!(core.snapshot(secs(0)).phase, JobPhase::Pending);
        let a = core.handle(secs(0), hosts(&[("a", 2), ("b", 2)]));
        let ids: Vec<WorkerId> = started(&a).into_iter().map(|(w, _)| w).collect();
        for &id in &ids {
            core.handle(secs(1), Input::Registered(id));
        }
        let s = core.snapshot(secs(1));
        assert_eq!(
            s,
            Snapshot {
                phase: JobPhase::Running,
                generation: 1,
                workers: 4,
                hosts: vec![("a".into(), 2), ("b".into(), 2)],
                blacklisted: vec![],
                resets: 0,
                noticed: vec![],
            }
        );
        assert_eq!(
            core.rounds().iter().collect::<Vec<_>>(),
            [&Round {
                generation: 1,
                at: secs(1),
                size: 4,
                causes: vec![],
            }]
        );
        let a = core.handle(
            secs(5),
            Input::Exited {
                worker: ids[3],
                exit: killed(),
            },
        );
        let s = core.snapshot(secs(5));
        assert_eq!(s.phase, JobPhase::Rescaling, "{a:?}");
        assert_eq!(s.blacklisted.len(), 1);
        assert_eq!(s.blacklisted[0].0, "b");
        let until = s.blacklisted[0].1.unwrap();
        assert!(until >= secs(15) && until <= secs(25), "{until:?}");
        for &id in &ids[..2] {
            core.handle(
                secs(6),
                Input::Joined {
                    worker: id,
                    reason: "peer lost".into(),
                },
            );
        }
        let s = core.snapshot(secs(6));
        assert_eq!(
            (s.phase, s.generation, s.workers, s.resets),
            (JobPhase::Running, 2, 2, 1)
        );
        assert_eq!(s.hosts, vec![("a".into(), 2)]);
        assert_eq!(
            core.rounds()[1],
            Round {
                generation: 2,
                at: secs(6),
                size: 2,
                causes: vec![ResetCause {
                    kind: CauseKind::Failure,
                    host: "b".into(),
                    detail: format!("worker {} on b was killed by signal 9", ids[3]),
                }],
            }
        );
        assert!(
            core.snapshot(secs(30)).blacklisted.is_empty(),
            "cooldown over"
        );
        for &id in &ids[..2] {
            core.handle(
                secs(7),
                Input::Exited {
                    worker: id,
                    exit: ok(),
                },
            );
        }
        assert_eq!(core.snapshot(secs(7)).phase, JobPhase::Succeeded);
        let (mut failed, ids) = running(cfg(2, 2, 2), &[("a", 2)]);
        failed.handle(
            secs(2),
            Input::Exited {
                worker: ids[0],
                exit: killed(),
            },
        );
        assert_eq!(failed.snapshot(secs(2)).phase, JobPhase::Rescaling);
        failed.handle(secs(700), Input::Tick); // past the elastic timeout, with no host left
        assert_eq!(failed.snapshot(secs(700)).phase, JobPhase::Failed);
    }

    #[test]
    fn first_round_waits_for_np_then_starts_every_slot_up_to_max() {
        let mut core = Core::new(cfg(4, 2, 5));
        assert!(core.handle(secs(0), hosts(&[("a", 2)])).is_empty());
        let a = core.handle(secs(1), hosts(&[("a", 2), ("b", 2), ("c", 2)]));
        let s = started(&a);
        assert_eq!(s.len(), 5, "max-np caps the workers started: {a:?}");
        assert_eq!(s.iter().filter(|(_, h)| h == "c").count(), 1);
        for (id, _) in &s[..4] {
            assert!(worlds(&core.handle(secs(2), Input::Registered(*id))).is_empty());
        }
        let w = worlds(&core.handle(secs(2), Input::Registered(s[4].0)));
        assert_eq!(
            w,
            vec![(0, 0, 5), (1, 1, 5), (2, 2, 5), (3, 3, 5), (4, 4, 5)]
        );
    }

    #[test]
    fn a_failure_before_the_first_round_completes_recovers_with_min_np() {
        let mut core = Core::new(cfg(4, 2, 4));
        let a = core.handle(secs(0), hosts(&[("a", 2), ("b", 2)]));
        let s = started(&a);
        assert_eq!(s.len(), 4, "{a:?}");
        // A worker of b dies while every worker is still starting: b is blacklisted for good.
        let b0 = s.iter().find(|(_, h)| h == "b").map(|(id, _)| *id).unwrap();
        core.handle(
            secs(1),
            Input::Exited {
                worker: b0,
                exit: killed(),
            },
        );
        // The two workers of a are enough (--min-np 2): the round completes with them.
        let on_a: Vec<WorkerId> = s
            .iter()
            .filter(|(_, h)| h == "a")
            .map(|(id, _)| *id)
            .collect();
        assert!(worlds(&core.handle(secs(2), Input::Registered(on_a[0]))).is_empty());
        let w = worlds(&core.handle(secs(2), Input::Registered(on_a[1])));
        assert_eq!(w, vec![(0, 0, 2), (1, 1, 2)], "no wait for -np 4 slots");
        assert_eq!(core.snapshot(secs(2)).phase, JobPhase::Running);
        // Without a failure, the first round still waits for -np.
        let mut patient = Core::new(cfg(4, 2, 4));
        assert!(started(&patient.handle(secs(0), hosts(&[("a", 2)]))).is_empty());
    }

    /// A driver taking over numbers its new workers past the gap, never reusing the id of a
    /// worker its predecessor may have started unrecorded.
    #[test]
    fn a_core_taking_over_numbers_new_workers_past_the_gap() {
        let (core, ids) = running(cfg(2, 2, 4), &[("a", 2)]);
        let mut c = Core::restore(cfg(2, 2, 4), core.save().unwrap()).unwrap();
        c.skip_worker_ids(1000);
        let mut started = Vec::new();
        for (t, input) in [
            (5, hosts(&[("a", 2), ("b", 2)])),
            (10, Input::Tick),
            (20, Input::Tick),
        ] {
            started.extend(
                c.handle(secs(t), input)
                    .into_iter()
                    .filter_map(|x| match x {
                        Action::Start { worker, .. } => Some(worker),
                        _ => None,
                    }),
            );
        }
        let last = ids.iter().max().copied().unwrap();
        assert_eq!(started.len(), 2, "{started:?}");
        assert!(started.iter().all(|&w| w > last + 1000), "{started:?}");
    }

    /// A worker whose end is reported twice (an adopted worker's connection closing, then its
    /// agent's report) counts once: the job still finishes when the last one exits 0.
    #[test]
    fn a_worker_reported_ended_twice_counts_once() {
        let (mut core, ids) = running(cfg(4, 2, 4), &[("a", 2), ("b", 2)]);
        let mut finished = Vec::new();
        for (i, &id) in ids.iter().enumerate() {
            for _ in 0..2 {
                let a = core.handle(
                    secs(10 + i as u64),
                    Input::Exited {
                        worker: id,
                        exit: ok(),
                    },
                );
                finished.extend(a.into_iter().filter(|x| matches!(x, Action::Finish { .. })));
            }
        }
        assert!(
            matches!(&finished[..], [Action::Finish { code: 0, .. }]),
            "{finished:?}"
        );
    }

    /// A core saved at any point and restored decides exactly as the original from there on:
    /// through a failure with a cooldown, a blacklisting, a host added and a finish.
    #[test]
    fn a_restored_core_decides_as_the_original_would() {
        let mut c = cfg(4, 2, 6);
        c.cooldown = Some(hvd_discovery::CooldownRange {
            lo: secs(10),
            hi: secs(100),
        });
        let (core, ids) = running(c.clone(), &[("a", 2), ("b", 2)]);
        let script: Vec<(u64, Input)> = vec![
            (
                5,
                Input::Exited {
                    worker: ids[0],
                    exit: killed(),
                },
            ),
            (
                5,
                Input::Joined {
                    worker: ids[2],
                    reason: "peer lost".into(),
                },
            ),
            (
                5,
                Input::Joined {
                    worker: ids[3],
                    reason: "peer lost".into(),
                },
            ),
            (
                6,
                Input::Exited {
                    worker: ids[1],
                    exit: killed(),
                },
            ),
            (8, hosts(&[("a", 2), ("b", 2), ("c", 2)])),
            (9, Input::Registered(100)),
            (20, Input::Tick),
            (21, hosts(&[("a", 2), ("b", 2), ("c", 2)])),
            (
                30,
                Input::Exited {
                    worker: ids[2],
                    exit: ok(),
                },
            ),
            (
                30,
                Input::Exited {
                    worker: ids[3],
                    exit: ok(),
                },
            ),
        ];
        for cut in 0..=script.len() {
            let mut original = Core::restore(c.clone(), core.save().unwrap()).unwrap();
            let mut ended = Vec::new();
            for (t, input) in &script[..cut] {
                ended.push(original.handle(secs(*t), input.clone()));
            }
            let mut restored = Core::restore(c.clone(), original.save().unwrap()).unwrap();
            for (t, input) in &script[cut..] {
                // Workers the original started after the cut register in both.
                let input = match input {
                    Input::Registered(_) => match started(ended.last().map_or(&[][..], |v| v)) {
                        s if !s.is_empty() => Input::Registered(s[0].0),
                        _ => Input::Tick,
                    },
                    i => i.clone(),
                };
                let (a, b) = (
                    original.handle(secs(*t), input.clone()),
                    restored.handle(secs(*t), input),
                );
                assert_eq!(a, b, "cut at {cut}, input at {t} s");
                ended.push(a);
            }
            assert_eq!(
                original.snapshot(secs(40)),
                restored.snapshot(secs(40)),
                "cut at {cut}"
            );
            assert_eq!(
                original.save().unwrap(),
                restored.save().unwrap(),
                "cut at {cut}"
            );
        }
        assert!(Core::restore(c, serde_json::json!({})).is_err());
    }

    #[test]
    fn failure_blacklists_the_host_and_reranks_survivors_oldest_first() {
        let (mut core, ids) = running(cfg(4, 2, 4), &[("a", 2), ("b", 2)]);
        let a = core.handle(
            secs(5),
            Input::Exited {
                worker: ids[0],
                exit: killed(),
            },
        );
        assert_eq!(
            a,
            vec![
                Action::Stop { worker: ids[1] },
                Action::Abort {
                    workers: vec![ids[2], ids[3]],
                    generation: 1,
                    reason: format!(
                        "round 1 lost a member: worker {} on a was killed by signal 9",
                        ids[0]
                    ),
                }
            ],
            "a's other worker is stopped, b's are told to abort"
        );
        assert!(
            core.handle(
                secs(5),
                Input::Joined {
                    worker: ids[2],
                    reason: "peer lost".into()
                }
            )
            .is_empty()
        );
        let w = worlds(&core.handle(
            secs(5),
            Input::Joined {
                worker: ids[3],
                reason: "x".into(),
            },
        ));
        assert_eq!(w, vec![(ids[2], 0, 2), (ids[3], 1, 2)]);
        assert_eq!(core.generation(), 2);
    }

    #[test]
    fn added_hosts_get_workers_before_the_old_ones_are_interrupted() {
        let (mut core, ids) = running(cfg(2, 2, 8), &[("a", 2)]);
        let a = core.handle(secs(3), hosts(&[("a", 2), ("c", 1), ("b", 1)]));
        let s = started(&a);
        assert_eq!(
            s.iter().map(|(_, h)| h.as_str()).collect::<Vec<_>>(),
            vec!["b", "c"],
            "ties by name"
        );
        assert!(
            !a.iter().any(|x| matches!(x, Action::Notify { .. })),
            "no interrupt before they connect"
        );
        core.handle(secs(3), Input::Registered(s[0].0));
        let a = core.handle(secs(3), Input::Registered(s[1].0));
        assert_eq!(
            a,
            vec![Action::Notify {
                workers: ids.clone(),
                update_id: 1,
                added: vec!["b".into(), "c".into()],
                removed: vec![]
            }]
        );
        core.handle(
            secs(4),
            Input::Joined {
                worker: ids[0],
                reason: "hosts updated".into(),
            },
        );
        let w = worlds(&core.handle(
            secs(4),
            Input::Joined {
                worker: ids[1],
                reason: "hosts updated".into(),
            },
        ));
        assert_eq!(
            w,
            vec![
                (ids[0], 0, 4),
                (ids[1], 1, 4),
                (s[0].0, 2, 4),
                (s[1].0, 3, 4)
            ]
        );
    }

    #[test]
    fn workers_start_with_the_numbers_of_the_slot_they_are_started_for() {
        let mut core = Core::new(cfg(2, 2, 8));
        let placements = |a: &[Action]| -> Vec<(String, Placement)> {
            a.iter()
                .filter_map(|x| match x {
                    Action::Start {
                        host, placement, ..
                    } => Some((host.clone(), *placement)),
                    _ => None,
                })
                .collect()
        };
        let p = |rank, size, local_rank, local_size, cross_rank, cross_size| Placement {
            rank,
            size,
            local_rank,
            local_size,
            cross_rank,
            cross_size,
        };
        let a = core.handle(secs(0), hosts(&[("a", 2)]));
        assert_eq!(
            placements(&a),
            vec![
                ("a".into(), p(0, 2, 0, 2, 0, 1)),
                ("a".into(), p(1, 2, 1, 2, 0, 1))
            ]
        );
        for (id, _) in started(&a) {
            core.handle(secs(1), Input::Registered(id));
        }
        // b joins behind a: its workers are started as ranks 2 and 3 of 4, the round's slots.
        let a = core.handle(secs(2), hosts(&[("a", 2), ("b", 2)]));
        assert_eq!(
            placements(&a),
            vec![
                ("b".into(), p(2, 4, 0, 2, 1, 2)),
                ("b".into(), p(3, 4, 1, 2, 1, 2))
            ]
        );
    }

    #[test]
    fn removed_host_workers_are_released_and_survivors_keep_order() {
        let (mut core, ids) = running(cfg(2, 1, 4), &[("a", 1), ("b", 1), ("c", 1)]);
        let a = core.handle(secs(3), hosts(&[("a", 1), ("c", 1)]));
        assert!(
            matches!(&a[..], [Action::Notify { removed, .. }] if removed == &vec!["b".to_string()])
        );
        let first = core.handle(
            secs(3),
            Input::Joined {
                worker: ids[0],
                reason: "u".into(),
            },
        );
        assert!(first.contains(&Action::Remove {
            worker: ids[1],
            reason: "its host left the job or the job shrank".into()
        }));
        let a = core.handle(
            secs(3),
            Input::Joined {
                worker: ids[2],
                reason: "u".into(),
            },
        );
        assert_eq!(worlds(&a), vec![(ids[0], 0, 2), (ids[2], 1, 2)]);
        // The removed worker's exit, whatever its code, is not a failure.
        assert!(
            core.handle(
                secs(4),
                Input::Exited {
                    worker: ids[1],
                    exit: killed()
                }
            )
            .is_empty()
        );
    }

    #[test]
    fn a_worker_that_never_joins_is_declared_failed_and_the_round_reruns() {
        let (mut core, ids) = running(cfg(3, 2, 3), &[("a", 1), ("b", 1), ("c", 1)]);
        core.handle(
            secs(10),
            Input::Joined {
                worker: ids[0],
                reason: "timeout".into(),
            },
        );
        core.handle(
            secs(10),
            Input::Joined {
                worker: ids[2],
                reason: "timeout".into(),
            },
        );
        assert_eq!(core.next_deadline(), Some(secs(40)));
        assert!(core.handle(secs(39), Input::Tick).is_empty());
        let a = core.handle(secs(40), Input::Tick);
        assert!(a.contains(&Action::Stop { worker: ids[1] }));
        assert_eq!(worlds(&a), vec![(ids[0], 0, 2), (ids[2], 1, 2)]);
    }

    #[test]
    fn a_death_aborts_the_round_a_stopped_member_is_declared_failed_a_busy_one_waited_for() {
        let (mut core, ids) = running(cfg(4, 2, 4), &[("a", 2), ("b", 1), ("c", 1)]);
        // The worker on c is stopped (it answers nothing); then the one on b dies. The workers
        // on a wait on c's, never reading b's connection: the core must tell them.
        let a = core.handle(
            secs(5),
            Input::Exited {
                worker: ids[2],
                exit: killed(),
            },
        );
        assert!(
            matches!(&a[..], [Action::Abort { workers, generation: 1, reason }]
                if workers == &vec![ids[0], ids[1], ids[3]] && reason.contains("on b")),
            "{a:?}"
        );
        assert_eq!(
            core.next_deadline(),
            Some(secs(35)),
            "every member gets a deadline"
        );
        // Both on a answer at once; one is in a long computation and joins much later.
        for &w in &ids[..2] {
            let seen = Input::AbortSeen {
                worker: w,
                generation: 1,
            };
            assert!(core.handle(secs(5), seen).is_empty());
        }
        // An answer for another round changes nothing.
        let stale = Input::AbortSeen {
            worker: ids[3],
            generation: 0,
        };
        assert!(core.handle(secs(5), stale).is_empty());
        let a = core.handle(
            secs(6),
            Input::Joined {
                worker: ids[1],
                reason: "communicator aborted".into(),
            },
        );
        assert!(worlds(&a).is_empty(), "the round waits: {a:?}");
        assert!(core.handle(secs(34), Input::Tick).is_empty());
        let a = core.handle(secs(35), Input::Tick);
        assert_eq!(
            a,
            vec![Action::Stop { worker: ids[3] }],
            "only the silent one is declared failed; no member is left running to abort"
        );
        assert!(
            core.live_workers().contains(&ids[0]),
            "the busy one answered the abort: it is alive"
        );
        let a = core.handle(
            secs(100),
            Input::Joined {
                worker: ids[0],
                reason: "communicator aborted".into(),
            },
        );
        assert_eq!(worlds(&a), vec![(ids[0], 0, 2), (ids[1], 1, 2)]);
    }

    fn unresponsive(core: &mut Core, at: u64, id: WorkerId) -> Vec<Action> {
        core.handle(
            secs(at),
            Input::Unresponsive {
                worker: id,
                silent: secs(10),
            },
        )
    }

    #[test]
    fn a_frozen_member_is_killed_its_host_blacklisted_and_the_round_reruns_without_it() {
        let (mut core, ids) = running(cfg(4, 2, 4), &[("a", 2), ("b", 2)]);
        // Worker 3 on b is frozen between two steps: every other member waits on it.
        let a = unresponsive(&mut core, 20, ids[3]);
        assert_eq!(a[0], Action::Stop { worker: ids[3] }, "{a:?}");
        assert!(
            a.contains(&Action::Stop { worker: ids[2] }),
            "the host's other worker is stopped with it: {a:?}"
        );
        assert!(
            a.iter().any(|x| matches!(x, Action::Abort { workers, generation: 1, reason }
                if workers == &vec![ids[0], ids[1]]
                    && reason.contains(&format!("worker {} on b stopped answering for 10.0 s (frozen?)", ids[3])))),
            "{a:?}"
        );
        let snap = core.snapshot(secs(20));
        assert_eq!(snap.blacklisted, vec![("b".to_string(), None)]);
        // Its kill, and the stop of the other one, mean nothing more.
        for &w in &ids[2..] {
            assert!(
                core.handle(
                    secs(21),
                    Input::Exited {
                        worker: w,
                        exit: killed()
                    }
                )
                .is_empty()
            );
        }
        // A second report changes nothing either.
        assert!(unresponsive(&mut core, 22, ids[3]).is_empty());
        joined(&mut core, 21, ids[0]);
        let a = joined(&mut core, 21, ids[1]);
        assert_eq!(worlds(&a), vec![(ids[0], 0, 2), (ids[1], 1, 2)]);
        assert_eq!(core.snapshot(secs(21)).resets, 1);
    }

    #[test]
    fn a_worker_frozen_while_the_round_forms_is_left_out_of_it() {
        let (mut core, ids) = running(cfg(2, 2, 4), &[("a", 2)]);
        // A new host's worker registers, then freezes before the round that adds it completes.
        let s = started(&core.handle(secs(3), hosts(&[("a", 2), ("b", 2)])));
        assert_eq!(s.len(), 2);
        core.handle(secs(4), Input::Registered(s[0].0));
        let a = core.handle(secs(4), Input::Registered(s[1].0));
        assert!(
            a.iter().any(|x| matches!(x, Action::Notify { .. })),
            "{a:?}"
        );
        let a = unresponsive(&mut core, 14, s[1].0);
        assert_eq!(
            a[..2],
            [
                Action::Stop { worker: s[1].0 },
                Action::Stop { worker: s[0].0 }
            ]
        );
        assert!(
            matches!(&a[2..], [Action::Notify { removed, .. }] if removed == &vec!["b".to_string()]),
            "no member of the running round was lost: nothing to abort; b is announced gone: {a:?}"
        );
        // The old members answer the announcement: the round goes on with them alone.
        joined(&mut core, 15, ids[0]);
        let a = joined(&mut core, 15, ids[1]);
        assert_eq!(worlds(&a), vec![(ids[0], 0, 2), (ids[1], 1, 2)]);
        // A worker that never registered is the start timeout's; one leaving is let go.
        let (mut core, _) = running(cfg(2, 2, 3), &[("a", 2)]);
        let s = started(&core.handle(secs(3), hosts(&[("a", 2), ("b", 1)])));
        assert!(unresponsive(&mut core, 13, s[0].0).is_empty());
    }

    #[test]
    fn a_member_frozen_after_others_finished_fails_the_job() {
        let (mut core, ids) = running(cfg(2, 1, 2), &[("a", 1), ("b", 1)]);
        core.handle(
            secs(50),
            Input::Exited {
                worker: ids[0],
                exit: ok(),
            },
        );
        let a = unresponsive(&mut core, 60, ids[1]);
        assert!(
            matches!(&a[..], [Action::Stop { .. }, Action::Finish { code: 1, message }]
                if message.contains("stopped answering") && message.contains("finished")),
            "{a:?}"
        );
    }

    #[test]
    fn a_busy_member_that_never_joins_is_declared_failed_after_the_elastic_timeout() {
        let (mut core, ids) = running(cfg(3, 2, 3), &[("a", 1), ("b", 1), ("c", 1)]);
        core.handle(
            secs(5),
            Input::Exited {
                worker: ids[2],
                exit: killed(),
            },
        );
        let seen = Input::AbortSeen {
            worker: ids[1],
            generation: 1,
        };
        core.handle(secs(5), seen);
        core.handle(
            secs(5),
            Input::Joined {
                worker: ids[0],
                reason: "peer lost".into(),
            },
        );
        assert_eq!(core.next_deadline(), Some(secs(605)));
        let a = core.handle(secs(605), Input::Tick);
        assert!(a.contains(&Action::Stop { worker: ids[1] }), "{a:?}");
    }

    #[test]
    fn a_new_worker_that_never_registers_does_not_disturb_the_old_ones() {
        let (mut core, ids) = running(cfg(2, 2, 3), &[("a", 2)]);
        let s = started(&core.handle(secs(3), hosts(&[("a", 2), ("b", 1)])));
        let a = core.handle(secs(33), Input::Tick);
        assert_eq!(a, vec![Action::Stop { worker: s[0].0 }]);
        assert!(worlds(&a).is_empty());
        // b is blacklisted for good: nothing more happens, the old workers train on.
        assert!(
            core.handle(secs(40), hosts(&[("a", 2), ("b", 1)]))
                .is_empty()
        );
        assert_eq!(core.live_workers(), ids);
    }

    #[test]
    fn below_min_np_waits_then_times_out_with_counts() {
        let mut c = cfg(2, 2, 2);
        c.elastic_timeout = secs(60);
        let (mut core, ids) = running(c, &[("a", 1), ("b", 1)]);
        core.handle(
            secs(5),
            Input::Exited {
                worker: ids[1],
                exit: killed(),
            },
        );
        assert!(
            core.handle(
                secs(5),
                Input::Joined {
                    worker: ids[0],
                    reason: "peer lost".into()
                }
            )
            .is_empty()
        );
        let a = core.handle(secs(65), Input::Tick);
        match &a[..] {
            [Action::Finish { code: 1, message }] => {
                assert!(message.contains("1 available, 2 needed"), "{message}");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn cooldown_lets_a_host_back() {
        let mut c = cfg(2, 1, 2);
        c.cooldown = Some(CooldownRange::new(secs(10), secs(100)).unwrap());
        let (mut core, ids) = running(c, &[("a", 1), ("b", 1)]);
        core.handle(
            secs(5),
            Input::Exited {
                worker: ids[1],
                exit: killed(),
            },
        );
        let w = worlds(&core.handle(
            secs(5),
            Input::Joined {
                worker: ids[0],
                reason: "x".into(),
            },
        ));
        assert_eq!(w, vec![(ids[0], 0, 1)]);
        assert!(started(&core.handle(secs(14), Input::Tick)).is_empty());
        let a = core.handle(secs(30), Input::Tick);
        let s = started(&a);
        assert_eq!(s.len(), 1);
        assert_eq!(s[0].1, "b");
    }

    #[test]
    fn reset_limit_and_success() {
        let mut c = cfg(2, 1, 2);
        c.reset_limit = Some(0);
        let (mut core, ids) = running(c.clone(), &[("a", 1), ("b", 1)]);
        core.handle(
            secs(5),
            Input::Exited {
                worker: ids[1],
                exit: killed(),
            },
        );
        let a = core.handle(
            secs(5),
            Input::Joined {
                worker: ids[0],
                reason: "x".into(),
            },
        );
        assert!(
            matches!(&a[..], [Action::Finish { code: 1, message }] if message.contains("--reset-limit 0")),
            "{a:?}"
        );

        let (mut core, ids) = running(c, &[("a", 1), ("b", 1)]);
        assert!(
            core.handle(
                secs(5),
                Input::Exited {
                    worker: ids[0],
                    exit: ok()
                }
            )
            .is_empty()
        );
        let a = core.handle(
            secs(5),
            Input::Exited {
                worker: ids[1],
                exit: killed(),
            },
        );
        assert!(
            matches!(&a[..], [Action::Finish { code: 1, .. }]),
            "a failure after another finished is not success: {a:?}"
        );
    }

    fn exited(core: &mut Core, at: u64, worker: WorkerId, exit: ExitInfo) -> Vec<Action> {
        core.handle(secs(at), Input::Exited { worker, exit })
    }

    /// Neither a blacklisting nor a worker stopped or started for it.
    fn no_failure(core: &Core, a: &[Action]) {
        assert!(
            !a.iter()
                .any(|x| matches!(x, Action::Stop { .. } | Action::Start { .. })),
            "{a:?}"
        );
        assert!(core.snapshot(secs(60)).blacklisted.is_empty());
    }

    #[test]
    fn a_worker_that_exits_0_before_joining_a_round_finishes_its_slot_and_is_no_failure() {
        // Both exit 0 without ever joining (a program that never calls init): the job succeeded.
        // A failure after the first one's exit fails the job, still blacklisting nothing.
        for (second, code, says) in [
            (ok(), 0, "every worker exited 0 (2 before joining a round)"),
            (
                killed(),
                1,
                "after worker 1 on b had finished (exited 0); the job failed",
            ),
        ] {
            let mut core = Core::new(cfg(2, 1, 2));
            let ids: Vec<WorkerId> = started(&core.handle(secs(0), hosts(&[("a", 1), ("b", 1)])))
                .into_iter()
                .map(|(w, _)| w)
                .collect();
            let a = exited(&mut core, 1, ids[1], ok());
            assert!(
                a.is_empty(),
                "the slot is finished: nothing to do yet: {a:?}"
            );
            no_failure(&core, &a);
            let a = core.handle(secs(10), Input::Tick);
            assert!(a.is_empty(), "no worker is started in its place: {a:?}");
            let a = exited(&mut core, 12, ids[0], second);
            assert!(
                matches!(&a[..], [Action::Finish { code: c, message }] if *c == code && message.contains(says)),
                "{a:?}"
            );
            no_failure(&core, &a);
        }
    }

    #[test]
    fn a_worker_waiting_for_a_round_after_another_exited_0_before_joining_ends_the_job() {
        let mut core = Core::new(cfg(2, 1, 2));
        let ids: Vec<WorkerId> = started(&core.handle(secs(0), hosts(&[("a", 1), ("b", 1)])))
            .into_iter()
            .map(|(w, _)| w)
            .collect();
        assert!(core.handle(secs(1), Input::Registered(ids[0])).is_empty());
        let a = exited(&mut core, 2, ids[1], ok());
        // Horovod stops the job once every worker has recorded its state; the one waiting
        // can't train without a recovery, which a job that succeeded can't have.
        let msg = "worker 0 on a waits for a round, but worker 1 on b exited 0 before it \
                   joined one; the job can't both succeed and recover";
        assert!(
            matches!(&a[..], [Action::Finish { code: 1, message }] if message == msg),
            "{a:?}"
        );
        no_failure(&core, &a);
    }

    #[test]
    fn a_new_worker_that_exits_0_before_joining_leaves_the_running_round_alone() {
        let (mut core, ids) = running(cfg(1, 1, 2), &[("a", 1)]);
        let a = core.handle(secs(5), hosts(&[("a", 1), ("b", 1)]));
        let new: Vec<WorkerId> = started(&a).into_iter().map(|(w, _)| w).collect();
        assert_eq!(new.len(), 1, "{a:?}");
        let a = exited(&mut core, 6, new[0], ok());
        no_failure(&core, &a);
        assert!(a.is_empty(), "{a:?}");
        let a = core.handle(secs(20), hosts(&[("a", 1), ("b", 2)]));
        assert!(
            a.is_empty(),
            "a job that has a finished slot grows no more: {a:?}"
        );
        let a = exited(&mut core, 30, ids[0], ok());
        assert!(
            matches!(&a[..], [Action::Finish { code: 0, message }] if message.contains("all 1 workers of round 1")),
            "{a:?}"
        );
    }

    #[test]
    fn first_discovery_failure_fails_the_job_later_ones_do_not() {
        let mut core = Core::new(cfg(1, 1, 1));
        let a = core.handle(secs(0), Input::DiscoveryFailed("exit 3".into()));
        assert!(
            matches!(&a[..], [Action::Finish { code: 1, message }] if message.contains("exit 3"))
        );
        let (mut core, _) = running(cfg(1, 1, 1), &[("a", 1)]);
        assert!(
            core.handle(secs(5), Input::DiscoveryFailed("exit 3".into()))
                .is_empty()
        );
    }

    fn joined(core: &mut Core, at: u64, id: WorkerId) -> Vec<Action> {
        core.handle(
            secs(at),
            Input::Joined {
                worker: id,
                reason: "hosts updated".into(),
            },
        )
    }

    fn synced(core: &mut Core, at: u64, id: WorkerId) -> Vec<Action> {
        let generation = core.generation();
        core.handle(
            secs(at),
            Input::Synced {
                worker: id,
                generation,
            },
        )
    }

    fn removed(actions: &[Action]) -> Vec<WorkerId> {
        actions
            .iter()
            .filter_map(|a| match a {
                Action::Remove { worker, .. } => Some(*worker),
                _ => None,
            })
            .collect()
    }

    fn notified(actions: &[Action]) -> Option<(Vec<WorkerId>, Vec<String>, Vec<String>)> {
        actions.iter().find_map(|a| match a {
            Action::Notify {
                workers,
                added,
                removed,
                ..
            } => Some((workers.clone(), added.clone(), removed.clone())),
            _ => None,
        })
    }

    /// Replaces the job's hosts `a` and `b` by `c` and `d` in one poll and registers the new
    /// workers; returns them.
    fn swap_fleet(core: &mut Core, old: &[WorkerId]) -> Vec<WorkerId> {
        let s = started(&core.handle(secs(3), hosts(&[("c", 1), ("d", 1)])));
        let new: Vec<WorkerId> = s.iter().map(|(id, _)| *id).collect();
        assert_eq!(new.len(), 2, "{s:?}");
        core.handle(secs(4), Input::Registered(new[0]));
        let a = core.handle(secs(4), Input::Registered(new[1]));
        assert_eq!(
            notified(&a),
            Some((
                old.to_vec(),
                vec!["c".into(), "d".into()],
                vec!["a".into(), "b".into()]
            ))
        );
        new
    }

    #[test]
    fn draining_every_host_that_holds_the_state_keeps_one_worker_until_the_next_round_synced() {
        let (mut core, old) = running(cfg(2, 1, 4), &[("a", 1), ("b", 1)]);
        let new = swap_fleet(&mut core, &old);
        // The first old worker by rank (it holds the newest commit) is kept as rank 0; the other
        // drained one leaves at once.
        let a = joined(&mut core, 5, old[0]);
        assert_eq!(removed(&a), vec![old[1]], "{a:?}");
        assert_eq!(
            worlds(&a),
            vec![(old[0], 0, 3), (new[0], 1, 3), (new[1], 2, 3)]
        );
        assert!(
            a.iter().all(|x| !matches!(x, Action::Finish { .. })),
            "the state is not lost: {a:?}"
        );
        // The kept worker leaves only after a worker that stays holds the state.
        assert!(
            joined(&mut core, 6, old[1]).is_empty(),
            "a removed worker's join"
        );
        assert!(
            synced(&mut core, 6, old[0]).is_empty(),
            "the kept one's own sync"
        );
        assert!(core.handle(secs(7), Input::Tick).is_empty());
        let a = synced(&mut core, 7, new[1]);
        assert_eq!(
            notified(&a),
            Some((vec![old[0], new[0], new[1]], vec![], vec!["a".into()]))
        );
        assert!(synced(&mut core, 7, new[0]).is_empty(), "announced once");
        // The first join plans the round without the kept worker: it is released at once.
        let mut a = joined(&mut core, 8, new[0]);
        a.extend(joined(&mut core, 8, new[1]));
        assert!(joined(&mut core, 8, old[0]).is_empty());
        assert_eq!(
            a[0],
            Action::Remove {
                worker: old[0],
                reason: "its host left the job; the workers that stay hold the state it kept"
                    .into()
            }
        );
        assert_eq!(worlds(&a), vec![(new[0], 0, 2), (new[1], 1, 2)]);
        for &id in &old {
            assert!(
                core.handle(
                    secs(9),
                    Input::Exited {
                        worker: id,
                        exit: ok()
                    }
                )
                .is_empty(),
                "a drained worker's exit is neither a failure nor the end"
            );
        }
        for &id in &new {
            core.handle(
                secs(10),
                Input::Exited {
                    worker: id,
                    exit: ok(),
                },
            );
        }
        assert_eq!(core.snapshot(secs(10)).phase, JobPhase::Succeeded);
    }

    fn notice(core: &mut Core, at: u64, host: &str, within: Option<u64>) -> Vec<Action> {
        core.handle(
            secs(at),
            Input::Notice {
                host: host.into(),
                source: NoticeSource::Sigterm,
                within: within.map(secs),
            },
        )
    }

    #[test]
    fn a_noticed_host_leaves_gracefully_unblacklisted_and_comes_back_after_its_deadline() {
        let (mut core, ids) = running(cfg(2, 1, 4), &[("a", 1), ("b", 1), ("c", 1)]);
        let a = notice(&mut core, 3, "b", Some(30));
        assert_eq!(
            notified(&a),
            Some((ids.clone(), vec![], vec!["b".into()])),
            "{a:?}"
        );
        assert!(
            notice(&mut core, 3, "b", None).is_empty(),
            "a second notice changes nothing"
        );
        assert_eq!(
            core.next_deadline(),
            Some(secs(93)),
            "the notice's end, with its margin"
        );
        let mut a = joined(&mut core, 4, ids[0]);
        assert_eq!(removed(&a), vec![ids[1]], "{a:?}");
        a.extend(joined(&mut core, 4, ids[2]));
        assert_eq!(worlds(&a), vec![(ids[0], 0, 2), (ids[2], 1, 2)]);
        assert!(
            a.iter()
                .all(|x| !matches!(x, Action::Stop { .. } | Action::Abort { .. })),
            "nothing is stopped or aborted: {a:?}"
        );
        assert!(
            joined(&mut core, 4, ids[1]).is_empty(),
            "the noticed one's join"
        );
        assert!(
            core.handle(
                secs(5),
                Input::Exited {
                    worker: ids[1],
                    exit: ok()
                }
            )
            .is_empty(),
            "the noticed worker's exit is neither a failure nor the end"
        );
        let snap = core.snapshot(secs(5));
        assert!(snap.blacklisted.is_empty(), "not blacklisted: {snap:?}");
        assert_eq!(
            snap.noticed,
            vec![("b".into(), NoticeSource::Sigterm, secs(93))]
        );
        // Discovery keeps listing b: it is kept out until a margin past the deadline (the
        // cloud's API may list a preempted machine a while), then gets a worker.
        assert!(
            core.handle(secs(20), hosts(&[("a", 1), ("b", 1), ("c", 1)]))
                .is_empty()
        );
        assert!(core.handle(secs(92), Input::Tick).is_empty());
        let a = core.handle(secs(93), Input::Tick);
        assert_eq!(started(&a), vec![(3, "b".to_string())], "{a:?}");
        assert!(core.snapshot(secs(93)).noticed.is_empty());
    }

    #[test]
    fn a_notice_for_the_only_holder_of_the_state_hands_it_over_first() {
        // a holds the state; c and d are new and have not synced when a gives notice.
        let (mut core, old) = running(cfg(1, 1, 4), &[("a", 1)]);
        let s = started(&core.handle(secs(2), hosts(&[("a", 1), ("c", 1), ("d", 1)])));
        let new: Vec<WorkerId> = s.iter().map(|(id, _)| *id).collect();
        core.handle(secs(2), Input::Registered(new[0]));
        let a = core.handle(secs(2), Input::Registered(new[1]));
        assert!(notified(&a).is_some(), "{a:?}");
        let a = notice(&mut core, 3, "a", Some(120));
        assert_eq!(
            notified(&a),
            Some((old.clone(), vec![], vec!["a".into()])),
            "{a:?}"
        );
        // The new workers wait for their first round: the old one's join completes it.
        let a = joined(&mut core, 4, old[0]);
        assert_eq!(
            worlds(&a),
            vec![(old[0], 0, 3), (new[0], 1, 3), (new[1], 2, 3)],
            "the noticed worker is kept as rank 0 to hand the state over: {a:?}"
        );
        let a = synced(&mut core, 5, new[0]);
        assert_eq!(
            notified(&a),
            Some((vec![old[0], new[0], new[1]], vec![], vec!["a".into()]))
        );
        let mut a = joined(&mut core, 6, new[0]);
        a.extend(joined(&mut core, 6, new[1]));
        assert_eq!(removed(&a), vec![old[0]]);
        assert_eq!(worlds(&a), vec![(new[0], 0, 2), (new[1], 1, 2)]);
        assert!(core.snapshot(secs(6)).blacklisted.is_empty());
    }

    #[test]
    fn a_stragglers_host_leaves_gracefully_is_cooled_down_and_never_below_min_np() {
        let mut c = cfg(2, 2, 4);
        c.cooldown = Some(CooldownRange::new(secs(10), secs(100)).expect("a range"));
        let (mut core, ids) = running(c, &[("a", 1), ("b", 1), ("c", 1)]);
        let straggler = |core: &mut Core, at: u64, host: &str| {
            core.handle(
                secs(at),
                Input::Straggler {
                    host: host.into(),
                    factor: 1.6,
                },
            )
        };
        let a = straggler(&mut core, 3, "c");
        assert_eq!(
            notified(&a),
            Some((ids.clone(), vec![], vec!["c".into()])),
            "{a:?}"
        );
        assert!(
            a.iter()
                .all(|x| !matches!(x, Action::Stop { .. } | Action::Abort { .. })),
            "nothing is stopped: {a:?}"
        );
        let mut a = joined(&mut core, 4, ids[0]);
        a.extend(joined(&mut core, 4, ids[1]));
        assert_eq!(removed(&a), vec![ids[2]]);
        assert_eq!(worlds(&a), vec![(ids[0], 0, 2), (ids[1], 1, 2)]);
        let snap = core.snapshot(secs(4));
        assert_eq!(snap.blacklisted.len(), 1, "cooled down: {snap:?}");
        // Two slots left, --min-np 2: b stays, however slow.
        assert!(straggler(&mut core, 5, "b").is_empty());
        assert_eq!(core.snapshot(secs(5)).blacklisted.len(), 1);
    }

    #[test]
    fn a_notice_survives_a_driver_handover() {
        let (mut core, _) = running(cfg(2, 1, 4), &[("a", 1), ("b", 1)]);
        notice(&mut core, 3, "b", Some(60));
        let saved = core.save().expect("saves");
        let restored = Core::restore(cfg(2, 1, 4), saved).expect("restores");
        assert!(restored.is_noticed("b"));
        assert_eq!(restored.next_deadline(), core.next_deadline());
        // A record written before notices existed reads as none.
        let mut old = core.save().expect("saves");
        old.as_object_mut().expect("an object").remove("noticed");
        let restored = Core::restore(cfg(2, 1, 4), old).expect("restores");
        assert!(!restored.is_noticed("b"));
    }

    #[test]
    fn a_drain_while_the_round_forms_keeps_the_state() {
        let (mut core, old) = running(cfg(2, 1, 8), &[("a", 1), ("b", 1)]);
        let s = started(&core.handle(secs(3), hosts(&[("a", 1), ("b", 1), ("c", 1), ("d", 1)])));
        let new: Vec<WorkerId> = s.iter().map(|(id, _)| *id).collect();
        core.handle(secs(4), Input::Registered(new[0]));
        core.handle(secs(4), Input::Registered(new[1]));
        assert!(worlds(&joined(&mut core, 5, old[1])).is_empty());
        // Both old hosts leave before the round forms.
        let a = core.handle(secs(5), hosts(&[("c", 1), ("d", 1)]));
        assert_eq!(
            removed(&a),
            vec![old[1]],
            "the first by rank is kept, the other released: {a:?}"
        );
        let a = joined(&mut core, 6, old[0]);
        assert_eq!(
            worlds(&a),
            vec![(old[0], 0, 3), (new[0], 1, 3), (new[1], 2, 3)],
        );
        synced(&mut core, 6, new[0]);
        for &id in &[old[0], new[0], new[1]] {
            joined(&mut core, 7, id);
        }
        assert_eq!(core.generation(), 3);
        assert_eq!(
            core.snapshot(secs(7)).hosts,
            vec![("c".into(), 1), ("d".into(), 1)]
        );
    }

    #[test]
    fn drained_workers_leave_at_once_when_new_members_synced_and_are_kept_when_not() {
        for synced_first in [true, false] {
            let (mut core, old) = running(cfg(2, 1, 8), &[("a", 1), ("b", 1)]);
            let s =
                started(&core.handle(secs(3), hosts(&[("a", 1), ("b", 1), ("c", 1), ("d", 1)])));
            let new: Vec<WorkerId> = s.iter().map(|(id, _)| *id).collect();
            core.handle(secs(4), Input::Registered(new[0]));
            core.handle(secs(4), Input::Registered(new[1]));
            for &id in &old {
                joined(&mut core, 5, id);
            }
            assert_eq!(core.generation(), 2);
            if synced_first {
                synced(&mut core, 5, new[1]);
            }
            core.handle(secs(6), hosts(&[("c", 1), ("d", 1)]));
            let mut a = Vec::new();
            for &id in old.iter().chain(&new) {
                a.extend(joined(&mut core, 7, id));
            }
            if synced_first {
                assert_eq!(removed(&a), old, "{a:?}");
                assert_eq!(worlds(&a), vec![(new[0], 0, 2), (new[1], 1, 2)]);
            } else {
                assert_eq!(removed(&a), vec![old[1]], "{a:?}");
                assert_eq!(
                    worlds(&a),
                    vec![(old[0], 0, 3), (new[0], 1, 3), (new[1], 2, 3)]
                );
            }
        }
    }

    #[test]
    fn the_kept_worker_counts_towards_max_np_only_while_it_is_kept() {
        let (mut core, old) = running(cfg(2, 1, 2), &[("a", 1), ("b", 1)]);
        let new = swap_fleet(&mut core, &old);
        joined(&mut core, 5, old[1]);
        let a = joined(&mut core, 5, old[0]);
        assert_eq!(
            worlds(&a),
            vec![(old[0], 0, 2), (new[0], 1, 2)],
            "d's worker waits for the next round"
        );
        assert!(!removed(&a).contains(&new[1]), "{a:?}");
        assert!(core.live_workers().contains(&new[1]));
        let a = synced(&mut core, 6, new[0]);
        assert!(notified(&a).is_some(), "{a:?}");
        let mut a = joined(&mut core, 7, new[0]);
        a.extend(joined(&mut core, 7, old[0]));
        assert_eq!(removed(&a), vec![old[0]]);
        assert_eq!(worlds(&a), vec![(new[0], 0, 2), (new[1], 1, 2)]);
    }

    #[test]
    fn a_failure_before_the_handover_keeps_the_worker_for_another_round() {
        let (mut core, old) = running(cfg(2, 1, 4), &[("a", 1), ("b", 1)]);
        let new = swap_fleet(&mut core, &old);
        joined(&mut core, 5, old[0]);
        assert_eq!(core.generation(), 2);
        // d's worker dies while the round connects, before any sync.
        let a = core.handle(
            secs(6),
            Input::Exited {
                worker: new[1],
                exit: killed(),
            },
        );
        assert!(
            matches!(&a[..], [Action::Abort { workers, .. }] if workers == &vec![old[0], new[0]])
        );
        joined(&mut core, 6, new[0]);
        let a = joined(&mut core, 6, old[0]);
        assert_eq!(
            worlds(&a),
            vec![(old[0], 0, 2), (new[0], 1, 2)],
            "kept again"
        );
        let a = synced(&mut core, 7, new[0]);
        assert!(notified(&a).is_some());
        let mut a = joined(&mut core, 8, new[0]);
        a.extend(joined(&mut core, 8, old[0]));
        assert_eq!(worlds(&a), vec![(new[0], 0, 1)]);
        assert_eq!(removed(&a), vec![old[0]]);
    }

    #[test]
    fn survivors_that_never_synced_the_state_end_the_job_saying_it_is_lost() {
        // a and b train; c joins them in round 2, then a and b die before c reports its sync.
        let (mut core, old) = running(cfg(2, 1, 4), &[("a", 1), ("b", 1)]);
        let s = started(&core.handle(secs(3), hosts(&[("a", 1), ("b", 1), ("c", 1)])));
        let c = s[0].0;
        core.handle(secs(3), Input::Registered(c));
        joined(&mut core, 4, old[0]);
        assert_eq!(worlds(&joined(&mut core, 4, old[1])).len(), 3);
        for &w in &old {
            core.handle(
                secs(5),
                Input::Exited {
                    worker: w,
                    exit: killed(),
                },
            );
        }
        let a = joined(&mut core, 5, c);
        assert!(
            matches!(&a[..], [Action::Finish { code: 1, message }] if message.contains("the committed state is lost")),
            "{a:?}"
        );
        // Had c synced, it would carry the state on alone.
        let (mut core, old) = running(cfg(2, 1, 4), &[("a", 1), ("b", 1)]);
        let s = started(&core.handle(secs(3), hosts(&[("a", 1), ("b", 1), ("c", 1)])));
        let c = s[0].0;
        core.handle(secs(3), Input::Registered(c));
        joined(&mut core, 4, old[0]);
        joined(&mut core, 4, old[1]);
        synced(&mut core, 4, c);
        for &w in &old {
            core.handle(
                secs(5),
                Input::Exited {
                    worker: w,
                    exit: killed(),
                },
            );
        }
        assert_eq!(worlds(&joined(&mut core, 5, c)), vec![(c, 0, 1)]);
    }

    #[test]
    fn a_sync_report_for_an_unknown_round_or_worker_changes_nothing() {
        let (mut core, ids) = running(cfg(1, 1, 1), &[("a", 1)]);
        let future = Input::Synced {
            worker: ids[0],
            generation: 9,
        };
        assert!(core.handle(secs(2), future).is_empty());
        let unknown = Input::Synced {
            worker: 99,
            generation: 1,
        };
        assert!(core.handle(secs(2), unknown).is_empty());
    }
}
