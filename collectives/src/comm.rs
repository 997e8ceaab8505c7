//! [`Communicator`]: the collectives over one mesh of TCP connections.

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::thread;
use std::time::Duration;

use crate::config::CommConfig;
use crate::connect;
use crate::error::{CommError, Result};
use crate::link::{AbortHandle, LinkFailure, Shared};
use crate::mailbox::{Mailbox, Remote};
use crate::topology::{Hierarchy, eager_peers, hierarchy_fits, host_groups};

/// One rank's end of a group of ranks, running collectives over TCP connections between
/// them (every pair in a small world; in a large one the pairs the rounds need, the others
/// on first use).
///
/// Build one per membership with [`Communicator::connect`]; when membership changes (or a
/// transport error breaks it), drop it and connect a new one: nothing is global, so a process
/// can rebuild its communicator as often as it needs to.
#[derive(Debug)]
pub struct Communicator {
    pub(crate) cfg: CommConfig,
    pub(crate) readers: Vec<Option<TcpStream>>,
    pub(crate) writers: Vec<Option<TcpStream>>,
    read_timeouts: Vec<Option<Duration>>,
    pub(crate) shared: Arc<Shared>,
    seq: u64,
    broken: Option<String>,
    pub(crate) txbuf: Vec<u8>,
    /// Every rank's process id, when all ranks share this host and may read each other.
    pub(crate) cma: Option<Vec<nix::unistd::Pid>>,
    /// The host and cross-host halves of this world, when allreduce runs hierarchically.
    pub(crate) hier: Option<Hierarchy>,
    /// Whether allreduce and allgather take the hierarchical path where `hier` exists
    /// (switched at run time by the engine's autotune, on every rank at the same cycle).
    pub(crate) hier_allreduce: bool,
    pub(crate) hier_allgather: bool,
    /// Whether some rank turned hierarchical allreduce, allgather off explicitly.
    pub(crate) hier_refused: (bool, bool),
    /// This rank's mailbox for small messages among ranks of one host.
    pub(crate) mailbox: Mailbox,
    /// Every rank's mailbox and the largest payload all of them hold, when the whole world
    /// shares this host.
    pub(crate) mail: Option<(Vec<Remote>, usize)>,
    /// The last call this rank posted in its mailbox.
    pub(crate) posted: Option<u64>,
    /// Ranks of the world running on this machine (they share its cores).
    pub(crate) machine_ranks: usize,
    /// Hosts the world spans (by address).
    hosts: usize,
    /// The cores this machine's ranks share, agreed by all of them (so that every rank plans
    /// the same crowded-host layout).
    pub(crate) cores: usize,
    /// Driven by a background thread beside the program's own (the engine's): waits give
    /// way at once (yield, then sleep) instead of spinning on a core the program computes on.
    pub(crate) background: bool,
    /// Further connections to each peer, over which the ring stripes its segments.
    pub(crate) extra: Vec<Vec<TcpStream>>,
    /// The same-host reduce's staging memory, kept between calls so that a call neither
    /// allocates it nor faults it in again (8-byte words: aligned for every element type).
    pub(crate) staging: Vec<u64>,
    /// This rank's listener for the pairs that connect on first use, in a world larger than
    /// [`CommConfig::direct_open_max`].
    pub(crate) later: Option<crate::lazy::Later>,
    /// Adasum's working buffers (two `Vec`s of the last element type it combined), kept
    /// between calls for the same reason.
    pub(crate) adasum: Option<Box<dyn std::any::Any + Send>>,
}

impl Drop for Communicator {
    /// Waits (up to the progress timeout) until every peer has read this rank's last mailbox
    /// post, so that a rank leaving right after a call does not take its post away from a
    /// slower peer. A peer that is gone, or a broken communicator, ends the wait.
    fn drop(&mut self) {
        let (Some(seq), Some((remotes, _)), Some(pids)) =
            (self.posted, self.mail.as_ref(), self.cma.as_ref())
        else {
            return;
        };
        if self.broken.is_some() || self.shared.abort_reason().is_some() {
            return;
        }
        let deadline = std::time::Instant::now() + self.cfg.progress_timeout;
        for p in (0..self.size()).filter(|&p| p != self.rank()) {
            while let Ok(false) = crate::mailbox::peer_finished(&pids[p], &remotes[p], seq) {
                if std::time::Instant::now() >= deadline || self.closed_peer(&[p]).is_some() {
                    break;
                }
                thread::sleep(Duration::from_micros(50));
            }
        }
    }
}

/// How long a read may wait: for peers to arrive, or for data from peers already there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Phase {
    Arrival,
    Data,
}

