//! `hvd`: the library a training program links.
//!
//! ```no_run
//! use hvd::ReduceOp;
//! hvd::init()?;
//! let mut grads = vec![0.5f32; 1024];
//! hvd::allreduce(&mut grads, ReduceOp::Average)?;
//! println!("rank {} of {}", hvd::rank()?, hvd::size()?);
//! hvd::shutdown()?;
//! # Ok::<(), hvd::Error>(())
//! ```
//!
//! [`init`] reads what `horovodrun` passed in the environment, registers with the driver, and
//! connects every rank to every other. A process started without `horovodrun` runs as a world
//! of one (as Horovod does), so the same program runs alone for debugging. The communicator is
//! not a process-wide singleton fixed at start: [`shutdown`] tears it down and [`init`] builds
//! a new one, which is what elastic membership changes rely on.
//!
//! # Layout
//! - `launch`: the launcher's environment, parsed once and checked;
//! - `client`: registration with the driver and the driver watchdog;
//! - `lib.rs`: the process-wide context and the collective functions.

mod client;
pub mod elastic;
mod error;
mod launch;
mod notice;
mod preemption;
mod process_set;

use std::net::TcpListener;
use std::sync::Arc;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Duration;

pub use error::{Error, Result};
pub use hvd_collectives::{
    AbortHandle, AutotuneConfig, Buffer, CommError, Communicator, Compression, DType, Element,
    Engine, EngineConfig, EngineStatus, Handle, Held, HugeBuffer, ReduceOp, Setting, Submitter,
    Timeline, bf16, f16, malloc_huge_pages,
};
pub use hvd_rendezvous::Placement;
pub use launch::{Env, Launch, ProcessEnv};
pub use process_set::{
    ProcessSet, add_process_set, allreduce_on, process_sets, remove_process_set, with_process_set,
};

/// This process's place in the job: the six Horovod numbers (through `Deref`, so
/// `topology.rank` works) and whether the hosts are homogeneous.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Topology {
    /// Rank, size, local and cross rank and size.
    pub placement: Placement,
    /// Whether every host runs the same number of ranks.
    pub homogeneous: bool,
}

impl std::ops::Deref for Topology {
    type Target = Placement;
    fn deref(&self) -> &Placement {
        &self.placement
    }
}

impl Topology {
    fn new(p: Placement, hosts: &[String]) -> Self {
        let mut per_host: Vec<(&str, usize)> = Vec::new();
        for h in hosts {
            match per_host.iter_mut().find(|(name, _)| name == h) {
                Some((_, k)) => *k += 1,
                None => per_host.push((h, 1)),
            }
        }
        Self {
            placement: p,
            homogeneous: per_host.windows(2).all(|w| w[0].1 == w[1].1),
        }
    }
}

/// The connection to the driver and what a new round needs.
struct Session {
    launch: Launch,
    listener: TcpListener,
    client: client::Client,
    generation: u64,
    updates_through: u64,
    /// Every rank's listener address in the current round.
    peers: Vec<std::net::SocketAddr>,
}

struct Context {
    topology: Topology,
    /// `None` while a membership change is in progress.
    comm: Option<Communicator>,
    /// `None` for a world of one started without a launcher.
    session: Option<Session>,
    /// The communicator is lent to a background engine.
    engine_active: bool,
    /// The engine's submission channel while it holds the communicator: `allreduce` goes
    /// through it then, under names `hvd.sync.<n>` every rank numbers alike.
    submitter: Option<Submitter>,
    sync_seq: u64,
    /// Where this rank records its timeline (`HOROVOD_TIMELINE`, or [`start_timeline`]);
    /// stopped when neither asked for one.
    timeline: Arc<Timeline>,
    /// Process sets of this round.
    sets: process_set::Sets,
    /// The rejoin the driver's abort of this round started, before the program noticed.
    early: Option<Arc<EarlyRejoin>>,
}

/// A round joined and connected, or why not.
type Joined = Result<(Topology, Communicator)>;

/// A rejoin started when the driver aborted the worker's round ([`rejoin_early`]): the next
/// round forms while the program finishes what it computes, and its next collective fails
/// until [`rejoin`] takes the new round over.
#[derive(Default)]
struct EarlyRejoin {
    done: Mutex<Option<(Joined, std::time::Instant)>>,
    ready: std::sync::Condvar,
}

impl EarlyRejoin {
    fn finish(&self, result: Joined, started: std::time::Instant) {
        *self.done.lock().unwrap_or_else(PoisonError::into_inner) = Some((result, started));
        self.ready.notify_all();
    }

    /// The new round, or why joining it failed, and when the rejoin started.
    fn wait(&self) -> (Joined, std::time::Instant) {
        let mut done = self.done.lock().unwrap_or_else(PoisonError::into_inner);
        loop {
            if let Some(d) = done.take() {
                return d;
            }
            done = self
                .ready
                .wait(done)
                .unwrap_or_else(PoisonError::into_inner);
        }
    }
}

