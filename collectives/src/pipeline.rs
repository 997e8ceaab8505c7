//! The pipelined segment engine behind the ring allreduce, reducescatter and chain broadcast.
//!
//! A buffer is cut into segments. A sender thread writes segments to the right-hand neighbour in
//! the order they are handed to it, while the calling thread reads segments from the left-hand
//! neighbour and reduces (or copies) them in place, then hands each one to the sender if it
//! travels on. Sending, receiving and reducing therefore overlap, segment by segment and across
//! ring steps. Ownership of each `&mut` segment moves between the two threads through channels,
//! so no segment is ever read and written at once and no `unsafe` is needed.

use std::net::TcpStream;
use std::sync::mpsc;
use std::thread;

use crate::dtype::{Element, ReduceOp};
use crate::link::{LinkFailure, Shared, read_full, write_full};

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

/// Elements of a reduce scratch piece: small enough to stay in L2 while it is reduced.
const PIECE_BYTES: usize = 256 * 1024;

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

/// Runs a schedule: `first` segments are sent at once, then `recvs` are processed in order.
///
/// `left`/`right` are the peers' ranks, used to name a failure.
pub(crate) fn run<T: Element>(
    shared: &Shared,
    reader: &mut TcpStream,
    left: usize,
    writer: &mut TcpStream,
    right: usize,
    segments: Vec<&mut [T]>,
    first: &[usize],
    recvs: &[Recv],
) -> Result<(), LinkFailure> {
    let n = segments.len();
    let mut slots: Vec<Option<&mut [T]>> = segments.into_iter().map(Some).collect();
    thread::scope(|scope| {
        // Capacity n: every segment can be queued at once, so the calling thread never blocks on
        // a send, only on data.
        let (to_sender, sender_rx) = mpsc::sync_channel::<(usize, &mut [T])>(n.max(1));
        let (back_tx, back) = mpsc::sync_channel::<(usize, &mut [T])>(n.max(1));
        let sender = scope.spawn(move || -> Result<(), LinkFailure> {
            for (id, seg) in sender_rx {
                if let Err(e) = write_full(writer, bytemuck::cast_slice(seg)) {
                    return Err(LinkFailure::new(shared, right, e));
                }
                if back_tx.send((id, seg)).is_err() {
                    break; // the receiving side gave up; its error is the one that counts
                }
            }
            Ok(())
        });

        let received = receive_all(
            shared, reader, left, &mut slots, &to_sender, &back, first, recvs,
        );
        if received.is_err() {
            shared.trip();
        }
        drop(to_sender);
        let sent = sender.join().unwrap_or_else(|_| {
            Err(LinkFailure::new(
                shared,
                right,
                std::io::Error::other("sender thread panicked"),
            ))
        });
        match (received, sent) {
            (Ok(()), Ok(())) => Ok(()),
            (Err(r), Err(s)) => Err(if s.primary && !r.primary { s } else { r }),
            (Err(e), _) | (_, Err(e)) => Err(e),
        }
    })
}

#[allow(clippy::too_many_arguments)]
fn receive_all<'a, T: Element>(
    shared: &Shared,
    reader: &mut TcpStream,
    left: usize,
    slots: &mut [Option<&'a mut [T]>],
    to_sender: &mpsc::SyncSender<(usize, &'a mut [T])>,
    back: &mpsc::Receiver<(usize, &'a mut [T])>,
    first: &[usize],
    recvs: &[Recv],
) -> Result<(), LinkFailure> {
    let gone = || LinkFailure::new(shared, left, std::io::Error::other("sender stopped"));
    for &id in first {
        let seg = slots[id].take().ok_or_else(gone)?;
        to_sender.send((id, seg)).map_err(|_| gone())?;
    }
    let piece = (PIECE_BYTES / size_of::<T>()).max(1);
    let mut scratch: Vec<T> = Vec::new();
    for r in recvs {
        while slots[r.seg].is_none() {
            match back.recv() {
                Ok((i, seg)) => slots[i] = Some(seg),
                // The sender failed: its own error names the peer; this one is secondary.
                Err(_) => return Err(gone()),
            }
        }
        let Some(seg) = slots[r.seg].take() else {
            return Err(gone());
        };
        let io = |e| LinkFailure::new(shared, left, e);
        match r.mode {
            Mode::Copy => read_full(reader, bytemuck::cast_slice_mut(seg)).map_err(io)?,
            Mode::Reduce(_) | Mode::ReduceDivide(_) if !seg.is_empty() => {
                let op = match r.mode {
                    Mode::Reduce(op) => op,
                    _ => ReduceOp::Sum,
                };
                if scratch.is_empty() {
                    scratch = vec![T::zeroed(); piece];
                }
                for chunk in seg.chunks_mut(piece) {
                    let tmp = &mut scratch[..chunk.len()];
                    read_full(reader, bytemuck::cast_slice_mut(tmp)).map_err(io)?;
                    T::reduce_into(chunk, tmp, op);
                }
                if let Mode::ReduceDivide(k) = r.mode {
                    T::divide(seg, k);
                }
            }
            Mode::Reduce(_) | Mode::ReduceDivide(_) => {}
        }
        if r.forward {
            to_sender.send((r.seg, seg)).map_err(|_| gone())?;
        } else {
            slots[r.seg] = Some(seg);
        }
    }
    Ok(())
}
