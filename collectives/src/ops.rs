//! The collectives themselves, each one an opening exchange followed by a data phase.
//!
//! Buffers up to `small_bytes` travel inside the opening exchange (one message to every peer:
//! one network latency in all), and every rank reduces the contributions in rank order, so all
//! ranks get bit-identical results. Larger buffers take the bandwidth-optimal ring
//! (reduce-scatter then allgather, each rank sending 2(n−1)/n of the buffer), a pipelined chain
//! (broadcast) or a pairwise exchange (allgather, alltoall).
//!
//! Ranks of one host reach into each other's memory, and each way is safe for its own reason:
//! - **Mailboxes** (small calls): every post is tagged with its mailbox's nonce and its call
//!   number and read header first (see [`crate::mailbox`]), so neither a post of another
//!   communicator nor a half-copied one is ever taken.
//! - **Direct reads** (large calls: the reduce's blocks and gather, broadcast from the root,
//!   allgather and alltoall parts): the addresses ride in this call's own opening, and every
//!   read is followed by a barrier the owner must pass too, so an owner keeps its buffer
//!   untouched until every reader is done, and a reader whose owner left early fails the call
//!   instead of returning what it read.
//! - **Crowded-host writes**: a rank writes into a peer only while the peer accepts writes for
//!   this very call, and a rank leaving a failed call waits until no writer is still at it
//!   ([`Communicator::reduce_blocks_same_host`]).
//! - **Hierarchical halves**: the host half is a communicator of its own (its own mailboxes,
//!   nonces and call numbers) and the cross half uses the sockets only; both run inside one
//!   call of the world, in the same order on every rank, and a failure of either closes the
//!   world's sockets, which they share.

use crate::comm::Communicator;
use crate::dtype::{Element, ReduceOp};
use crate::error::{CommError, Result};
use crate::pipeline::{Mode, Recv, split_at_bounds};
use crate::schedule::{block_bounds, ring_schedule, segment_bounds};
use crate::transport::take_payload;
use crate::wire::{Descriptor, Kind};

/// A peer whose buffer can no longer be read has left the collective (it failed and
/// returned, or its process is gone); reported as a lost peer, as a closed socket would be.
fn left_collective(rank: usize, op: &'static str, e: &std::io::Error) -> CommError {
    CommError::PeerLost {
        rank,
        op,
        source: std::io::Error::other(format!("its buffer became unreadable ({e})")),
    }
}

/// The parts of the virtual concatenation `[a, b)` of buffers starting at `starts` (prefix
/// sums, one more than the buffers): `(buffer, offset, length)`, empty buffers skipped.
fn pieces(starts: &[usize], a: usize, b: usize) -> Vec<(usize, usize, usize)> {
    let mut out = Vec::new();
    for i in 0..starts.len().saturating_sub(1) {
        let (s, e) = (starts[i].max(a), starts[i + 1].min(b));
        if s < e {
            out.push((i, s - starts[i], e - s));
        }
    }
    out
}

/// Most bytes read from one peer per step of the same-host reduce: large enough to amortize a
/// system call, small enough that a step's data stays in cache.
const SAME_HOST_CHUNK: usize = 256 * 1024;

/// Bytes of peers' chunks a step of the same-host reduce stages (every peer's chunk), spread
/// over the peers, but never below 64 KiB a peer (so more with more than 12 peers).
const SAME_HOST_STAGING: usize = 768 * 1024;

/// Bytes of an accumulator reduced against every source before moving on: a slice of L1.
const REDUCE_STRETCH: usize = 8 * 1024;

/// What one same-host reduce call is: its name and number, every rank's process, the op,
/// whether it gathers the result, and whether crowded-host writes ([`Communicator::accept_pushes`])
/// are on for it.
#[derive(Clone, Copy)]
struct SameHostCall<'a> {
    name: &'static str,
    seq: u64,
    pids: &'a [nix::unistd::Pid],
    op: ReduceOp,
    allgather: bool,
    pushed: bool,
}

/// `out` as `len` zeros, in the memory it already holds where it can.
fn zeroed<T: Element>(out: &mut Vec<T>, len: usize) {
    out.clear();
    out.resize(len, T::zeroed());
}

fn desc<T: Element>(kind: Kind, op: Option<ReduceOp>, seq: u64, count: usize) -> Descriptor {
    Descriptor {
        kind,
        dtype: Some(T::DTYPE),
        op,
        root: 0,
        seq,
        count: count as u64,
        row_len: 1,
        payload_len: 0,
        invalid: false,
    }
}

impl Communicator {
    /// Reduces `buf` across all ranks in place: afterwards every rank holds the same result.
    ///
    /// # Errors
    /// [`CommError::Mismatch`] when ranks disagree on length, type or op (on every rank); a
    /// transport error when a peer fails, after which the communicator must be rebuilt.
    pub fn allreduce<T: Element>(&mut self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        if op == ReduceOp::Adasum {
            return self.adasum(&mut [buf]);
        }
        self.reduce(Kind::Allreduce, buf, op, 1, true)
    }