static CONTEXT: Mutex<Option<Context>> = Mutex::new(None);

/// What autotune settled on in this process, one per shape of the world, most recent last:
/// kept across elastic rounds and re-initialisations so that the next engine starts from it
/// (see [`hvd_collectives::Tuned`]).
static TUNED: Mutex<Vec<hvd_collectives::Tuned>> = Mutex::new(Vec::new());

fn context() -> MutexGuard<'static, Option<Context>> {
    // A panic while a collective held the lock leaves the communicator as it was; it reports
    // its own state on the next call.
    CONTEXT.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Initializes hvd from the launcher's environment (see the crate docs).
///
/// # Errors
/// [`Error::AlreadyInitialized`]; [`Error::Env`] for a missing or malformed variable;
/// [`Error::Rendezvous`] when the driver can't be reached or refuses; [`Error::Removed`] when
/// the driver has no place for this worker; [`Error::Comm`] when the peers can't be connected.
pub fn init() -> Result<()> {
    init_from(&ProcessEnv)
}

/// [`init`] with the launcher's variables read from `env` instead of the process environment.
///
/// # Errors
/// As [`init`].
pub fn init_from(env: &dyn Env) -> Result<()> {
    let mut ctx = context();
    if ctx.is_some() {
        return Err(Error::AlreadyInitialized);
    }
    let Some(launch) = Launch::from_env(env)? else {
        *ctx = Some(Context {
            topology: Topology::new(Placement::single(), &[]),
            comm: Some(Communicator::single()),
            session: None,
            engine_active: false,
            submitter: None,
            sync_seq: 0,
            timeline: open_timeline(env, 0),
            sets: process_set::Sets::default(),
            early: None,
        });
        return Ok(());
    };
    if malloc_huge_pages() == Some(false) {
        tracing::info!(
            "malloc in this process ignored GLIBC_TUNABLES glibc.malloc.hugetlb=1 (glibc 2.35 \
             and 2.36 do so at random): its large buffers stay on 4 KiB pages, which same-host \
             transfers copy at about half speed; hvd::HugeBuffer, glibc 2.37 or later, or \
             transparent_hugepage=always avoid it (and PyTorch's THP_MEM_ALLOC_ENABLE=1, \
             set by horovodrun, for tensors of 2 MiB and more)"
        );
    }
    let (listener, advertised) = client::bind_listener(&launch)?;
    let (client, round) = client::Client::register(&launch, &advertised)?;
    let mut session = Session {
        launch,
        listener,
        client,
        generation: 0,
        updates_through: 0,
        peers: Vec::new(),
    };
    let (topology, comm) = enter(&mut session, round)?;
    if session.launch.elastic {
        // Set once per client: a second `init` after `shutdown` has a client of its own.
        let _ = session.client.inbox.on_abort.set(rejoin_early);
    }
    let timeline = open_timeline(env, topology.rank);
    *ctx = Some(Context {
        topology,
        comm: Some(comm),
        session: Some(session),
        engine_active: false,
        submitter: None,
        sync_seq: 0,
        timeline,
        sets: process_set::Sets::default(),
        early: None,
    });
    Ok(())
}

/// This rank's timeline: recording into the file the launcher named, if any; a file that
/// can't be opened is logged and training goes on without it.
fn open_timeline(env: &dyn Env, rank: usize) -> Arc<Timeline> {
    let t = Arc::new(Timeline::stopped(rank));
    let Some(path) = env
        .var(hvd_rendezvous::ENV_TIMELINE)
        .filter(|p| !p.is_empty())
    else {
        return t;
    };
    let mark = env
        .var(hvd_rendezvous::ENV_TIMELINE_MARK_CYCLES)
        .is_some_and(|v| v.trim() == "1");
    if let Err(e) = t.start(std::path::Path::new(&path), mark) {
        tracing::warn!(%path, error = %e, "cannot write the timeline; continuing without it");
    }
    t
}

/// Starts recording this rank's timeline into `path` while the job runs (Horovod's
/// `start_timeline`): every rank may name the same file, each appending its own events.
/// Replaces any timeline recording before, `HOROVOD_TIMELINE`'s included.
///
/// # Errors
/// [`Error::NotInitialized`]; [`Error::Timeline`] when the file can't be created.
pub fn start_timeline(path: &std::path::Path, mark_cycles: bool) -> Result<()> {
    let t = context()
        .as_ref()
        .ok_or(Error::NotInitialized)?
        .timeline
        .clone();
    t.start(path, mark_cycles)
        .map_err(|source| Error::Timeline {
            path: path.display().to_string(),
            source,
        })
}