impl Communicator {
    /// A world of one: every collective returns at once with this rank's data.
    pub fn single() -> Self {
        Self::from_streams(
            CommConfig::new(0, 1, ""),
            vec![None],
            Arc::new(Shared::default()),
        )
    }

    /// Connects rank `cfg.rank` to every peer: `peers[j]` is where rank `j` listens, and
    /// `listener` is this rank's own listener (bound before the addresses were exchanged).
    ///
    /// # Errors
    /// [`CommError::InvalidArgument`] for a bad config, [`CommError::Connect`] when a peer cannot
    /// be reached or refuses the handshake within `cfg.connect_timeout`.
    pub fn connect(cfg: CommConfig, listener: &TcpListener, peers: &[SocketAddr]) -> Result<Self> {
        Self::connect_abortable(cfg, listener, peers, &AbortHandle::new())
    }

    /// [`Communicator::connect`] that `abort` can cancel while it connects, and that becomes
    /// the communicator's own abort handle once connected (what
    /// [`Communicator::abort_handle`] returns). Elastic workers make the handle first and hand
    /// it to whoever learns that the round failed, so a peer's death while the mesh forms
    /// ends the connecting at once instead of after `cfg.connect_timeout`.
    ///
    /// A peer that dies while the mesh forms fails it as soon as its connection closes; this
    /// rank then shuts its own connections down, so the ranks waiting on it fail as fast.
    ///
    /// # Errors
    /// As [`Communicator::connect`]; [`CommError::Aborted`] once `abort` is aborted (before or
    /// during the call); [`CommError::PeerLost`] or [`CommError::Io`] when a peer's connection
    /// closes before the communicator is built.
    pub fn connect_abortable(
        cfg: CommConfig,
        listener: &TcpListener,
        peers: &[SocketAddr],
        abort: &AbortHandle,
    ) -> Result<Self> {
        let shared = &abort.shared;
        let built = Self::connect_with(cfg, listener, peers, shared);
        if built.is_err() {
            // Peers blocked on this rank's sockets learn at once that the mesh will not form.
            shared.trip();
        }
        match (built, shared.abort_reason()) {
            (Err(e), None) => Err(e),
            (_, Some(reason)) => Err(CommError::Aborted { reason }),
            (Ok(comm), None) => Ok(comm),
        }
    }

    fn connect_with(
        cfg: CommConfig,
        listener: &TcpListener,
        peers: &[SocketAddr],
        shared: &Arc<Shared>,
    ) -> Result<Self> {
        cfg.validate()
            .map_err(|detail| CommError::InvalidArgument {
                op: "connect",
                detail,
            })?;
        if peers.len() != cfg.size {
            return Err(CommError::InvalidArgument {
                op: "connect",
                detail: format!("{} peer addresses for a world of {}", peers.len(), cfg.size),
            });
        }
        let started = std::time::Instant::now();
        let host_of = host_groups(peers);
        let eager = eager_peers(cfg.rank, &host_of, cfg.direct_open_max);
        let lazy = cfg.size > cfg.direct_open_max.max(1);
        let connect::Mesh {
            primary: streams,
            extra,
        } = connect::mesh(&cfg, listener, peers, &eager, shared)?;
        let meshed = started.elapsed();
        let mailbox = Mailbox::new(cfg.small_bytes);
        let forced = cfg.hierarchical == Some(true) || cfg.hierarchical_allgather == Some(true);
        let wishes = u8::from(cfg.hierarchical != Some(false))
            | (u8::from(cfg.hierarchical_allgather == Some(true)) << 1)
            | (u8::from(cfg.hierarchical_allgather != Some(false)) << 2);
        // The communicator registers its own duplicates of the sockets (an abort from here on
        // reaches them through those).
        shared.forget_streams();
        let mut comm = Self::from_streams(cfg, streams, Arc::clone(shared));
        comm.set_extra(extra)?;
        // The agreement on same-host transfers travels as the calls' openings do (in rounds in
        // a large world), waiting no longer than the connecting may.
        let arrival = comm.cfg.arrival_timeout;
        comm.cfg.arrival_timeout = arrival.min(comm.cfg.connect_timeout);
        // In a large world the listener for later pairs is bound now; its port travels with
        // the agreement's record.
        let later = if lazy {
            Some(crate::lazy::bind_beside(listener, comm.size()).map_err(|e| comm.fail(e))?)
        } else {
            None
        };
        let port = later.as_ref().map(|(_, port)| port.to_le_bytes());
        let own = crate::cma::Offer {
            enabled: comm.cfg.same_host_copy,
            hierarchical: wishes,
            mailbox: &mailbox,
            cores: crate::cma::CoreOffer::own(comm.cfg.cores),
            rider: port.as_ref().map_or(&[][..], |p| &p[..]),
        };
        let fits = hierarchy_fits(&host_of);
        let agreed = crate::cma::negotiate(comm.rank(), &host_of, fits, &own, |item| {
            comm.gather_small(item)
        })
        .map_err(|e| comm.fail(e))?;
        if let Some((own, _)) = later {
            let later = crate::lazy::Later::new(own, peers, &agreed.riders);
            comm.later = Some(later.map_err(|e| comm.fail(e))?);
        }
        comm.cfg.arrival_timeout = arrival;
        comm.cma = agreed.world.then(|| agreed.pids.clone());
        comm.mailbox = mailbox;
        comm.machine_ranks = agreed.machine_ranks;
        comm.hosts = host_of.iter().max().map_or(1, |&h| h + 1);
        comm.cores = agreed.cores;
        if agreed.world {
            let limit = agreed
                .mailboxes
                .iter()
                .map(|m| m.capacity)
                .min()
                .unwrap_or(0);
            comm.mail = Some((agreed.mailboxes.clone(), limit));
        }
        comm.split_hosts(&host_of, &agreed, forced)?;
        tracing::debug!(
            rank = comm.rank(),
            size = comm.size(),
            same_host_copy = comm.cma.is_some(),
            hierarchical = comm.hier.is_some(),
            peers = comm.connected_peers(),
            ?meshed,
            agreed = ?started.elapsed().saturating_sub(meshed),
            "communicator connected"
        );
        Ok(comm)
    }

