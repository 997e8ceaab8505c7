//! Small messages between ranks of one host without a socket on the data path.
//!
//! Every rank owns a mailbox of two slots in its own memory; a collective numbered `seq` posts
//! this rank's descriptor and payload into slot `seq % 2`, and peers read it with
//! `process_vm_readv` (the same cross-memory attach the large transfers use). Two slots
//! suffice: every collective starts with an exchange in which every rank hears from every peer
//! (through the mailboxes or the sockets), so no rank can post call `seq + 2` before every peer
//! has finished reading call `seq`.
//!
//! What makes a post safe to take:
//! - **It belongs to this mailbox and this call.** Each mailbox draws a random 64-bit `nonce`
//!   when it is made, and peers learn it with its address. A post's header and trailer carry
//!   the tag `nonce + seq + 1`, never the bare call number: call numbers restart with every
//!   communicator, and a freed mailbox's memory is soon another's (the allocator hands the
//!   same block to the next communicator of the same size). A reader holding a previous
//!   communicator's record, or reading memory that now holds anything else, finds no tag it
//!   accepts.
//! - **It is read after it was written.** The writer stores the payload, then the trailer,
//!   then the header (release stores, in program order). A reader first reads the header word
//!   alone, and only once it shows the call's tag reads the descriptor, payload and trailer in
//!   a second system call, whose loads come after the first one's. One copy of the whole slot
//!   would not do: the kernel copies with string instructions, whose loads may be performed in
//!   any order within the one instruction, so a copy can see a new header and trailer around a
//!   cache line of the previous post's payload.
//!
//! After reading every peer's post for a call, a rank records the call in its `done` word
//! (after the two slots); a communicator being dropped waits, briefly, until its peers' `done`
//! words show they have read its last post, so that leaving right after a call (the last
//! barrier of a job) never takes a post away from a slower peer.
//!
//! Two more words serve the crowded-host reduce, where ranks write into each other's buffers
//! (see `Communicator::reduce_blocks_same_host`): `open` holds the tag of the call whose
//! buffers this rank lets peers write into (0 when none), and `writing` the tag of the call
//! this rank is writing into peers for (0 when none).
//!
//! A slot is `[header][descriptor][payload][trailer]` in 8-byte words.

use std::io::{self, IoSliceMut};
use std::sync::atomic::{AtomicU64, Ordering, fence};

use nix::sys::uio::{RemoteIoVec, process_vm_readv};
use nix::unistd::Pid;

use crate::wire::DESCRIPTOR_LEN;

const DESC_WORDS: usize = DESCRIPTOR_LEN / 8;

/// The words after the two slots, by offset: `done`, `open`, `writing`.
const DONE: usize = 0;
const OPEN: usize = 1;
const WRITING: usize = 2;
const CONTROL_WORDS: usize = 3;

/// Bytes of a slot carrying `payload` bytes, header and trailer included.
pub(crate) fn slot_bytes(payload: usize) -> usize {
    8 * (1 + DESC_WORDS + payload.div_ceil(8) + 1)
}

/// The tag of call `seq` in the mailbox whose nonce is `nonce`: never 0 (nonces stay below
/// 2^63, call numbers far below that).
pub(crate) fn tag(nonce: u64, seq: u64) -> u64 {
    nonce.wrapping_add(seq).wrapping_add(1)
}

/// A fresh mailbox nonce: 63 random bits (std's per-process random hash keys, mixed with a
/// counter, the process id and the time).
fn fresh_nonce() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    static MADE: AtomicU64 = AtomicU64::new(0);
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(MADE.fetch_add(1, Ordering::Relaxed));
    h.write_u32(std::process::id());
    if let Ok(t) = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH) {
        h.write_u128(t.as_nanos());
    }
    h.finish() >> 1
}

/// Memory of another rank that this one may read: the peer's process in a communicator; tests
/// stand in for it to replay reads that race a writer.
pub(crate) trait PeerMemory {
    /// Copies up to `buf.len()` bytes from `addr`; returns how many were copied.
    fn read(&self, addr: usize, buf: &mut [u8]) -> io::Result<usize>;
}