/// Stops recording the timeline (Horovod's `stop_timeline`); what was recorded stays in the
/// file. Stopping a timeline that does not record does nothing.
///
/// # Errors
/// [`Error::NotInitialized`].
pub fn stop_timeline() -> Result<()> {
    context()
        .as_ref()
        .ok_or(Error::NotInitialized)?
        .timeline
        .stop();
    Ok(())
}

/// Connects the world of a completed round.
///
/// The round's abort handle is registered with the driver connection before connecting, so
/// the driver's abort of the round (a member died) ends the connecting at once. In an elastic
/// job a round that fails while its members connect (a member died, or the driver aborted it)
/// costs a new round, never the worker: this worker joins the next one and connects again.
fn enter(session: &mut Session, mut round: client::Round) -> Result<(Topology, Communicator)> {
    loop {
        let world = match round {
            client::Round::World(w) => w,
            client::Round::Removed(reason) => return Err(Error::Removed { reason }),
        };
        let l = &session.launch;
        let p = world.placement;
        let mut cfg = hvd_collectives::CommConfig::new(p.rank, p.size, l.secret.clone());
        cfg.generation = world.generation;
        cfg.progress_timeout = l.progress_timeout;
        cfg.arrival_timeout = l.arrival_timeout;
        cfg.connect_timeout = l.start_timeout.max(Duration::from_secs(1));
        cfg.same_host_copy = l.same_host_copy;
        cfg.hierarchical = l.hierarchical;
        cfg.hierarchical_allgather = l.hierarchical_allgather;
        cfg.streams = l.streams;
        session.generation = world.generation;
        session.updates_through = world.updates_through;
        session.peers.clone_from(&world.peers);
        let abort = AbortHandle::new();
        session.client.inbox.watch(world.generation, abort.clone());
        let started = std::time::Instant::now();
        if !l.connect_delay.is_zero() {
            // Tests only: members start connecting at scattered times (`RandomState` is seeded
            // afresh each time); the round's abort ends the wait as it ends the connecting.
            use std::hash::{BuildHasher, Hasher};
            let r = std::collections::hash_map::RandomState::new()
                .build_hasher()
                .finish();
            let until = started + l.connect_delay.mul_f64((r % 1001) as f64 / 1000.0);
            while !abort.is_aborted() {
                let left = until.saturating_duration_since(std::time::Instant::now());
                if left.is_zero() {
                    break;
                }
                std::thread::sleep(left.min(Duration::from_millis(5)));
            }
        }
        let e = match Communicator::connect_abortable(cfg, &session.listener, &world.peers, &abort)
        {
            Ok(comm) => {
                tracing::info!(
                    rank = p.rank,
                    size = p.size,
                    generation = world.generation,
                    host = %l.hostname,
                    "hvd initialized"
                );
                return Ok((Topology::new(p, &world.hosts), comm));
            }
            Err(e) => Error::Comm(e),
        };
        if !(l.elastic && e.is_recoverable()) {
            return Err(e);
        }
        tracing::warn!(
            generation = world.generation,
            error = %e,
            after = ?started.elapsed(),
            "connecting the round failed; joining the next one"
        );
        let reason = format!("connecting round {} failed: {e}", world.generation);
        round = session.client.join(world.generation, &reason)?;
    }
}

/// Leaves the current communicator and joins the driver's next round (elastic jobs), again
/// while a peer dies as a new round connects. The context lock is not held while waiting, so
/// collectives called meanwhile from other threads fail with [`Error::MembershipChanging`]
/// instead of blocking.
pub(crate) fn rejoin(reason: &str) -> Result<()> {
    loop {
        match rejoin_once(reason) {
            Err(e) if e.is_recoverable() => {
                tracing::warn!(error = %e, "connecting the new round failed; joining the next one");
            }
            done => return done,
        }
    }
}

/// One join of the driver's next round, or the take-over of the round a rejoin started by
/// the driver's abort joined meanwhile.
fn rejoin_once(reason: &str) -> Result<()> {
    // Whether the driver's abort started a rejoin is decided under the same lock as leaving
    // the round: between the two, that rejoin could take the session.
    enum Who {
        Early(Arc<EarlyRejoin>),
        Program(Box<Session>, std::time::Instant),
    }
    let who = {
        let mut ctx = context();
        let c = ctx.as_mut().ok_or(Error::NotInitialized)?;
        match c.early.take() {
            Some(early) => Who::Early(early),
            None => Who::Program(Box::new(leave_round(c)?), std::time::Instant::now()),
        }
    };
    let (result, started) = match who {
        Who::Early(early) => early.wait(),
        Who::Program(session, started) => (join_round(*session, reason), started),
    };
    let mut ctx = context();
    let c = ctx.as_mut().ok_or(Error::NotInitialized)?;
    let generation = c.session.as_ref().map_or(0, |s| s.generation);
    if c.timeline.is_active() {
        let outcome = if result.is_ok() { "joined" } else { "failed" };
        let args =
            format!("\"generation\":{generation},\"reason\":{reason:?},\"outcome\":\"{outcome}\"");
        c.timeline.span(
            "elastic",
            "RENDEZVOUS_AND_RING_REBUILD",
            started,
            std::time::Instant::now(),
            &args,
        );
    }
    let (topology, comm) = result?;
    c.topology = topology;
    c.comm = Some(comm);
    // The sets' communicators belong to the old round; `elastic::run` rebuilds them.
    c.sets.disconnect();
    tracing::debug!(generation, "rejoined");
    Ok(())
}