    /// Allreduces several buffers of one type as a single fused operation (with
    /// [`ReduceOp::Adasum`], each buffer combines as a tensor of its own).
    ///
    /// # Errors
    /// As [`Communicator::allreduce`]; ranks must pass the same number of buffers.
    pub fn grouped_allreduce<T: Element>(
        &mut self,
        bufs: &mut [&mut [T]],
        op: ReduceOp,
    ) -> Result<()> {
        if op == ReduceOp::Adasum {
            return self.adasum(bufs);
        }
        let total: usize = bufs.iter().map(|b| b.len()).sum();
        if self.size() > 1
            && self.cma.is_some()
            && !self.is_small(total * std::mem::size_of::<T>())
            && bufs.len() > 1
        {
            return self.grouped_same_host(bufs, op);
        }
        let mut fused = Vec::with_capacity(total);
        bufs.iter().for_each(|b| fused.extend_from_slice(b));
        self.reduce(Kind::Allreduce, &mut fused, op, bufs.len().max(1), true)?;
        let mut at = 0;
        for b in bufs.iter_mut() {
            b.copy_from_slice(&fused[at..at + b.len()]);
            at += b.len();
        }
        Ok(())
    }

    /// Reduces `input` across ranks and returns this rank's block of the result. Blocks split
    /// the buffer evenly; the first `len % size` ranks get one element more.
    ///
    /// # Errors
    /// As [`Communicator::allreduce`].
    pub fn reducescatter<T: Element>(&mut self, input: &[T], op: ReduceOp) -> Result<Vec<T>> {
        let mut work = input.to_vec();
        self.reduce(Kind::Reducescatter, &mut work, op, 1, false)?;
        let b = block_bounds(work.len(), self.size());
        let r = self.rank();
        work.truncate(b[r + 1]);
        work.drain(..b[r]);
        Ok(work)
    }

    /// Allreduce (`allgather` set) or reducescatter (result left in this rank's block of `buf`).
    fn reduce<T: Element>(
        &mut self,
        kind: Kind,
        buf: &mut [T],
        op: ReduceOp,
        tensors: usize,
        allgather: bool,
    ) -> Result<()> {
        if op == ReduceOp::Adasum {
            // Allreduce routes Adasum to its own algorithm; a reducescatter has no Adasum.
            return Err(CommError::InvalidArgument {
                op: kind.name(),
                detail: "Adasum is an allreduce only; use sum or average".into(),
            });
        }
        let seq = self.begin()?;
        let (n, r) = (self.size(), self.rank());
        if n == 1 {
            return Ok(()); // a sum, min, max, product or average over one rank is the identity
        }
        let bytes = std::mem::size_of_val(buf);
        let mut mine = desc::<T>(kind, Some(op), seq, buf.len());
        mine.row_len = tensors as u64;
        let hier = self.hier_allreduce;
        if let Some(mut h) = self
            .hier
            .take_if(|_| allgather && hier && self.cfg.small_bytes >= bytes)
        {
            // Small, across hosts: on the host through the mailboxes, then across hosts; every
            // cross group adds the same host sums in the same order, so all ranks agree.
            h.local.forget_timeouts();
            h.cross.forget_timeouts();
            let done = match h.local.allreduce(buf, op.combining()) {
                Err(e) if !e.is_fatal() => {
                    h.cross.refuse(Kind::Allreduce, e.to_string());
                    Err(e)
                }
                Err(e) => Err(e),
                Ok(()) => h.cross.allreduce(buf, op.combining()),
            };
            if done.is_ok() && op == ReduceOp::Average {
                T::divide(buf, n);
            }
            self.hier = Some(h);
            self.forget_timeouts();
            return done.map_err(|e| self.fail(e));
        }
        if self.fits_mailbox(bytes) || self.is_small(bytes) {
            mine.payload_len = bytes as u64;
            let mut inbox: Vec<Vec<T>> = vec![Vec::new(); n];
            let payload: &[u8] = bytemuck::cast_slice(buf);
            if self.fits_mailbox(bytes) {
                let mut raw = vec![Vec::new(); n];
                self.open_mailbox(mine, Ok(()), payload, &mut raw)?;
                for (dst, src) in inbox.iter_mut().zip(&raw) {
                    let k = src.len() / std::mem::size_of::<T>();
                    dst.resize(k, T::zeroed());
                    let whole = k * std::mem::size_of::<T>();
                    bytemuck::cast_slice_mut::<T, u8>(dst).copy_from_slice(&src[..whole]);
                }
            } else {
                self.open(
                    mine,
                    Ok(()),
                    |_| (mine, payload),
                    |p, d, rd| take_payload(rd, d, d.agrees_with(&mine), &mut inbox[p]),
                )?;
            }
            // Every rank combines in rank order, so all get bit-identical results.
            let mut acc = if r == 0 {
                buf.to_vec()
            } else {
                std::mem::take(&mut inbox[0])
            };
            for (j, contribution) in inbox.iter().enumerate().skip(1) {
                let src: &[T] = if j == r { buf } else { contribution };
                T::reduce_into(&mut acc, src, op.combining());
            }
            if op == ReduceOp::Average {
                T::divide(&mut acc, n);
            }
            buf.copy_from_slice(&acc);
            return Ok(());
        }
        if let Some(mut h) = self.hier.take_if(|_| allgather && hier) {
            h.local.forget_timeouts();
            h.cross.forget_timeouts();
            let done = h.local.hierarchical(buf, op, tensors, &mut h.cross);
            self.hier = Some(h);
            self.forget_timeouts();
            return done.map_err(|e| self.fail(e));
        }
        if let Some(pids) = self.cma.clone() {
            return self.reduce_same_host(kind, buf, op, mine, &pids, allgather, None);
        }
        self.open(
            mine,
            Ok(()),
            |_| (mine, &[][..]),
            |_, d, rd| crate::link::discard(rd, d.payload_len),
        )?;
        let blocks = block_bounds(buf.len(), n);
        let (bounds, ranges) = segment_bounds(&blocks, self.segment_elems::<T>());
        let (first, recvs) = ring_schedule(r, n, &ranges, op, allgather);
        let segments = split_at_bounds(buf, &bounds);
        self.ring(
            kind.name(),
            segments,
            &first,
            &recvs,
            (r + n - 1) % n,
            (r + 1) % n,
        )
    }

