//! Errors of the `hvd` library.

use hvd_collectives::CommError;

/// Why an `hvd` call failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A call that needs [`crate::init`] came before it (or after [`crate::shutdown`]).
    #[error("hvd is not initialized: call hvd::init() first")]
    NotInitialized,
    /// [`crate::init`] was called twice without [`crate::shutdown`] in between.
    #[error("hvd is already initialized")]
    AlreadyInitialized,
    /// An environment variable the launcher sets is missing or malformed.
    #[error("environment variable {var}: {detail}")]
    Env {
        /// The variable.
        var: &'static str,
        /// What is wrong with it.
        detail: String,
    },
    /// Talking to the driver failed.
    #[error("rendezvous with the driver at {addr} failed: {detail}")]
    Rendezvous {
        /// The driver's address.
        addr: String,
        /// What went wrong.
        detail: String,
    },
    /// A collective failed.
    #[error(transparent)]
    Comm(#[from] CommError),
    /// The driver has no place for this worker any more (its host left the job, or the job
    /// shrank). The worker should exit 0.
    #[error("this worker was removed from the job: {reason}")]
    Removed {
        /// The driver's reason.
        reason: String,
    },
    /// A collective was called while the worker was between rounds of an elastic job; call
    /// collectives inside `hvd::elastic::run`.
    #[error(
        "the job's membership is changing: collectives must be called inside hvd::elastic::run"
    )]
    MembershipChanging,
    /// The driver announced a host change; raised by `State::check_host_updates` so that
    /// `hvd::elastic::run` moves every rank to the next round at the same step.
    #[error("hosts were added or removed (update {update_id}); the job moves to a new round")]
    HostsUpdated {
        /// The newest announced update.
        update_id: u64,
    },
    /// The communicator itself (or a process set's) was asked for while the background engine
    /// holds it ([`crate::start_engine`]); give it back with [`crate::stop_engine`].
    #[error(
        "the background engine holds the communicator: use its async ops, or hvd::stop_engine first"
    )]
    EngineActive,
    /// [`crate::join`] was called with no background engine running: join needs one, as the
    /// other ranks' ops reach a joined rank through it.
    #[error("hvd::join needs the background engine: hvd::start_engine first")]
    EngineInactive,
    /// This rank is not a member of the process set it used.
    #[error("rank {rank} is not in process set {set} (ranks {ranks:?})")]
    NotInProcessSet {
        /// This rank.
        rank: usize,
        /// The set's id.
        set: u32,
        /// Its members.
        ranks: Vec<usize>,
    },
    /// A process set's definition is invalid, or it no longer exists.
    #[error("process set: {0}")]
    ProcessSet(String),
    /// An elastic call in a process that no elastic launcher started.
    #[error("not an elastic job: run it under horovodrun with --min-np or --host-discovery-script")]
    NotElastic,
    /// The timeline file could not be created or opened.
    #[error("cannot write the timeline to {path}: {source}")]
    Timeline {
        /// The file asked for.
        path: String,
        /// Why it failed.
        source: std::io::Error,
    },
    /// Encoding or decoding the state to synchronize failed.
    #[error("state synchronization: {0}")]
    State(String),
}

impl Error {
    /// Whether `hvd::elastic::run` recovers from this error by restoring the last commit and
    /// joining a new round: a peer failed, hung or went away mid-collective.
    pub fn is_recoverable(&self) -> bool {
        match self {
            Self::Comm(e) => !matches!(
                e,
                CommError::Mismatch { .. }
                    | CommError::Joined { .. }
                    | CommError::InvalidArgument { .. }
                    | CommError::RemoteInvalid { .. }
            ),
            Self::MembershipChanging => true,
            _ => false,
        }
    }

    /// Whether a call met ranks that joined (Horovod's `join`) while no engine ran here: run
    /// it again through a background engine, which takes their part.
    pub fn met_joined_ranks(&self) -> bool {
        matches!(self, Self::Comm(CommError::Joined { .. }))
    }
}

/// Result of an `hvd` call.
pub type Result<T, E = Error> = std::result::Result<T, E>;