/// Takes the session out of the context for a rejoin: from now on no collective runs on the
/// old round's communicator (an engine on it fails its ops), and collectives fail with
/// [`Error::MembershipChanging`] until the new round's is in place.
fn leave_round(c: &mut Context) -> Result<Session> {
    let session = c.session.take().ok_or(Error::NotElastic)?;
    c.comm = None;
    c.engine_active = false;
    c.submitter = None;
    Ok(session)
}

/// Joins the driver's next round and connects it, then gives the session back to the context.
fn join_round(mut session: Session, reason: &str) -> Joined {
    let result = session
        .client
        .join(session.generation, reason)
        .and_then(|round| enter(&mut session, round));
    let mut ctx = context();
    let c = ctx.as_mut().ok_or(Error::NotInitialized)?;
    c.session = Some(session);
    result
}

/// The driver aborted round `generation` (a member died): while the program finishes what
/// it computes, the next round forms. Started on a thread of its own, so the driver
/// connection's reader reads on (the join's answer comes through it); nothing happens when
/// the program already left that round.
fn rejoin_early(generation: u64, reason: &str) {
    let reason = format!("round {generation} was aborted: {reason}");
    let spawned = std::thread::Builder::new()
        .name("hvd-rejoin".into())
        .spawn(move || {
            let started = std::time::Instant::now();
            let (session, early) = {
                let mut ctx = context();
                let Some(c) = ctx.as_mut() else { return };
                let current = c.session.as_ref().map(|s| s.generation);
                if c.early.is_some() || current != Some(generation) {
                    return;
                }
                let Ok(session) = leave_round(c) else { return };
                let early = Arc::new(EarlyRejoin::default());
                c.early = Some(Arc::clone(&early));
                (session, early)
            };
            tracing::debug!(
                generation,
                "joining the next round before the program notices"
            );
            early.finish(join_round(session, &reason), started);
        });
    if let Err(e) = spawned {
        // The program still rejoins at its next collective, as without this thread.
        tracing::warn!(error = %e, "cannot start the early rejoin's thread");
    }
}

/// The round this worker is in (0 before its first).
pub(crate) fn generation() -> u64 {
    context()
        .as_ref()
        .and_then(|c| c.session.as_ref())
        .map_or(0, |s| s.generation)
}

/// Tells the driver (elastic jobs) that this worker completed the state sync of its round.
pub(crate) fn report_synced() {
    if let Some(s) = context().as_ref().and_then(|c| c.session.as_ref()) {
        s.client.synced(s.generation);
    }
}

/// The newest host update the current round accounts for.
pub(crate) fn updates_through() -> u64 {
    context()
        .as_ref()
        .and_then(|c| c.session.as_ref())
        .map_or(0, |s| s.updates_through)
}

/// The highest host-update id the driver has announced to this worker (0: none).
pub(crate) fn latest_update() -> u64 {
    context()
        .as_ref()
        .and_then(|c| c.session.as_ref())
        .map_or(0, |s| {
            s.client
                .inbox
                .latest_update
                .load(std::sync::atomic::Ordering::SeqCst)
        })
}

/// Leaves the job cleanly: tells the driver, closes every connection. [`init`] may be called
/// again afterwards.
///
/// # Errors
/// [`Error::NotInitialized`].
pub fn shutdown() -> Result<()> {
    let ctx = context().take().ok_or(Error::NotInitialized)?;
    if let Some(session) = ctx.session {
        session.client.goodbye();
    }
    Ok(())
}

/// Whether [`init`] has been called (and not undone by [`shutdown`]).
pub fn is_initialized() -> bool {
    context().is_some()
}

/// This process's place in the job.
///
/// # Errors
/// [`Error::NotInitialized`].
pub fn topology() -> Result<Topology> {
    context()
        .as_ref()
        .map(|c| c.topology.clone())
        .ok_or(Error::NotInitialized)
}

macro_rules! topology_getter {
    ($(#[$doc:meta] $name:ident: $t:ty;)*) => {$(
        #[$doc]
        ///
        /// # Errors
        /// [`Error::NotInitialized`].
        pub fn $name() -> Result<$t> {
            Ok(topology()?.$name)
        }
    )*};
}

