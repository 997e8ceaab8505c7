//! Small messages between ranks of one host without a socket on the data path.
//!
//! Every rank owns a mailbox of two slots in its own memory; a collective numbered `seq` posts
//! this rank's descriptor and payload into slot `seq % 2`, and peers read it with one
//! `process_vm_readv` each (the same cross-memory attach the large transfers use). Two slots
//! suffice: every collective starts by reading every peer's descriptor, so no rank can post
//! call `seq + 2` before every peer has finished reading call `seq`.
//!
//! After reading every peer's post for a call, a rank records the call in its `done` word
//! (after the two slots); a communicator being dropped waits, briefly, until its peers' `done`
//! words show they have read its last post, so that leaving right after a call (the last
//! barrier of a job) never takes a post away from a slower peer.
//!
//! A slot is `[header][descriptor][payload][trailer]` in 8-byte words. The writer stores the
//! payload, then the trailer, then the header (release stores); both carry `seq + 1`. A reader
//! copies the slot in ascending address order and takes it only when header and trailer both
//! say `seq + 1`, so a copy that raced the writer is read again.

use std::io::{self, IoSliceMut};
use std::sync::atomic::{AtomicU64, Ordering};

use nix::sys::uio::{RemoteIoVec, process_vm_readv};
use nix::unistd::Pid;

use crate::wire::DESCRIPTOR_LEN;

const DESC_WORDS: usize = DESCRIPTOR_LEN / 8;

/// Bytes of a slot carrying `payload` bytes, header and trailer included.
pub(crate) fn slot_bytes(payload: usize) -> usize {
    8 * (1 + DESC_WORDS + payload.div_ceil(8) + 1)
}

/// This rank's mailbox: peers read it, only this rank writes it.
#[derive(Debug)]
pub(crate) struct Mailbox {
    words: Box<[AtomicU64]>,
    /// Words per slot.
    stride: usize,
    /// Largest payload a slot holds, in bytes.
    capacity: usize,
}

impl Mailbox {
    /// A mailbox whose slots hold payloads of up to `capacity` bytes.
    pub(crate) fn new(capacity: usize) -> Self {
        let stride = slot_bytes(capacity) / 8;
        Self {
            words: (0..2 * stride + 1).map(|_| AtomicU64::new(0)).collect(),
            stride,
            capacity,
        }
    }

    /// Where peers find it.
    pub(crate) fn addr(&self) -> usize {
        self.words.as_ptr() as usize
    }

    /// Bytes from one slot to the next.
    pub(crate) fn stride_bytes(&self) -> usize {
        self.stride * 8
    }

    /// Largest payload a slot holds.
    pub(crate) fn capacity(&self) -> usize {
        self.capacity
    }

    /// Records that this rank has read every peer's post for call `seq`.
    pub(crate) fn finish(&self, seq: u64) {
        self.words[2 * self.stride].store(seq + 1, Ordering::Release);
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
        words[body + len.div_ceil(8)].store(seq + 1, Ordering::Release);
        words[0].store(seq + 1, Ordering::Release);
    }
}

/// A peer's mailbox, as its negotiation record announced it.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Remote {
    pub(crate) addr: usize,
    pub(crate) stride: usize,
    pub(crate) capacity: usize,
}

/// Whether a peer has read every post up to call `seq` (its `done` word).
pub(crate) fn peer_finished(pid: Pid, remote: &Remote, seq: u64) -> io::Result<bool> {
    let mut w = [0u8; 8];
    let n = process_vm_readv(
        pid,
        &mut [IoSliceMut::new(&mut w)],
        &[RemoteIoVec {
            base: remote.addr + 2 * remote.stride,
            len: 8,
        }],
    )
    .map_err(io::Error::from)?;
    Ok(n == 8 && u64::from_ne_bytes(w) > seq)
}

