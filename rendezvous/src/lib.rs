//! What the hvd driver and its workers say to each other, in one place so the two sides can't
//! drift: the environment a launcher passes, the JSON-lines messages of the rendezvous
//! connection, and rank assignment.
//!
//! Messages are JSON, one object a line, tagged by `"type"`: self-describing and never executed
//! on decode. A connection opens with a handshake in which both sides prove they hold the job
//! secret (which never crosses the wire), and every line after it carries a tag bound to that
//! connection ([`seal_line`], [`open_line`]).

mod assign;
mod auth;
mod env;
mod log_stderr;
mod msg;
mod notice;
mod vars;

pub use assign::{AssignError, HostSlots, SlotInfo, assign_static};
pub use auth::{AuthMsg, CONTEXT, DialerAuth, ListenerAuth, open_line, refusal_line, seal_line};
pub use env::*;
pub use hvd_auth::{Opener, Sealer, Session};
pub use log_stderr::{Lossy, log_stderr};
pub use msg::{
    DriverMsg, HostsUpdate, MAX_LINE, Placement, ProtocolError, WorkerMsg, decode_line, encode_line,
};
pub use notice::{Cloud, NOTICE_HOLD_DEFAULT, NoticeSource, SIGTERM_GRACE_DEFAULT};
pub use vars::{HOROVOD_VARS, Meaning, build_switch, check_backend, horovod_var};