topology_getter! {
    /// Global rank of this process.
    rank: usize;
    /// Number of processes in the job.
    size: usize;
    /// Rank of this process among those on its host.
    local_rank: usize;
    /// Number of processes on this host.
    local_size: usize;
    /// Rank of this host among the hosts with a process of this local rank.
    cross_rank: usize;
    /// Number of hosts with a process of this local rank.
    cross_size: usize;
}

/// Whether every host runs the same number of processes.
///
/// # Errors
/// [`Error::NotInitialized`].
pub fn is_homogeneous() -> Result<bool> {
    Ok(topology()?.homogeneous)
}

/// The engine settings from the launcher's environment, defaults otherwise:
/// `HOROVOD_CYCLE_TIME` (ms), `HOROVOD_FUSION_THRESHOLD` (bytes), `HOROVOD_CACHE_CAPACITY`;
/// the stall check (`HOROVOD_STALL_CHECK_TIME_SECONDS`, `HOROVOD_STALL_SHUTDOWN_TIME_SECONDS`,
/// `HOROVOD_STALL_CHECK_DISABLE`); autotune (`HOROVOD_AUTOTUNE` and its `HOROVOD_AUTOTUNE_*`
/// settings; a knob whose variable is set is held there); `HOROVOD_THREAD_AFFINITY`; and
/// `HOROVOD_NUM_NCCL_STREAMS`, checked but without effect in a build without NCCL.
///
/// # Errors
/// [`Error::Env`] naming a malformed variable and its value.
pub fn engine_config() -> Result<EngineConfig> {
    engine_config_from(&ProcessEnv)
}

/// The value of `var` parsed as `T` where `ok` holds; `what` says what it must be.
fn parsed<T: std::str::FromStr>(
    env: &dyn Env,
    var: &'static str,
    what: &str,
    ok: impl Fn(&T) -> bool,
) -> Result<Option<T>> {
    match env.var(var) {
        None => Ok(None),
        Some(v) => match v.trim().parse::<T>() {
            Ok(x) if ok(&x) => Ok(Some(x)),
            _ => Err(Error::Env {
                var,
                detail: format!("'{v}' is not {what}"),
            }),
        },
    }
}

/// A `0`/`1` variable: `None` when unset or empty.
pub(crate) fn switch(env: &dyn Env, var: &'static str) -> Result<Option<bool>> {
    match env.var(var).as_deref().map(str::trim) {
        None | Some("") => Ok(None),
        // As Horovod reads its switches: an integer above 0 is on, 0 or below off.
        Some(v) => match v.parse::<i64>() {
            Ok(n) => Ok(Some(n > 0)),
            Err(_) => Err(Error::Env {
                var,
                detail: format!("'{v}' is not an integer (1 turns it on, 0 off)"),
            }),
        },
    }
}

/// The core of `HOROVOD_THREAD_AFFINITY` for this process, as Horovod reads it: a
/// comma-separated list of cores, one per local rank, `list[local_rank]` being this one's.
/// A list shorter than the host's ranks pins nothing (logged, as Horovod does).
fn thread_affinity(env: &dyn Env) -> Result<Option<usize>> {
    use hvd_rendezvous as rv;
    let var = rv::ENV_THREAD_AFFINITY;
    let Some(v) = env.var(var).filter(|v| !v.trim().is_empty()) else {
        return Ok(None);
    };
    let cores: Vec<usize> = v
        .split(',')
        .map(|c| c.trim().parse())
        .collect::<std::result::Result<_, _>>()
        .map_err(|_| Error::Env {
            var,
            detail: format!("'{v}' is not a comma-separated list of core numbers"),
        })?;
    let index = |name: &'static str| -> Result<Option<usize>> {
        parsed::<usize>(env, name, "a non-negative integer", |_| true)
    };
    let local_rank = index(rv::ENV_LOCAL_RANK)?.unwrap_or(0);
    let local_size = index(rv::ENV_LOCAL_SIZE)?.unwrap_or(1).max(local_rank + 1);
    if cores.len() < local_size {
        tracing::warn!(
            "{var}={v} names {} cores for the {local_size} ranks of this host: the engine \
             thread is not pinned",
            cores.len()
        );
        return Ok(None);
    }
    Ok(cores.get(local_rank).copied())
}