    /// Hierarchical allreduce, called on the host communicator: reduce-scatter on the host,
    /// allreduce of this rank's block with the ranks of the same local index on the other hosts,
    /// then gather the blocks on the host. Across hosts each rank sends 1/local_size of what a
    /// flat ring would.
    fn hierarchical<T: Element>(
        &mut self,
        buf: &mut [T],
        op: ReduceOp,
        tensors: usize,
        cross: &mut Communicator,
    ) -> Result<()> {
        let seq = self.begin()?;
        let mut mine = desc::<T>(Kind::Allreduce, Some(op), seq, buf.len());
        mine.row_len = tensors as u64;
        let Some(pids) = self.cma.clone() else {
            return Err(self.fail(CommError::Broken {
                cause: "same-host transfers are not set up".into(),
            }));
        };
        let before = cross.calls();
        let done = self.reduce_same_host(Kind::Allreduce, buf, op, mine, &pids, true, Some(cross));
        match done {
            // Failed on this host before the hosts met: the other hosts must fail it too.
            Err(e) if !e.is_fatal() && cross.calls() == before => {
                cross.refuse(Kind::Allreduce, e.to_string());
                Err(e)
            }
            other => other,
        }
    }

    /// Reduce-scatter (and allgather) of one buffer among ranks of one host, reading peers'
    /// buffers in place: opens the call with this rank's buffer address, then
    /// [`Communicator::reduce_blocks_same_host`] does the work (with `cross`, across hosts too).
    #[allow(clippy::too_many_arguments)]
    fn reduce_same_host<T: Element>(
        &mut self,
        kind: Kind,
        buf: &mut [T],
        op: ReduceOp,
        mut mine: Descriptor,
        pids: &[nix::unistd::Pid],
        allgather: bool,
        cross: Option<&mut Communicator>,
    ) -> Result<()> {
        let (n, r) = (self.size(), self.rank());
        let name = kind.name();
        let word = (buf.as_ptr() as u64).to_le_bytes();
        mine.payload_len = word.len() as u64;
        let mut addrs = vec![0usize; n];
        addrs[r] = buf.as_ptr() as usize;
        let pushed = self.accept_pushes(mine.seq, allgather && cross.is_none());
        let opened = self.open(
            mine,
            Ok(()),
            |_| (mine, &word[..]),
            |p, d, rd| {
                if d.payload_len != 8 {
                    return crate::link::discard(rd, d.payload_len);
                }
                let mut b = [0u8; 8];
                crate::link::read_full(rd, &mut b)?;
                addrs[p] = usize::try_from(u64::from_le_bytes(b)).unwrap_or(0);
                Ok(())
            },
        );
        let done = opened.and_then(|_| {
            let mut bufs = [buf];
            let addrs: Vec<Vec<usize>> = addrs.into_iter().map(|a| vec![a]).collect();
            let work = SameHostCall {
                name,
                seq: mine.seq,
                pids,
                op,
                allgather,
                pushed,
            };
            self.reduce_blocks_same_host(&work, &mut bufs, &addrs, cross)
        });
        if pushed {
            self.refuse_pushes(mine.seq, done.is_ok());
        }
        done
    }

