//! The error type of every collective.

use std::io;
use std::time::Duration;

/// Why a collective or the set-up of a communicator failed.
///
/// A transport error ([`CommError::PeerLost`], [`CommError::Timeout`], [`CommError::Aborted`])
/// leaves the communicator broken: every later call returns [`CommError::Broken`] and the owner
/// builds a new one for the next membership. A [`CommError::Mismatch`] is detected before any data
/// moves, so the communicator stays usable.
#[derive(Debug, thiserror::Error)]
pub enum CommError {
    /// Ranks called different collectives, or the same one with different arguments.
    #[error(
        "collective mismatch at call #{seq}: rank {rank_a} called {desc_a}, but rank {rank_b} called {desc_b}"
    )]
    Mismatch {
        /// Position of the call in this communicator's sequence of collectives.
        seq: u64,
        /// The rank whose call is taken as the reference (the lowest rank).
        rank_a: usize,
        /// What `rank_a` called.
        desc_a: String,
        /// The first rank that disagrees with `rank_a`.
        rank_b: usize,
        /// What `rank_b` called.
        desc_b: String,
    },
    /// The call met ranks that called `join` (no more data) instead; on every rank, before any
    /// data moved. A rank that did not join runs its call again through a background engine,
    /// which takes the joined ranks' part (zeros); the joined ranks join through theirs.
    #[error("call #{seq} met ranks {ranks:?}, which joined (they have no more data)")]
    Joined {
        /// Position of the call in this communicator's sequence of collectives.
        seq: u64,
        /// The ranks that called `join`.
        ranks: Vec<usize>,
    },
    /// The connection to a peer closed or failed during a collective.
    #[error("lost connection to rank {rank} during {op}: {source}")]
    PeerLost {
        /// The peer's rank.
        rank: usize,
        /// The collective that was running.
        op: &'static str,
        /// What the socket reported.
        #[source]
        source: io::Error,
    },
    /// A peer sent nothing for longer than the configured timeout.
    #[error("rank {rank} sent nothing for {waited:?} during {op} (peer hung or unreachable)")]
    Timeout {
        /// The peer's rank.
        rank: usize,
        /// The collective that was running.
        op: &'static str,
        /// How long this rank waited.
        waited: Duration,
    },
    /// [`crate::AbortHandle::abort`] was called, for example because membership changed.
    #[error("communicator aborted: {reason}")]
    Aborted {
        /// Why the owner aborted it.
        reason: String,
    },
    /// An earlier transport error broke this communicator; build a new one.
    #[error("communicator is broken by an earlier error ({cause}); it must be rebuilt")]
    Broken {
        /// The error that broke it.
        cause: String,
    },
    /// A peer sent bytes that are not a valid message of this protocol.
    #[error("protocol error from rank {rank}: {detail}")]
    Protocol {
        /// The peer's rank.
        rank: usize,
        /// What was wrong.
        detail: String,
    },
    /// Arguments that are invalid on this rank alone (a bad root, splits that don't add up).
    #[error("invalid argument to {op}: {detail}")]
    InvalidArgument {
        /// The collective.
        op: &'static str,
        /// What was wrong.
        detail: String,
    },
    /// Another rank passed arguments that are invalid on that rank (it reports the detail).
    #[error("rank {rank} passed invalid arguments to {op} (its own error says which)")]
    RemoteInvalid {
        /// The rank whose call was invalid.
        rank: usize,
        /// The collective.
        op: &'static str,
    },
    /// Connecting the mesh failed.
    #[error("could not connect to rank {rank} at {addr}: {detail}")]
    Connect {
        /// The peer's rank.
        rank: usize,
        /// Where it was expected to listen.
        addr: String,
        /// What went wrong.
        detail: String,
    },
    /// A socket operation outside any collective failed.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
}

impl CommError {
    /// True when the communicator can no longer be used (everything but mismatches and bad
    /// arguments).
    pub fn is_fatal(&self) -> bool {
        !matches!(
            self,
            Self::Mismatch { .. }
                | Self::Joined { .. }
                | Self::InvalidArgument { .. }
                | Self::RemoteInvalid { .. }
        )
    }

    /// A short, stable label for metrics and logs.
    pub fn metric_label(&self) -> &'static str {
        match self {
            Self::Mismatch { .. } => "mismatch",
            Self::Joined { .. } => "joined",
            Self::PeerLost { .. } => "peer_lost",
            Self::Timeout { .. } => "timeout",
            Self::Aborted { .. } => "aborted",
            Self::Broken { .. } => "broken",
            Self::Protocol { .. } => "protocol",
            Self::InvalidArgument { .. } => "invalid_argument",
            Self::RemoteInvalid { .. } => "remote_invalid",
            Self::Connect { .. } => "connect",
            Self::Io { .. } => "io",
        }
    }
}

/// Result of a collective.
pub type Result<T, E = CommError> = std::result::Result<T, E>;
