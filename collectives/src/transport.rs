//! How bytes move between ranks: every call's opening (over sockets or same-host mailboxes),
//! the ring and pairwise exchanges, and the same-host pushes into peers' buffers.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::thread;
use std::time::Duration;

use crate::comm::{Communicator, Phase};
use crate::dtype::Element;
use crate::error::{CommError, Result};
use crate::link::{LinkFailure, discard, read_full, write_full};
use crate::pipeline::{self, Recv};
use crate::wire::{DESCRIPTOR_LEN, Descriptor, Kind};

impl Communicator {
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

    /// Waits until at least one of `peers` has something to read (or has closed); returns
    /// those that do. Past `deadline`, the first of them times out.
    fn wait_readable(
        &self,
        peers: &[usize],
        deadline: std::time::Instant,
    ) -> std::result::Result<Vec<usize>, (usize, std::io::Error)> {
        use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
        use std::os::fd::AsFd;
        if let Some(&p) = peers.iter().find(|&&p| self.readers[p].is_none()) {
            return Err((p, std::io::Error::other("no connection to this peer")));
        }
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
        sink: impl FnMut(usize, &Descriptor, &mut dyn Read) -> std::io::Result<()>,
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
    /// peer over TCP; waits block in `poll`. A world larger than
    /// [`crate::CommConfig::direct_open_max`] opens a call that tells every peer the same in
    /// rounds ([`Communicator::open_rounds`]).
    pub(crate) fn open_sockets<'p>(
        &mut self,
        mine: Descriptor,
        local: std::result::Result<(), String>,
        out: impl Fn(usize) -> (Descriptor, &'p [u8]),
        mut sink: impl FnMut(usize, &Descriptor, &mut dyn Read) -> std::io::Result<()>,
    ) -> Result<Vec<Descriptor>> {
        let op = mine.kind.name();
        let (n, r) = (self.size(), self.rank());
        if n > self.cfg.direct_open_max.max(1) {
            let (d, payload) = out((r + 1) % n);
            let uniform = (2..n).all(|k| {
                let (e, q) = out((r + k) % n);
                e == d && std::ptr::eq(q, payload)
            });
            if uniform {
                return self.open_rounds(mine, d, payload, local, sink);
            }
        }
        // A large world's pairs beyond the rounds' connect now, once.
        self.reach(0..n)?;
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
                let w = self.writers[p]
                    .as_mut()
                    .ok_or_else(|| unreached(&self.shared, p))?;
                write_full(w, &self.txbuf).map_err(|e| LinkFailure::new(&self.shared, p, e))?;
            }
            Ok(())
        });
        if let Err(f) = sent {
            return Err(self.link_error(f, op, Phase::Arrival));
        }
        let mut descs = vec![flag(mine); n];
        // Read descriptors in the order peers send them: a dead peer is noticed at once even
        // while another peer is slow to arrive (or stopped), instead of behind it.
        let mut pending: Vec<usize> = (1..n).map(|k| (r + n - k) % n).collect();
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
                    && let Err(e) = sink(p, &d, &mut *reader)
                {
                    let f = LinkFailure::new(&self.shared, p, e);
                    return Err(self.link_error(f, op, Phase::Arrival));
                }
                descs[p] = d;
            }
        }
        self.agree(op, local, descs)
    }

    /// [`Communicator::open_sockets`] for a call that tells every peer the same descriptor and
    /// payload, in ⌈log2 n⌉ rounds (Bruck's allgather): in the round where this rank holds the
    /// items of ranks `r .. r + h`, it sends the first `min(h, n − h)` of them to rank `r − h`
    /// and receives as many, those of ranks `r + h ..`, from rank `r + h`. Each rank talks to
    /// 2⌈log2 n⌉ peers instead of n − 1 and ends holding every rank's descriptor, so the
    /// agreement and its errors are those of the direct opening. Payloads reach `sink` in the
    /// direct opening's order once every round is done.
    fn open_rounds(
        &mut self,
        mine: Descriptor,
        told: Descriptor,
        payload: &[u8],
        local: std::result::Result<(), String>,
        mut sink: impl FnMut(usize, &Descriptor, &mut dyn Read) -> std::io::Result<()>,
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
        let told = flag(told);
        let payload = if told.payload_len > 0 { payload } else { &[] };
        // The items this rank holds, rank r + i's at index i: descriptors, and their encodings
        // with payloads end to end in `held` (item i spans `ends[i]..ends[i + 1]`).
        let mut descs_held = vec![told];
        let mut held = told.encode().to_vec();
        held.extend_from_slice(payload);
        let mut ends = vec![0, held.len()];
        if let Err(f) = self.set_phase(Phase::Arrival) {
            return Err(self.link_error(f, op, Phase::Arrival));
        }
        while descs_held.len() < n {
            let h = descs_held.len();
            let count = h.min(n - h);
            let (to, from) = ((r + n - h) % n, (r + h) % n);
            let got = match self.swap(to, &held[..ends[count]], from) {
                Ok(got) => got,
                Err(f) => return Err(self.link_error(f, op, Phase::Arrival)),
            };
            let mut at = 0;
            for i in 0..count {
                let p = (from + i) % n;
                let item = got.get(at..at + DESCRIPTOR_LEN).map(|b| {
                    let mut head = [0u8; DESCRIPTOR_LEN];
                    head.copy_from_slice(b);
                    Descriptor::decode(&head)
                });
                let d = match item {
                    Some(Ok(d)) => d,
                    Some(Err(detail)) => {
                        return Err(self.fail(CommError::Protocol { rank: p, detail }));
                    }
                    None => {
                        let detail =
                            format!("rank {from} relayed {count} items in {} bytes", got.len());
                        return Err(self.fail(CommError::Protocol { rank: from, detail }));
                    }
                };
                let end = usize::try_from(d.payload_len)
                    .ok()
                    .and_then(|len| (at + DESCRIPTOR_LEN).checked_add(len))
                    .filter(|&end| end <= got.len());
                let Some(end) = end else {
                    let detail = format!("rank {from} relayed a payload past its message's end");
                    return Err(self.fail(CommError::Protocol { rank: from, detail }));
                };
                held.extend_from_slice(&got[at..end]);
                ends.push(held.len());
                descs_held.push(d);
                at = end;
            }
            if at != got.len() {
                let detail = format!(
                    "rank {from} relayed {} bytes past its items",
                    got.len() - at
                );
                return Err(self.fail(CommError::Protocol { rank: from, detail }));
            }
        }
        let mut descs = vec![flag(mine); n];
        for i in 1..n {
            let (p, d) = ((r + i) % n, descs_held[i]);
            if d.payload_len > 0 {
                let mut rd = &held[ends[i] + DESCRIPTOR_LEN..ends[i + 1]];
                if let Err(e) = sink(p, &d, &mut rd) {
                    let detail = format!("its payload could not be taken: {e}");
                    return Err(self.fail(CommError::Protocol { rank: p, detail }));
                }
            }
            descs[p] = d;
        }
        self.agree(op, local, descs)
    }

    /// Sends `out`, behind its length, to rank `to` while receiving one such message from rank
    /// `from` (the same rank or another), both sockets non-blocking under one `poll`, so that
    /// neither side's write waits for the other's read. Waits up to the arrival timeout.
    fn swap(
        &self,
        to: usize,
        out: &[u8],
        from: usize,
    ) -> std::result::Result<Vec<u8>, LinkFailure> {
        use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
        use std::io::ErrorKind::{Interrupted, TimedOut, UnexpectedEof, WouldBlock};
        use std::os::fd::AsFd;
        let shared = &*self.shared;
        let (Some(mut w), Some(mut rd)) = (self.writers[to].as_ref(), self.readers[from].as_ref())
        else {
            let e = std::io::Error::other("no connection to this peer");
            return Err(LinkFailure::new(shared, to, e));
        };
        let _modes = crate::pipeline::NonBlocking::new(w, rd)
            .map_err(|e| LinkFailure::new(shared, to, e))?;
        let header = (out.len() as u64).to_le_bytes();
        let mut sent = 0;
        let (mut head, mut got_head) = ([0u8; 8], 0);
        let mut body: Vec<u8> = Vec::new();
        let deadline = std::time::Instant::now() + self.cfg.arrival_timeout;
        loop {
            let mut progressed = false;
            while sent < header.len() + out.len() {
                let chunk = match sent.checked_sub(header.len()) {
                    None => &header[sent..],
                    Some(at) => &out[at..],
                };
                match w.write(chunk) {
                    Ok(k) => {
                        sent += k;
                        progressed = true;
                    }
                    Err(e) if e.kind() == WouldBlock => break,
                    Err(e) if e.kind() == Interrupted => {}
                    Err(e) => return Err(LinkFailure::new(shared, to, e)),
                }
            }
            // The message's length first, then its bytes, taken as they come (a length that
            // lies only makes the wait time out: nothing is allocated ahead of the bytes).
            let done = loop {
                let want = (got_head == head.len())
                    .then(|| usize::try_from(u64::from_le_bytes(head)).unwrap_or(usize::MAX));
                if want == Some(body.len()) {
                    break true;
                }
                let start = body.len();
                let target: &mut [u8] = match want {
                    None => &mut head[got_head..],
                    Some(want) => {
                        body.resize(start + (want - start).min(64 * 1024), 0);
                        &mut body[start..]
                    }
                };
                let read = rd.read(target);
                if want.is_some() {
                    body.truncate(start + *read.as_ref().unwrap_or(&0));
                }
                match read {
                    Ok(0) => {
                        let e = std::io::Error::new(UnexpectedEof, "connection closed by peer");
                        return Err(LinkFailure::new(shared, from, e));
                    }
                    Ok(k) => {
                        if want.is_none() {
                            got_head += k;
                        }
                        progressed = true;
                    }
                    Err(e) if e.kind() == WouldBlock => break false,
                    Err(e) if e.kind() == Interrupted => {}
                    Err(e) => return Err(LinkFailure::new(shared, from, e)),
                }
            };
            if done && sent == header.len() + out.len() {
                return Ok(body);
            }
            if progressed {
                continue;
            }
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            let (peer, what) = if done {
                (to, "could not send")
            } else {
                (from, "no descriptor arrived")
            };
            if left.is_zero() {
                return Err(LinkFailure::new(
                    shared,
                    peer,
                    std::io::Error::new(TimedOut, what),
                ));
            }
            let mut fds = Vec::with_capacity(2);
            if !done {
                fds.push(PollFd::new(rd.as_fd(), PollFlags::POLLIN));
            }
            if sent < header.len() + out.len() {
                fds.push(PollFd::new(w.as_fd(), PollFlags::POLLOUT));
            }
            let ms = i32::try_from(left.as_millis().max(1)).unwrap_or(i32::MAX);
            match poll(
                &mut fds,
                PollTimeout::try_from(ms).unwrap_or(PollTimeout::MAX),
            ) {
                Ok(_) | Err(nix::errno::Errno::EINTR) => {}
                Err(e) => return Err(LinkFailure::new(shared, peer, std::io::Error::from(e))),
            }
        }
    }

    /// Every rank's `item` by rank (items of one length): an allgather of a few bytes carried
    /// by a call's opening (one message to each peer, or rounds in a large world), for what
    /// the ranks agree on while the communicator is built.
    pub(crate) fn gather_small(&mut self, item: &[u8]) -> Result<Vec<Vec<u8>>> {
        let seq = self.begin()?;
        let len = item.len() as u64;
        let d = Descriptor {
            dtype: Some(crate::dtype::DType::U8),
            count: len,
            row_len: 1,
            payload_len: len,
            ..Descriptor::bare(Kind::Allgather, seq)
        };
        let mut got = vec![Vec::new(); self.size()];
        got[self.rank()] = item.to_vec();
        let descs = self.open_sockets(
            d,
            Ok(()),
            |_| (d, item),
            |p, d, rd| {
                if d.payload_len != len {
                    return discard(rd, d.payload_len);
                }
                let mut theirs = vec![0u8; item.len()];
                read_full(rd, &mut theirs)?;
                got[p] = theirs;
                Ok(())
            },
        )?;
        if let Some(p) = (0..descs.len()).find(|&p| descs[p].payload_len != len) {
            let detail = format!(
                "sent {} bytes where {len} were agreed",
                descs[p].payload_len
            );
            return Err(self.fail(CommError::Protocol { rank: p, detail }));
        }
        Ok(got)
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
    pub(crate) fn closed_peer(&self, peers: &[usize]) -> Option<usize> {
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
        let (n, r) = (self.size(), self.rank());
        // Both ends of a transfer name each other: the pairs of a large world that are not
        // connected yet connect now, once.
        self.reach((0..n).filter(|&p| sends[p].is_some() || recvs[p].is_some()))?;
        if let Err(f) = self.set_phase(Phase::Data) {
            return Err(self.link_error(f, op, Phase::Data));
        }
        let shared = &*self.shared;
        let writers = &mut self.writers;
        let readers = &mut self.readers;
        let res = thread::scope(|scope| {
            let sender = scope.spawn(move || -> std::result::Result<(), LinkFailure> {
                for k in 1..n {
                    let p = (r + k) % n;
                    let Some(buf) = sends[p] else { continue };
                    let w = writers[p].as_mut().ok_or_else(|| unreached(shared, p))?;
                    write_full(w, buf).map_err(|e| LinkFailure::new(shared, p, e))?;
                }
                Ok(())
            });
            let mut received = Ok(());
            for k in 1..n {
                let p = (r + n - k) % n;
                let Some(buf) = recvs[p].as_deref_mut() else {
                    continue;
                };
                let done = match readers[p].as_mut() {
                    Some(rd) => read_full(rd, buf).map_err(|e| LinkFailure::new(shared, p, e)),
                    None => Err(unreached(shared, p)),
                };
                if let Err(f) = done {
                    received = Err(f);
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
}

/// The failure of a transfer to or from a peer this rank holds no connection to.
fn unreached(shared: &crate::link::Shared, p: usize) -> LinkFailure {
    LinkFailure::new(
        shared,
        p,
        std::io::Error::other("no connection to this peer"),
    )
}

/// Reads an inline payload into `dst` when it is what this rank expects, else drops it.
pub(crate) fn take_payload<T: Element>(
    reader: &mut dyn Read,
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
