//! [`Communicator`]: the collectives over one mesh of TCP connections.

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::thread;
use std::time::Duration;

use crate::config::CommConfig;
use crate::connect;
use crate::dtype::{Element, ReduceOp};
use crate::error::{CommError, Result};
use crate::link::{AbortHandle, LinkFailure, Shared, discard, read_full, write_full};
use crate::mailbox::{Mailbox, Remote};
use crate::pipeline::{self, Mode, Recv};
use crate::wire::{DESCRIPTOR_LEN, Descriptor, Kind};

/// One rank's end of a group of ranks connected all-to-all, running collectives.
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
    txbuf: Vec<u8>,
    /// Every rank's process id, when all ranks share this host and may read each other.
    pub(crate) cma: Option<Vec<nix::unistd::Pid>>,
    /// The host and cross-host halves of this world, when allreduce runs hierarchically.
    pub(crate) hier: Option<Hierarchy>,
    /// Whether allreduce and allgather take the hierarchical path where `hier` exists
    /// (switched at run time by the engine's autotune, on every rank at the same cycle).
    pub(crate) hier_allreduce: bool,
    pub(crate) hier_allgather: bool,
    /// Whether some rank turned hierarchical allreduce, allgather off explicitly.
    hier_refused: (bool, bool),
    /// This rank's mailbox for small messages among ranks of one host.
    mailbox: Mailbox,
    /// Every rank's mailbox and the largest payload all of them hold, when the whole world
    /// shares this host.
    mail: Option<(Vec<Remote>, usize)>,
    /// The last call this rank posted in its mailbox.
    posted: Option<u64>,
    /// Ranks of the world running on this machine (they share its cores).
    machine_ranks: usize,
    /// Hosts the world spans (by address).
    hosts: usize,
    /// The cores this machine's ranks share, agreed by all of them (so that every rank plans
    /// the same crowded-host layout).
    cores: usize,
    /// Driven by a background thread beside the program's own (the engine's): waits give
    /// way at once (yield, then sleep) instead of spinning on a core the program computes on.
    background: bool,
    /// Further connections to each peer, over which the ring stripes its segments.
    extra: Vec<Vec<TcpStream>>,
    /// The same-host reduce's staging memory, kept between calls so that a call neither
    /// allocates it nor faults it in again (8-byte words: aligned for every element type).
    pub(crate) staging: Vec<u64>,
    /// Adasum's working buffers (two `Vec`s of the last element type it combined), kept
    /// between calls for the same reason.
    pub(crate) adasum: Option<Box<dyn std::any::Any + Send>>,
}

