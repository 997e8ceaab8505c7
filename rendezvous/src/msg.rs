//! Rendezvous messages and their line codec.

use serde::{Deserialize, Serialize};

/// Longest line either side accepts; a longer one is an error, not an allocation.
pub const MAX_LINE: usize = 1 << 20;

/// What a worker sends the driver.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum WorkerMsg {
    /// Opens the worker's connection: it listens for its peers at `addr`. In a static job this
    /// is also its request to join the (only) round.
    Register {
        /// The id the launcher gave this worker (`HVD_WORKER_ID`; the rank in a static job).
        worker: u64,
        /// `ip:port` of the worker's collective listener.
        addr: String,
        /// The host the worker runs on, as the launcher named it.
        host: String,
        /// The worker's process id, for the driver's log.
        pid: u32,
        /// Set when the worker reconnects after losing its driver (jobs with a state store):
        /// the round it trains in. The driver that took over adopts it.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        resume: Option<u64>,
    },
    /// Asks to join the next rendezvous round (elastic jobs): after a collective failed, or
    /// after the driver announced a host change.
    Join {
        /// The worker's id.
        worker: u64,
        /// The last round this worker was part of.
        generation: u64,
        /// Why it asks, for the driver's log.
        reason: String,
    },
    /// The worker saw the driver's [`DriverMsg::Abort`] of round `generation`: it is alive
    /// (a stopped process cannot answer), and joins the next round at its next collective,
    /// which a long computation may delay.
    AbortSeen {
        /// The worker's id.
        worker: u64,
        /// The aborted round.
        generation: u64,
    },
    /// The worker completed the state sync of round `generation`: it holds the job's newest
    /// committed state. A worker whose host was drained while no other worker held that state
    /// is kept in the job until another member of its round says this.
    Synced {
        /// The worker's id.
        worker: u64,
        /// The round whose sync completed.
        generation: u64,
    },
    /// The answer to [`DriverMsg::Ping`], written by the worker's connection thread (not its
    /// training thread): the process is alive, however long its training step takes. A worker
    /// that answers nothing, not even this, for the driver's heartbeat timeout is frozen
    /// (stopped, a paused VM, stuck in the kernel) and is declared failed.
    Pong {
        /// The worker's id.
        worker: u64,
    },
    /// Rank 0's training progress since its process started, sent with its answer to a
    /// [`DriverMsg::Ping`]: the driver turns successive reports into the job's step and
    /// allreduce rates on its `/metrics`. Only rank 0 sends it; every rank trains in step.
    Progress {
        /// The worker's id.
        worker: u64,
        /// Training steps (commits of the elastic state).
        steps: u64,
        /// Allreduce calls.
        allreduces: u64,
        /// Bytes of the buffers allreduced.
        allreduce_bytes: u64,
        /// By rank, the thousandths of the time the median rank waits for it at the
        /// collectives (empty without the background engine, which measures it).
        #[serde(default)]
        lateness_permille: Vec<u32>,
    },
    /// The worker's host is going away (`source` says who said so): the driver takes the host
    /// out of the job gracefully, as if discovery had dropped it, without blacklisting it. The
    /// worker trains on until the round without it has formed.
    Notice {
        /// The worker's id.
        worker: u64,
        /// Who gave the notice.
        source: crate::NoticeSource,
        /// Milliseconds the host has left, as the notice says (`None`: it named no deadline).
        within_ms: Option<u64>,
    },
    /// The worker is leaving cleanly (`hvd::shutdown`).
    Goodbye {
        /// The worker's id.
        worker: u64,
    },
}

/// A worker's place in one round: the six numbers Horovod gives every process.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Placement {
    /// Global rank.
    pub rank: usize,
    /// Number of workers.
    pub size: usize,
    /// Rank among the workers on this host.
    pub local_rank: usize,
    /// Number of workers on this host.
    pub local_size: usize,
    /// Index of this host among the hosts that have a worker of this local rank.
    pub cross_rank: usize,
    /// Number of hosts that have a worker of this local rank.
    pub cross_size: usize,
}