    /// The work of the same-host reduce, on the virtual concatenation of `bufs` (one tensor,
    /// or a grouped call's several) whose start addresses in rank `p` are `addrs[p]`. Block
    /// `w` of the concatenation is reduced by rank `w` alone, in place, own values first and
    /// then each peer's in rank order, so every rank gets the same bits. Then a barrier, the
    /// gather of the other blocks, and another barrier that keeps every buffer untouched until
    /// no peer reads it any more. On a crowded host only one rank per core reduces, pushing
    /// each finished chunk into every peer, and one barrier over the sockets ends the call.
    /// With `cross` (one tensor), each block is allreduced among the other hosts' ranks of the
    /// same local index before the gather.
    ///
    /// What keeps every buffer safe:
    /// - Reads: the addresses come from this call's own opening, and every read of a peer's
    ///   buffer is followed by a barrier that peer must pass too. A peer that left the call
    ///   early (it failed, or was aborted) closed its sockets, so the reader's barrier fails
    ///   and whatever it read is never returned as a result.
    /// - Writes (crowded hosts): a rank writes into a peer only after announcing it
    ///   (`begin_writes`) and seeing that the peer still accepts writes for this very call
    ///   (its `open` word holds this call's tag), and checks again before every chunk. A rank
    ///   leaving the call on a failure first stops accepting writes, then waits until no peer
    ///   that announced writes for the call still has them under way
    ///   ([`Communicator::refuse_pushes`]), so its buffers never change after it returns.
    fn reduce_blocks_same_host<T: Element>(
        &mut self,
        work: &SameHostCall<'_>,
        bufs: &mut [&mut [T]],
        addrs: &[Vec<usize>],
        cross: Option<&mut Communicator>,
    ) -> Result<()> {
        let SameHostCall {
            name,
            seq,
            pids,
            op,
            allgather,
            pushed,
        } = *work;
        let (n, r) = (self.size(), self.rank());
        let starts = prefix_sums(&bufs.iter().map(|b| b.len()).collect::<Vec<_>>());
        let total = starts[bufs.len()];
        let elem = std::mem::size_of::<T>();
        // With more ranks than cores, only one rank per core reduces (the others would just
        // take turns with it) and it writes its finished block straight into every peer's
        // buffers: one barrier, no gather, no rank waiting on a descheduled block owner.
        let workers = if pushed {
            self.shared_cores().clamp(1, n)
        } else {
            n
        };
        let writer = workers < n && r < workers;
        if writer {
            self.begin_pushes(seq);
        }
        let blocks = block_bounds(total, workers);
        let (lo, hi) = if r < workers {
            (blocks[r], blocks[r + 1])
        } else {
            (0, 0)
        };
        // Each step reads every peer's chunk, then reduces them all while they are in cache.
        let peers: Vec<usize> = (0..n).filter(|&p| p != r).collect();
        let per_peer = (SAME_HOST_STAGING / peers.len().max(1)).clamp(64 * 1024, SAME_HOST_CHUNK);
        let chunk = (per_peer / elem).max(1).min(hi - lo).max(1);
        let mut staging = std::mem::take(&mut self.staging);
        let words = (chunk * peers.len() * elem).div_ceil(8);
        if staging.len() < words {
            staging.resize(words, 0);
        }
        let tmp: &mut [T] =
            &mut bytemuck::cast_slice_mut::<u64, T>(&mut staging)[..chunk * peers.len()];
        let mut failed = None;
        let mut at = lo;
        'reduce: while at < hi {
            let len = chunk.min(hi - at);
            let parts = pieces(&starts, at, at + len);
            for (j, &p) in peers.iter().enumerate() {
                let mut filled = j * len;
                for &(i, off, plen) in &parts {
                    let dst: &mut [u8] = bytemuck::cast_slice_mut(&mut tmp[filled..filled + plen]);
                    if let Err(e) = crate::cma::read_remote(pids[p], addrs[p][i] + off * elem, dst)
                    {
                        failed = Some((p, e));
                        break 'reduce;
                    }
                    filled += plen;
                }
            }
            let mut taken = 0;
            for &(i, off, plen) in &parts {
                let acc = &mut bufs[i][off..off + plen];
                reduce_staged(acc, &tmp[taken..], len, peers.len(), op.combining());
                // Across hosts, an average is a sum divided once at the end.
                if op == ReduceOp::Average && cross.is_none() {
                    T::divide(acc, n);
                }
                taken += plen;
            }
            // A crowded host's reducer pushes each finished chunk while it is still in cache,
            // into peers still in this call.
            if writer {
                for p in (1..n).map(|k| (r + k) % n) {
                    match self.peer_accepts_pushes(p, seq) {
                        Ok(true) => {}
                        Ok(false) => {
                            let e = std::io::Error::other("it left the call");
                            failed = Some((p, e));
                            break 'reduce;
                        }
                        Err(e) => {
                            failed = Some((p, e));
                            break 'reduce;
                        }
                    }
                    for &(i, off, plen) in &parts {
                        let raw: &[u8] = bytemuck::cast_slice(&bufs[i][off..off + plen]);
                        let to = addrs[p][i] + off * elem;
                        if let Err(e) = crate::cma::write_remote(pids[p], to, raw) {
                            failed = Some((p, e));
                            break 'reduce;
                        }
                    }
                }
            }
            at += len;
        }
        if writer {
            self.end_pushes();
        }
        self.staging = staging;
        if let Some((p, e)) = failed {
            return Err(self.fail(left_collective(p, name, &e)));
        }
        if let Some(x) = cross {
            // Hierarchical calls reduce one tensor (grouped calls fuse before they get here).
            let [one] = bufs else {
                return Err(self.fail(CommError::Broken {
                    cause: format!("a hierarchical reduce got {} tensors, not one", bufs.len()),
                }));
            };
            let block = &mut one[lo..hi];
            if let Err(e) = x.allreduce(block, op.combining()) {
                return Err(self.fail(e));
            }
            if op == ReduceOp::Average {
                T::divide(block, n * x.size());
            }
        }
        if workers < n {
            // Every block is written before any rank returns (and lets its buffers go). The
            // ranks that did not reduce have waited all along: they block on their sockets
            // rather than wake every 100 µs on cores the reducers need.
            return self.socket_barrier();
        }
        self.barrier()?;
        if allgather {
            for p in (1..n).map(|k| (r + k) % n) {
                for (i, off, plen) in pieces(&starts, blocks[p], blocks[p + 1]) {
                    let dst: &mut [u8] = bytemuck::cast_slice_mut(&mut bufs[i][off..off + plen]);
                    if let Err(e) = crate::cma::read_remote(pids[p], addrs[p][i] + off * elem, dst)
                    {
                        return Err(self.fail(left_collective(p, name, &e)));
                    }
                }
            }
            self.barrier()?;
        }
        Ok(())
    }

    /// [`Communicator::grouped_allreduce`] among ranks of one host, in place: the buffers are
    /// one virtual concatenation, each rank reduces its block of it straight from the peers'
    /// buffers, then reads the other blocks into its own. No fusion copy.
    fn grouped_same_host<T: Element>(&mut self, bufs: &mut [&mut [T]], op: ReduceOp) -> Result<()> {
        let seq = self.begin()?;
        let (n, r) = (self.size(), self.rank());
        let Some(pids) = self.cma.clone() else {
            return Err(self.fail(CommError::Broken {
                cause: "same-host transfers are not set up".into(),
            }));
        };
        let starts = prefix_sums(&bufs.iter().map(|b| b.len()).collect::<Vec<_>>());
        let total = starts[bufs.len()];
        let mut mine = desc::<T>(Kind::Allreduce, Some(op), seq, total);
        mine.row_len = bufs.len() as u64;
        // The layout must agree too, or blocks would pair up different tensors.
        mine.root = starts.iter().fold(0x811c_9dc5u32, |h, &s| {
            (h ^ s as u32).wrapping_mul(0x0100_0193)
        });
        let mut words = Vec::with_capacity(8 * bufs.len());
        for b in bufs.iter() {
            words.extend_from_slice(&(b.as_ptr() as u64).to_le_bytes());
        }
        mine.payload_len = words.len() as u64;
        let k = bufs.len();
        let mut addrs = vec![Vec::new(); n];
        addrs[r] = bufs.iter().map(|b| b.as_ptr() as usize).collect();
        let pushed = self.accept_pushes(seq, true);
        let opened = self.open(
            mine,
            Ok(()),
            |_| (mine, &words[..]),
            |p, d, rd| {
                if d.payload_len != 8 * k as u64 {
                    return crate::link::discard(rd, d.payload_len);
                }
                let mut b = vec![0u8; 8 * k];
                crate::link::read_full(rd, &mut b)?;
                addrs[p] = b
                    .chunks_exact(8)
                    .map(|w| {
                        let mut a = [0u8; 8];
                        a.copy_from_slice(w);
                        usize::try_from(u64::from_le_bytes(a)).unwrap_or(0)
                    })
                    .collect();
                Ok(())
            },
        );
        let work = SameHostCall {
            name: "allreduce",
            seq,
            pids: &pids,
            op,
            allgather: true,
            pushed,
        };
        let done = opened.and_then(|_| self.reduce_blocks_same_host(&work, bufs, &addrs, None));
        if pushed {
            self.refuse_pushes(seq, done.is_ok());
        }
        done
    }

    /// Copies `buf` from rank `root` to every rank.
    ///
    /// # Errors
    /// [`CommError::InvalidArgument`] for a root outside the world; a mismatch when ranks
    /// disagree on the root or the length; a transport error when a peer fails.
    pub fn broadcast<T: Element>(&mut self, buf: &mut [T], root: usize) -> Result<()> {
        let seq = self.begin()?;
        let (n, r) = (self.size(), self.rank());
        let local = if root < n {
            Ok(())
        } else {
            Err(format!("root {root} is not a rank of a world of {n}"))
        };
        if n == 1 {
            return local.map_err(|detail| CommError::InvalidArgument {
                op: "broadcast",
                detail,
            });
        }
        let bytes = std::mem::size_of_val(buf);
        let mut mine = desc::<T>(Kind::Broadcast, None, seq, buf.len());
        mine.root = u32::try_from(root).unwrap_or(u32::MAX);
        let small = self.is_small(bytes);
        // On one host the root's buffer is read in place; its address rides in its descriptor.
        let direct = !small && self.cma.is_some();
        let word = (buf.as_ptr() as u64).to_le_bytes();
        if small && r == root {
            mine.payload_len = bytes as u64;
        } else if direct && r == root {
            mine.payload_len = word.len() as u64;
        }
        let mut inbox: Vec<T> = Vec::new();
        let mut root_addr = 0usize;
        {
            let payload: &[u8] = if direct {
                &word
            } else {
                bytemuck::cast_slice(buf)
            };
            self.open(
                mine,
                local,
                |_| (mine, payload),
                |p, d, rd| {
                    if direct && p == root && d.payload_len == 8 {
                        let mut b = [0u8; 8];
                        crate::link::read_full(rd, &mut b)?;
                        root_addr = usize::try_from(u64::from_le_bytes(b)).unwrap_or(0);
                        return Ok(());
                    }
                    let expected = small && p == root && d.agrees_with(&mine);
                    take_payload(rd, d, expected, &mut inbox)
                },
            )?;
        }
        if let (true, Some(pids)) = (direct, self.cma.clone()) {
            if r != root {
                let raw: &mut [u8] = bytemuck::cast_slice_mut(buf);
                if let Err(e) = crate::cma::read_remote(pids[root], root_addr, raw) {
                    return Err(self.fail(left_collective(root, "broadcast", &e)));
                }
            }
            // The root's buffer stays untouched until every rank has read it.
            return self.barrier();
        }
        if small {
            if r != root {
                buf.copy_from_slice(&inbox);
            }
            return Ok(());
        }
        // A pipelined chain root → root+1 → … → root−1: every link carries the buffer once.
        let pos = (r + n - root) % n;
        let seg = self.segment_elems::<T>();
        let mut bounds: Vec<usize> = (0..buf.len()).step_by(seg).collect();
        bounds.push(buf.len());
        let ids = 0..bounds.len() - 1;
        let (first, recvs): (Vec<usize>, Vec<Recv>) = if pos == 0 {
            (ids.collect(), Vec::new())
        } else {
            let forward = pos < n - 1;
            (
                Vec::new(),
                ids.map(|seg| Recv {
                    seg,
                    mode: Mode::Copy,
                    forward,
                })
                .collect(),
            )
        };
        let segments = split_at_bounds(buf, &bounds);
        self.ring(
            "broadcast",
            segments,
            &first,
            &recvs,
            (r + n - 1) % n,
            (r + 1) % n,
        )
    }

    /// Concatenates every rank's `input` in rank order. `input` is rows of `row_len` elements;
    /// the number of rows may differ between ranks, `row_len` may not.
    ///
    /// # Errors
    /// [`CommError::InvalidArgument`] when `input` is not whole rows; a mismatch when ranks
    /// disagree on type or row length; a transport error when a peer fails.
    pub fn allgather<T: Element>(&mut self, input: &[T], row_len: usize) -> Result<Vec<T>> {
        let mut out = Vec::new();
        self.allgather_to(input, row_len, &mut out)?;
        Ok(out)
    }

    /// [`Communicator::allgather`] into `out`, whose memory is reused: a caller that gathers
    /// large buffers again and again keeps their pages.
    pub(crate) fn allgather_to<T: Element>(
        &mut self,
        input: &[T],
        row_len: usize,
        out: &mut Vec<T>,
    ) -> Result<()> {
        let seq = self.begin()?;
        let (n, r) = (self.size(), self.rank());
        let local = if row_len == 0 && !input.is_empty() {
            Err("row_len is 0 for a non-empty input".to_string())
        } else if row_len != 0 && !input.len().is_multiple_of(row_len) {
            Err(format!(
                "{} elements are not whole rows of {row_len}",
                input.len()
            ))
        } else {
            Ok(())
        };
        if n == 1 {
            local.map_err(|detail| CommError::InvalidArgument {
                op: "allgather",
                detail,
            })?;
            out.clear();
            out.extend_from_slice(input);
            return Ok(());
        }
        let hier = self.hier_allgather;
        if let Some(mut h) = self.hier.take_if(|_| hier) {
            let done = self
                .allgather_by_host(&mut h, input, row_len, local)
                .map(|v| *out = v);
            self.hier = Some(h);
            self.forget_timeouts();
            return done.map_err(|e| self.fail(e));
        }
        let bytes = std::mem::size_of_val(input);
        let mut mine = desc::<T>(Kind::Allgather, None, seq, input.len());
        mine.row_len = row_len as u64;
        let inline = self.is_small(bytes);
        // On one host a large contribution is read in place: its address rides instead. An
        // 8-byte payload for a contribution of another size can only be an address, because
        // contributions that small always ride inline.
        let direct = !inline && self.cma.is_some();
        let word = (input.as_ptr() as u64).to_le_bytes();
        if inline {
            mine.payload_len = bytes as u64;
        } else if direct {
            mine.payload_len = word.len() as u64;
        }
        let elem = std::mem::size_of::<T>();
        let mut inbox: Vec<Vec<T>> = vec![Vec::new(); n];
        let mut addrs: Vec<Option<usize>> = vec![None; n];
        let payload: &[u8] = if direct {
            &word
        } else {
            bytemuck::cast_slice(input)
        };
        let descs = self.open(
            mine,
            local,
            |_| (mine, payload),
            |p, d, rd| {
                let theirs = d.count.saturating_mul(elem as u64);
                if d.payload_len == 8 && theirs != 8 && d.agrees_with(&mine) {
                    let mut b = [0u8; 8];
                    crate::link::read_full(rd, &mut b)?;
                    addrs[p] = usize::try_from(u64::from_le_bytes(b)).ok();
                    return Ok(());
                }
                take_payload(rd, d, d.agrees_with(&mine), &mut inbox[p])
            },
        )?;
        // Every rank sees the same descriptors, so all take this path or none.
        let any_direct = direct || addrs.iter().any(Option::is_some);
        if let Some(pids) = self.cma.clone().filter(|_| any_direct) {
            let counts: Vec<usize> = descs.iter().map(|d| d.count as usize).collect();
            zeroed(out, counts.iter().sum());
            let mut at = 0;
            let mut failed = None;
            for (p, &c) in counts.iter().enumerate() {
                let head = &mut out[at..at + c];
                at += c;
                if p == r {
                    head.copy_from_slice(input);
                } else if let Some(addr) = addrs[p] {
                    let raw: &mut [u8] = bytemuck::cast_slice_mut(head);
                    if let Err(e) = crate::cma::read_remote(pids[p], addr, raw) {
                        failed = Some((p, e));
                        break;
                    }
                } else {
                    head.copy_from_slice(&inbox[p]);
                }
            }
            if let Some((p, e)) = failed {
                return Err(self.fail(left_collective(p, "allgather", &e)));
            }
            // Every input stays untouched until every rank has read it.
            self.barrier()?;
            return Ok(());
        }
        let counts: Vec<usize> = descs.iter().map(|d| d.count as usize).collect();
        zeroed(out, counts.iter().sum());
        let mut recvs: Vec<Option<&mut [u8]>> = Vec::with_capacity(n);
        let mut rest = out.as_mut_slice();
        for (p, &c) in counts.iter().enumerate() {
            let (head, tail) = std::mem::take(&mut rest).split_at_mut(c);
            rest = tail;
            if p == r {
                head.copy_from_slice(input);
                recvs.push(None);
            } else if descs[p].payload_len > 0 || c == 0 {
                head.copy_from_slice(&inbox[p]);
                recvs.push(None);
            } else {
                recvs.push(Some(bytemuck::cast_slice_mut(head)));
            }
        }
        let sends: Vec<Option<&[u8]>> = (0..n)
            .map(|p| (p != r && !inline && !input.is_empty()).then_some(payload))
            .collect();
        if recvs.iter().any(Option::is_some) || sends.iter().any(Option::is_some) {
            self.pairwise("allgather", &sends, &mut recvs)?;
        }
        Ok(())
    }

    /// Sends `splits[p]` consecutive elements of `input` to each rank `p` (an empty `splits`
    /// means equal parts) and returns what every rank sent here, in rank order, with the
    /// number of elements received from each rank.
    ///
    /// # Errors
    /// [`CommError::InvalidArgument`] when the splits don't cover `input`; a mismatch on type; a
    /// transport error when a peer fails.
    pub fn alltoall<T: Element>(
        &mut self,
        input: &[T],
        splits: &[usize],
    ) -> Result<(Vec<T>, Vec<usize>)> {
        let mut out = Vec::new();
        let counts = self.alltoall_to(input, splits, &mut out)?;
        Ok((out, counts))
    }

    /// [`Communicator::alltoall`] into `out`, whose memory is reused; returns the counts.
    pub(crate) fn alltoall_to<T: Element>(
        &mut self,
        input: &[T],
        splits: &[usize],
        out: &mut Vec<T>,
    ) -> Result<Vec<usize>> {
        let seq = self.begin()?;
        let (n, r) = (self.size(), self.rank());
        let (splits, local) = resolve_splits(input.len(), splits, n);
        if n == 1 {
            local.map_err(|detail| CommError::InvalidArgument {
                op: "alltoall",
                detail,
            })?;
            out.clear();
            out.extend_from_slice(input);
            return Ok(vec![input.len()]);
        }
        let offsets = prefix_sums(&splits);
        let part = |p: usize| -> &[T] { &input[offsets[p]..offsets[p + 1]] };
        let small = |p: usize| self.is_small(std::mem::size_of_val(part(p)));
        let inline: Vec<bool> = (0..n).map(small).collect();
        let base = desc::<T>(Kind::Alltoall, None, seq, 0);
        let mut inbox: Vec<Vec<T>> = vec![Vec::new(); n];
        // On one host a large part is not sent: its receiver reads it where it lies, given
        // its address (an 8-byte payload for a part of another size can only be that).
        let pids = self.cma.clone();
        let elem = std::mem::size_of::<T>();
        let words: Vec<[u8; 8]> = (0..n)
            .map(|p| (part(p).as_ptr() as u64).to_le_bytes())
            .collect();
        let mut addrs: Vec<Option<usize>> = vec![None; n];
        let descs = self.open(
            base,
            local,
            |p| {
                let bytes = bytemuck::cast_slice(part(p));
                let (len, payload) = match (inline[p], &pids) {
                    (true, _) => (bytes.len(), bytes),
                    (false, Some(_)) if !bytes.is_empty() => (8, &words[p][..]),
                    (false, _) => (0, &[][..]),
                };
                let d = Descriptor {
                    count: splits[p] as u64,
                    payload_len: len as u64,
                    ..base
                };
                (d, payload)
            },
            |p, d, rd| {
                let data = d.count.saturating_mul(elem as u64);
                if pids.is_some() && d.payload_len == 8 && data != 8 && d.agrees_with(&base) {
                    let mut b = [0u8; 8];
                    crate::link::read_full(rd, &mut b)?;
                    addrs[p] = usize::try_from(u64::from_le_bytes(b)).ok();
                    return Ok(());
                }
                take_payload(rd, d, d.agrees_with(&base), &mut inbox[p])
            },
        )?;
        let mut counts: Vec<usize> = descs.iter().map(|d| d.count as usize).collect();
        counts[r] = splits[r];
        zeroed(out, counts.iter().sum());
        let mut recvs: Vec<Option<&mut [u8]>> = Vec::with_capacity(n);
        let mut rest = out.as_mut_slice();
        for (p, &c) in counts.iter().enumerate() {
            let (head, tail) = std::mem::take(&mut rest).split_at_mut(c);
            rest = tail;
            if p == r {
                head.copy_from_slice(part(r));
                recvs.push(None);
            } else if let (Some(addr), Some(pids)) = (addrs[p], &pids) {
                let raw: &mut [u8] = bytemuck::cast_slice_mut(head);
                if let Err(e) = crate::cma::read_remote(pids[p], addr, raw) {
                    return Err(self.fail(left_collective(p, "alltoall", &e)));
                }
                recvs.push(None);
            } else if descs[p].payload_len > 0 || c == 0 {
                head.copy_from_slice(&inbox[p]);
                recvs.push(None);
            } else {
                recvs.push(Some(bytemuck::cast_slice_mut(head)));
            }
        }
        let sends: Vec<Option<&[u8]>> = (0..n)
            .map(|p| {
                (p != r && !inline[p] && splits[p] > 0 && pids.is_none())
                    .then(|| bytemuck::cast_slice(part(p)))
            })
            .collect();
        if recvs.iter().any(Option::is_some) || sends.iter().any(Option::is_some) {
            self.pairwise("alltoall", &sends, &mut recvs)?;
        }
        if pids.is_some() {
            // Every part read in place has been read before any rank lets its input go.
            self.barrier()?;
        }
        Ok(counts)
    }

    /// Horovod's `join` on a communicator no engine drives: this rank has no more data.
    /// Returns the last rank when every rank joined at this same call.
    ///
    /// # Errors
    /// [`CommError::Joined`] on every rank when some ranks still run other calls: they run
    /// theirs again through a background engine, and the joined ranks join through theirs,
    /// taking part in the others' allreduces with zeros. A transport error when a peer fails.
    pub fn join(&mut self) -> Result<usize> {
        let seq = self.begin()?;
        let n = self.size();
        if n == 1 {
            return Ok(0);
        }
        let mine = Descriptor::bare(Kind::Join, seq);
        // The others' calls may carry inline payloads: read past them.
        self.open(
            mine,
            Ok(()),
            |_| (mine, &[]),
            |_, d, rd| crate::link::discard(rd, d.payload_len),
        )?;
        // Everyone joined at once: the last of them is the highest rank.
        Ok(n - 1)
    }

    /// Returns once every rank has called it.
    ///
    /// # Errors
    /// A mismatch when another rank is in a different collective; a transport error.
    pub fn barrier(&mut self) -> Result<()> {
        self.barrier_via(true)
    }

    /// A barrier whose waits block in the kernel on the sockets, never polling the
    /// mailboxes: for ranks that wait through a long phase while others work on their cores.
    /// Every rank of the call must take it at the same point.
    fn socket_barrier(&mut self) -> Result<()> {
        self.barrier_via(false)
    }

    /// A barrier through the mailboxes where they serve (`mailbox`), else over the sockets.
    fn barrier_via(&mut self, mailbox: bool) -> Result<()> {
        let seq = self.begin()?;
        if self.size() == 1 {
            return Ok(());
        }
        let mut mine = desc::<u8>(Kind::Barrier, None, seq, 0);
        mine.dtype = None;
        let out = |_| (mine, &[][..]);
        let sink =
            |_, d: &Descriptor, rd: &mut dyn std::io::Read| crate::link::discard(rd, d.payload_len);
        if !mailbox {
            self.open_sockets(mine, Ok(()), out, sink)?;
        } else if self.fits_mailbox(0) {
            let mut inbox = vec![Vec::new(); self.size()];
            self.open_mailbox(mine, Ok(()), &[], &mut inbox)?;
        } else {
            self.open(mine, Ok(()), out, sink)?;
        }
        Ok(())
    }
}