impl PeerMemory for Pid {
    fn read(&self, addr: usize, buf: &mut [u8]) -> io::Result<usize> {
        let len = buf.len();
        process_vm_readv(
            *self,
            &mut [IoSliceMut::new(buf)],
            &[RemoteIoVec { base: addr, len }],
        )
        .map_err(io::Error::from)
    }
}

/// Reads exactly `buf.len()` bytes at `addr` in one call (a mailbox never straddles memory
/// that can be unmapped part-way).
fn read_all(mem: &impl PeerMemory, addr: usize, buf: &mut [u8]) -> io::Result<()> {
    if mem.read(addr, buf)? < buf.len() {
        return Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            "its mailbox could not be read whole",
        ));
    }
    Ok(())
}

fn read_word(mem: &impl PeerMemory, addr: usize) -> io::Result<u64> {
    let mut w = [0u8; 8];
    read_all(mem, addr, &mut w)?;
    Ok(u64::from_ne_bytes(w))
}

/// This rank's mailbox: peers read it, only this rank writes it.
#[derive(Debug)]
pub(crate) struct Mailbox {
    words: Box<[AtomicU64]>,
    /// Words per slot.
    stride: usize,
    /// Largest payload a slot holds, in bytes.
    capacity: usize,
    /// Drawn when the mailbox is made; every tag in it is derived from it.
    nonce: u64,
}

impl Mailbox {
    /// A mailbox whose slots hold payloads of up to `capacity` bytes.
    pub(crate) fn new(capacity: usize) -> Self {
        let stride = slot_bytes(capacity) / 8;
        Self {
            words: (0..2 * stride + CONTROL_WORDS)
                .map(|_| AtomicU64::new(0))
                .collect(),
            stride,
            capacity,
            nonce: fresh_nonce(),
        }
    }

    /// What a peer needs to read it: the record this rank sends when a mesh is built.
    pub(crate) fn remote(&self) -> Remote {
        Remote {
            addr: self.words.as_ptr() as usize,
            stride: self.stride * 8,
            capacity: self.capacity,
            nonce: self.nonce,
        }
    }

    fn control(&self, which: usize) -> &AtomicU64 {
        &self.words[2 * self.stride + which]
    }

    /// Records that this rank has read every peer's post for call `seq`.
    pub(crate) fn finish(&self, seq: u64) {
        self.control(DONE).store(seq + 1, Ordering::Release);
    }

    /// Lets peers write into this rank's buffers for call `seq` (see [`peer_accepts_writes`]).
    pub(crate) fn accept_writes(&self, seq: u64) {
        self.control(OPEN)
            .store(tag(self.nonce, seq), Ordering::SeqCst);
    }

    /// Stops letting peers write into this rank's buffers. The fence orders the store before
    /// the caller's next reads of its peers' `writing` words (see [`peer_writing`]).
    pub(crate) fn refuse_writes(&self) {
        self.control(OPEN).store(0, Ordering::SeqCst);
        fence(Ordering::SeqCst);
    }

    /// Announces that this rank may write into its peers for call `seq`, before it checks that
    /// they accept it; the fence orders the announcement before those checks.
    pub(crate) fn begin_writes(&self, seq: u64) {
        self.control(WRITING)
            .store(tag(self.nonce, seq), Ordering::SeqCst);
        fence(Ordering::SeqCst);
    }

    /// Withdraws [`Mailbox::begin_writes`]: this rank writes into no peer any more.
    pub(crate) fn end_writes(&self) {
        self.control(WRITING).store(0, Ordering::SeqCst);
    }

    /// Posts call `seq`'s descriptor and payload (at most [`Mailbox::capacity`] bytes).
    pub(crate) fn post(&self, seq: u64, desc: &[u8; DESCRIPTOR_LEN], payload: &[u8]) {
        let base = (seq % 2) as usize * self.stride;
        let words = &self.words[base..base + self.stride];
        let word = |b: &[u8]| {
            let mut w = [0u8; 8];
            w[..b.len()].copy_from_slice(b);
            u64::from_ne_bytes(w)
        };
        for (i, c) in desc.chunks(8).enumerate() {
            words[1 + i].store(word(c), Ordering::Relaxed);
        }
        let body = 1 + DESC_WORDS;
        let len = payload.len().min(self.capacity);
        for (i, c) in payload[..len].chunks(8).enumerate() {
            words[body + i].store(word(c), Ordering::Relaxed);
        }
        let tag = tag(self.nonce, seq);
        words[body + len.div_ceil(8)].store(tag, Ordering::Release);
        words[0].store(tag, Ordering::Release);
    }
}

