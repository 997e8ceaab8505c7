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
mod error;
mod launch;

use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Duration;

pub use error::{Error, Result};
pub use hvd_collectives::{
    AbortHandle, CommError, Communicator, DType, Element, ReduceOp, bf16, f16,
};
pub use launch::{Env, Launch, ProcessEnv};

/// This process's place in the job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Topology {
    /// Global rank.
    pub rank: usize,
    /// Number of ranks.
    pub size: usize,
    /// Rank on this host.
    pub local_rank: usize,
    /// Ranks on this host.
    pub local_size: usize,
    /// Rank among the hosts' ranks of the same local rank.
    pub cross_rank: usize,
    /// Hosts with a rank of this local rank.
    pub cross_size: usize,
    /// Whether every host runs the same number of ranks.
    pub homogeneous: bool,
}

struct Context {
    topology: Topology,
    comm: Communicator,
    client: Option<client::Client>,
}

static CONTEXT: Mutex<Option<Context>> = Mutex::new(None);

fn context() -> MutexGuard<'static, Option<Context>> {
    // A panic while a collective held the lock leaves the communicator as it was; it reports
    // its own state on the next call.
    CONTEXT.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Initializes hvd from the launcher's environment (see the crate docs).
///
/// # Errors
/// [`Error::AlreadyInitialized`]; [`Error::Env`] for a missing or malformed variable;
/// [`Error::Rendezvous`] when the driver can't be reached or refuses; [`Error::Comm`] when the
/// peers can't be connected.
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
            topology: Topology {
                rank: 0,
                size: 1,
                local_rank: 0,
                local_size: 1,
                cross_rank: 0,
                cross_size: 1,
                homogeneous: true,
            },
            comm: Communicator::single(),
            client: None,
        });
        return Ok(());
    };
    let (listener, advertised) = client::bind_listener(&launch)?;
    let (client, world) = client::Client::register(&launch, &advertised)?;
    let mut cfg = hvd_collectives::CommConfig::new(launch.rank, launch.size, launch.secret.clone());
    cfg.generation = world.generation;
    cfg.progress_timeout = launch.progress_timeout;
    cfg.arrival_timeout = launch.arrival_timeout;
    cfg.connect_timeout = launch.start_timeout.max(Duration::from_secs(1));
    let comm = Communicator::connect(cfg, &listener, &world.peers)?;
    let mut per_host: Vec<(&str, usize)> = Vec::new();
    for h in &world.hosts {
        match per_host.iter_mut().find(|(name, _)| name == h) {
            Some((_, k)) => *k += 1,
            None => per_host.push((h, 1)),
        }
    }
    let homogeneous = per_host.windows(2).all(|w| w[0].1 == w[1].1);
    tracing::info!(rank = launch.rank, size = launch.size, host = %launch.hostname, "hvd initialized");
    *ctx = Some(Context {
        topology: Topology {
            rank: launch.rank,
            size: launch.size,
            local_rank: launch.local_rank,
            local_size: launch.local_size,
            cross_rank: launch.cross_rank,
            cross_size: launch.cross_size,
            homogeneous,
        },
        comm,
        client: Some(client),
    });
    Ok(())
}

/// Leaves the job cleanly: tells the driver, closes every connection. [`init`] may be called
/// again afterwards.
///
/// # Errors
/// [`Error::NotInitialized`].
pub fn shutdown() -> Result<()> {
    let ctx = context().take().ok_or(Error::NotInitialized)?;
    if let Some(client) = ctx.client {
        client.goodbye();
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

/// Runs `f` on the communicator; the building block of the functions below.
///
/// # Errors
/// [`Error::NotInitialized`], or whatever `f` returns.
pub fn with_communicator<R>(
    f: impl FnOnce(&mut Communicator) -> hvd_collectives::Result<R>,
) -> Result<R> {
    let mut ctx = context();
    let ctx = ctx.as_mut().ok_or(Error::NotInitialized)?;
    Ok(f(&mut ctx.comm)?)
}

/// Reduces `buf` across all ranks in place. See [`Communicator::allreduce`].
///
/// # Errors
/// [`Error::NotInitialized`]; [`Error::Comm`] on a mismatch or a peer failure.
pub fn allreduce<T: Element>(buf: &mut [T], op: ReduceOp) -> Result<()> {
    with_communicator(|c| c.allreduce(buf, op))
}

/// Allreduces several buffers as one fused operation.
///
/// # Errors
/// As [`allreduce`].
pub fn grouped_allreduce<T: Element>(bufs: &mut [&mut [T]], op: ReduceOp) -> Result<()> {
    with_communicator(|c| c.grouped_allreduce(bufs, op))
}

/// Concatenates every rank's rows (of `row_len` elements) in rank order.
///
/// # Errors
/// As [`allreduce`].
pub fn allgather<T: Element>(input: &[T], row_len: usize) -> Result<Vec<T>> {
    with_communicator(|c| c.allgather(input, row_len))
}

/// Copies `buf` from `root` to every rank.
///
/// # Errors
/// As [`allreduce`].
pub fn broadcast<T: Element>(buf: &mut [T], root: usize) -> Result<()> {
    with_communicator(|c| c.broadcast(buf, root))
}

/// Sends `splits[p]` elements to rank `p`; returns what arrived and how much from each rank.
///
/// # Errors
/// As [`allreduce`].
pub fn alltoall<T: Element>(input: &[T], splits: &[usize]) -> Result<(Vec<T>, Vec<usize>)> {
    with_communicator(|c| c.alltoall(input, splits))
}

/// Reduces `input` across ranks and returns this rank's block.
///
/// # Errors
/// As [`allreduce`].
pub fn reducescatter<T: Element>(input: &[T], op: ReduceOp) -> Result<Vec<T>> {
    with_communicator(|c| c.reducescatter(input, op))
}

/// Waits until every rank has called it.
///
/// # Errors
/// As [`allreduce`].
pub fn barrier() -> Result<()> {
    with_communicator(Communicator::barrier)
}
