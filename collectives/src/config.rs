//! Settings of one communicator.

use std::time::Duration;

/// Most TCP connections per peer ([`CommConfig::streams`]).
pub const MAX_STREAMS: usize = 15;

/// How a [`crate::Communicator`] connects and how long it waits.
#[derive(Debug, Clone)]
pub struct CommConfig {
    /// This process's rank, `0..size`.
    pub rank: usize,
    /// Number of ranks.
    pub size: usize,
    /// The job's secret: a connecting peer must present it.
    pub token: String,
    /// The rendezvous round this communicator belongs to; a peer from another round is refused.
    pub generation: u64,
    /// How long a collective waits for a peer to arrive at it (ranks may be imbalanced).
    pub arrival_timeout: Duration,
    /// How long a collective that every rank has entered may go without a byte from a peer
    /// before that peer is declared hung.
    pub progress_timeout: Duration,
    /// How long building the mesh may take.
    pub connect_timeout: Duration,
    /// Pipeline segment size of the ring algorithms.
    pub segment_bytes: usize,
    /// Buffers up to this size take the latency-optimal path: one message to every peer.
    pub small_bytes: usize,
    /// Worlds up to this many ranks open every call with one message from every rank to every
    /// other (one hop, n − 1 messages a rank); larger ones in ⌈log2 n⌉ rounds of one message
    /// (Bruck's allgather), so a call's opening grows with the log of the world, not with it.
    /// Calls that send each peer something else (alltoall) always open directly. Up to this
    /// many ranks every pair of ranks connects while the world forms; beyond, only the pairs
    /// the rounds need, and the others on first use. Every rank must use the same number.
    pub direct_open_max: usize,
    /// Whether ranks that all run on one host read each other's buffers directly
    /// (cross-memory attach) instead of sending them over TCP. Every rank must allow it.
    pub same_host_copy: bool,
    /// Hierarchical allreduce when the ranks span several hosts: `None` uses it where it
    /// applies (several hosts, the same number of ranks on each, more than one per host),
    /// `Some(true)` asks for it (logged when it cannot apply), `Some(false)` never uses it.
    /// Ranks listening on one address form one host. Every rank must want it.
    pub hierarchical: Option<bool>,
    /// Hierarchical allgather (gather on each host, allgather across hosts, broadcast on each
    /// host) where the hosts allow it, as for [`CommConfig::hierarchical`], but off unless every
    /// rank asks for it with `Some(true)` (Horovod's default: for small rows the three steps
    /// cost more than the flat ring). Autotune may switch it on where it is not `Some(false)`.
    pub hierarchical_allgather: Option<bool>,
    /// TCP connections to each peer (1 to 15); with more than one, the ring's segments are
    /// striped over all of them, which pays where one stream cannot fill a link (a long, fat
    /// network). Every rank must use the same number.
    pub streams: usize,
    /// Cores this rank may use at once, if not what its CPU affinity and quota allow. The ranks
    /// of one machine agree on the cores they share from every rank's mask and count; with more
    /// ranks than cores, same-host waits sleep instead of spinning, and only one rank per core
    /// reduces a large allreduce.
    pub cores: Option<usize>,
}

impl CommConfig {
    /// Defaults for everything but the identity of this rank.
    pub fn new(rank: usize, size: usize, token: impl Into<String>) -> Self {
        Self {
            rank,
            size,
            token: token.into(),
            generation: 0,
            arrival_timeout: Duration::from_secs(300),
            progress_timeout: Duration::from_secs(5),
            connect_timeout: Duration::from_secs(30),
            segment_bytes: 1024 * 1024,
            small_bytes: 32 * 1024,
            direct_open_max: 8,
            same_host_copy: true,
            hierarchical: None,
            hierarchical_allgather: None,
            streams: 1,
            cores: None,
        }
    }

    /// Checks the settings before any socket is touched.
    ///
    /// # Errors
    /// A message naming the bad setting.
    pub fn validate(&self) -> Result<(), String> {
        if self.size == 0 {
            return Err("size must be at least 1".into());
        }
        if self.rank >= self.size {
            return Err(format!(
                "rank {} is out of range for size {}",
                self.rank, self.size
            ));
        }
        for (name, d) in [
            ("arrival_timeout", self.arrival_timeout),
            ("progress_timeout", self.progress_timeout),
            ("connect_timeout", self.connect_timeout),
        ] {
            if d.is_zero() {
                return Err(format!("{name} must be positive"));
            }
        }
        if !(1..=MAX_STREAMS).contains(&self.streams) {
            return Err(format!(
                "streams must be 1 to {MAX_STREAMS}, not {}",
                self.streams
            ));
        }
        if self.cores == Some(0) {
            return Err("cores must be at least 1".into());
        }
        if self.segment_bytes < 4096 {
            return Err(format!(
                "segment_bytes {} is below 4096",
                self.segment_bytes
            ));
        }
        // The latency path writes to every peer before reading: it must fit in socket buffers.
        if self.small_bytes > 64 * 1024 {
            return Err(format!("small_bytes {} is above 65536", self.small_bytes));
        }
        Ok(())
    }
}
