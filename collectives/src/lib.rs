//! Collective communication for hvd: allreduce, grouped allreduce, allgather, broadcast,
//! alltoall, reducescatter and barrier over TCP connections between ranks.
//!
//! A [`Communicator`] belongs to one membership. It is built from a listener this rank bound
//! and the addresses of every rank; when membership changes it is dropped and a new one is
//! connected, in the same process. Every failure is an error value: a peer that dies makes every
//! blocked call on every rank return within a bounded time, and a call that does not match the
//! other ranks' calls fails on all of them with a message naming both sides.
//!
//! # Layout
//! - `dtype`: element types and reduction kernels;
//! - `buffer`: tensor buffers backed by transparent huge pages;
//! - `pages`: whether this process's `malloc` honours the huge-page tunable;
//! - `wire`: the descriptor that opens every collective (a pure codec);
//! - `connect`: the authenticated mesh handshake;
//! - `lazy`: the pairs of a large world that connect on first use;
//! - `link`: sockets, abort, and the shut-everything-down path that turns a failure anywhere
//!   into an error everywhere;
//! - `pipeline`: the segment engine of the ring algorithms;
//! - `comm`, `ops`: the communicator and its collectives;
//! - `topology`: the host groups and the hierarchy's host and cross-host communicators;
//! - `transport`: how bytes move between ranks (openings, mailboxes, ring and pairwise);
//! - `schedule`: the ring's pure block, segment and receive schedule;
//! - `adasum`: Horovod's adaptive summation, an allreduce op of its own;
//! - `engine`: the background engine (named async ops), run in cycles of `negotiation` (what
//!   every rank has pending, agreed the same everywhere), `fusion` (allreduces reduced as few
//!   large ones) and the `stall` check;
//! - `autotune`: the engine's knobs tuned on the running job by Bayesian optimisation.
//!
//! # Example
//! ```
//! use hvd_collectives::{Communicator, ReduceOp};
//! let mut comm = Communicator::single();
//! let mut grads = vec![1.0f32, 2.0];
//! comm.allreduce(&mut grads, ReduceOp::Sum)?;
//! assert_eq!(grads, [1.0, 2.0]);
//! # Ok::<(), hvd_collectives::CommError>(())
//! ```

mod adasum;
pub mod autotune;
mod buffer;
mod cma;
mod comm;
mod config;
mod connect;
mod dtype;
mod engine;
mod error;
mod fusion;
mod hier_gather;
mod lateness;
mod lazy;
mod link;
mod mailbox;
mod negotiation;
mod ops;
mod pages;
mod pipeline;
mod schedule;
mod stall;
mod timeline;
mod topology;
mod transport;
mod wire;

pub use autotune::{AutotuneConfig, Held, Setting, Tuned};
pub use buffer::HugeBuffer;
pub use comm::Communicator;
pub use config::{CommConfig, MAX_STREAMS};
pub use dtype::{DType, Element, ReduceOp};
pub use engine::{
    Buffer, Compression, Engine, EngineConfig, EngineStatus, Handle, StatusReader, Submitter,
};
pub use error::{CommError, Result};
pub use half::{bf16, f16};
pub use lateness::WINDOW as LATENESS_WINDOW;
pub use link::AbortHandle;
pub use pages::{malloc_huge_pages, thp_fault_fallbacks};
pub use timeline::Timeline;
pub use wire::{Descriptor, Kind};