/// Reads call `seq` from a peer's mailbox into `buf` (its descriptor, then the payload),
/// expecting `len` payload bytes. `Ok(None)` while the peer has not posted it.
pub(crate) fn peek(
    pid: Pid,
    remote: &Remote,
    seq: u64,
    len: usize,
    buf: &mut Vec<u8>,
) -> io::Result<Option<[u8; DESCRIPTOR_LEN]>> {
    let base = remote.addr + (seq % 2) as usize * remote.stride;
    let mut want = len.min(remote.capacity);
    // A second pass only when the peer's payload length differs from ours.
    for _ in 0..2 {
        let total = slot_bytes(want);
        buf.resize(total, 0);
        let n = process_vm_readv(
            pid,
            &mut [IoSliceMut::new(&mut buf[..])],
            &[RemoteIoVec { base, len: total }],
        )
        .map_err(io::Error::from)?;
        if n < total {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "its mailbox could not be read whole",
            ));
        }
        let word = |i: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&buf[8 * i..8 * i + 8]);
            u64::from_ne_bytes(w)
        };
        if word(0) != seq + 1 {
            return Ok(None);
        }
        let mut desc = [0u8; DESCRIPTOR_LEN];
        desc.copy_from_slice(&buf[8..8 + DESCRIPTOR_LEN]);
        // payload_len sits at the same place in every descriptor; the peer's may differ from
        // ours (a mismatch the caller reports), and the trailer follows the peer's payload.
        let theirs = crate::wire::Descriptor::decode(&desc)
            .ok()
            .and_then(|d| usize::try_from(d.payload_len).ok())
            .unwrap_or(0)
            .min(remote.capacity);
        if theirs != want {
            want = theirs;
            continue;
        }
        if word(total / 8 - 1) != seq + 1 {
            // Copied while the peer was writing: the header is new but the rest is not yet.
            return Ok(None);
        }
        buf.drain(..8 + DESCRIPTOR_LEN);
        buf.truncate(want);
        return Ok(Some(desc));
    }
    Ok(None)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn remote(m: &Mailbox) -> Remote {
        Remote {
            addr: m.addr(),
            stride: m.stride_bytes(),
            capacity: m.capacity(),
        }
    }

    fn desc(payload_len: usize) -> [u8; DESCRIPTOR_LEN] {
        crate::wire::Descriptor {
            kind: crate::wire::Kind::Allreduce,
            dtype: None,
            op: None,
            root: 0,
            seq: 0,
            count: 0,
            row_len: 1,
            payload_len: payload_len as u64,
            invalid: false,
        }
        .encode()
    }

    #[test]
    fn a_post_is_read_whole_and_only_for_its_call() {
        let m = Mailbox::new(64);
        let (me, r) = (Pid::this(), remote(&m));
        let mut buf = Vec::new();
        assert_eq!(peek(me, &r, 0, 5, &mut buf).unwrap(), None);
        m.post(0, &desc(5), b"hello");
        assert_eq!(peek(me, &r, 0, 5, &mut buf).unwrap(), Some(desc(5)));
        assert_eq!(buf, b"hello");
        // Call 2 uses the same slot: the post for call 0 is not mistaken for it.
        assert_eq!(peek(me, &r, 2, 5, &mut buf).unwrap(), None);
        // A peer whose payload differs in length is still read whole (the caller reports it).
        m.post(1, &desc(11), b"hello world");
        assert_eq!(peek(me, &r, 1, 3, &mut buf).unwrap(), Some(desc(11)));
        assert_eq!(buf, b"hello world");
    }

    #[test]
    fn a_copy_that_raced_the_writer_is_not_taken() {
        let m = Mailbox::new(64);
        let (me, r) = (Pid::this(), remote(&m));
        m.post(0, &desc(16), &[7u8; 16]);
        // The header of call 2 is written but its trailer not yet: a torn copy.
        m.words[0].store(3, Ordering::Release);
        let mut buf = Vec::new();
        assert_eq!(peek(me, &r, 2, 16, &mut buf).unwrap(), None);
        m.post(2, &desc(16), &[9u8; 16]);
        assert!(peek(me, &r, 2, 16, &mut buf).unwrap().is_some());
        assert_eq!(buf, [9u8; 16]);
    }

    #[test]
    fn finished_calls_are_visible_to_peers() {
        let m = Mailbox::new(0);
        let (me, r) = (Pid::this(), remote(&m));
        assert!(!peer_finished(me, &r, 0).unwrap());
        m.finish(4);
        assert!(peer_finished(me, &r, 4).unwrap());
        assert!(!peer_finished(me, &r, 5).unwrap());
    }
}