/// The two communicators of a hierarchical allreduce, over the world's own sockets: the ranks
/// of this host (reading each other's memory), and the ranks holding this rank's local index
/// on every host (over TCP). They run only inside a world collective, so their messages never
/// interleave with the world's.
#[derive(Debug)]
pub(crate) struct Hierarchy {
    pub(crate) local: Box<Communicator>,
    pub(crate) cross: Box<Communicator>,
    /// Every host's ranks, hosts in the cross communicators' order, ranks ascending.
    pub(crate) groups: Vec<Vec<usize>>,
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

/// Each rank's host group: ranks listening on one address share a host. Groups are numbered
/// in order of their lowest rank.
fn host_groups(peers: &[SocketAddr]) -> Vec<usize> {
    let mut seen: Vec<std::net::IpAddr> = Vec::new();
    peers
        .iter()
        .map(|p| {
            seen.iter().position(|&ip| ip == p.ip()).unwrap_or_else(|| {
                seen.push(p.ip());
                seen.len() - 1
            })
        })
        .collect()
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
        let connect::Mesh {
            primary: mut streams,
            extra,
        } = connect::mesh(&cfg, listener, peers, shared)?;
        let host_of = host_groups(peers);
        let mailbox = Mailbox::new(cfg.small_bytes);
        let agreed = crate::cma::negotiate(
            cfg.rank,
            &mut streams,
            &host_of,
            cfg.same_host_copy,
            u8::from(cfg.hierarchical != Some(false))
                | (u8::from(cfg.hierarchical_allgather == Some(true)) << 1)
                | (u8::from(cfg.hierarchical_allgather != Some(false)) << 2),
            &mailbox,
            crate::cma::CoreOffer::own(cfg.cores),
        )
        .map_err(|source| CommError::Io {
            context: "agreeing on same-host transfers".into(),
            source,
        })?;
        let forced = cfg.hierarchical == Some(true) || cfg.hierarchical_allgather == Some(true);
        // The communicator registers its own duplicates of the sockets (an abort from here on
        // reaches them through those).
        shared.forget_streams();
        let mut comm = Self::from_streams(cfg, streams, Arc::clone(shared));
        comm.set_extra(extra)?;
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
            "communicator connected"
        );
        Ok(comm)
    }

    /// Sets up hierarchical allreduce when the world spans hosts with the same number (more
    /// than one) of ranks each, every host group could agree on same-host reads, and every rank
    /// wants it. The decision depends only on what every rank agreed, so all make the same one.
    fn split_hosts(
        &mut self,
        host_of: &[usize],
        agreed: &crate::cma::Agreement,
        forced: bool,
    ) -> Result<()> {
        let hosts = host_of.iter().max().map_or(0, |&h| h + 1);
        if hosts < 2 {
            return Ok(());
        }
        let groups: Vec<Vec<usize>> = (0..hosts)
            .map(|h| (0..host_of.len()).filter(|&r| host_of[r] == h).collect())
            .collect();
        let per_host = groups[0].len();
        let why_not = if groups.iter().any(|g| g.len() != per_host) {
            Some("hosts run different numbers of ranks")
        } else if per_host < 2 {
            Some("every host runs one rank")
        } else if agreed.hierarchical & 3 == 0 {
            Some("not every host could read its ranks' memory, or a rank disabled it")
        } else {
            None
        };
        if let Some(reason) = why_not {
            if forced {
                tracing::warn!(
                    reason,
                    "hierarchical allreduce or allgather was asked for but cannot apply"
                );
            }
            return Ok(());
        }
        let me = self.rank();
        let local_members = &groups[host_of[me]];
        let index = local_members.iter().position(|&r| r == me).unwrap_or(0);
        let cross_members: Vec<usize> = groups.iter().map(|g| g[index]).collect();
        let pids = local_members.iter().map(|&r| agreed.pids[r]).collect();
        let mut local = self.sub(local_members, Some(pids))?;
        local.share_mailboxes().map_err(|source| CommError::Io {
            context: "exchanging mailboxes with the ranks of this host".into(),
            source,
        })?;
        let cross = self.sub(&cross_members, None)?;
        self.hier = Some(Hierarchy {
            local: Box::new(local),
            cross: Box::new(cross),
            groups,
        });
        // What every rank wants: one rank's 0 makes allreduce flat everywhere; allgather is
        // hierarchical only where every rank asked for it (Horovod's default is flat).
        self.hier_allreduce = agreed.hierarchical & 1 != 0;
        self.hier_allgather = agreed.hierarchical & 2 != 0;
        // A rank's explicit 0 holds the knob off for autotune too.
        self.hier_refused = (agreed.hierarchical & 1 == 0, agreed.hierarchical & 4 == 0);
        Ok(())
    }

    /// A communicator among `members` (world ranks, ascending position = new rank) over
    /// duplicates of this one's sockets, failing together with it.
    fn sub(&self, members: &[usize], cma: Option<Vec<nix::unistd::Pid>>) -> Result<Self> {
        let mut cfg = self.cfg.clone();
        cfg.rank = members.iter().position(|&r| r == self.rank()).unwrap_or(0);
        cfg.size = members.len();
        cfg.hierarchical = Some(false);
        cfg.hierarchical_allgather = Some(false);
        let mut streams = Vec::with_capacity(members.len());
        for &m in members {
            let s = match self.readers[m].as_ref() {
                Some(s) if m != self.rank() => {
                    Some(s.try_clone().map_err(|source| CommError::Io {
                        context: "duplicating a socket for hierarchical allreduce".into(),
                        source,
                    })?)
                }
                _ => None,
            };
            streams.push(s);
        }
        let dup = |s: &TcpStream| {
            s.try_clone().map_err(|source| CommError::Io {
                context: "duplicating a socket for hierarchical allreduce".into(),
                source,
            })
        };
        let mut extra = Vec::with_capacity(members.len());
        for &m in members {
            extra.push(self.extra[m].iter().map(dup).collect::<Result<Vec<_>>>()?);
        }
        let mut c = Self::from_streams(cfg, streams, Arc::clone(&self.shared));
        c.extra = extra;
        c.cma = cma;
        c.machine_ranks = self.machine_ranks;
        c.cores = self.cores;
        c.background = self.background;
        Ok(c)
    }

    /// Gives this (host) communicator a mailbox and learns its peers': every member sends
    /// where its mailbox is to every other, then reads theirs. Members do this at the same
    /// point of building the world, so nothing else is on these sockets meanwhile.
    fn share_mailboxes(&mut self) -> std::io::Result<()> {
        use std::io::{Read, Write};
        let mailbox = Mailbox::new(self.cfg.small_bytes);
        let own = mailbox.remote();
        for w in self.writers.iter_mut().flatten() {
            w.set_write_timeout(Some(self.cfg.connect_timeout))?;
            w.write_all(&own.encode())?;
        }
        let mut remotes = vec![own; self.size()];
        for (j, r) in self.readers.iter_mut().enumerate() {
            let Some(r) = r else { continue };
            r.set_read_timeout(Some(self.cfg.connect_timeout))?;
            let mut theirs = [0u8; Remote::RECORD];
            r.read_exact(&mut theirs)?;
            remotes[j] = Remote::decode(&theirs);
        }
        self.forget_timeouts();
        let limit = remotes.iter().map(|m| m.capacity).min().unwrap_or(0);
        self.mailbox = mailbox;
        self.mail = Some((remotes, limit));
        Ok(())
    }

    /// Fails call `kind` on every peer: this rank's part of it already failed (on its host),
    /// so the peers get [`CommError::RemoteInvalid`] at their opening instead of waiting for
    /// data that will not come. Returns this rank's own [`CommError::InvalidArgument`].
    pub(crate) fn refuse(&mut self, kind: crate::wire::Kind, why: String) -> CommError {
        let seq = match self.begin() {
            Ok(seq) => seq,
            Err(e) => return e,
        };
        let d = Descriptor {
            invalid: true,
            ..Descriptor::bare(kind, seq)
        };
        match self.open(
            d,
            Err(why),
            |_| (d, &[][..]),
            |_, d, rd| discard(rd, d.payload_len),
        ) {
            Ok(_) => CommError::Broken {
                cause: "a refused call was accepted".into(),
            },
            Err(e) => e,
        }
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

    fn from_streams(cfg: CommConfig, streams: Vec<Option<TcpStream>>, shared: Arc<Shared>) -> Self {
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

    /// Whether more ranks of the world run on this machine than it has cores.
    /// Marks this communicator (and its host and cross-host parts) as driven by a background
    /// thread, whose waits must not spin on the program's cores, or not.
    pub(crate) fn set_background(&mut self, on: bool) {
        self.background = on;
        if let Some(h) = self.hier.as_mut() {
            h.local.set_background(on);
            h.cross.set_background(on);
        }
    }

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

    /// Waits until at least one of `peers` has something to read (or has closed); returns
    /// those that do. Past `deadline`, the first of them times out.
    fn wait_readable(
        &self,
        peers: &[usize],
        deadline: std::time::Instant,
    ) -> std::result::Result<Vec<usize>, (usize, std::io::Error)> {
        use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
        use std::os::fd::AsFd;
        loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                return Err((
                    peers[0],
                    std::io::Error::new(std::io::ErrorKind::TimedOut, "no descriptor arrived"),
                ));
            }
            let mut fds: Vec<PollFd<'_>> = peers
                .iter()
                .filter_map(|&p| self.readers[p].as_ref())
                .map(|s| PollFd::new(s.as_fd(), PollFlags::POLLIN))
                .collect();
            let ms = i32::try_from(left.as_millis().max(1)).unwrap_or(i32::MAX);
            match poll(
                &mut fds,
                PollTimeout::try_from(ms).unwrap_or(PollTimeout::MAX),
            ) {
                Ok(0) => continue,
                Ok(_) => {
                    return Ok(peers
                        .iter()
                        .zip(&fds)
                        .filter(|(_, f)| f.revents().is_some_and(|r| !r.is_empty()))
                        .map(|(&p, _)| p)
                        .collect());
                }
                Err(nix::errno::Errno::EINTR) => continue,
                Err(e) => return Err((peers[0], std::io::Error::from(e))),
            }
        }
    }

    /// The opening of every collective: sends `out(peer)` (a descriptor and an inline payload)
    /// to every peer and reads every peer's descriptor, handing inline payloads to `sink`, which
    /// must consume exactly `payload_len` bytes. Returns all descriptors by rank, after checking
    /// that they agree.
    ///
    /// `local` is this rank's own verdict on its arguments: an invalid call still takes part in
    /// the exchange (flagged), so every rank returns an error instead of waiting for it.
    pub(crate) fn open<'p>(
        &mut self,
        mine: Descriptor,
        local: std::result::Result<(), String>,
        out: impl Fn(usize) -> (Descriptor, &'p [u8]),
        sink: impl FnMut(usize, &Descriptor, &mut TcpStream) -> std::io::Result<()>,
    ) -> Result<Vec<Descriptor>> {
        if self.mail.is_some() {
            // On one host every call first agrees through the mailboxes, whatever path it
            // takes next, so ranks that disagree fail together instead of waiting on
            // different channels.
            let mut d = mine;
            d.payload_len = 0;
            let mut scratch = vec![Vec::new(); self.size()];
            self.open_mailbox(d, local.clone(), &[], &mut scratch)?;
        }
        self.open_sockets(mine, local, out, sink)
    }

    /// The socket half of [`Communicator::open`]: descriptors (and payloads) to and from every
    /// peer over TCP; waits block in `poll`.
    pub(crate) fn open_sockets<'p>(
        &mut self,
        mine: Descriptor,
        local: std::result::Result<(), String>,
        out: impl Fn(usize) -> (Descriptor, &'p [u8]),
        mut sink: impl FnMut(usize, &Descriptor, &mut TcpStream) -> std::io::Result<()>,
    ) -> Result<Vec<Descriptor>> {
        let op = mine.kind.name();
        let (n, r) = (self.size(), self.rank());
        let invalid = local.is_err();
        let flag = |mut d: Descriptor| {
            if invalid {
                d.invalid = true;
                d.payload_len = 0;
            }
            d
        };
        let sent = self.set_phase(Phase::Arrival).and_then(|()| {
            for k in 1..n {
                let p = (r + k) % n;
                let (d, payload) = out(p);
                let d = flag(d);
                self.txbuf.clear();
                self.txbuf.extend_from_slice(&d.encode());
                // Only what the descriptor announces goes on the wire.
                if d.payload_len > 0 {
                    debug_assert_eq!(d.payload_len, payload.len() as u64);
                    self.txbuf.extend_from_slice(payload);
                }
                if let Some(w) = self.writers[p].as_mut() {
                    write_full(w, &self.txbuf).map_err(|e| LinkFailure::new(&self.shared, p, e))?;
                }
            }
            Ok(())
        });
        if let Err(f) = sent {
            return Err(self.link_error(f, op, Phase::Arrival));
        }
        let mut descs = vec![flag(mine); n];
        // Read descriptors in the order peers send them: a dead peer is noticed at once even
        // while another peer is slow to arrive (or stopped), instead of behind it.
        let mut pending: Vec<usize> = (1..n)
            .map(|k| (r + n - k) % n)
            .filter(|&p| self.readers[p].is_some())
            .collect();
        let deadline = std::time::Instant::now() + self.cfg.arrival_timeout;
        while !pending.is_empty() {
            let ready = match self.wait_readable(&pending, deadline) {
                Ok(ready) => ready,
                Err((p, e)) => {
                    let f = LinkFailure::new(&self.shared, p, e);
                    return Err(self.link_error(f, op, Phase::Arrival));
                }
            };
            for p in ready {
                pending.retain(|&q| q != p);
                let Some(reader) = self.readers[p].as_mut() else {
                    continue;
                };
                let mut head = [0u8; DESCRIPTOR_LEN];
                if let Err(e) = read_full(reader, &mut head) {
                    let f = LinkFailure::new(&self.shared, p, e);
                    return Err(self.link_error(f, op, Phase::Arrival));
                }
                let d = match Descriptor::decode(&head) {
                    Ok(d) => d,
                    Err(detail) => return Err(self.fail(CommError::Protocol { rank: p, detail })),
                };
                if d.payload_len > 0
                    && let Err(e) = sink(p, &d, reader)
                {
                    let f = LinkFailure::new(&self.shared, p, e);
                    return Err(self.link_error(f, op, Phase::Arrival));
                }
                descs[p] = d;
            }
        }
        self.agree(op, local, descs)
    }

    /// The end of every opening: this rank's own verdict first, then a peer's, then whether
    /// every descriptor matches rank 0's.
    fn agree(
        &mut self,
        op: &'static str,
        local: std::result::Result<(), String>,
        descs: Vec<Descriptor>,
    ) -> Result<Vec<Descriptor>> {
        let n = descs.len();
        if let Err(detail) = local {
            return Err(CommError::InvalidArgument { op, detail });
        }
        if let Some(j) = descs.iter().position(|d| d.invalid) {
            return Err(CommError::RemoteInvalid { rank: j, op });
        }
        let joined: Vec<usize> = (0..n).filter(|&j| descs[j].kind == Kind::Join).collect();
        if !joined.is_empty() && joined.len() < n {
            return Err(CommError::Joined {
                seq: descs[0].seq,
                ranks: joined,
            });
        }
        for j in 1..n {
            if !descs[j].agrees_with(&descs[0]) {
                let mut desc_b = descs[j].to_string();
                if descs[j].seq != descs[0].seq {
                    desc_b = format!("{desc_b} as its call #{}", descs[j].seq);
                }
                return Err(CommError::Mismatch {
                    seq: descs[0].seq,
                    rank_a: 0,
                    desc_a: descs[0].to_string(),
                    rank_b: j,
                    desc_b,
                });
            }
        }
        Ok(descs)
    }

    /// Whether a call with `bytes` of payload goes through the mailboxes: the whole world
    /// shares this host and every rank's mailbox holds it. Every rank gives the same answer.
    pub(crate) fn fits_mailbox(&self, bytes: usize) -> bool {
        self.mail.as_ref().is_some_and(|(_, limit)| bytes <= *limit)
    }

    /// [`Communicator::open`] for small calls on one host: posts this rank's descriptor and
    /// payload in its mailbox and reads every peer's (payloads into `inbox`), with no socket
    /// in between. A waiting rank spins briefly only when there are cores to spare, then
    /// yields, then sleeps; the sockets still tell when a peer is gone.
    pub(crate) fn open_mailbox(
        &mut self,
        mine: Descriptor,
        local: std::result::Result<(), String>,
        payload: &[u8],
        inbox: &mut [Vec<u8>],
    ) -> Result<Vec<Descriptor>> {
        let op = mine.kind.name();
        let (n, r) = (self.size(), self.rank());
        let (Some((remotes, _)), Some(pids)) = (self.mail.clone(), self.cma.clone()) else {
            return Err(self.fail(CommError::Broken {
                cause: "same-host mailboxes are not set up".into(),
            }));
        };
        let mut d = mine;
        if local.is_err() {
            d.invalid = true;
            d.payload_len = 0;
        }
        let posted = if d.invalid { &[][..] } else { payload };
        self.mailbox.post(d.seq, &d.encode(), posted);
        self.posted = Some(d.seq);
        let mut descs = vec![d; n];
        let mut pending: Vec<usize> = (1..n).map(|k| (r + k) % n).collect();
        let started = std::time::Instant::now();
        // Ranks of other host groups may share this machine's cores too.
        let spin = !self.crowded() && !self.background;
        let mut rounds = 0u32;
        let mut checked = started;
        loop {
            let mut i = 0;
            while i < pending.len() {
                let p = pending[i];
                match crate::mailbox::peek(
                    &pids[p],
                    &remotes[p],
                    d.seq,
                    posted.len(),
                    &mut inbox[p],
                ) {
                    Ok(Some(head)) => {
                        descs[p] = match Descriptor::decode(&head) {
                            Ok(x) => x,
                            // A peer that failed closes its connection first and may free
                            // its mailbox after: what is read there then is no post.
                            Err(_) if self.closed_peer(&[p]).is_some() => {
                                let e = std::io::Error::new(
                                    std::io::ErrorKind::UnexpectedEof,
                                    "it closed its connection",
                                );
                                let f = LinkFailure::new(&self.shared, p, e);
                                return Err(self.link_error(f, op, Phase::Arrival));
                            }
                            Err(detail) => {
                                return Err(self.fail(CommError::Protocol { rank: p, detail }));
                            }
                        };
                        pending.swap_remove(i);
                    }
                    Ok(None) => i += 1,
                    Err(e) => {
                        let f = LinkFailure::new(&self.shared, p, e);
                        return Err(self.link_error(f, op, Phase::Arrival));
                    }
                }
            }
            if pending.is_empty() {
                self.mailbox.finish(d.seq);
                break;
            }
            rounds = rounds.wrapping_add(1);
            // A peer that died is looked for every 64 rounds of spinning, and at least every
            // quarter millisecond of waiting: a sleeping round may take a millisecond or more
            // on a loaded host, so counting rounds alone would notice a death tens of
            // milliseconds late.
            if rounds.is_multiple_of(64) || checked.elapsed() >= Duration::from_micros(250) {
                checked = std::time::Instant::now();
                let waited = started.elapsed();
                let gone = if self.shared.abort_reason().is_some() {
                    Some((pending[0], std::io::Error::other("aborted")))
                } else if let Some(p) = if waited < Duration::from_secs(1) {
                    self.closed_peer(&pending)
                } else {
                    // A long wait may be a chain of ranks waiting on one that is gone: any
                    // closed connection dooms the call.
                    let everyone: Vec<usize> = (0..n).filter(|&p| p != r).collect();
                    self.closed_peer(&everyone)
                } {
                    let e = std::io::Error::new(
                        std::io::ErrorKind::UnexpectedEof,
                        "it closed its connection",
                    );
                    Some((p, e))
                } else if waited >= self.cfg.arrival_timeout {
                    let e = std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        "it posted nothing in its mailbox",
                    );
                    Some((pending[0], e))
                } else {
                    None
                };
                if let Some((p, e)) = gone {
                    let f = LinkFailure::new(&self.shared, p, e);
                    return Err(self.link_error(f, op, Phase::Arrival));
                }
            }
            let waited = started.elapsed();
            if spin && waited < Duration::from_micros(200) {
                std::hint::spin_loop();
            } else if waited < Duration::from_millis(2) {
                thread::yield_now();
            } else {
                thread::sleep(Duration::from_micros(100));
            }
        }
        self.agree(op, local, descs)
    }

    /// Whether a same-host reduce numbered `seq` writes into peers' buffers (a crowded host:
    /// fewer cores than ranks, a call that gathers and stays on this host), and if so lets
    /// peers write into this rank's buffers for it, before the call's opening tells them
    /// where they are. Every rank gives the same answer: it depends only on what they agreed.
    pub(crate) fn accept_pushes(&mut self, seq: u64, eligible: bool) -> bool {
        let pushed = eligible && self.mail.is_some() && self.crowded() && self.cores < self.size();
        if pushed {
            self.mailbox.accept_writes(seq);
        }
        pushed
    }

    /// Ends what [`Communicator::accept_pushes`] began. After a `completed` call every peer
    /// wrote all it had to before the closing barrier; after a failed one, a peer may still
    /// be writing, so this waits until every peer that announced writes for call `seq` has
    /// withdrawn them or is gone. A peer still announcing them after the progress timeout is
    /// frozen in the middle of writing into this rank's memory: it is killed, because the
    /// buffers must not change once the call has returned.
    pub(crate) fn refuse_pushes(&mut self, seq: u64, completed: bool) {
        self.mailbox.refuse_writes();
        if completed {
            return;
        }
        let (Some((remotes, _)), Some(pids)) = (self.mail.as_ref(), self.cma.as_ref()) else {
            return;
        };
        let started = std::time::Instant::now();
        let mut killed = false;
        for p in (0..self.size()).filter(|&p| p != self.rank()) {
            let mut warned = false;
            // An unreadable word means the peer's process is gone (or its memory is): it
            // writes nothing more.
            while let Ok(true) = crate::mailbox::peer_writing(&pids[p], &remotes[p], seq) {
                let waited = started.elapsed();
                // Ranks that are threads of this process (tests) are never frozen alone.
                if !killed
                    && waited >= self.cfg.progress_timeout
                    && pids[p] != nix::unistd::Pid::this()
                {
                    tracing::error!(
                        rank = p,
                        pid = pids[p].as_raw(),
                        waited = ?waited,
                        "a peer frozen while writing into this rank's buffers is killed"
                    );
                    let _ = nix::sys::signal::kill(pids[p], nix::sys::signal::Signal::SIGKILL);
                    killed = true;
                } else if !warned && waited >= Duration::from_secs(1) {
                    tracing::warn!(
                        rank = p,
                        "a failed call waits for a peer that may still write into this rank's buffers"
                    );
                    warned = true;
                }
                thread::sleep(Duration::from_micros(100));
            }
        }
    }

    /// Announces that this rank writes into its peers' buffers for call `seq`.
    pub(crate) fn begin_pushes(&self, seq: u64) {
        self.mailbox.begin_writes(seq);
    }

    /// Withdraws [`Communicator::begin_pushes`].
    pub(crate) fn end_pushes(&self) {
        self.mailbox.end_writes();
    }

    /// Whether peer `p` still accepts writes into its buffers for call `seq`.
    pub(crate) fn peer_accepts_pushes(&self, p: usize, seq: u64) -> std::io::Result<bool> {
        match (self.mail.as_ref(), self.cma.as_ref()) {
            (Some((remotes, _)), Some(pids)) => {
                crate::mailbox::peer_accepts_writes(&pids[p], &remotes[p], seq)
            }
            _ => Ok(false),
        }
    }

    /// The first of `peers` whose connection has closed (its process is gone or it failed).
    fn closed_peer(&self, peers: &[usize]) -> Option<usize> {
        use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
        use std::os::fd::AsFd;
        let socks: Vec<(usize, &TcpStream)> = peers
            .iter()
            .filter_map(|&p| self.readers[p].as_ref().map(|s| (p, s)))
            .collect();
        // POLLRDHUP: the peer closed its side, even when what it wrote before is still unread
        // here (a peek would find that data and take the dead peer for a live one). Peers
        // never half-close a live connection.
        let rdhup = PollFlags::from_bits_retain(nix::libc::POLLRDHUP);
        let mut fds: Vec<PollFd<'_>> = socks
            .iter()
            .map(|(_, s)| PollFd::new(s.as_fd(), PollFlags::POLLIN | rdhup))
            .collect();
        poll(&mut fds, PollTimeout::ZERO).ok()?;
        // nix has no name for POLLRDHUP, so a poll that reports it reads as `None` (the only
        // flag asked for that it cannot name); hang-up and error it names.
        let gone = |f: &PollFd<'_>| {
            f.revents()
                .is_none_or(|r| r.intersects(PollFlags::POLLHUP | PollFlags::POLLERR))
        };
        if let Some(((p, _), _)) = socks.iter().zip(&fds).find(|(_, f)| gone(f)) {
            return Some(*p);
        }
        // Readable is not closed: a peer already in its next call may have written to us.
        // A closed connection reads as end of stream (or an error) without consuming anything.
        let readable: Vec<(usize, &TcpStream)> = socks
            .iter()
            .zip(&fds)
            .filter(|(_, f)| f.revents().is_some_and(|r| !r.is_empty()))
            .map(|(ps, _)| *ps)
            .collect();
        readable
            .into_iter()
            .find(|(_, s)| !matches!(s.peek(&mut [0u8; 1]), Ok(n) if n > 0))
            .map(|(p, _)| p)
    }

    /// Runs a pipelined ring schedule between the left and right neighbours.
    pub(crate) fn ring<T: Element>(
        &mut self,
        op: &'static str,
        segments: Vec<&mut [T]>,
        first: &[usize],
        recvs: &[Recv],
        left: usize,
        right: usize,
    ) -> Result<()> {
        if let Err(f) = self.set_phase(Phase::Data) {
            return Err(self.link_error(f, op, Phase::Data));
        }
        let timeout = self.cfg.progress_timeout;
        let (Some(reader), Some(writer)) =
            (self.readers[left].as_ref(), self.writers[right].as_ref())
        else {
            return Err(self.fail(CommError::Broken {
                cause: "missing ring connection".into(),
            }));
        };
        let reads: Vec<&TcpStream> = std::iter::once(reader)
            .chain(self.extra[left].iter())
            .collect();
        let writes: Vec<&TcpStream> = std::iter::once(writer)
            .chain(self.extra[right].iter())
            .collect();
        let res = pipeline::run(
            &self.shared,
            &reads,
            left,
            &writes,
            right,
            segments,
            first,
            recvs,
            timeout,
        );
        res.map_err(|f| self.link_error(f, op, Phase::Data))
    }

    /// Exchanges large payloads with every peer at once: at step `k` this rank sends to
    /// `rank + k` while it receives from `rank - k`, so every send meets a receive and no pair
    /// waits on another. `sends[p]`/`recvs[p]` are `None` where nothing moves.
    pub(crate) fn pairwise(
        &mut self,
        op: &'static str,
        sends: &[Option<&[u8]>],
        recvs: &mut [Option<&mut [u8]>],
    ) -> Result<()> {
        if let Err(f) = self.set_phase(Phase::Data) {
            return Err(self.link_error(f, op, Phase::Data));
        }
        let (n, r) = (self.size(), self.rank());
        let shared = &*self.shared;
        let writers = &mut self.writers;
        let readers = &mut self.readers;
        let res = thread::scope(|scope| {
            let sender = scope.spawn(move || -> std::result::Result<(), LinkFailure> {
                for k in 1..n {
                    let p = (r + k) % n;
                    if let (Some(buf), Some(w)) = (sends[p], writers[p].as_mut()) {
                        write_full(w, buf).map_err(|e| LinkFailure::new(shared, p, e))?;
                    }
                }
                Ok(())
            });
            let mut received = Ok(());
            for k in 1..n {
                let p = (r + n - k) % n;
                if let (Some(buf), Some(rd)) = (recvs[p].as_deref_mut(), readers[p].as_mut())
                    && let Err(e) = read_full(rd, buf)
                {
                    received = Err(LinkFailure::new(shared, p, e));
                    break;
                }
            }
            let sent = sender.join().unwrap_or_else(|_| {
                Err(LinkFailure::new(
                    shared,
                    r,
                    std::io::Error::other("sender thread panicked"),
                ))
            });
            match (received, sent) {
                (Ok(()), Ok(())) => Ok(()),
                (Err(a), Err(b)) => Err(if b.primary && !a.primary { b } else { a }),
                (Err(e), _) | (_, Err(e)) => Err(e),
            }
        });
        res.map_err(|f| self.link_error(f, op, Phase::Data))
    }

    /// Whether a buffer of `bytes` takes the latency-optimal path.
    pub(crate) fn is_small(&self, bytes: usize) -> bool {
        bytes <= self.cfg.small_bytes
    }

    pub(crate) fn segment_elems<T>(&self) -> usize {
        (self.cfg.segment_bytes / size_of::<T>()).max(1)
    }
}

