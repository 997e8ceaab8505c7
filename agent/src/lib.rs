//! The hvd agent: runs on every worker host (or pod) and starts, watches and stops the
//! training processes the driver asks for, in place of `ssh`.
//!
//! - [`proto`]: the JSON-lines messages ([`ToAgent`], [`FromAgent`]).
//! - [`auth`]: the job's one authentication ([`hvd_auth`]), a mutual challenge–response both
//!   sides run with the shared secret ([`ENV_AGENT_SECRET`]) before anything else.
//! - [`serve`]: the agent's server. Processes run in their own process groups; when the
//!   connection that started them ends, they are stopped, so a dead driver leaves no orphans;
//!   a driver that claimed its job ([`ToAgent::Claim`]) leaves them running for its grace,
//!   their output kept (bounded), for the driver that takes the job over.
//! - [`connect`]: the driver's client, returning the two halves of an authenticated connection.
//!   [`Events::next`] is cancel safe, so it can wait in a `select!` beside other work.
//! - [`dying`]: a child's failure noticed when its death begins, before the kernel has freed
//!   its memory (which may take longer than the job's recovery).
//! - [`reap_orphans`]: for an agent that is PID 1, reaping the orphans it inherits.
//!
//! ```no_run
//! # async fn demo() -> Result<(), hvd_agent::AgentError> {
//! use hvd_agent::{FromAgent, ToAgent, connect};
//! let (mut events, mut requests) =
//!     connect("10.0.0.7:7077", "s3cret", std::time::Duration::from_secs(5)).await?;
//! requests
//!     .send(&ToAgent::Start { id: 0, argv: vec!["hostname".into()], env: vec![], cwd: None })
//!     .await?;
//! while let Some(msg) = events.next().await? {
//!     if let FromAgent::Exited { code, .. } = msg {
//!         println!("exited with {code:?}");
//!         break;
//!     }
//! }
//! # Ok(()) }
//! ```

pub mod auth;
mod client;
pub mod dying;
mod lines;
mod net;
pub mod proto;
mod reaper;
mod server;

pub use client::{AgentError, Events, Requests, connect};
pub use proto::{FromAgent, Held, Stream, ToAgent};
pub use reaper::reap_orphans;
pub use server::{Limits, serve, serve_with_limits, set_host_env};

pub use hvd_rendezvous::ENV_AGENT_SECRET;

/// The port an agent listens on unless told otherwise.
pub const DEFAULT_PORT: u16 = 7077;
