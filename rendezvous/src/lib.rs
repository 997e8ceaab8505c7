//! What the hvd driver and its workers say to each other, in one place so the two sides can't
//! drift: the environment a launcher passes, the JSON-lines messages of the rendezvous
//! connection, and rank assignment.
//!
//! Messages are JSON, one object a line, tagged by `"type"`: self-describing and never executed
//! on decode.

mod assign;
mod env;
mod msg;

pub use assign::{AssignError, HostSlots, SlotInfo, assign_static};
pub use env::*;
pub use msg::{
    DriverMsg, HostsUpdate, MAX_LINE, Placement, ProtocolError, WorkerMsg, decode_line, encode_line,
};
