//! The pipelined segment engine behind the ring allreduce, reducescatter and chain broadcast.
//!
//! A buffer is cut into segments. One thread drives both directions with non-blocking sockets:
//! it writes queued segments to the right-hand neighbour while it reads segments from the
//! left-hand one (each segment striped over every connection to that neighbour), reducing (or
//! copying) them in place, and queues each finished segment that travels on. Sending, receiving and reducing overlap segment by segment and
//! across ring steps, with no second thread to wake (on a machine with fewer cores than ranks,
//! every extra runnable thread costs a context switch per segment). A segment is never
//! overwritten while its old contents still wait to be sent.

use std::collections::VecDeque;
use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::os::fd::AsFd;
use std::time::Duration;

use nix::poll::{PollFd, PollFlags, PollTimeout, poll};

use crate::dtype::{Element, ReduceOp};
use crate::link::{LinkFailure, Shared};
/// What to do with a segment that arrives from the left.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Mode {
    /// Combine it into the local segment.
    Reduce(ReduceOp),
    /// Combine, then divide by the world size (the last step of an average).
    ReduceDivide(usize),
    /// Overwrite the local segment.
    Copy,
}

/// One receive of the schedule: which segment, how, and whether it is sent on afterwards.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Recv {
    pub seg: usize,
    pub mode: Mode,
    pub forward: bool,
}

/// Cuts `buf` into `bounds.len() - 1` segments at the given element offsets.
pub(crate) fn split_at_bounds<'a, T>(mut buf: &'a mut [T], bounds: &[usize]) -> Vec<&'a mut [T]> {
    let mut out = Vec::with_capacity(bounds.len().saturating_sub(1));
    for w in bounds.windows(2) {
        let (head, tail) = std::mem::take(&mut buf).split_at_mut(w[1] - w[0]);
        out.push(head);
        buf = tail;
    }
    out
}

/// Puts both sockets in non-blocking mode for the engine and back when it is done.
pub(crate) struct NonBlocking<'a>(&'a TcpStream, &'a TcpStream);

impl<'a> NonBlocking<'a> {
    pub(crate) fn new(a: &'a TcpStream, b: &'a TcpStream) -> io::Result<Self> {
        a.set_nonblocking(true)?;
        b.set_nonblocking(true)?;
        Ok(Self(a, b))
    }
}

impl Drop for NonBlocking<'_> {
    fn drop(&mut self) {
        // A socket that can't be switched back is broken, and the next call reports it.
        let _ = self.0.set_nonblocking(false);
        let _ = self.1.set_nonblocking(false);
    }
}

