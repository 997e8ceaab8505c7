//! A seeded, deterministic simulation of an elastic job under churn. It drives the real
//! [`Core`] with a simulated cluster in place of processes, sockets and clocks.
//!
//! The simulated cluster starts the processes the core asks for and registers them after a
//! random delay. It plays the workers' part: a worker asks to join the next round after an
//! announced host change, when the core aborts its round, or when a peer of its round died,
//! left or hung, since its collectives then fail (but a death goes unnoticed while a hung
//! member holds the round's collectives: only the core's abort tells the others). Some
//! members are busy, in a long computation, and notice only after the round timeout; every
//! member that is not hung answers an abort at once. Where a scenario has heartbeats, a hung
//! worker that had registered is frozen: its driver connection answers no ping either, and
//! the core hears of it ([`Input::Unresponsive`]) once it has been silent for the heartbeat
//! timeout; it must then stop it at once (a busy member keeps answering, so it is never
//! reported). Meanwhile the cluster kills workers, hangs some, and changes what
//! discovery reports: hosts come, go, crash and change their slots (to zero, where a scenario
//! allows), some polls fail and some list no host at all. Then the churn stops, the job
//! settles, and the workers of the last round exit 0. Time is simulated: the core gets an
//! [`Input::Tick`] at its [`Core::next_deadline`] whenever nothing else comes first.
//!
//! After every input the simulation checks what the core promises:
//! - a round is one batch of `World`s: ranks `0..size` once each, one `World` per member, the
//!   same tables for all, and the six Horovod numbers recomputed from the hosts (ranks
//!   contiguous per host, hosts in order of first appearance);
//! - rounds are numbered 1, 2, 3…; sizes respect `-np`, `--min-np` and `--max-np`, and a round
//!   uses every available slot up to `--max-np`;
//! - no worker starts, and no round trains, on a host while the core blacklists it (exact
//!   without a cooldown; with one, up to the cooldown's unknown jitter);
//! - rank 0 of every round after the first was a member of the round before, so the committed
//!   state survives; the core may instead end the job saying the state is lost, but only when
//!   no worker of the last round is left on a usable host;
//! - the committed state is never lost to a drain: the simulation knows which workers hold it
//!   (the first round's, then every member of a round whose sync completed, which they report
//!   with [`Input::Synced`]), and every round after the first has one of them as a member,
//!   unless every holder died, hung or was stopped (a failure); the core removes a holder only
//!   while another stays in the job. A worker whose host left discovery may train on in the
//!   next round only to hand the state over: one at most, as rank 0, and only while no other
//!   member holds it;
//! - surviving hosts (one of their workers trains in both rounds, and discovery kept listing
//!   them) keep their relative order from one round to the next, and a worker keeps its slot;
//! - ids are started once; `Stop`, `Remove`, `World`, `Abort` and `Notify` name only live
//!   workers that the core started, and never one it already stopped or removed; `Abort`
//!   names members of the current round only;
//! - announcement ids increase, and a round accounts for every announcement before it;
//! - once the job is idle after the churn, its round uses every available slot;
//! - the job always ends: with code 0 once the last round's workers exit 0, or with a failure
//!   the cluster explains (too few slots for too long, no survivor, the reset limit).
//!
//! Oddities that break no promise (a worker stopped twice, say) are counted and printed.
//! The same seed replays the same trace: one seed runs twice and the traces' hashes must match.
//!
//! Notices (a scenario option) warn of a host's preemption: a random host of the job gives one
//! with a deadline, and at the deadline it leaves discovery and whatever still runs on it dies.
//! The core must drain it gracefully before then: no worker starts there while its notice
//! stands, and no round after the notice trains there, but for one worker kept as rank 0 to
//! hand the state over.
//!
//! Spot fleets (a scenario option) replace every host at once: new hosts arrive, and in the
//! same poll or up to 20 s later every host listed before them leaves discovery, while the
//! new workers start, join or sync.
//!
//! The default scenarios stay small (tens of hosts, 64 workers, about a thousand inputs a
//! seed) because tests build unoptimised and each input costs the core time in proportion to
//! its hosts times the workers of the round (its scans are linear). `large_cluster` runs 2,000
//! hosts and 1,000 workers; run it optimised with
//! `cargo test --release -p hvd-driver --bin horovodrun sim -- --ignored --nocapture`.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap};
use std::time::{Duration, Instant};

use hvd_discovery::{CooldownRange, HostSpec};
use hvd_rendezvous::{NoticeSource, Placement};

use super::core::{Action, Config, Core, ExitInfo, Input, NOTICE_MARGIN, WorkerId};

/// Returns the violation, naming the seed and the step, when `cond` does not hold.
macro_rules! ensure {
    ($sim:expr, $cond:expr, $($what:tt)+) => {
        if !$cond {
            return Err($sim.violation(format!($($what)+)));
        }
    };
}

const ROUND_TIMEOUT: Duration = Duration::from_secs(30);
const ELASTIC_TIMEOUT: Duration = Duration::from_secs(600);
const POLL_EVERY: Duration = Duration::from_secs(10);
/// How long the job may take to end once the churn stops.
const SETTLE_LIMIT: Duration = Duration::from_secs(4 * 3600);
/// Milliseconds from start to registration.
const REGISTER_MS: (u64, u64) = (500, 15_000);
/// Milliseconds from noticing a failed peer or an announcement to asking to join.
const JOIN_MS: (u64, u64) = (200, 8_000);
/// Milliseconds a busy member (a long computation between collectives) takes to notice.
const BUSY_MS: (u64, u64) = (40_000, 120_000);
/// Chance that a member is busy when its round breaks.
const BUSY: f64 = 0.05;
/// Milliseconds before a member's driver connection answers an abort.
const ABORT_SEEN_MS: (u64, u64) = (1, 300);
/// Milliseconds before peers notice a hung member: their collectives time out.
const PROGRESS_MS: (u64, u64) = (20_000, 60_000);
/// Milliseconds from a round's rank tables to its state sync completing on every member
/// (connecting the mesh, then the broadcast); below `JOIN_MS`, as a worker raises a host
/// update only at a commit after the sync.
const SYNC_MS: (u64, u64) = (5, 150);
/// Longest delay from a spot fleet's arrival to the old fleet leaving discovery.
const SWAP_DRAIN_MS: u64 = 20_000;
/// Milliseconds from a notice to its host's preemption: GCE's 30 s to AWS's two minutes, and
/// shorter SIGTERM graces.
const NOTICE_MS: (u64, u64) = (5_000, 120_000);

/// SplitMix64: a tiny generator with the same stream on every platform.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n`; `n` is above zero.
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    fn chance(&mut self, p: f64) -> bool {
        ((self.next() >> 11) as f64 / (1u64 << 53) as f64) < p
    }

    /// Uniform in `lo..=hi` milliseconds.
    fn ms(&mut self, (lo, hi): (u64, u64)) -> Duration {
        Duration::from_millis(lo + self.next() % (hi - lo + 1))
    }

    /// Uniform with mean `mean`.
    fn gap(&mut self, mean: Duration) -> Duration {
        self.ms((1, 2 * mean.as_millis() as u64))
    }
}

/// FNV-1a over the trace, so two runs compare without keeping either.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Trace(u64);

impl Trace {
    fn bytes(&mut self, b: &[u8]) {
        for &x in b {
            self.0 ^= u64::from(x);
            self.0 = self.0.wrapping_mul(0x0000_0100_0000_01B3);
        }
    }

    fn u64(&mut self, v: u64) {
        self.bytes(&v.to_le_bytes());
    }

    fn str(&mut self, s: &str) {
        self.u64(s.len() as u64);
        self.bytes(s.as_bytes());
    }
}

/// The cluster and how hard it churns.
#[derive(Debug, Clone, Copy)]
struct Scenario {
    /// Hosts discovered at the start, with 1 to 8 slots each.
    hosts: usize,
    np: usize,
    min_np: usize,
    max_np: usize,
    /// Simulated time during which workers die and hosts change.
    churn: Duration,
    /// Mean time between killed workers.
    kill_every: Duration,
    /// Mean time between hung workers.
    hang_every: Duration,
    /// Blacklist cooldown range in seconds; `None` blacklists for good.
    cooldown: Option<(u64, u64)>,
    /// `--reset-limit`.
    reset_limit: Option<usize>,
    /// Whether discovery may report a host with no slots (`host:0`).
    zero_slots: bool,
    /// Chance that a poll finds new hosts.
    grow: f64,
    /// Chance that a poll's script prints nothing: no hosts, which is not a failure.
    empty_polls: f64,
    /// Chance that a started worker hangs before registering.
    start_hang: f64,
    /// Chance that a poll brings a spot fleet that replaces every host: the old ones leave
    /// discovery in the same poll or soon after.
    swap: f64,
    /// `--heartbeat-timeout`: a hung worker that registered is reported silent after it.
    /// `None` models hung training threads whose connections still answer pings, so that
    /// only the round and progress timeouts catch them.
    heartbeat: Option<Duration>,
    /// Mean time between preemption notices; `None`: none.
    notice_every: Option<Duration>,
    /// Mean time between evictions of a straggler's host (`--straggler-policy evict`); `None`:
    /// none.
    straggle_every: Option<Duration>,
}