    /// Takes the further connections to each peer; a failure closes them with the rest.
    fn set_extra(&mut self, extra: Vec<Vec<TcpStream>>) -> Result<()> {
        for s in extra.iter().flatten() {
            self.shared.register(s).map_err(|source| CommError::Io {
                context: "registering a connection".into(),
                source,
            })?;
        }
        self.extra = extra;
        Ok(())
    }

    /// Forgets which read timeouts are set: another communicator over the same sockets may
    /// have changed them.
    pub(crate) fn forget_timeouts(&mut self) {
        self.read_timeouts.iter_mut().for_each(|t| *t = None);
    }

    pub(crate) fn from_streams(
        cfg: CommConfig,
        streams: Vec<Option<TcpStream>>,
        shared: Arc<Shared>,
    ) -> Self {
        let mut readers = Vec::with_capacity(streams.len());
        let mut writers = Vec::with_capacity(streams.len());
        let mut broken = None;
        for s in streams {
            let pair = s.map(|s| -> std::io::Result<_> {
                shared.register(&s)?;
                let w = s.try_clone()?;
                Ok((s, w))
            });
            match pair {
                Some(Ok((r, w))) => {
                    readers.push(Some(r));
                    writers.push(Some(w));
                }
                Some(Err(e)) => {
                    broken = Some(format!("could not duplicate a socket: {e}"));
                    readers.push(None);
                    writers.push(None);
                }
                None => {
                    readers.push(None);
                    writers.push(None);
                }
            }
        }
        let n = readers.len();
        Self {
            cfg,
            readers,
            writers,
            read_timeouts: vec![None; n],
            shared,
            seq: 0,
            broken,
            txbuf: Vec::new(),
            cma: None,
            hier: None,
            hier_allreduce: false,
            hier_allgather: false,
            hier_refused: (false, false),
            mailbox: Mailbox::new(0),
            mail: None,
            posted: None,
            machine_ranks: 1,
            hosts: 1,
            cores: crate::cma::cores(),
            background: false,
            extra: (0..n).map(|_| Vec::new()).collect(),
            staging: Vec::new(),
            later: None,
            adasum: None,
        }
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.cfg.rank
    }

    /// Number of ranks.
    pub fn size(&self) -> usize {
        self.cfg.size
    }

    /// Whether allreduce runs hierarchically: on each host, then across hosts, then on each
    /// host again (see [`crate::CommConfig::hierarchical`]).
    pub fn is_hierarchical(&self) -> bool {
        self.hier.is_some() && self.hier_allreduce
    }

    /// Whether allgather runs hierarchically: gathered on each host, across hosts among the
    /// hosts' first ranks, then broadcast on each host (see
    /// [`crate::CommConfig::hierarchical_allgather`]).
    pub fn is_hierarchical_allgather(&self) -> bool {
        self.hier.is_some() && self.hier_allgather
    }

    /// Whether the hosts allow the hierarchical paths at all (several hosts, the same number
    /// of ranks on each, more than one per host, and no rank refused both).
    pub fn can_run_hierarchically(&self) -> bool {
        self.hier.is_some()
    }