/// A peer's mailbox, as its record announced it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Remote {
    pub(crate) addr: usize,
    /// Bytes from one slot to the next.
    pub(crate) stride: usize,
    pub(crate) capacity: usize,
    pub(crate) nonce: u64,
}

impl Remote {
    /// Bytes of [`Remote::encode`]'s record.
    pub(crate) const RECORD: usize = 32;

    /// The record a rank sends its peers.
    pub(crate) fn encode(&self) -> [u8; Self::RECORD] {
        let mut b = [0u8; Self::RECORD];
        let fields = [
            self.addr as u64,
            self.stride as u64,
            self.capacity as u64,
            self.nonce,
        ];
        for (i, v) in fields.into_iter().enumerate() {
            b[8 * i..8 * i + 8].copy_from_slice(&v.to_le_bytes());
        }
        b
    }

    /// A record read from a peer (at least [`Remote::RECORD`] bytes).
    pub(crate) fn decode(b: &[u8]) -> Self {
        let field = |i: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&b[8 * i..8 * i + 8]);
            u64::from_le_bytes(w)
        };
        let size = |i: usize| usize::try_from(field(i)).unwrap_or(0);
        Self {
            addr: size(0),
            stride: size(1),
            capacity: size(2),
            nonce: field(3),
        }
    }

    fn control(&self, which: usize) -> usize {
        self.addr + 2 * self.stride + 8 * which
    }
}

/// Whether a peer has read every post up to call `seq` (its `done` word).
pub(crate) fn peer_finished(mem: &impl PeerMemory, remote: &Remote, seq: u64) -> io::Result<bool> {
    Ok(read_word(mem, remote.control(DONE))? > seq)
}

/// Whether a peer still lets this rank write into its buffers for call `seq`.
pub(crate) fn peer_accepts_writes(
    mem: &impl PeerMemory,
    remote: &Remote,
    seq: u64,
) -> io::Result<bool> {
    Ok(read_word(mem, remote.control(OPEN))? == tag(remote.nonce, seq))
}

/// Whether a peer has announced writes into its peers for call `seq` and not withdrawn them.
pub(crate) fn peer_writing(mem: &impl PeerMemory, remote: &Remote, seq: u64) -> io::Result<bool> {
    Ok(read_word(mem, remote.control(WRITING))? == tag(remote.nonce, seq))
}