/// [`engine_config`] reading from `env`.
///
/// # Errors
/// As [`engine_config`].
pub fn engine_config_from(env: &dyn Env) -> Result<EngineConfig> {
    use hvd_rendezvous as rv;
    let number = |var| {
        parsed::<f64>(env, var, "a non-negative number", |x| {
            x.is_finite() && *x >= 0.0
        })
    };
    let count = |var| parsed::<usize>(env, var, "a non-negative integer", |_| true);
    let positive = |var| parsed::<usize>(env, var, "a positive integer", |k| *k > 0);
    let mut cfg = EngineConfig::default();
    let cycle = number(rv::ENV_CYCLE_TIME)?;
    if let Some(ms) = cycle {
        cfg.cycle = Duration::from_secs_f64(ms / 1000.0);
    }
    let fusion = number(rv::ENV_FUSION_THRESHOLD)?;
    if let Some(b) = fusion {
        cfg.fusion_bytes = b as usize;
    }
    if let Some(s) = number(rv::ENV_STALL_CHECK_TIME)? {
        cfg.stall_warning = Duration::from_secs_f64(s);
    }
    if let Some(s) = number(rv::ENV_STALL_SHUTDOWN_TIME)? {
        cfg.stall_shutdown = Duration::from_secs_f64(s);
    }
    cfg.stall_check = switch(env, rv::ENV_STALL_CHECK_DISABLE)? != Some(true);
    let cache = count(rv::ENV_CACHE_CAPACITY)?;
    if let Some(c) = cache {
        cfg.cache_capacity = c;
    }
    cfg.thread_affinity = thread_affinity(env)?;
    if positive(rv::ENV_NUM_NCCL_STREAMS)?.is_some() {
        static ONCE: std::sync::Once = std::sync::Once::new();
        ONCE.call_once(|| {
            tracing::debug!("HOROVOD_NUM_NCCL_STREAMS has no effect: this build has no NCCL");
        });
    }
    if switch(env, rv::ENV_AUTOTUNE)? == Some(true) {
        let mut a = hvd_collectives::AutotuneConfig {
            log: env
                .var(rv::ENV_AUTOTUNE_LOG)
                .filter(|p| !p.trim().is_empty())
                .map(std::path::PathBuf::from),
            ..hvd_collectives::AutotuneConfig::default()
        };
        if let Some(k) = count(rv::ENV_AUTOTUNE_WARMUP_SAMPLES)? {
            a.warmup_samples = k;
        }
        if let Some(k) = positive(rv::ENV_AUTOTUNE_STEPS_PER_SAMPLE)? {
            a.steps_per_sample = k;
        }
        if let Some(k) = positive(rv::ENV_AUTOTUNE_BAYES_OPT_MAX_SAMPLES)? {
            a.max_samples = k;
        }
        if let Some(x) = parsed::<f64>(
            env,
            rv::ENV_AUTOTUNE_GAUSSIAN_PROCESS_NOISE,
            "a number from 0 to 1",
            |x| (0.0..=1.0).contains(x),
        )? {
            a.noise = x;
        }
        a.held = hvd_collectives::Held {
            fusion: fusion.is_some(),
            cycle: cycle.is_some(),
            cache: cache.is_some(),
            hierarchical_allreduce: switch(env, rv::ENV_HIERARCHICAL_ALLREDUCE)?.is_some(),
            hierarchical_allgather: switch(env, rv::ENV_HIERARCHICAL_ALLGATHER)?.is_some(),
        };
        cfg.autotune = Some(a);
    }
    Ok(cfg)
}

/// How a worker's log lines look, from Horovod's variables: what a program that installs a
/// tracing subscriber should give it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogSettings {
    /// The filter directives: `RUST_LOG` where set, else the level `HOROVOD_LOG_LEVEL` names,
    /// else the program's default.
    pub filter: String,
    /// Leave the time out of each line (`HOROVOD_LOG_HIDE_TIME=1`).
    pub hide_time: bool,
}

/// The log filter and format from `RUST_LOG`, `HOROVOD_LOG_LEVEL` (TRACE, DEBUG, INFO,
/// WARNING, ERROR, FATAL, any case; FATAL logs errors) and `HOROVOD_LOG_HIDE_TIME`, with
/// `default` as the filter when neither level variable is set.
///
/// # Errors
/// [`Error::Env`] naming a level or switch that is not one of those.
pub fn log_settings_from(env: &dyn Env, default: &str) -> Result<LogSettings> {
    let level = match env.var(hvd_rendezvous::ENV_LOG_LEVEL) {
        None => None,
        Some(v) => Some(hvd_rendezvous::log_directive(&v).ok_or_else(|| Error::Env {
            var: hvd_rendezvous::ENV_LOG_LEVEL,
            detail: format!("'{v}' is not one of TRACE, DEBUG, INFO, WARNING, ERROR, FATAL"),
        })?),
    };
    let filter = env
        .var("RUST_LOG")
        .filter(|v| !v.trim().is_empty())
        .or_else(|| level.map(String::from))
        .unwrap_or_else(|| default.to_string());
    Ok(LogSettings {
        filter,
        hide_time: switch(env, hvd_rendezvous::ENV_LOG_HIDE_TIME)? == Some(true),
    })
}