/// Waits until one of `fds` is ready; an error when none is within `timeout`.
fn wait(fds: &mut [PollFd<'_>], timeout: PollTimeout) -> io::Result<()> {
    match poll(fds, timeout) {
        Ok(0) => Err(io::Error::new(io::ErrorKind::TimedOut, "no progress")),
        Ok(_) | Err(nix::errno::Errno::EINTR) => Ok(()),
        Err(e) => Err(io::Error::from(e)),
    }
}

/// Byte range of stripe `s` of `k` over `len` bytes.
fn stripe(len: usize, s: usize, k: usize) -> std::ops::Range<usize> {
    len * s / k..len * (s + 1) / k
}

/// Runs a schedule over one or more connections to each neighbour: `first` segments are queued
/// for sending at once, then `recvs` are processed in order. Every segment is cut into one
/// stripe per connection, stripe `s` travelling on connection `s`, all of them at once; a
/// reduced segment is received whole (into scratch) before it is combined. `left`/`right` are
/// the peers' ranks, used to name a failure; `timeout` bounds how long the engine waits
/// without any progress.
#[allow(clippy::too_many_arguments)]
pub(crate) fn run<T: Element>(
    shared: &Shared,
    reads: &[&TcpStream],
    left: usize,
    writes: &[&TcpStream],
    right: usize,
    mut segments: Vec<&mut [T]>,
    first: &[usize],
    recvs: &[Recv],
    timeout: Duration,
) -> Result<(), LinkFailure> {
    let rd_fail = |e| LinkFailure::new(shared, left, e);
    let wr_fail = |e| LinkFailure::new(shared, right, e);
    if reads.len() != writes.len() || reads.is_empty() {
        let e = io::Error::other("as many connections are needed on both sides of the ring");
        return Err(rd_fail(e));
    }
    let k = reads.len();
    let mut modes = Vec::with_capacity(k);
    for (r, w) in reads.iter().zip(writes) {
        modes.push(NonBlocking::new(r, w).map_err(rd_fail)?);
    }
    let mut scratch: Vec<T> = Vec::new();
    let mut queue: VecDeque<usize> = first.iter().copied().collect();
    let mut queued = vec![false; segments.len()];
    first.iter().for_each(|&id| queued[id] = true);
    let (mut sent, mut got) = (vec![0usize; k], vec![0usize; k]);
    let mut ri = 0usize;
    let poll_timeout = PollTimeout::try_from(timeout).unwrap_or(PollTimeout::MAX);
    loop {
        let mut progressed = false;
        // Send the head segment's stripes, each on its own connection.
        while let Some(&id) = queue.front() {
            let bytes: &[u8] = bytemuck::cast_slice(&*segments[id]);
            for (s, mut w) in writes.iter().copied().enumerate() {
                let range = stripe(bytes.len(), s, k);
                while sent[s] < range.len() {
                    match w.write(&bytes[range.start + sent[s]..range.end]) {
                        Ok(n) => {
                            sent[s] += n;
                            progressed = true;
                        }
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                        Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                        Err(e) => return Err(wr_fail(e)),
                    }
                }
            }
            if (0..k).any(|s| sent[s] < stripe(bytes.len(), s, k).len()) {
                break;
            }
            queue.pop_front();
            queued[id] = false;
            sent.iter_mut().for_each(|x| *x = 0);
            progressed = true;
        }
        // Receive the current segment's stripes.
        while let Some(r) = recvs.get(ri).copied() {
            if queued[r.seg] {
                break; // its old contents are still on their way out
            }
            let seg = &mut *segments[r.seg];
            let target: &mut [u8] = match r.mode {
                Mode::Copy => bytemuck::cast_slice_mut(seg),
                Mode::Reduce(_) | Mode::ReduceDivide(_) => {
                    if scratch.len() < seg.len() {
                        scratch.resize(seg.len(), T::zeroed());
                    }
                    bytemuck::cast_slice_mut(&mut scratch[..seg.len()])
                }
            };
            let len = target.len();
            for (s, mut rd) in reads.iter().copied().enumerate() {
                let range = stripe(len, s, k);
                while got[s] < range.len() {
                    match rd.read(&mut target[range.start + got[s]..range.end]) {
                        Ok(0) => {
                            let eof = io::Error::new(
                                io::ErrorKind::UnexpectedEof,
                                "connection closed by peer",
                            );
                            return Err(rd_fail(eof));
                        }
                        Ok(n) => {
                            got[s] += n;
                            progressed = true;
                        }
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                        Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                        Err(e) => return Err(rd_fail(e)),
                    }
                }
            }
            if (0..k).any(|s| got[s] < stripe(len, s, k).len()) {
                break;
            }
            match r.mode {
                Mode::Copy => {}
                Mode::Reduce(op) => T::reduce_into(seg, &scratch[..seg.len()], op),
                Mode::ReduceDivide(n) => {
                    T::reduce_into(seg, &scratch[..seg.len()], ReduceOp::Sum);
                    T::divide(seg, n);
                }
            }
            got.iter_mut().for_each(|x| *x = 0);
            ri += 1;
            if r.forward {
                queue.push_back(r.seg);
                queued[r.seg] = true;
            }
            progressed = true;
        }
        if queue.is_empty() && ri == recvs.len() {
            return Ok(());
        }
        if progressed {
            continue;
        }
        // Wait for a connection that still owes (or can take) bytes of the current segments.
        let mut fds = Vec::with_capacity(2 * k);
        let mut waiting_on_read = false;
        if let Some(r) = recvs.get(ri).filter(|r| !queued[r.seg]) {
            let len = std::mem::size_of_val(&*segments[r.seg]);
            for (s, rd) in reads.iter().enumerate() {
                if got[s] < stripe(len, s, k).len() {
                    fds.push(PollFd::new(rd.as_fd(), PollFlags::POLLIN));
                    waiting_on_read = true;
                }
            }
        }
        if let Some(&id) = queue.front() {
            let len = std::mem::size_of_val(&*segments[id]);
            for (s, w) in writes.iter().enumerate() {
                if sent[s] < stripe(len, s, k).len() {
                    fds.push(PollFd::new(w.as_fd(), PollFlags::POLLOUT));
                }
            }
        }
        if let Err(e) = wait(&mut fds, poll_timeout) {
            return Err(if waiting_on_read || e.kind() != io::ErrorKind::TimedOut {
                rd_fail(e)
            } else {
                wr_fail(e)
            });
        }
    }
}
