//! The agent's use of the job's one authentication ([`hvd_auth`]): the driver dials, the agent
//! listens, and each proves it knows the shared secret over both sides' fresh nonces before
//! anything else crosses the connection.

pub use hvd_auth::{AuthError, Handshake, Nonce, Role, Tag};

/// The context both sides name in their proofs, so that a proof made for another service of
/// the job (its rendezvous, its mesh) is refused here.
pub const CONTEXT: &str = "hvd-agent";