/// Reads an inline payload into `dst` when it is what this rank expects, else drops it.
pub(crate) fn take_payload<T: Element>(
    reader: &mut TcpStream,
    d: &Descriptor,
    expected: bool,
    dst: &mut Vec<T>,
) -> std::io::Result<()> {
    let len = match usize::try_from(d.payload_len) {
        Ok(len) if expected && len % size_of::<T>() == 0 => len,
        _ => return discard(reader, d.payload_len),
    };
    dst.clear();
    dst.resize(len / size_of::<T>(), T::zeroed());
    read_full(reader, bytemuck::cast_slice_mut(dst))
}

/// Element offsets of `n` blocks over `count` elements: the first `count % n` get one extra.
pub(crate) fn block_bounds(count: usize, n: usize) -> Vec<usize> {
    let (base, extra) = (count / n, count % n);
    let mut b = Vec::with_capacity(n + 1);
    b.push(0);
    for i in 0..n {
        let last = b[i];
        b.push(last + base + usize::from(i < extra));
    }
    b
}

/// Cuts each block into segments of at most `seg` elements; returns the segment bounds and, for
/// each block, the range of its segment ids.
pub(crate) fn segment_bounds(
    blocks: &[usize],
    seg: usize,
) -> (Vec<usize>, Vec<std::ops::Range<usize>>) {
    let mut bounds = vec![0];
    let mut ranges = Vec::with_capacity(blocks.len().saturating_sub(1));
    for w in blocks.windows(2) {
        let start_id = bounds.len() - 1;
        let mut at = w[0];
        while at < w[1] {
            at = (at + seg).min(w[1]);
            bounds.push(at);
        }
        ranges.push(start_id..bounds.len() - 1);
    }
    (bounds, ranges)
}

/// The receive schedule of a ring reduce-scatter (rank `r` ends holding block `r` reduced),
/// followed, when `allgather` is set, by the ring allgather that spreads every block.
pub(crate) fn ring_schedule(
    r: usize,
    n: usize,
    blocks: &[std::ops::Range<usize>],
    op: ReduceOp,
    allgather: bool,
) -> (Vec<usize>, Vec<Recv>) {
    let at = |k: usize| blocks[(r + n * 2 - k) % n].clone();
    let first: Vec<usize> = at(1).collect();
    let mut recvs = Vec::new();
    for s in 0..n - 1 {
        let last = s == n - 2;
        let mode = match op {
            ReduceOp::Average if last => Mode::ReduceDivide(n),
            other => Mode::Reduce(other.combining()),
        };
        let forward = allgather || !last;
        recvs.extend(at(s + 2).map(|seg| Recv { seg, mode, forward }));
    }
    if allgather {
        for s in 0..n - 1 {
            let forward = s < n - 2;
            recvs.extend(at(s + 1).map(|seg| Recv {
                seg,
                mode: Mode::Copy,
                forward,
            }));
        }
    }
    (first, recvs)
}