    /// Whether some rank turned hierarchical allreduce and allgather (in that order) off
    /// explicitly: autotune holds such a knob off, as every rank's wish is needed to turn it on.
    pub fn hierarchy_refused(&self) -> (bool, bool) {
        self.hier_refused
    }

    /// How many peers this rank holds a connection to: every one in a small world; in a
    /// large one those the rounds need, and the others once a call needed them.
    pub fn connected_peers(&self) -> usize {
        self.readers.iter().flatten().count()
    }

    /// Number of hosts (distinct addresses) the world spans.
    pub fn hosts(&self) -> usize {
        self.hosts
    }

    /// Switches hierarchical allreduce and allgather on or off where the hosts allow them
    /// (a no-op where they do not). Every rank must switch at the same point of its sequence
    /// of collectives, as the engine's autotune does.
    pub fn set_hierarchical(&mut self, allreduce: bool, allgather: bool) {
        self.hier_allreduce = allreduce;
        self.hier_allgather = allgather;
    }

    /// A handle that aborts this communicator from another thread.
    pub fn abort_handle(&self) -> AbortHandle {
        AbortHandle {
            shared: Arc::clone(&self.shared),
        }
    }

    /// Why this communicator can no longer be used, if it can't.
    pub fn broken_reason(&self) -> Option<&str> {
        self.broken.as_deref()
    }

    /// Marks this communicator (and its host and cross-host parts) as driven by a background
    /// thread, whose waits must not spin on the program's cores, or not.
    pub(crate) fn set_background(&mut self, on: bool) {
        self.background = on;
        if let Some(h) = self.hier.as_mut() {
            h.local.set_background(on);
            h.cross.set_background(on);
        }
    }

    /// Whether more ranks of the world run on this machine than it has cores.
    pub(crate) fn crowded(&self) -> bool {
        self.size().max(self.machine_ranks) > self.cores
    }

    /// The cores this machine's ranks share (the same number on each of them).
    pub(crate) fn shared_cores(&self) -> usize {
        self.cores
    }

    /// How many calls this communicator has started.
    pub(crate) fn calls(&self) -> u64 {
        self.seq
    }

    /// Starts a collective: refuses on a broken communicator, returns the call's number.
    pub(crate) fn begin(&mut self) -> Result<u64> {
        if let Some(reason) = self.shared.abort_reason() {
            return Err(CommError::Aborted { reason });
        }
        if let Some(cause) = &self.broken {
            return Err(CommError::Broken {
                cause: cause.clone(),
            });
        }
        let seq = self.seq;
        self.seq += 1;
        Ok(seq)
    }

    /// Records a fatal error so that every later call reports it, and closes the sockets so
    /// that peers blocked on this rank fail too.
    pub(crate) fn fail(&mut self, e: CommError) -> CommError {
        if e.is_fatal() && self.broken.is_none() {
            self.broken = Some(e.to_string());
            self.shared.trip();
        }
        e
    }

    pub(crate) fn link_error(
        &mut self,
        f: LinkFailure,
        op: &'static str,
        phase: Phase,
    ) -> CommError {
        let waited = self.timeout_for(phase);
        let e = f.into_error(&self.shared, op, waited);
        self.fail(e)
    }

    fn timeout_for(&self, phase: Phase) -> Duration {
        match phase {
            Phase::Arrival => self.cfg.arrival_timeout,
            Phase::Data => self.cfg.progress_timeout,
        }
    }

    /// Sets the read timeout of every peer socket for the coming phase (only where it changes).
    pub(crate) fn set_phase(&mut self, phase: Phase) -> std::result::Result<(), LinkFailure> {
        let t = Some(self.timeout_for(phase));
        for (j, r) in self.readers.iter().enumerate() {
            if let Some(s) = r
                && self.read_timeouts[j] != t
            {
                s.set_read_timeout(t)
                    .map_err(|e| LinkFailure::new(&self.shared, j, e))?;
                s.set_write_timeout(Some(self.cfg.progress_timeout))
                    .map_err(|e| LinkFailure::new(&self.shared, j, e))?;
                self.read_timeouts[j] = t;
            }
        }
        Ok(())
    }

    /// Whether a buffer of `bytes` takes the latency-optimal path.
    pub(crate) fn is_small(&self, bytes: usize) -> bool {
        bytes <= self.cfg.small_bytes
    }

    pub(crate) fn segment_elems<T>(&self) -> usize {
        (self.cfg.segment_bytes / size_of::<T>()).max(1)
    }
}