/// Reads call `seq` from a peer's mailbox into `buf` (its descriptor, then the payload),
/// expecting `len` payload bytes. `Ok(None)` while the peer has not posted it.
///
/// # Errors
/// The peer's memory cannot be read, or its post's trailer does not match its header.
pub(crate) fn peek(
    mem: &impl PeerMemory,
    remote: &Remote,
    seq: u64,
    len: usize,
    buf: &mut Vec<u8>,
) -> io::Result<Option<[u8; DESCRIPTOR_LEN]>> {
    let base = remote.addr + (seq % 2) as usize * remote.stride;
    let tag = tag(remote.nonce, seq);
    if read_word(mem, base)? != tag {
        return Ok(None);
    }
    // The header shows this call, so everything the peer wrote before it (descriptor, payload,
    // trailer) is there for the loads of the reads below, which come after this one.
    let mut want = len.min(remote.capacity);
    // A second pass only when the peer's payload length differs from ours.
    for _ in 0..2 {
        let total = slot_bytes(want) - 8;
        buf.resize(total, 0);
        read_all(mem, base + 8, &mut buf[..])?;
        let mut desc = [0u8; DESCRIPTOR_LEN];
        desc.copy_from_slice(&buf[..DESCRIPTOR_LEN]);
        // payload_len sits at the same place in every descriptor; the peer's may differ from
        // ours (a mismatch the caller reports), and the trailer follows the peer's payload.
        let Ok(d) = crate::wire::Descriptor::decode(&desc) else {
            // Not a descriptor: the caller decodes it again and reports what is wrong.
            buf.clear();
            return Ok(Some(desc));
        };
        let theirs = usize::try_from(d.payload_len)
            .unwrap_or(usize::MAX)
            .min(remote.capacity);
        if theirs != want {
            want = theirs;
            continue;
        }
        let mut w = [0u8; 8];
        w.copy_from_slice(&buf[total - 8..]);
        if u64::from_ne_bytes(w) != tag {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("its mailbox post for call #{seq} has a header but no matching trailer"),
            ));
        }
        buf.drain(..DESCRIPTOR_LEN);
        buf.truncate(want);
        return Ok(Some(desc));
    }
    Err(io::Error::new(
        io::ErrorKind::InvalidData,
        format!("its mailbox post for call #{seq} changed length while it was read"),
    ))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::cell::Cell;

    use super::*;

    /// This process's own memory, read as a peer's would be.
    fn me() -> Pid {
        Pid::this()
    }

    fn desc(payload_len: usize, seq: u64) -> [u8; DESCRIPTOR_LEN] {
        crate::wire::Descriptor {
            payload_len: payload_len as u64,
            ..crate::wire::Descriptor::bare(crate::wire::Kind::Allreduce, seq)
        }
        .encode()
    }

    fn words(v: &[u64]) -> Vec<u8> {
        v.iter().flat_map(|w| w.to_ne_bytes()).collect()
    }

    #[test]
    fn a_post_is_read_whole_and_only_for_its_call() {
        let m = Mailbox::new(64);
        let r = m.remote();
        let mut buf = Vec::new();
        assert_eq!(peek(&me(), &r, 0, 5, &mut buf).unwrap(), None);
        m.post(0, &desc(5, 0), b"hello");
        assert_eq!(peek(&me(), &r, 0, 5, &mut buf).unwrap(), Some(desc(5, 0)));
        assert_eq!(buf, b"hello");
        // Call 2 uses the same slot: the post for call 0 is not mistaken for it.
        assert_eq!(peek(&me(), &r, 2, 5, &mut buf).unwrap(), None);
        // A peer whose payload differs in length is still read whole (the caller reports it).
        m.post(1, &desc(11, 1), b"hello world");
        assert_eq!(peek(&me(), &r, 1, 3, &mut buf).unwrap(), Some(desc(11, 1)));
        assert_eq!(buf, b"hello world");
    }

    #[test]
    fn a_previous_communicators_record_never_takes_the_next_ones_post() {
        // Call numbers restart with every communicator, and the next communicator's mailbox
        // is often the same memory as the last one's. A reader still holding the old record
        // (its nonce) at that address must not take the new post of the same call number.
        let old = Mailbox::new(64);
        old.post(3, &desc(16, 3), &words(&[14_142, 14_142]));
        let new = Mailbox::new(64);
        new.post(3, &desc(16, 3), &words(&[1, 1]));
        let stale = Remote {
            nonce: old.remote().nonce,
            ..new.remote()
        };
        assert_ne!(stale.nonce, new.remote().nonce);
        let mut buf = Vec::new();
        assert_eq!(peek(&me(), &stale, 3, 16, &mut buf).unwrap(), None);
        assert_eq!(
            peek(&me(), &new.remote(), 3, 16, &mut buf).unwrap(),
            Some(desc(16, 3))
        );
        assert_eq!(buf, words(&[1, 1]));
        // Nor do its other words answer for the new communicator's calls.
        new.finish(3);
        new.accept_writes(3);
        new.begin_writes(3);
        assert!(!peer_accepts_writes(&me(), &stale, 3).unwrap());
        assert!(!peer_writing(&me(), &stale, 3).unwrap());
        assert!(peer_accepts_writes(&me(), &new.remote(), 3).unwrap());
        assert!(peer_writing(&me(), &new.remote(), 3).unwrap());
    }

    /// A reader racing the writer, as the kernel's copy may behave: reads that end before the
    /// post see none of it, reads that start after it see all of it, and the read during which
    /// it lands takes each 64-byte line from before or after the post, whichever is worse:
    /// the lines holding the header and the trailer new (the post looks complete), every
    /// other line old.
    struct Racing {
        before: Vec<u8>,
        base: usize,
        fresh: [usize; 2],
        during: usize,
        reads: Cell<usize>,
    }

    impl PeerMemory for Racing {
        fn read(&self, addr: usize, buf: &mut [u8]) -> io::Result<usize> {
            let n = self.reads.get();
            self.reads.set(n + 1);
            let got = me().read(addr, buf)?;
            for (i, b) in buf.iter_mut().enumerate() {
                let a = addr + i;
                if n < self.during || (n == self.during && !self.fresh.contains(&(a / 64))) {
                    *b = self.before[a - self.base];
                }
            }
            Ok(got)
        }
    }

    #[test]
    fn a_copy_racing_the_post_never_passes_an_old_payload_for_the_new_call() {
        // Call 2 posts 16 ones into the slot where call 0 left [14142, 14142] (the shape of a
        // wrong result once seen: a line of the previous post between a new header and
        // trailer). Whichever read the post lands during, the reader takes either nothing
        // yet or the new payload.
        for during in 0..4 {
            let m = Mailbox::new(256);
            m.post(0, &desc(16, 0), &words(&[14_142, 14_142]));
            m.post(1, &desc(8, 1), &words(&[7]));
            let before: Vec<u8> = m
                .words
                .iter()
                .flat_map(|w| w.load(Ordering::Relaxed).to_ne_bytes())
                .collect();
            m.post(2, &desc(128, 2), &words(&[1; 16]));
            let r = m.remote();
            let trailer = r.addr + 8 * (1 + DESC_WORDS + 16);
            let racing = Racing {
                before,
                base: r.addr,
                fresh: [r.addr / 64, trailer / 64],
                during,
                reads: Cell::new(0),
            };
            let mut buf = Vec::new();
            let got = loop {
                if let Some(d) = peek(&racing, &r, 2, 128, &mut buf).unwrap() {
                    break d;
                }
            };
            assert_eq!(got, desc(128, 2));
            assert_eq!(buf, words(&[1; 16]), "the post landed during read {during}");
        }
    }

    #[test]
    fn a_header_without_its_trailer_is_an_error_not_a_payload() {
        let m = Mailbox::new(64);
        m.post(0, &desc(16, 0), &[7u8; 16]);
        // Header of call 2 in place, trailer not: memory that no correct writer leaves.
        m.words[0].store(tag(m.nonce, 2), Ordering::Release);
        let mut buf = Vec::new();
        let e = peek(&me(), &m.remote(), 2, 16, &mut buf).unwrap_err();
        assert!(e.to_string().contains("no matching trailer"), "{e}");
    }

    #[test]
    fn control_words_are_visible_to_peers() {
        let m = Mailbox::new(0);
        let r = m.remote();
        assert!(!peer_finished(&me(), &r, 0).unwrap());
        m.finish(4);
        assert!(peer_finished(&me(), &r, 4).unwrap());
        assert!(!peer_finished(&me(), &r, 5).unwrap());
        assert!(!peer_accepts_writes(&me(), &r, 4).unwrap());
        m.accept_writes(4);
        assert!(peer_accepts_writes(&me(), &r, 4).unwrap());
        assert!(!peer_accepts_writes(&me(), &r, 5).unwrap());
        m.refuse_writes();
        assert!(!peer_accepts_writes(&me(), &r, 4).unwrap());
        m.begin_writes(9);
        assert!(peer_writing(&me(), &r, 9).unwrap());
        m.end_writes();
        assert!(!peer_writing(&me(), &r, 9).unwrap());
    }

    #[test]
    fn records_survive_the_wire_and_nonces_differ() {
        let m = Mailbox::new(100);
        let r = m.remote();
        assert_eq!(Remote::decode(&r.encode()), r);
        assert_ne!(Mailbox::new(100).remote().nonce, r.nonce);
        assert!(r.nonce < 1 << 63);
    }
}