#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
enum Event {
    /// A started worker connects.
    Register(WorkerId),
    /// A worker training in round `.1` asks to join the next one, if it still trains there.
    Join(WorkerId, u64),
    /// A process ends (stopped, removed, or done training).
    Exit(WorkerId, bool),
    /// A member answers the abort of round `.1`, unless it hangs.
    AbortSeen(WorkerId, u64),
    /// Round `.0`'s members notice that a member hangs.
    Break(u64),
    /// Round `.0`'s state sync completes, if the round still stands.
    Sync(u64),
    /// Churn: the hosts of an old fleet leave discovery, and discovery runs at once.
    Drain(Vec<String>),
    /// Churn: a random worker is killed.
    Kill,
    /// Churn: a random worker hangs.
    Hang,
    /// A frozen worker has answered no ping for the heartbeat timeout.
    Silent(WorkerId),
    /// Churn: a host of the job gives notice of its preemption.
    Notice,
    /// Churn: a member's host is a straggler, and the driver asks for its eviction.
    Straggle,
    /// A noticed host's deadline: it leaves discovery and what still runs there dies.
    Preempt(String),
    /// Discovery runs (and, during churn, the hosts change first).
    Poll,
    /// The churn stops.
    EndChurn,
}

impl Event {
    /// Whether it concerns a worker, so the job is not idle while it is queued.
    fn of_worker(&self) -> bool {
        matches!(
            self,
            Self::Register(_)
                | Self::Join(..)
                | Self::Exit(..)
                | Self::AbortSeen(..)
                | Self::Break(_)
                | Self::Sync(_)
                | Self::Silent(_)
        )
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Churn,
    /// No more failures or host changes; waiting for the job to be idle.
    Settle,
    /// The last round's workers are exiting 0.
    Finishing,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Life {
    /// Started, not connected yet.
    Starting,
    /// Connected, waiting for its first round.
    Ready,
    /// Training in round `.0`.
    Running(u64),
    /// Asked to join the next round.
    Joining,
    /// Exited, and the core was told.
    Dead,
}

#[derive(Debug)]
struct Proc {
    host: String,
    life: Life,
    /// Answers nothing any more, but dies when killed.
    hung: bool,
    /// The core stopped or removed it: it is leaving and its exit means nothing.
    told: bool,
    /// Newest announcement it received.
    notified: u64,
    /// Newest announcement its round accounts for.
    through: u64,
    /// Its slot on its host, from its first round.
    local_rank: Option<usize>,
    /// The core stopped it (a failure), rather than removing it.
    stopped: bool,
}

impl Proc {
    /// Whether it was lost to a failure: killed, crashed, hung or stopped. A worker that left
    /// because the core removed it was not.
    fn failed(&self) -> bool {
        self.hung || self.stopped || (self.life == Life::Dead && !self.told)
    }

    /// Whether the core may still use it: it neither failed nor was told to go.
    fn available(&self) -> bool {
        !self.failed() && !self.told
    }
}

/// One `World` action.
struct World {
    worker: WorkerId,
    generation: u64,
    placement: Placement,
    members: Vec<WorkerId>,
    hosts: Vec<String>,
    updates_through: u64,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Stats {
    inputs: u64,
    rounds: u64,
    min_size: usize,
    max_size: usize,
    started: u64,
    kills: u64,
    hangs: u64,
    host_changes: u64,
    hosts_seen: usize,
    failed_polls: u64,
    announcements: u64,
    /// Rounds the core aborted while a hung member held them, so only the abort told the
    /// others of a death.
    held_aborts: u64,
    /// Longest time from a round's members noticing a failure to the next round.
    longest_pause: Duration,
    /// Spot fleets that replaced every host.
    swaps: u64,
    /// Rounds with a worker kept for the state although its host had left.
    kept: u64,
    /// Rounds that started without the committed state because every holder failed.
    lost_to_failures: u64,
    /// Frozen workers the core heard of through the heartbeat while they were still live.
    silent: u64,
    /// Preemption notices given.
    notices: u64,
    /// Noticed hosts that still ran a worker of the job at their deadline.
    late_drains: u64,
    /// Straggler evictions the core carried out (it refuses those below `--min-np`).
    evictions: u64,
}

/// How one run ended.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Outcome {
    code: u8,
    message: String,
    stats: Stats,
    trace: Trace,
    end: Duration,
    /// Oddities that break no promise, with how often they happened and the first instance.
    notes: BTreeMap<&'static str, (u64, String)>,
}

struct Sim {
    seed: u64,
    sc: Scenario,
    rng: Rng,
    core: Core,
    cooldown: Option<CooldownRange>,
    now: Duration,
    step: u64,
    queue: BinaryHeap<Reverse<(Duration, u64, Event)>>,
    seq: u64,
    /// Worker events queued; with none queued and nothing due in the core, the job is idle.
    busy: usize,
    phase: Phase,
    /// What discovery reports now.
    hosts: BTreeMap<String, usize>,
    /// Every host name used so far.
    names: BTreeSet<String>,
    /// Hosts lost with their processes: starting a worker there fails or hangs.
    crashed: BTreeSet<String>,
    /// Hosts that left discovery intact and may come back.
    departed: Vec<String>,
    procs: BTreeMap<WorkerId, Proc>,
    /// The host set of the last successful poll.
    discovered: BTreeMap<String, usize>,
    /// Hosts the core saw leave discovery since the last round; back, they count as new.
    left: BTreeSet<String>,
    /// Host failures the core counted: when the last one was, and how many.
    failures: BTreeMap<String, (Duration, u32)>,
    generation: u64,
    /// The last round's members and hosts, by rank.
    members: Vec<WorkerId>,
    round_hosts: Vec<String>,
    /// The newest round whose members noticed a failure and rejoin, and when.
    broken: u64,
    broken_at: Duration,
    last_update: u64,
    /// Workers that hold the committed state, as far as the cluster knows.
    holders: BTreeSet<WorkerId>,
    /// Hosts that gave notice, and when the core may use them again (a margin past the
    /// deadline).
    noticed: BTreeMap<String, Duration>,
    ending: Option<(u8, String)>,
    trace: Trace,
    stats: Stats,
    notes: BTreeMap<&'static str, (u64, String)>,
}

impl Sim {
    fn new(seed: u64, sc: Scenario) -> Self {
        let cooldown = sc.cooldown.map(|(lo, hi)| {
            CooldownRange::new(Duration::from_secs(lo), Duration::from_secs(hi))
                .expect("valid cooldown range")
        });
        let core = Core::new(Config {
            np: sc.np,
            min_np: sc.min_np,
            max_np: sc.max_np,
            elastic_timeout: ELASTIC_TIMEOUT,
            round_timeout: ROUND_TIMEOUT,
            reset_limit: sc.reset_limit,
            cooldown,
            seed,
        });
        let mut sim = Self {
            seed,
            sc,
            rng: Rng(seed ^ 0x005E_ED0F_C1A5),
            core,
            cooldown,
            now: Duration::ZERO,
            step: 0,
            queue: BinaryHeap::new(),
            seq: 0,
            busy: 0,
            phase: Phase::Churn,
            hosts: BTreeMap::new(),
            names: BTreeSet::new(),
            crashed: BTreeSet::new(),
            departed: Vec::new(),
            procs: BTreeMap::new(),
            discovered: BTreeMap::new(),
            left: BTreeSet::new(),
            failures: BTreeMap::new(),
            generation: 0,
            members: Vec::new(),
            round_hosts: Vec::new(),
            broken: 0,
            broken_at: Duration::ZERO,
            last_update: 0,
            holders: BTreeSet::new(),
            noticed: BTreeMap::new(),
            ending: None,
            trace: Trace(0xCBF2_9CE4_8422_2325),
            stats: Stats::default(),
            notes: BTreeMap::new(),
        };
        for _ in 0..sc.hosts {
            let slots = 1 + sim.rng.below(8);
            sim.add_host(slots);
        }
        sim
    }

    fn violation(&self, what: String) -> String {
        format!(
            "seed {} step {} (t={:.3}s, round {}): {what}",
            self.seed,
            self.step,
            self.now.as_secs_f64(),
            self.generation
        )
    }

    fn note(&mut self, what: &'static str, detail: String) {
        let detail = self.violation(detail);
        self.notes.entry(what).or_insert((0, detail)).0 += 1;
    }

    fn push(&mut self, after: Duration, ev: Event) {
        if ev.of_worker() {
            self.busy += 1;
        }
        self.seq += 1;
        self.queue.push(Reverse((self.now + after, self.seq, ev)));
    }

    fn add_host(&mut self, slots: usize) {
        let name = loop {
            let n = format!("h{:07x}", self.rng.next() & 0x0FFF_FFFF);
            if self.names.insert(n.clone()) {
                break n;
            }
        };
        self.hosts.insert(name, slots);
        self.stats.hosts_seen += 1;
    }

    fn random_host(&mut self) -> Option<String> {
        if self.hosts.is_empty() {
            return None;
        }
        let i = self.rng.below(self.hosts.len());
        self.hosts.keys().nth(i).cloned()
    }

    /// Whether the core keeps `host` out at `now` for sure. Without a cooldown this is exact;
    /// with one, the core's jitter may keep it out up to the range's lower bound longer.
    /// Whether `host`'s notice keeps it out of the job now.
    fn is_noticed(&self, host: &str) -> bool {
        self.noticed
            .get(host)
            .is_some_and(|&until| self.now < until)
    }

    fn blacklisted(&self, host: &str) -> bool {
        match (self.failures.get(host), self.cooldown) {
            (None, _) => false,
            (Some(_), None) => true,
            (Some(&(at, n)), Some(r)) => self.now < at + r.cooldown(n, 0.0),
        }
    }

    /// Hosts the core may use now, with their slots: (surely usable, possibly usable).
    fn usable_hosts(&self) -> (BTreeMap<&str, usize>, BTreeMap<&str, usize>) {
        let (mut lo, mut hi) = (BTreeMap::new(), BTreeMap::new());
        for (h, &s) in &self.discovered {
            if self.is_noticed(h) {
                continue;
            }
            let released = match (self.failures.get(h), self.cooldown) {
                (None, _) => Some(true),
                (Some(_), None) => Some(false),
                (Some(&(at, n)), Some(r)) => {
                    let earliest = at + r.cooldown(n, 0.0);
                    if self.now >= earliest + r.lo {
                        Some(true)
                    } else if self.now >= earliest {
                        None
                    } else {
                        Some(false)
                    }
                }
            };
            if released == Some(true) {
                lo.insert(h.as_str(), s);
            }
            if released != Some(false) {
                hi.insert(h.as_str(), s);
            }
        }
        (lo, hi)
    }

    /// Slots the core may use now: (surely available, possibly available).
    fn available(&self) -> (usize, usize) {
        let (lo, hi) = self.usable_hosts();
        (lo.values().sum(), hi.values().sum())
    }

    /// The core counted a failure on `host`: it blacklists the host, unless it already does.
    fn failed(&mut self, host: &str) {
        if self.blacklisted(host) {
            return;
        }
        let now = self.now;
        let e = self.failures.entry(host.to_string()).or_insert((now, 0));
        *e = (now, e.1 + 1);
    }

    fn describe(&self) -> String {
        let mut lives: BTreeMap<String, usize> = BTreeMap::new();
        for m in &self.members {
            let p = &self.procs[m];
            let k = format!(
                "{:?}{}{}",
                p.life,
                if p.hung { " hung" } else { "" },
                if p.told { " told" } else { "" }
            );
            *lives.entry(k).or_default() += 1;
        }
        // Hosts the core keeps out that the cluster did not see fail: a disagreement.
        let snap = self.core.snapshot(self.now);
        let unexplained: Vec<String> = snap
            .blacklisted
            .into_iter()
            .map(|(h, _)| h)
            .filter(|h| !self.failures.contains_key(h) && self.discovered.contains_key(h))
            .collect();
        format!(
            "phase {:?} (the core's {:?}), {} members {lives:?}, {} worker events queued, next \
             deadline {:?}, {:?} slots available, {} live workers in the core, blacklisted by the \
             core with no failure seen: {unexplained:?}",
            self.phase,
            snap.phase,
            self.members.len(),
            self.busy,
            self.core.next_deadline(),
            self.available(),
            self.core.live_workers().len()
        )
    }

    fn run(mut self) -> Result<Outcome, String> {
        self.push(Duration::ZERO, Event::Poll);
        let k = self.rng.gap(self.sc.kill_every);
        self.push(k, Event::Kill);
        let h = self.rng.gap(self.sc.hang_every);
        self.push(h, Event::Hang);
        if let Some(every) = self.sc.notice_every {
            let n = self.rng.gap(every);
            self.push(n, Event::Notice);
        }
        if let Some(every) = self.sc.straggle_every {
            let n = self.rng.gap(every);
            self.push(n, Event::Straggle);
        }
        self.push(self.sc.churn, Event::EndChurn);
        let limit = self.sc.churn + SETTLE_LIMIT;
        while self.ending.is_none() {
            ensure!(
                self,
                self.now <= limit,
                "the job has not ended {}s after the churn stopped: {}",
                SETTLE_LIMIT.as_secs(),
                self.describe()
            );
            let next = self.queue.peek().map(|Reverse((t, _, _))| *t);
            match (self.core.next_deadline(), next) {
                (Some(d), n) if n.is_none_or(|t| d <= t) => {
                    ensure!(
                        self,
                        d >= self.now,
                        "the core's deadline {d:?} is in the past"
                    );
                    self.now = d;
                    self.feed(Input::Tick)?;
                    let again = self.core.next_deadline();
                    ensure!(
                        self,
                        self.ending.is_some() || again.is_none_or(|a| a > d),
                        "a tick at the deadline {d:?} left it due ({again:?})"
                    );
                }
                (_, Some(_)) => {
                    let Some(Reverse((t, _, ev))) = self.queue.pop() else {
                        break;
                    };
                    self.now = t;
                    if ev.of_worker() {
                        self.busy -= 1;
                    }
                    self.event(ev)?;
                }
                _ => {
                    return Err(self.violation(format!(
                        "nothing is queued or due, yet the job is not over: {}",
                        self.describe()
                    )));
                }
            }
            if self.phase == Phase::Settle && self.ending.is_none() {
                self.settle()?;
            }
        }
        self.judge()
    }

    fn event(&mut self, ev: Event) -> Result<(), String> {
        match ev {
            Event::Register(id) => {
                let p = self.procs.get_mut(&id).expect("started");
                if p.life != Life::Starting || p.hung {
                    return Ok(());
                }
                p.life = Life::Ready;
                self.feed(Input::Registered(id))
            }
            Event::Join(id, g) => {
                let p = self.procs.get_mut(&id).expect("started");
                if p.life != Life::Running(g) || p.hung {
                    return Ok(());
                }
                p.life = Life::Joining;
                let reason = if p.notified > p.through {
                    format!("hosts updated (update {})", p.notified)
                } else {
                    "a peer failed".to_string()
                };
                self.break_round(g);
                self.feed(Input::Joined { worker: id, reason })
            }
            Event::Exit(id, success) => self.exit(id, success),
            Event::AbortSeen(id, g) => {
                let p = &self.procs[&id];
                if p.hung || p.life == Life::Dead {
                    return Ok(());
                }
                self.feed(Input::AbortSeen {
                    worker: id,
                    generation: g,
                })
            }
            Event::Break(g) => {
                self.break_round(g);
                Ok(())
            }
            Event::Sync(g) => self.sync(g),
            Event::Drain(hosts) => {
                if self.phase != Phase::Churn {
                    return Ok(());
                }
                for h in hosts {
                    if self.hosts.remove(&h).is_some() {
                        self.stats.host_changes += 1;
                        self.departed.push(h);
                    }
                }
                self.discover()
            }
            Event::Kill => {
                if self.phase != Phase::Churn {
                    return Ok(());
                }
                let gap = self.rng.gap(self.sc.kill_every);
                self.push(gap, Event::Kill);
                let alive: Vec<WorkerId> = self
                    .procs
                    .iter()
                    .filter(|(_, p)| p.life != Life::Dead)
                    .map(|(id, _)| *id)
                    .collect();
                if alive.is_empty() {
                    return Ok(());
                }
                let id = alive[self.rng.below(alive.len())];
                self.stats.kills += 1;
                self.exit(id, false)
            }
            Event::Hang => {
                if self.phase != Phase::Churn {
                    return Ok(());
                }
                let gap = self.rng.gap(self.sc.hang_every);
                self.push(gap, Event::Hang);
                let alive: Vec<WorkerId> = self
                    .procs
                    .iter()
                    .filter(|(_, p)| p.life != Life::Dead && !p.hung)
                    .map(|(id, _)| *id)
                    .collect();
                if alive.is_empty() {
                    return Ok(());
                }
                let id = alive[self.rng.below(alive.len())];
                self.stats.hangs += 1;
                let p = self.procs.get_mut(&id).expect("alive");
                p.hung = true;
                let registered = matches!(p.life, Life::Ready | Life::Running(_) | Life::Joining);
                if let Life::Running(g) = p.life {
                    let d = self.rng.ms(PROGRESS_MS);
                    self.push(d, Event::Break(g));
                }
                if let (Some(t), true) = (self.sc.heartbeat, registered) {
                    // Its last answer came up to a ping period before it froze.
                    let d = t.saturating_sub(self.rng.ms((0, t.as_millis() as u64 / 4)));
                    self.push(d, Event::Silent(id));
                }
                Ok(())
            }
            Event::Silent(id) => {
                let p = &self.procs[&id];
                if p.life == Life::Dead {
                    return Ok(());
                }
                let live = !p.told;
                self.feed(Input::Unresponsive {
                    worker: id,
                    silent: self.sc.heartbeat.unwrap_or_default(),
                })?;
                if live {
                    self.stats.silent += 1;
                    ensure!(
                        self,
                        self.procs[&id].stopped || self.ending.is_some(),
                        "worker {id} was reported frozen but the core did not stop it"
                    );
                }
                Ok(())
            }
            Event::Notice => self.notice(),
            Event::Straggle => self.straggle(),
            Event::Preempt(host) => self.preempt(&host),
            Event::Poll => self.poll(),
            Event::EndChurn => {
                self.phase = Phase::Settle;
                // Enough healthy slots for the job to finish, seen by the next poll.
                while self.usable_slots() < self.sc.np.max(self.sc.min_np) {
                    self.add_host(8);
                }
                Ok(())
            }
        }
    }

    /// Churn: a random host running a worker of the job gives notice, with a random deadline
    /// and source.
    fn notice(&mut self) -> Result<(), String> {
        let Some(every) = self.sc.notice_every else {
            return Ok(());
        };
        if self.phase != Phase::Churn {
            return Ok(());
        }
        let gap = self.rng.gap(every);
        self.push(gap, Event::Notice);
        let candidates: BTreeSet<String> = self
            .procs
            .values()
            .filter(|p| p.life != Life::Dead && !self.is_noticed(&p.host))
            .map(|p| p.host.clone())
            .filter(|h| self.hosts.contains_key(h))
            .collect();
        if candidates.is_empty() {
            return Ok(());
        }
        let Some(host) = candidates
            .iter()
            .nth(self.rng.below(candidates.len()))
            .cloned()
        else {
            return Ok(());
        };
        let within = self.rng.ms(NOTICE_MS);
        let source = NoticeSource::ALL[self.rng.below(NoticeSource::ALL.len())];
        self.stats.notices += 1;
        self.noticed
            .insert(host.clone(), self.now + within + NOTICE_MARGIN);
        self.push(within, Event::Preempt(host.clone()));
        self.feed(Input::Notice {
            host,
            source,
            within: Some(within),
        })
    }

    /// Churn: a random member's host is a straggler: the core evicts it (blacklisted with the
    /// cooldown, drained gracefully) unless fewer than `--min-np` slots would be left.
    fn straggle(&mut self) -> Result<(), String> {
        let Some(every) = self.sc.straggle_every else {
            return Ok(());
        };
        if self.phase != Phase::Churn {
            return Ok(());
        }
        let gap = self.rng.gap(every);
        self.push(gap, Event::Straggle);
        if self.round_hosts.is_empty() {
            return Ok(());
        }
        let host = self.round_hosts[self.rng.below(self.round_hosts.len())].clone();
        let out = |sim: &Self| {
            let snap = sim.core.snapshot(sim.now);
            snap.blacklisted.iter().any(|(h, _)| *h == host)
        };
        let before = out(self);
        let usable = self.available().0;
        self.feed(Input::Straggler {
            host: host.clone(),
            factor: 1.5,
        })?;
        if out(self) && !before {
            let slots = self.discovered.get(&host).copied().unwrap_or(0);
            ensure!(
                self,
                usable.saturating_sub(slots) >= self.sc.min_np,
                "the core evicted straggler {host} although {usable} usable slots less its {slots} \
                 are below --min-np {}",
                self.sc.min_np
            );
            self.stats.evictions += 1;
            self.failed(&host);
        }
        Ok(())
    }

    /// A noticed host's deadline: it leaves discovery (intact: it may come back) and what
    /// still runs there dies with it.
    fn preempt(&mut self, host: &str) -> Result<(), String> {
        let doomed: Vec<WorkerId> = self
            .procs
            .iter()
            .filter(|(_, p)| p.host == host && p.life != Life::Dead)
            .map(|(id, _)| *id)
            .collect();
        if doomed.iter().any(|id| !self.procs[id].told) {
            self.stats.late_drains += 1;
            self.note(
                "a noticed host still ran a worker of the job at its deadline",
                format!("{host} at t={:.0}s", self.now.as_secs_f64()),
            );
        }
        for id in doomed {
            self.exit(id, false)?;
            if self.ending.is_some() {
                return Ok(());
            }
        }
        if self.phase == Phase::Churn && self.hosts.remove(host).is_some() {
            self.stats.host_changes += 1;
            self.departed.push(host.to_string());
            return self.discover();
        }
        Ok(())
    }

    /// Slots of the hosts discovery reports that the core does not keep out for good.
    fn usable_slots(&self) -> usize {
        self.hosts
            .iter()
            .filter(|(h, _)| self.cooldown.is_some() || !self.failures.contains_key(*h))
            .map(|(_, s)| *s)
            .sum()
    }

    /// A process ends and the core is told.
    fn exit(&mut self, id: WorkerId, success: bool) -> Result<(), String> {
        let p = self.procs.get_mut(&id).expect("started");
        if p.life == Life::Dead {
            return Ok(());
        }
        let was = p.life;
        p.life = Life::Dead;
        let host = p.host.clone();
        let told = p.told;
        let done = success && !told && matches!(was, Life::Running(_));
        if !told && !done {
            self.failed(&host);
        }
        // Its peers' collectives fail, unless it exits because training is over, or a hung
        // member holds them: waiting on it, they never read the dead one's connection and
        // learn of the death only from the core.
        if let (Life::Running(g), false) = (was, done) {
            let held = self.members.iter().any(|m| {
                let p = &self.procs[m];
                p.hung && p.life == Life::Running(g)
            });
            if !held {
                self.break_round(g);
            }
        }
        let description = if success {
            "exited with code 0"
        } else {
            "was killed by signal 9 (SIGKILL)"
        };
        self.feed(Input::Exited {
            worker: id,
            exit: ExitInfo {
                success,
                description: description.into(),
            },
        })
    }

    /// The members of round `g` notice a failure: their collectives fail and they rejoin.
    fn break_round(&mut self, g: u64) {
        if g != self.generation || self.broken >= g {
            return;
        }
        self.broken = g;
        self.broken_at = self.now;
        for i in 0..self.members.len() {
            let m = self.members[i];
            let p = &self.procs[&m];
            if p.life == Life::Running(g) && !p.hung {
                let d = if self.rng.chance(BUSY) {
                    self.rng.ms(BUSY_MS)
                } else {
                    self.rng.ms(JOIN_MS)
                };
                self.push(d, Event::Join(m, g));
            }
        }
    }

    fn poll(&mut self) -> Result<(), String> {
        self.push(POLL_EVERY, Event::Poll);
        if self.phase == Phase::Churn && self.step > 0 {
            self.churn_hosts()?;
            if self.ending.is_some() {
                return Ok(());
            }
            if self.rng.chance(0.08) {
                self.stats.failed_polls += 1;
                return self.feed(Input::DiscoveryFailed(
                    "discovery script exited with code 1".into(),
                ));
            }
        }
        self.discover()
    }

    /// Discovery runs and the core sees what it prints.
    fn discover(&mut self) -> Result<(), String> {
        let empty = self.rng.chance(self.sc.empty_polls) && self.phase == Phase::Churn;
        let shown = if empty {
            BTreeMap::new()
        } else {
            self.hosts.clone()
        };
        let mut list: Vec<HostSpec> = shown
            .iter()
            .map(|(h, s)| HostSpec {
                host: h.clone(),
                slots: *s,
            })
            .collect();
        // Scripts print hosts in any order.
        if !list.is_empty() {
            let r = self.rng.below(list.len());
            list.rotate_left(r);
        }
        for h in self.discovered.keys() {
            if !shown.contains_key(h) {
                self.left.insert(h.clone());
            }
        }
        self.discovered = shown;
        self.feed(Input::Discovered(list))
    }

    fn churn_hosts(&mut self) -> Result<(), String> {
        if self.rng.chance(self.sc.swap) {
            return self.swap_fleet();
        }
        if self.rng.chance(self.sc.grow) {
            for _ in 0..1 + self.rng.below(4) {
                let slots = 1 + self.rng.below(8);
                self.add_host(slots);
                self.stats.host_changes += 1;
            }
        }
        if self.rng.chance(0.12) {
            for _ in 0..1 + self.rng.below(3) {
                let Some(h) = self.random_host() else { break };
                self.hosts.remove(&h);
                self.stats.host_changes += 1;
                if self.rng.chance(0.4) {
                    // The host is lost with its processes; their peers see them die.
                    self.crashed.insert(h.clone());
                    let on: Vec<WorkerId> = self
                        .procs
                        .iter()
                        .filter(|(_, p)| p.host == h && p.life != Life::Dead)
                        .map(|(id, _)| *id)
                        .collect();
                    for id in on {
                        self.stats.kills += 1;
                        self.exit(id, false)?;
                        if self.ending.is_some() {
                            return Ok(());
                        }
                    }
                } else {
                    self.departed.push(h);
                }
            }
        }
        if self.rng.chance(0.2) {
            for _ in 0..1 + self.rng.below(4) {
                let Some(h) = self.random_host() else { break };
                let slots = if self.sc.zero_slots && self.rng.chance(0.15) {
                    0
                } else {
                    1 + self.rng.below(8)
                };
                self.hosts.insert(h, slots);
                self.stats.host_changes += 1;
            }
        }
        if self.rng.chance(0.05) && !self.departed.is_empty() {
            let i = self.rng.below(self.departed.len());
            let h = self.departed.swap_remove(i);
            let slots = 1 + self.rng.below(8);
            self.hosts.insert(h, slots);
            self.stats.host_changes += 1;
        }
        Ok(())
    }

    /// A spot fleet arrives with at least as many slots as the job needs; every host listed
    /// before it leaves discovery now or within `SWAP_DRAIN_MS`, gracefully.
    fn swap_fleet(&mut self) -> Result<(), String> {
        self.stats.swaps += 1;
        let old: Vec<String> = self.hosts.keys().cloned().collect();
        let need = self.sc.np.max(self.sc.min_np);
        let mut slots = 0;
        while slots < need {
            let s = 1 + self.rng.below(8);
            self.add_host(s);
            self.stats.host_changes += 1;
            slots += s;
        }
        if self.rng.chance(0.3) {
            for h in old {
                self.hosts.remove(&h);
                self.stats.host_changes += 1;
                self.departed.push(h);
            }
        } else {
            let d = self.rng.ms((1, SWAP_DRAIN_MS));
            self.push(d, Event::Drain(old));
        }
        Ok(())
    }

    /// Round `g`'s sync completes when every member is still in it: each then holds the
    /// committed state and tells the core.
    fn sync(&mut self, g: u64) -> Result<(), String> {
        if g != self.generation || self.broken >= g || self.ending.is_some() {
            return Ok(());
        }
        let whole = self.members.iter().all(|m| {
            let p = &self.procs[m];
            p.life == Life::Running(g) && !p.hung
        });
        if !whole {
            return Ok(());
        }
        self.holders = self.members.iter().copied().collect();
        for i in 0..self.members.len() {
            let m = self.members[i];
            self.feed(Input::Synced {
                worker: m,
                generation: g,
            })?;
            if self.ending.is_some() {
                break;
            }
        }
        Ok(())
    }

    /// Once the job is idle after the churn, checks that the last round uses every available
    /// slot, then lets its workers finish.
    fn settle(&mut self) -> Result<(), String> {
        if self.busy > 0
            || self.core.next_deadline().is_some()
            || self.generation == 0
            || self.discovered != self.hosts
        {
            return Ok(());
        }
        let g = self.generation;
        let healthy = self.members.iter().all(|m| {
            let p = &self.procs[m];
            p.life == Life::Running(g) && !p.hung && !p.told
        });
        ensure!(
            self,
            healthy,
            "the job is idle but round {g} is not training: {}",
            self.describe()
        );
        let (lo, hi) = self.available();
        let max = self.sc.max_np;
        let n = self.members.len();
        ensure!(
            self,
            lo.min(max) <= n && n <= hi.min(max),
            "the job is idle with {n} workers while {lo} slots are available \
             (--max-np {max}): {}",
            self.describe()
        );
        self.phase = Phase::Finishing;
        for i in 0..self.members.len() {
            let d = self.rng.ms((1_000, 20_000));
            self.push(d, Event::Exit(self.members[i], true));
        }
        Ok(())
    }

    fn judge(self) -> Result<Outcome, String> {
        let (code, message) = self.ending.clone().expect("ended");
        if code == 0 {
            ensure!(
                self,
                self.phase == Phase::Finishing,
                "code 0 before the workers finished: {message}"
            );
            let expect = format!(
                "all {} workers of round {}",
                self.members.len(),
                self.generation
            );
            ensure!(
                self,
                message.contains(&expect),
                "success message {message:?} does not say {expect:?}"
            );
        } else if message.contains("committed state is lost") {
            ensure!(
                self,
                self.phase != Phase::Finishing,
                "state lost while the workers were finishing: {message}"
            );
            let (lo_hosts, _) = self.usable_hosts();
            let survivor = self.members.iter().find(|m| {
                let p = &self.procs[*m];
                p.life != Life::Dead
                    && !p.told
                    && lo_hosts
                        .get(p.host.as_str())
                        .is_some_and(|&s| p.local_rank.is_some_and(|l| l < s))
            });
            ensure!(
                self,
                survivor.is_none(),
                "the core says no worker of round {} survives, but worker {:?} does, on a host \
                 that offers its slot",
                self.generation,
                survivor
            );
            if let Some(h) = self.holders.iter().find(|h| self.procs[*h].available()) {
                let p = &self.procs[h];
                return Err(self.violation(format!(
                    "the core says the committed state is lost, but worker {h} holds it and did \
                     not fail: on {} (slot {:?}, discovery offers {:?}), {:?}, told to go: {}, \
                     member of round {}: {}",
                    p.host,
                    p.local_rank,
                    self.discovered.get(&p.host),
                    p.life,
                    p.told,
                    self.generation,
                    self.members.contains(h)
                )));
            }
        } else if message.contains("--reset-limit") {
            let limit = self.sc.reset_limit;
            ensure!(
                self,
                limit.is_some_and(|l| self.generation == l as u64 + 1),
                "reset limit {limit:?} reached after {} rounds: {message}",
                self.generation
            );
        } else if message.contains("waiting for enough slots") {
            let need = if self.generation == 0 && self.failures.is_empty() {
                self.sc.np
            } else {
                self.sc.min_np
            };
            let (lo, _) = self.available();
            ensure!(
                self,
                lo < need,
                "the core gave up waiting for slots with {lo} available and {need} needed: \
                 {message}"
            );
        } else {
            return Err(self.violation(format!(
                "the job failed with code {code}: {message} ({})",
                self.describe()
            )));
        }
        Ok(Outcome {
            code,
            message,
            stats: self.stats,
            trace: self.trace,
            end: self.now,
            notes: self.notes,
        })
    }

    fn hash_input(&mut self, input: &Input) {
        let t = &mut self.trace;
        t.u64(self.now.as_millis() as u64);
        match input {
            Input::Discovered(hosts) => {
                t.u64(1);
                for h in hosts {
                    t.str(&h.host);
                    t.u64(h.slots as u64);
                }
            }
            Input::DiscoveryFailed(r) => {
                t.u64(2);
                t.str(r);
            }
            Input::Registered(id) => {
                t.u64(3);
                t.u64(*id);
            }
            Input::Joined { worker, reason } => {
                t.u64(4);
                t.u64(*worker);
                t.str(reason);
            }
            Input::Exited { worker, exit } => {
                t.u64(5);
                t.u64(*worker);
                t.u64(u64::from(exit.success));
            }
            Input::Tick => t.u64(6),
            Input::AbortSeen { worker, generation } => {
                t.u64(7);
                t.u64(*worker);
                t.u64(*generation);
            }
            Input::Synced { worker, generation } => {
                t.u64(8);
                t.u64(*worker);
                t.u64(*generation);
            }
            Input::Unresponsive { worker, silent } => {
                t.u64(9);
                t.u64(*worker);
                t.u64(silent.as_millis() as u64);
            }
            Input::Straggler { host, factor } => {
                t.u64(16);
                t.str(host);
                t.u64(factor.to_bits());
            }
            Input::Notice {
                host,
                source,
                within,
            } => {
                t.u64(15);
                t.str(host);
                t.str(source.name());
                t.u64(within.map_or(0, |d| d.as_millis() as u64));
            }
        }
    }

    /// Hands one input to the core and plays out, and checks, what it does.
    fn feed(&mut self, input: Input) -> Result<(), String> {
        ensure!(
            self,
            self.ending.is_none(),
            "input {input:?} after the job ended"
        );
        self.step += 1;
        self.stats.inputs += 1;
        self.hash_input(&input);
        let actions = self.core.handle(self.now, input);
        let mut worlds = Vec::new();
        for a in actions {
            if self.ending.is_some() {
                self.note("action after Finish", format!("{a:?}"));
            }
            match a {
                Action::Start { worker, host, .. } => self.started(worker, host)?,
                Action::Stop { worker } => {
                    self.trace.u64(11);
                    self.trace.u64(worker);
                    let Some(p) = self.procs.get(&worker) else {
                        return Err(self.violation(format!("Stop of unknown worker {worker}")));
                    };
                    ensure!(
                        self,
                        p.life != Life::Dead,
                        "Stop of worker {worker}, which had exited"
                    );
                    if p.told {
                        self.note(
                            "Stop of a worker already stopped or removed",
                            format!("worker {worker}"),
                        );
                        continue;
                    }
                    let host = p.host.clone();
                    self.failed(&host);
                    let p = self.procs.get_mut(&worker).expect("known");
                    p.told = true;
                    p.stopped = true;
                    let d = self.rng.ms((50, 2_000));
                    self.push(d, Event::Exit(worker, false));
                }
                Action::Remove { worker, reason } => {
                    self.trace.u64(12);
                    self.trace.u64(worker);
                    self.trace.str(&reason);
                    let Some(p) = self.procs.get(&worker) else {
                        return Err(self.violation(format!("Remove of unknown worker {worker}")));
                    };
                    ensure!(
                        self,
                        p.life != Life::Dead && !p.told,
                        "Remove of worker {worker}, which had exited or was told to go"
                    );
                    // A drain releases a holder of the committed state only while another
                    // stays in the job.
                    let other = self.holders.iter().any(|&h| {
                        let q = &self.procs[&h];
                        h != worker && q.life != Life::Dead && !q.told
                    });
                    ensure!(
                        self,
                        other || !self.holders.contains(&worker),
                        "Remove of worker {worker} on {}, the last worker holding the committed \
                         state",
                        p.host
                    );
                    // A removed worker exits 0 by itself; a hung one is killed 10 s later.
                    let exit = if p.hung {
                        (Duration::from_secs(10), false)
                    } else {
                        (self.rng.ms((100, 5_000)), true)
                    };
                    self.procs.get_mut(&worker).expect("known").told = true;
                    self.push(exit.0, Event::Exit(worker, exit.1));
                }
                Action::World {
                    worker,
                    generation,
                    placement,
                    members,
                    hosts,
                    updates_through,
                } => worlds.push(World {
                    worker,
                    generation,
                    placement,
                    members,
                    hosts,
                    updates_through,
                }),
                Action::Abort {
                    workers,
                    generation,
                    reason,
                } => self.aborted(&workers, generation, &reason)?,
                Action::Notify {
                    workers,
                    update_id,
                    added,
                    removed,
                } => self.notified(workers, update_id, &added, &removed)?,
                Action::Finish { code, message } => {
                    self.trace.u64(15);
                    self.trace.u64(u64::from(code));
                    self.trace.str(&message);
                    ensure!(
                        self,
                        self.ending.is_none(),
                        "a second Finish: {code} {message}"
                    );
                    ensure!(
                        self,
                        self.core.finished(),
                        "Finish, but the core says it is not finished"
                    );
                    self.ending = Some((code, message));
                }
            }
        }
        if !worlds.is_empty() {
            self.round(worlds)?;
        }
        ensure!(
            self,
            self.core.generation() == self.generation,
            "the core says round {}, its Worlds said {}",
            self.core.generation(),
            self.generation
        );
        Ok(())
    }

    /// The core tells the running members of round `g` that it failed: each that is not hung
    /// asks to join the next round.
    fn aborted(&mut self, workers: &[WorkerId], g: u64, reason: &str) -> Result<(), String> {
        self.trace.u64(16);
        self.trace.u64(g);
        self.trace.str(reason);
        ensure!(
            self,
            g == self.generation,
            "Abort of round {g} during round {}",
            self.generation
        );
        for w in workers {
            self.trace.u64(*w);
            ensure!(
                self,
                self.members.contains(w),
                "Abort names worker {w}, not a member of round {g}"
            );
            let p = &self.procs[w];
            ensure!(
                self,
                p.life != Life::Dead && !p.told,
                "Abort of worker {w}, which had exited or was told to go"
            );
        }
        let held = self.members.iter().any(|m| {
            let p = &self.procs[m];
            p.hung && p.life == Life::Running(g)
        });
        if held && self.broken < g {
            self.stats.held_aborts += 1;
        }
        for w in workers {
            if !self.procs[w].hung {
                let d = self.rng.ms(ABORT_SEEN_MS);
                self.push(d, Event::AbortSeen(*w, g));
            }
        }
        self.break_round(g);
        Ok(())
    }

    fn started(&mut self, worker: WorkerId, host: String) -> Result<(), String> {
        self.trace.u64(10);
        self.trace.u64(worker);
        self.trace.str(&host);
        ensure!(
            self,
            !self.procs.contains_key(&worker),
            "worker {worker} started twice"
        );
        ensure!(
            self,
            self.discovered.get(&host).is_some_and(|&s| s > 0),
            "worker {worker} started on {host}, which the last discovery does not offer"
        );
        ensure!(
            self,
            !self.blacklisted(&host),
            "worker {worker} started on {host}, which is blacklisted"
        );
        ensure!(
            self,
            !self.is_noticed(&host),
            "worker {worker} started on {host}, which gave notice"
        );
        self.stats.started += 1;
        let crashed = self.crashed.contains(&host);
        let hung = (crashed && self.rng.chance(0.5)) || self.rng.chance(self.sc.start_hang);
        if hung {
            self.stats.hangs += 1;
        } else if crashed {
            let d = self.rng.ms((500, 5_000));
            self.push(d, Event::Exit(worker, false));
        } else {
            let d = self.rng.ms(REGISTER_MS);
            self.push(d, Event::Register(worker));
        }
        self.procs.insert(
            worker,
            Proc {
                host,
                life: Life::Starting,
                hung,
                told: false,
                stopped: false,
                notified: 0,
                through: 0,
                local_rank: None,
            },
        );
        Ok(())
    }

    fn notified(
        &mut self,
        workers: Vec<WorkerId>,
        update_id: u64,
        added: &[String],
        removed: &[String],
    ) -> Result<(), String> {
        self.trace.u64(14);
        self.trace.u64(update_id);
        for w in &workers {
            self.trace.u64(*w);
        }
        for h in added.iter().chain(removed) {
            self.trace.str(h);
        }
        ensure!(
            self,
            update_id > self.last_update,
            "announcement {update_id} after announcement {}",
            self.last_update
        );
        ensure!(
            self,
            !added.iter().any(|h| removed.contains(h)),
            "announcement {update_id} both adds and removes a host: {added:?} {removed:?}"
        );
        self.last_update = update_id;
        self.stats.announcements += 1;
        if workers.is_empty() {
            self.note("announcement to nobody", format!("update {update_id}"));
        }
        let g = self.generation;
        for w in workers {
            let Some(p) = self.procs.get(&w) else {
                return Err(self.violation(format!("announcement to unknown worker {w}")));
            };
            ensure!(
                self,
                p.life == Life::Running(g) && !p.told,
                "announcement {update_id} to worker {w}, which is not training in round {g} \
                 ({:?}, told to go: {})",
                p.life,
                p.told
            );
            let p = self.procs.get_mut(&w).expect("known");
            p.notified = p.notified.max(update_id);
            if !p.hung && update_id > p.through {
                let d = self.rng.ms(JOIN_MS);
                self.push(d, Event::Join(w, g));
            }
        }
        Ok(())
    }

    /// Checks a completed round and delivers it.
    fn round(&mut self, worlds: Vec<World>) -> Result<(), String> {
        let g = self.generation + 1;
        let members = worlds[0].members.clone();
        let hosts = worlds[0].hosts.clone();
        let n = members.len();
        ensure!(
            self,
            worlds[0].generation == g,
            "round {} follows round {}",
            worlds[0].generation,
            g - 1
        );
        ensure!(
            self,
            hosts.len() == n,
            "round {g} has {n} members and {} hosts",
            hosts.len()
        );
        ensure!(
            self,
            worlds.len() == n,
            "round {g} has {n} members but {} Worlds",
            worlds.len()
        );
        ensure!(
            self,
            n <= self.sc.max_np,
            "round {g} has {n} workers, above --max-np {}",
            self.sc.max_np
        );
        // The first round needs -np slots, unless a worker failed before it completed: then
        // it is a recovery, which needs --min-np.
        let need = if g == 1 && self.failures.is_empty() {
            self.sc.np
        } else {
            self.sc.min_np
        };
        ensure!(
            self,
            n >= need.max(1),
            "round {g} has {n} workers, below the {need} needed"
        );
        let distinct: BTreeSet<WorkerId> = members.iter().copied().collect();
        ensure!(self, distinct.len() == n, "round {g} lists a worker twice");
        // The status page's history: every round recorded, every reset with what caused it.
        let last = self.core.rounds().back();
        ensure!(
            self,
            last.is_some_and(|r| r.generation == g && r.size == n && r.at == self.now),
            "round {g} of {n} workers is recorded as {last:?}"
        );
        let causes = last.map_or(0, |r| r.causes.len());
        ensure!(
            self,
            (g == 1) == (causes == 0),
            "round {g} is recorded with {causes} causes: {last:?}"
        );
        let expected = match placements(&hosts) {
            Ok(p) => p,
            Err(e) => return Err(self.violation(format!("round {g}: {e}"))),
        };
        let mut seen = vec![false; n];
        for w in &worlds {
            ensure!(
                self,
                w.generation == g,
                "worker {} got round {} in the batch of round {g}",
                w.worker,
                w.generation
            );
            ensure!(
                self,
                w.members == members && w.hosts == hosts,
                "worker {} got other tables than worker {}",
                w.worker,
                worlds[0].worker
            );
            ensure!(
                self,
                w.updates_through == self.last_update,
                "worker {} accounts for announcements through {}, the newest is {}",
                w.worker,
                w.updates_through,
                self.last_update
            );
            let r = w.placement.rank;
            ensure!(
                self,
                r < n && !seen[r],
                "rank {r} of round {g} given twice or out of range"
            );
            seen[r] = true;
            ensure!(
                self,
                members[r] == w.worker,
                "worker {} got rank {r}, which the table gives worker {}",
                w.worker,
                members[r]
            );
            ensure!(
                self,
                w.placement == expected[r],
                "worker {} got {:?}; Horovod's rules give {:?}",
                w.worker,
                w.placement,
                expected[r]
            );
        }
        // Members whose host no longer offers their slot: kept to hand the state over.
        let prev: BTreeSet<WorkerId> = self.members.iter().copied().collect();
        let kept: Vec<WorkerId> = members
            .iter()
            .enumerate()
            .filter(|&(r, _)| {
                let lr = expected[r].local_rank;
                self.discovered.get(&hosts[r]).is_none_or(|&s| s <= lr)
                    || self.is_noticed(&hosts[r])
            })
            .map(|(_, &m)| m)
            .collect();
        if let Some(&k) = kept.first() {
            ensure!(
                self,
                kept.len() == 1 && members[0] == k && prev.contains(&k),
                "round {g} keeps workers {kept:?} on hosts that do not offer their slots; only \
                 rank 0, a member of round {}, may be kept (to hand the state over)",
                g - 1
            );
            let other = members[1..].iter().find(|m| self.holders.contains(m));
            ensure!(
                self,
                other.is_none() && self.holders.contains(&k),
                "round {g} keeps worker {k} for the state, but it holds it: {}, and member \
                 {other:?} holds it too",
                self.holders.contains(&k)
            );
            self.stats.kept += 1;
        }
        for (r, &m) in members.iter().enumerate() {
            let Some(p) = self.procs.get(&m) else {
                return Err(self.violation(format!("round {g} names unknown worker {m}")));
            };
            ensure!(
                self,
                matches!(p.life, Life::Ready | Life::Joining) && !p.told,
                "World to worker {m}, which is {:?} (told to go: {})",
                p.life,
                p.told
            );
            ensure!(
                self,
                p.host == hosts[r],
                "worker {m} runs on {}, the table puts it on {}",
                p.host,
                hosts[r]
            );
            ensure!(
                self,
                !self.blacklisted(&hosts[r]),
                "round {g} uses {}, which is blacklisted",
                hosts[r]
            );
            let lr = expected[r].local_rank;
            ensure!(
                self,
                kept.contains(&m) || self.discovered.get(&hosts[r]).is_some_and(|&s| s > lr),
                "round {g} puts slot {lr} on {}, which the last discovery gives {:?} slots",
                hosts[r],
                self.discovered.get(&hosts[r])
            );
            ensure!(
                self,
                p.local_rank.is_none_or(|old| old == lr),
                "worker {m} moved from slot {:?} to slot {lr} of {}",
                p.local_rank,
                hosts[r]
            );
        }
        let (lo, hi) = self.available();
        let max = self.sc.max_np;
        // A recovery round may leave out slots whose workers are still starting (they join
        // through a later change; `settle` checks that every slot is used in the end).
        let floor = if g == 1 { lo.min(max) } else { 1 };
        ensure!(
            self,
            floor <= n && n - kept.len() <= hi && n <= max,
            "round {g} has {n} workers ({} kept for the state) while {lo}..={hi} slots are \
             available (--max-np {max})",
            kept.len()
        );
        if g == 1 {
            self.holders = members.iter().copied().collect();
        } else {
            let holding: BTreeSet<WorkerId> = members
                .iter()
                .copied()
                .filter(|m| self.holders.contains(m))
                .collect();
            if holding.is_empty() {
                let unused = self.holders.iter().find(|h| self.procs[*h].available());
                if let Some(&h) = unused {
                    let p = &self.procs[&h];
                    return Err(self.violation(format!(
                        "round {g} starts without the committed state, which worker {h} on {} \
                         holds ({:?}, told to go: {}); no failure lost it",
                        p.host, p.life, p.told
                    )));
                }
                self.stats.lost_to_failures += 1;
                self.note(
                    "every holder of the committed state failed; a round started without it",
                    format!("round {g}"),
                );
                self.holders = members.iter().copied().collect();
            } else {
                self.holders = holding;
            }
        }
        if g > 1 {
            ensure!(
                self,
                prev.contains(&members[0]),
                "rank 0 of round {g} is worker {} on {}, which was not in round {}: the state it \
                 starts from is not the committed one",
                members[0],
                hosts[0],
                g - 1
            );
            // Surviving hosts: a worker of theirs trains in both rounds, and discovery kept
            // listing them. One that left discovery and came back joins anew, at the end.
            let mut survivors = BTreeSet::new();
            for (m, h) in members.iter().zip(&hosts) {
                if !prev.contains(m) || kept.contains(m) {
                    continue;
                }
                if !self.left.contains(h) {
                    survivors.insert(h.as_str());
                } else if survivors.insert(h.as_str()) {
                    let detail = format!("worker {m} on {h} in rounds {} and {g}", g - 1);
                    self.note(
                        "a host that left discovery and came back moved its surviving workers",
                        detail,
                    );
                }
            }
            survivors.retain(|h| !self.left.contains(*h));
            let before: Vec<&str> = first_appearance(&self.round_hosts)
                .into_iter()
                .filter(|h| survivors.contains(h))
                .collect();
            let after: Vec<&str> = first_appearance(&hosts)
                .into_iter()
                .filter(|h| survivors.contains(h))
                .collect();
            if let Some(i) = (0..before.len()).find(|&i| before[i] != after[i]) {
                return Err(self.violation(format!(
                    "surviving hosts changed their order from round {} to round {g}: {} was at \
                     position {i} of them, now {} is",
                    g - 1,
                    before[i],
                    after[i]
                )));
            }
        }
        self.trace.u64(13);
        self.trace.u64(g);
        for (m, h) in members.iter().zip(&hosts) {
            self.trace.u64(*m);
            self.trace.str(h);
        }
        for w in &worlds {
            self.trace.u64(w.worker);
            self.trace.u64(w.placement.rank as u64);
            self.trace.u64(w.updates_through);
        }
        for (r, &m) in members.iter().enumerate() {
            let p = self.procs.get_mut(&m).expect("checked");
            p.life = Life::Running(g);
            p.through = worlds[0].updates_through;
            p.local_rank = Some(expected[r].local_rank);
            let (hung, behind) = (p.hung, p.notified > p.through);
            if hung {
                let d = self.rng.ms(PROGRESS_MS);
                self.push(d, Event::Break(g));
            } else if behind {
                let d = self.rng.ms(JOIN_MS);
                self.push(d, Event::Join(m, g));
            }
        }
        let d = self.rng.ms(SYNC_MS);
        self.push(d, Event::Sync(g));
        self.stats.rounds += 1;
        if self.broken == g - 1 && g > 1 {
            let pause = self.now - self.broken_at;
            self.stats.longest_pause = self.stats.longest_pause.max(pause);
        }
        self.stats.max_size = self.stats.max_size.max(n);
        self.stats.min_size = if g == 1 {
            n
        } else {
            self.stats.min_size.min(n)
        };
        self.generation = g;
        self.left.clear();
        self.members = members;
        self.round_hosts = hosts;
        Ok(())
    }
}

/// Hosts in the order they first appear.
fn first_appearance(hosts: &[String]) -> Vec<&str> {
    let mut seen = BTreeSet::new();
    hosts
        .iter()
        .map(String::as_str)
        .filter(|h| seen.insert(*h))
        .collect()
}

/// Horovod's six numbers for a rank table whose ranks are contiguous per host: `local_rank`
/// is the index within the host, `cross_rank` the index of the host among the hosts with that
/// local rank, and `cross_size` their number.
fn placements(hosts: &[String]) -> Result<Vec<Placement>, String> {
    let mut blocks: Vec<usize> = Vec::new();
    let mut seen = BTreeSet::new();
    for (r, h) in hosts.iter().enumerate() {
        if r > 0 && hosts[r - 1] == *h {
            if let Some(k) = blocks.last_mut() {
                *k += 1;
            }
        } else {
            if !seen.insert(h.as_str()) {
                return Err(format!("the ranks of {h} are not contiguous (rank {r})"));
            }
            blocks.push(1);
        }
    }
    let widest = blocks.iter().copied().max().unwrap_or(0);
    // Hosts with at least `l + 1` workers, for each local rank `l`.
    let mut cross_size = vec![0; widest];
    for &k in &blocks {
        for c in &mut cross_size[..k] {
            *c += 1;
        }
    }
    let mut cross_rank = vec![0; widest];
    let mut out = Vec::with_capacity(hosts.len());
    for &k in &blocks {
        for l in 0..k {
            out.push(Placement {
                rank: out.len(),
                size: hosts.len(),
                local_rank: l,
                local_size: k,
                cross_rank: cross_rank[l],
                cross_size: cross_size[l],
            });
            cross_rank[l] += 1;
        }
    }
    Ok(out)
}

fn secs(s: u64) -> Duration {
    Duration::from_secs(s)
}

/// Runs `seeds` of `sc`, prints a line per seed, and fails with every violation found.
fn run_seeds(name: &str, sc: Scenario, seeds: &[u64]) -> Vec<Outcome> {
    let mut failures = Vec::new();
    let mut outcomes = Vec::new();
    for &seed in seeds {
        let t0 = Instant::now();
        match Sim::new(seed, sc).run() {
            Ok(o) => {
                let s = &o.stats;
                println!(
                    "{name} seed {seed}: {} inputs, {} rounds of {}..={} workers, {} started, \
                     {} killed, {} hung ({} caught by the heartbeat), {} host changes ({} hosts), {} announcements, \
                     {} aborts of held rounds, {} fleet swaps, {} rounds keeping a worker for \
                     the state, {} rounds without it after failures, \
                     {} failed polls, {} notices ({} hosts still busy at the deadline), \
                     longest pause {:.0}s; ended at t={:.0}s with {}: {} \
                     [{:.2}s, trace {:016x}]",
                    s.inputs,
                    s.rounds,
                    s.min_size,
                    s.max_size,
                    s.started,
                    s.kills,
                    s.hangs,
                    s.silent,
                    s.host_changes,
                    s.hosts_seen,
                    s.announcements,
                    s.held_aborts,
                    s.swaps,
                    s.kept,
                    s.lost_to_failures,
                    s.failed_polls,
                    s.notices,
                    s.late_drains,
                    s.longest_pause.as_secs_f64(),
                    o.end.as_secs_f64(),
                    o.code,
                    o.message,
                    t0.elapsed().as_secs_f64(),
                    o.trace.0
                );
                for (what, (count, first)) in &o.notes {
                    println!("  note: {what} ({count}x), first: {first}");
                }
                outcomes.push(o);
            }
            Err(e) => {
                println!("{name} seed {seed}: VIOLATION {e}");
                failures.push(e);
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{name}: {} of {} seeds broke a promise:\n{}",
        failures.len(),
        seeds.len(),
        failures.join("\n")
    );
    outcomes
}

/// 20 hosts with about 90 slots for up to 64 workers, so that failures and host changes
/// reach the round; small, as unoptimised test builds are slow.
fn base() -> Scenario {
    Scenario {
        hosts: 20,
        np: 32,
        min_np: 12,
        max_np: 64,
        churn: secs(600),
        kill_every: secs(60),
        hang_every: secs(600),
        cooldown: None,
        reset_limit: None,
        zero_slots: false,
        grow: 0.2,
        empty_polls: 0.0,
        start_hang: 0.01,
        swap: 0.0,
        heartbeat: None,
        notice_every: None,
        straggle_every: None,
    }
}

#[test]
fn churn_without_cooldown_keeps_every_promise() {
    let outcomes = run_seeds("no cooldown", base(), &[1, 2, 3, 4]);
    assert!(
        outcomes.iter().any(|o| o.code == 0),
        "no seed reached a successful end; the churn is too hard to test the end"
    );
}

#[test]
fn churn_with_cooldown_keeps_every_promise() {
    let sc = Scenario {
        cooldown: Some((60, 600)),
        ..base()
    };
    run_seeds("cooldown", sc, &[11, 12, 13]);
}

#[test]
fn churn_with_hosts_losing_all_slots_keeps_every_promise() {
    let sc = Scenario {
        zero_slots: true,
        ..base()
    };
    run_seeds("zero slots", sc, &[21, 22, 27, 32]);
}

/// The job grows from a few hosts and never reaches `--max-np`; no worker is killed, but some
/// new ones never register.
#[test]
fn growth_with_starts_that_hang_keeps_every_promise() {
    let sc = Scenario {
        hosts: 6,
        np: 12,
        min_np: 6,
        max_np: 400,
        kill_every: secs(1_000_000),
        hang_every: secs(1_000_000),
        grow: 0.3,
        start_hang: 0.1,
        ..base()
    };
    run_seeds("growth", sc, &[100, 101, 103, 104, 105, 106]);
}

/// Workers hang often: deaths in rounds a hung member holds reach the others only through the
/// core's abort, and the hung member must be declared failed in time.
#[test]
fn churn_with_hung_workers_keeps_every_promise() {
    let sc = Scenario {
        hang_every: secs(60),
        ..base()
    };
    let outcomes = run_seeds("hangs", sc, &[41, 42, 43]);
    assert!(
        outcomes.iter().any(|o| o.stats.held_aborts > 0),
        "no death happened in a held round; the scenario does not test the abort"
    );
}

/// Workers freeze often, and the driver's heartbeat catches the registered ones: each is
/// stopped at once and its round re-run, before its peers' collectives would time out.
#[test]
fn churn_with_frozen_workers_caught_by_the_heartbeat_keeps_every_promise() {
    let sc = Scenario {
        hang_every: secs(60),
        heartbeat: Some(secs(10)),
        ..base()
    };
    let outcomes = run_seeds("frozen", sc, &[61, 62, 63]);
    assert!(
        outcomes.iter().all(|o| o.stats.silent > 0),
        "a seed froze no registered worker; the scenario does not test the heartbeat"
    );
}

#[test]
fn churn_with_empty_discovery_results_keeps_every_promise() {
    let sc = Scenario {
        empty_polls: 0.03,
        ..base()
    };
    run_seeds("empty polls", sc, &[51, 52, 53]);
}

/// No host ever comes: the job shrinks below `--min-np` and must give up after
/// `--elastic-timeout`, saying how many slots it had.
#[test]
fn a_shrinking_cluster_times_out() {
    let sc = Scenario {
        kill_every: secs(15),
        grow: 0.0,
        churn: secs(3600),
        ..base()
    };
    let outcomes = run_seeds("shrinking", sc, &[61, 62]);
    assert!(
        outcomes
            .iter()
            .all(|o| o.code == 1 && o.message.contains("waiting for enough slots")),
        "every seed should time out"
    );
}

#[test]
fn the_reset_limit_ends_the_job() {
    let sc = Scenario {
        reset_limit: Some(5),
        ..base()
    };
    let outcomes = run_seeds("reset limit", sc, &[71, 72]);
    assert!(
        outcomes
            .iter()
            .all(|o| o.message.contains("--reset-limit 5"))
    );
}

#[test]
fn the_same_seed_replays_the_same_trace() {
    let sc = Scenario {
        cooldown: Some((60, 600)),
        empty_polls: 0.03,
        ..base()
    };
    let a = Sim::new(7, sc).run();
    let b = Sim::new(7, sc).run();
    assert_eq!(a, b);
    let c = Sim::new(8, sc).run();
    assert_ne!(
        a.map(|o| o.trace),
        c.map(|o| o.trace),
        "another seed, another trace"
    );
}

/// Spot fleets replace every host, again and again, with nothing failing: the state is never
/// lost, whether the old fleet leaves in the new one's first poll, while its workers start,
/// while they join, or just after their first round.
#[test]
fn spot_fleets_replacing_every_host_never_lose_the_state() {
    let sc = Scenario {
        kill_every: secs(1_000_000),
        hang_every: secs(1_000_000),
        start_hang: 0.0,
        grow: 0.05,
        swap: 0.15,
        ..base()
    };
    let seeds: Vec<u64> = (200..216).collect();
    let outcomes = run_seeds("spot fleets", sc, &seeds);
    for o in &outcomes {
        assert_eq!(o.code, 0, "{}", o.message);
        assert_eq!(o.stats.lost_to_failures, 0);
    }
    let swaps: u64 = outcomes.iter().map(|o| o.stats.swaps).sum();
    let kept: u64 = outcomes.iter().map(|o| o.stats.kept).sum();
    assert!(swaps >= 32, "only {swaps} fleet swaps");
    assert!(
        kept * 4 >= swaps,
        "{kept} rounds kept a worker for the state in {swaps} swaps: the drains came too late \
         to need it"
    );
}

/// Spot fleets amid the usual churn (workers killed and hung, hosts crashing): a drain never
/// loses the state, and a failure loses it only when every holder failed.
#[test]
fn spot_fleets_amid_failures_lose_the_state_only_to_failures() {
    let sc = Scenario {
        swap: 0.1,
        cooldown: Some((60, 600)),
        ..base()
    };
    let seeds: Vec<u64> = (300..308).collect();
    let outcomes = run_seeds("spot fleets with failures", sc, &seeds);
    assert!(outcomes.iter().any(|o| o.stats.kept > 0));
}

/// Hosts give preemption notices amid the usual churn: each is drained before its deadline
/// without a failure of its own, nothing starts there meanwhile, and the state is handed over
/// when the noticed host holds it.
#[test]
fn preemption_notices_drain_hosts_gracefully_amid_churn() {
    let sc = Scenario {
        notice_every: Some(secs(45)),
        cooldown: Some((60, 600)),
        ..base()
    };
    let seeds: Vec<u64> = (400..406).collect();
    let outcomes = run_seeds("notices", sc, &seeds);
    let notices: u64 = outcomes.iter().map(|o| o.stats.notices).sum();
    assert!(notices >= 40, "only {notices} notices");
}

/// Notices alone, nothing failing: every noticed host is drained before its deadline, so no
/// worker dies and the job ends well.
#[test]
fn preemption_notices_alone_cost_no_failure() {
    let sc = Scenario {
        notice_every: Some(secs(30)),
        kill_every: secs(1_000_000),
        hang_every: secs(1_000_000),
        start_hang: 0.0,
        grow: 0.3,
        ..base()
    };
    let seeds: Vec<u64> = (500..508).collect();
    let outcomes = run_seeds("notices alone", sc, &seeds);
    for o in &outcomes {
        assert_eq!(o.code, 0, "{}", o.message);
        assert_eq!(
            o.stats.late_drains, 0,
            "a noticed host was still busy at its deadline"
        );
        assert_eq!(o.stats.lost_to_failures, 0);
    }
    let notices: u64 = outcomes.iter().map(|o| o.stats.notices).sum();
    assert!(notices >= 80, "only {notices} notices");
}

/// Straggler evictions amid the usual churn, with a cooldown: a straggler's host leaves
/// gracefully (its workers are removed, nothing is stopped), stays out for its cooldown, and
/// the core never evicts below `--min-np`.
#[test]
fn straggler_evictions_amid_churn_keep_every_promise() {
    let sc = Scenario {
        straggle_every: Some(secs(40)),
        cooldown: Some((60, 600)),
        ..base()
    };
    let seeds: Vec<u64> = (600..606).collect();
    let outcomes = run_seeds("stragglers", sc, &seeds);
    let evictions: u64 = outcomes.iter().map(|o| o.stats.evictions).sum();
    assert!(evictions >= 20, "only {evictions} evictions");
}

#[test]
fn placements_follow_horovod() {
    let hosts: Vec<String> = ["a", "a", "b", "c", "c", "c"]
        .iter()
        .map(|h| (*h).to_string())
        .collect();
    let p = placements(&hosts).expect("contiguous");
    let six: Vec<[usize; 5]> = p
        .iter()
        .map(|p| {
            [
                p.rank,
                p.local_rank,
                p.local_size,
                p.cross_rank,
                p.cross_size,
            ]
        })
        .collect();
    assert_eq!(
        six,
        vec![
            [0, 0, 2, 0, 3],
            [1, 1, 2, 0, 2],
            [2, 0, 1, 1, 3],
            [3, 0, 3, 2, 3],
            [4, 1, 3, 1, 2],
            [5, 2, 3, 0, 1],
        ]
    );
    let split: Vec<String> = ["a", "b", "a"].iter().map(|h| (*h).to_string()).collect();
    assert!(placements(&split).is_err());
}

#[test]
#[ignore = "minutes even optimised; run with --release --ignored"]
fn large_cluster() {
    let sc = Scenario {
        hosts: 2_000,
        np: 1_000,
        min_np: 500,
        max_np: 1_000,
        churn: secs(600),
        kill_every: secs(120),
        hang_every: secs(600),
        ..base()
    };
    run_seeds("large", sc, &[101]);
}
