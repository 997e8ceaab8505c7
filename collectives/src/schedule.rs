//! The ring's schedule: pure functions that cut a buffer into blocks and segments and say
//! which segment arrives when and what is done with it.

use crate::dtype::ReduceOp;
use crate::pipeline::{Mode, Recv};

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