impl Placement {
    /// The place of the only worker of a world of one.
    pub fn single() -> Self {
        Self {
            rank: 0,
            size: 1,
            local_rank: 0,
            local_size: 1,
            cross_rank: 0,
            cross_size: 1,
        }
    }
}

/// A host change the driver announces to every live worker.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostsUpdate {
    /// Increases by one with every announcement of the job; never reused.
    pub update_id: u64,
    /// Milliseconds since the Unix epoch when the driver saw the change.
    pub timestamp_ms: u64,
    /// Hosts (or slots) that joined.
    pub added: Vec<String>,
    /// Hosts (or slots) that left.
    pub removed: Vec<String>,
}

/// What the driver sends a worker.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum DriverMsg {
    /// The round is complete: this worker's place and where every rank listens.
    World {
        /// The rendezvous round; peers from other rounds refuse each other.
        generation: u64,
        /// This worker's ranks in the round.
        placement: Placement,
        /// `peers[r]` is rank `r`'s listener address.
        peers: Vec<String>,
        /// `hosts[r]` is rank `r`'s host.
        hosts: Vec<String>,
        /// The newest host update this round already accounts for; older announcements
        /// need no further round.
        updates_through: u64,
    },
    /// Hosts were added or removed; the worker joins the next round at its next check.
    HostsUpdated(HostsUpdate),
    /// The worker has no place in the job any more (its host left, or the job shrank); it
    /// leaves and exits 0.
    Removed {
        /// Why.
        reason: String,
    },
    /// Round `generation` lost a member: the worker cancels the round's collectives (a
    /// survivor may be waiting on a hung peer, never reading from the dead one's connection),
    /// answers [`WorkerMsg::AbortSeen`] at once, and joins the next round.
    Abort {
        /// The failed round.
        generation: u64,
        /// What failed, for the worker's log and error.
        reason: String,
    },
    /// Are you alive? Sent to every registered worker a few times per heartbeat timeout; its
    /// connection thread answers [`WorkerMsg::Pong`] at once.
    Ping,
    /// The registration was refused; the worker reports `reason` and fails.
    Refused {
        /// Why.
        reason: String,
    },
}