/// Sends hvd's log to stderr as [`log_settings_from`] the process environment says, unless
/// the program installed a logger of its own (that one stays). For programs and frontends
/// that have no logging setup of their own: Horovod's core logs to stderr the same way.
///
/// # Errors
/// [`Error::Env`] naming a malformed `HOROVOD_LOG_LEVEL` or `HOROVOD_LOG_HIDE_TIME`.
pub fn install_logging(default: &str) -> Result<()> {
    let log = log_settings_from(&ProcessEnv, default)?;
    let fmt = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new(&log.filter))
        .with_target(false)
        // Colours only on a terminal: a launcher's pipe carries the lines into its own output
        // and log files, where escape codes would be noise.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(hvd_rendezvous::log_stderr);
    // An error means a subscriber is installed already: that one stays.
    let _ = if log.hide_time {
        fmt.without_time().try_init()
    } else {
        fmt.try_init()
    };
    Ok(())
}

/// Hands the communicator to a background [`Engine`]: named, asynchronous collectives
/// ([`hvd_collectives::Submitter::allreduce_async`] and the others) matched across ranks by
/// name, allreduces fused. Meanwhile the synchronous collectives below are thin wrappers
/// that submit an op under a generated name and wait for it, so elastic commits keep working;
/// only [`with_communicator`] fails with [`Error::EngineActive`] until [`stop_engine`].
///
/// # Errors
/// [`Error::NotInitialized`], [`Error::EngineActive`] or [`Error::MembershipChanging`] when
/// there is no communicator to hand over; [`Error::Comm`] when the thread can't start.
pub fn start_engine(cfg: EngineConfig) -> Result<Engine> {
    let mut ctx = context();
    let c = ctx.as_mut().ok_or(Error::NotInitialized)?;
    if c.engine_active {
        return Err(Error::EngineActive);
    }
    let comm = c.comm.take().ok_or(Error::MembershipChanging)?;
    c.engine_active = true;
    let mut cfg = cfg;
    if let Some(a) = cfg.autotune.as_mut().filter(|a| a.resume.is_empty()) {
        a.resume = TUNED.lock().unwrap_or_else(PoisonError::into_inner).clone();
    }
    if cfg.timeline.is_none() {
        cfg.timeline = Some(c.timeline.clone());
    }
    let engine = Engine::start(comm, cfg)?;
    client::report_engine(Some(engine.status_reader()));
    c.submitter = Some(engine.submitter());
    c.sync_seq = 0;
    Ok(engine)
}

/// Stops the engine (on every rank together: pending ops fail) and gives the communicator
/// back to the synchronous collectives.
///
/// # Errors
/// [`Error::NotInitialized`].
pub fn stop_engine(engine: Engine) -> Result<()> {
    client::report_engine(None);
    let (comm, status) = engine.stop_with_status();
    if let Some(t) = status.tuned {
        let mut tuned = TUNED.lock().unwrap_or_else(PoisonError::into_inner);
        tuned.retain(|k| k.shape() != t.shape());
        tuned.push(t);
    }
    let mut ctx = context();
    let c = ctx.as_mut().ok_or(Error::NotInitialized)?;
    c.engine_active = false;
    c.submitter = None;
    // A rejoin under way holds the next round's communicator: the old one is dropped.
    if c.comm.is_none() && c.early.is_none() {
        c.comm = comm;
    }
    Ok(())
}

/// Runs `f` on the communicator; the building block of the functions below.
///
/// # Errors
/// [`Error::NotInitialized`], or whatever `f` returns.
pub fn with_communicator<R>(
    f: impl FnOnce(&mut Communicator) -> hvd_collectives::Result<R>,
) -> Result<R> {
    let mut ctx = context();
    let ctx = ctx.as_mut().ok_or(Error::NotInitialized)?;
    if ctx.engine_active {
        return Err(Error::EngineActive);
    }
    let comm = ctx.comm.as_mut().ok_or(Error::MembershipChanging)?;
    Ok(f(comm)?)
}

/// The running engine's submitter and a fresh name for one synchronous call, if an engine
/// holds the communicator. Every rank makes the same synchronous calls in the same order, so
/// the names match.
fn through_engine() -> Result<Option<(Submitter, String)>> {
    let mut ctx = context();
    let c = ctx.as_mut().ok_or(Error::NotInitialized)?;
    Ok(c.submitter.clone().map(|s| {
        c.sync_seq += 1;
        (s, format!("hvd.sync.{}", c.sync_seq))
    }))
}

/// Declares that this rank has no more data (Horovod's `join`) and waits until every rank
/// has: meanwhile its engine takes part in the other ranks' allreduces with zeros, so ranks
/// with uneven amounts of data finish together. Returns the rank that joined last.
///
/// # Errors
/// [`Error::NotInitialized`]; [`Error::EngineInactive`] without a running engine;
/// [`Error::Comm`] when a peer fails or the engine stops first.
pub fn join() -> Result<usize> {
    let s = {
        let ctx = context();
        let c = ctx.as_ref().ok_or(Error::NotInitialized)?;
        c.submitter.clone().ok_or(Error::EngineInactive)?
    };
    let last = s.join()?;
    // Every rank is past the join: their synchronous calls are numbered afresh alike.
    if let Some(c) = context().as_mut() {
        c.sync_seq = 0;
    }
    Ok(last)
}