/// `acc[x] op= staged[k * stride + x]` for every source `k < sources`, in order, one L1-sized
/// stretch of `acc` at a time, so `acc` is read and written once instead of once per source.
/// Every element sees the same operations in the same order as source by source.
fn reduce_staged<T: Element>(
    acc: &mut [T],
    staged: &[T],
    stride: usize,
    sources: usize,
    op: ReduceOp,
) {
    let len = acc.len();
    let step = (REDUCE_STRETCH / std::mem::size_of::<T>()).max(1);
    let mut at = 0;
    while at < len {
        let end = (at + step).min(len);
        for k in 0..sources {
            let src = &staged[k * stride + at..k * stride + end];
            T::reduce_into(&mut acc[at..end], src, op);
        }
        at = end;
    }
}

fn prefix_sums(parts: &[usize]) -> Vec<usize> {
    let mut v = Vec::with_capacity(parts.len() + 1);
    v.push(0);
    for p in parts {
        let last = v[v.len() - 1];
        v.push(last + p);
    }
    v
}

/// The splits to use, and whether the caller's were valid (invalid ones fall back to zeros so
/// the rank can still take part in the opening exchange and report its error everywhere).
fn resolve_splits(
    len: usize,
    splits: &[usize],
    n: usize,
) -> (Vec<usize>, std::result::Result<(), String>) {
    let bad = |msg: String| (vec![0; n], Err(msg));
    if splits.is_empty() {
        if !len.is_multiple_of(n) {
            return bad(format!(
                "{len} elements do not split evenly over {n} ranks; pass splits"
            ));
        }
        return (vec![len / n; n], Ok(()));
    }
    if splits.len() != n {
        return bad(format!("{} splits for a world of {n}", splits.len()));
    }
    let sum: usize = splits.iter().sum();
    if sum != len {
        return bad(format!(
            "splits sum to {sum} but the input has {len} elements"
        ));
    }
    (splits.to_vec(), Ok(()))
}