/// A line that is not a valid message.
#[derive(Debug, thiserror::Error)]
pub enum ProtocolError {
    /// Not JSON, or not a message of this protocol.
    #[error("malformed message: {0}")]
    Malformed(#[from] serde_json::Error),
    /// Longer than [`MAX_LINE`].
    #[error("message of {0} bytes exceeds the {MAX_LINE}-byte limit")]
    TooLong(usize),
    /// The handshake failed, or a sealed line's tag did not check out.
    #[error(transparent)]
    Auth(#[from] hvd_auth::AuthError),
    /// A line without its tag on a connection whose lines are sealed.
    #[error("an unsealed line on an authenticated connection")]
    Unsealed,
    /// The other side refused the connection.
    #[error("refused: {0}")]
    Refused(String),
    /// A well-formed line out of its place in the handshake.
    #[error("unexpected message: expected {0}")]
    Unexpected(&'static str),
}

/// Encodes one message as a JSON line (with the trailing newline).
pub fn encode_line<T: Serialize>(msg: &T) -> Result<Vec<u8>, ProtocolError> {
    let mut v = serde_json::to_vec(msg)?;
    v.push(b'\n');
    Ok(v)
}

/// Decodes one line (with or without its newline).
pub fn decode_line<'a, T: Deserialize<'a>>(line: &'a [u8]) -> Result<T, ProtocolError> {
    if line.len() > MAX_LINE {
        return Err(ProtocolError::TooLong(line.len()));
    }
    Ok(serde_json::from_slice(line.trim_ascii_end())?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip() {
        let m = WorkerMsg::Register {
            worker: 3,
            addr: "127.0.0.3:5000".into(),
            host: "127.0.0.3".into(),
            pid: 42,
            resume: None,
        };
        let line = encode_line(&m).unwrap();
        assert!(line.ends_with(b"\n"));
        assert_eq!(decode_line::<WorkerMsg>(&line).unwrap(), m);
        let w = DriverMsg::World {
            generation: 1,
            placement: Placement::single(),
            peers: vec!["a:1".into()],
            hosts: vec!["a".into()],
            updates_through: 0,
        };
        assert_eq!(
            decode_line::<DriverMsg>(&encode_line(&w).unwrap()).unwrap(),
            w
        );
        let a = DriverMsg::Abort {
            generation: 4,
            reason: "worker 2 on 127.0.0.3 was killed by signal 9 (SIGKILL)".into(),
        };
        let line = encode_line(&a).unwrap();
        assert!(
            line.starts_with(br#"{"type":"abort","generation":4,"#),
            "{line:?}"
        );
        assert_eq!(decode_line::<DriverMsg>(&line).unwrap(), a);
        let seen = WorkerMsg::AbortSeen {
            worker: 2,
            generation: 4,
        };
        let line = encode_line(&seen).unwrap();
        assert_eq!(decode_line::<WorkerMsg>(&line).unwrap(), seen);
        let synced = WorkerMsg::Synced {
            worker: 2,
            generation: 5,
        };
        let line = encode_line(&synced).unwrap();
        assert!(line.starts_with(br#"{"type":"synced","#), "{line:?}");
        assert_eq!(decode_line::<WorkerMsg>(&line).unwrap(), synced);
        let ping = encode_line(&DriverMsg::Ping).unwrap();
        assert_eq!(ping, b"{\"type\":\"ping\"}\n");
        assert_eq!(decode_line::<DriverMsg>(&ping).unwrap(), DriverMsg::Ping);
        let pong = WorkerMsg::Pong { worker: 7 };
        let line = encode_line(&pong).unwrap();
        assert_eq!(line, b"{\"type\":\"pong\",\"worker\":7}\n");
        assert_eq!(decode_line::<WorkerMsg>(&line).unwrap(), pong);
        assert!(decode_line::<WorkerMsg>(br#"{"type":"pong"}"#).is_err());
        let progress = WorkerMsg::Progress {
            worker: 0,
            steps: 12,
            allreduces: 40,
            allreduce_bytes: 1 << 20,
            lateness_permille: vec![0, 350],
        };
        let line = encode_line(&progress).unwrap();
        assert_eq!(
            line,
            b"{\"type\":\"progress\",\"worker\":0,\"steps\":12,\"allreduces\":40,\"allreduce_bytes\":1048576,\"lateness_permille\":[0,350]}\n"
        );
        assert_eq!(decode_line::<WorkerMsg>(&line).unwrap(), progress);
        // A report without the engine's lateness reads as none.
        let bare =
            br#"{"type":"progress","worker":0,"steps":1,"allreduces":0,"allreduce_bytes":0}"#;
        assert!(matches!(
            decode_line::<WorkerMsg>(bare),
            Ok(WorkerMsg::Progress { lateness_permille, .. }) if lateness_permille.is_empty()
        ));
        // The secret never travels in a message.
        assert!(decode_line::<WorkerMsg>(br#"{"type":"pong","secret":"s","worker":7}"#).is_err());
    }

    #[test]
    fn rejects_unknown_and_oversized() {
        assert!(decode_line::<WorkerMsg>(br#"{"type":"register"}"#).is_err());
        assert!(decode_line::<WorkerMsg>(br#"{"type":"exec","cmd":"rm"}"#).is_err());
        assert!(decode_line::<WorkerMsg>(b"not json").is_err());
        let huge = vec![b' '; MAX_LINE + 1];
        assert!(matches!(
            decode_line::<WorkerMsg>(&huge),
            Err(ProtocolError::TooLong(_))
        ));
    }
}
