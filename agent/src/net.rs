//! Socket settings both ends of an agent connection use.

use std::os::fd::AsFd;

use nix::sys::socket::{setsockopt, sockopt};

/// Seconds a connection may be idle before the first keepalive probe.
pub(crate) const KEEPALIVE_IDLE_S: u32 = 30;
/// Seconds between unanswered keepalive probes.
const KEEPALIVE_INTERVAL_S: u32 = 10;
/// Unanswered probes after which the connection counts as dead.
const KEEPALIVE_PROBES: u32 = 3;

/// Turns on TCP keepalive so a peer that vanished without a FIN or RST (a crashed node, a
/// dropped route) ends the connection within about a minute instead of never.
pub(crate) fn keepalive(socket: &impl AsFd) -> nix::Result<()> {
    setsockopt(socket, sockopt::KeepAlive, &true)?;
    setsockopt(socket, sockopt::TcpKeepIdle, &KEEPALIVE_IDLE_S)?;
    setsockopt(socket, sockopt::TcpKeepInterval, &KEEPALIVE_INTERVAL_S)?;
    setsockopt(socket, sockopt::TcpKeepCount, &KEEPALIVE_PROBES)
}