/// [`join`] on a rank whose engine does not run: returns the last rank when every rank
/// joined at this same call.
///
/// # Errors
/// [`Error::EngineActive`] while an engine runs; an error for which
/// [`Error::met_joined_ranks`] holds when other ranks still run: start an engine and
/// [`join`] through it (they run their calls again through theirs).
pub fn join_without_engine() -> Result<usize> {
    let last = with_communicator(Communicator::join)?;
    if let Some(c) = context().as_mut() {
        c.sync_seq = 0;
    }
    Ok(last)
}

/// Reduces `buf` across all ranks in place. See [`Communicator::allreduce`].
///
/// # Errors
/// [`Error::NotInitialized`]; [`Error::Comm`] on a mismatch or a peer failure.
pub fn allreduce<T: Element>(buf: &mut [T], op: ReduceOp) -> Result<()> {
    client::count_allreduce(std::mem::size_of_val(buf));
    allreduce_uncounted(buf, op)
}

/// [`allreduce`] left out of the rates rank 0 reports: hvd's own bookkeeping (the check for
/// host updates at each commit).
pub(crate) fn allreduce_uncounted<T: Element>(buf: &mut [T], op: ReduceOp) -> Result<()> {
    if let Some((s, name)) = through_engine()? {
        let v = s.allreduce_async(&name, buf.to_vec(), op).wait()?;
        buf.copy_from_slice(&v);
        return Ok(());
    }
    with_communicator(|c| c.allreduce(buf, op))
}

/// Allreduces several buffers as one fused operation.
///
/// # Errors
/// As [`allreduce`].
pub fn grouped_allreduce<T: Element>(bufs: &mut [&mut [T]], op: ReduceOp) -> Result<()> {
    for b in bufs.iter() {
        client::count_allreduce(std::mem::size_of_val(&**b));
    }
    if let Some((s, name)) = through_engine()? {
        // Submitted together, they are agreed in one cycle and fused.
        let handles: Vec<_> = bufs
            .iter()
            .enumerate()
            .map(|(k, b)| s.allreduce_async(&format!("{name}.{k}"), b.to_vec(), op))
            .collect();
        for (b, h) in bufs.iter_mut().zip(handles) {
            b.copy_from_slice(&h.wait()?);
        }
        return Ok(());
    }
    with_communicator(|c| c.grouped_allreduce(bufs, op))
}

/// Concatenates every rank's rows (of `row_len` elements) in rank order.
///
/// # Errors
/// As [`allreduce`].
pub fn allgather<T: Element>(input: &[T], row_len: usize) -> Result<Vec<T>> {
    if let Some((s, name)) = through_engine()? {
        return Ok(s.allgather_async(&name, input.to_vec(), row_len).wait()?);
    }
    with_communicator(|c| c.allgather(input, row_len))
}

/// Copies `buf` from `root` to every rank.
///
/// # Errors
/// As [`allreduce`].
pub fn broadcast<T: Element>(buf: &mut [T], root: usize) -> Result<()> {
    if let Some((s, name)) = through_engine()? {
        let v = s.broadcast_async(&name, buf.to_vec(), root).wait()?;
        buf.copy_from_slice(&v);
        return Ok(());
    }
    with_communicator(|c| c.broadcast(buf, root))
}

/// Sends `splits[p]` elements to rank `p`; returns what arrived and how much from each rank.
///
/// # Errors
/// As [`allreduce`].
pub fn alltoall<T: Element>(input: &[T], splits: &[usize]) -> Result<(Vec<T>, Vec<usize>)> {
    if let Some((s, name)) = through_engine()? {
        return Ok(s
            .alltoall_async(&name, input.to_vec(), splits.to_vec())
            .wait()?);
    }
    with_communicator(|c| c.alltoall(input, splits))
}

/// Reduces `input` across ranks and returns this rank's block.
///
/// # Errors
/// As [`allreduce`].
pub fn reducescatter<T: Element>(input: &[T], op: ReduceOp) -> Result<Vec<T>> {
    if let Some((s, name)) = through_engine()? {
        return Ok(s.reducescatter_async(&name, input.to_vec(), op).wait()?);
    }
    with_communicator(|c| c.reducescatter(input, op))
}

/// Waits until every rank has called it.
///
/// # Errors
/// As [`allreduce`].
pub fn barrier() -> Result<()> {
    if let Some((s, name)) = through_engine()? {
        s.allreduce_async(&name, vec![0u8], ReduceOp::Max).wait()?;
        return Ok(());
    }
    with_communicator(Communicator::barrier)
}
