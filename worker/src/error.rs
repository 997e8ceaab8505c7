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
}

/// Result of an `hvd` call.
pub type Result<T, E = Error> = std::result::Result<T, E>;
