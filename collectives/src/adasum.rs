//! Adasum: adaptive summation of gradients (Maleki et al., "Scaling Distributed Training with
//! Adaptive Summation", MLSys 2021), Horovod's `op=hvd.Adasum`.
//!
//! Two gradients `a` and `b` combine as `(1 − a·b/(2‖a‖²))·a + (1 − a·b/(2‖b‖²))·b`: orthogonal
//! gradients add, parallel ones average, and anything between is in between. A squared norm
//! below `√f64::MIN_POSITIVE` (a zero gradient) leaves its coefficient at 1, as Horovod does.
//! Each tensor combines on its own, even when several travel fused in one call.
//!
//! The ranks combine up a binary tree ([`rounds`]): ranks `lo..hi` split into a left half of
//! `⌈(hi − lo)/2⌉` ranks and a right half, each half's result combines with the other's. For a
//! power of two this is Horovod's recursive pairing (ranks 0+1 and 2+3, then the two pairs);
//! other sizes, which Horovod refuses and an elastic world shrinks to, get the same rule: 3
//! ranks are `(a₀ ⊕ a₁) ⊕ a₂`, 5 are `((a₀ ⊕ a₁) ⊕ a₂) ⊕ (a₃ ⊕ a₄)`.
//!
//! The data moves as in a ring allreduce, `2(n−1)/n` of the buffer per rank: an alltoall hands
//! rank `r` block `r` of every rank's buffer; each tree level then combines the blocks, with
//! the dot products and norms of each tensor summed over the blocks by one small allreduce of
//! `f64`s (bit-identical on every rank, so every rank scales alike); an allgather spreads the
//! finished blocks.

use crate::comm::Communicator;
use crate::dtype::{Element, ReduceOp};
use crate::error::{CommError, Result};
use crate::schedule::block_bounds;

/// Below this squared norm a gradient counts as zero and its coefficient stays 1 (Horovod's
/// `sqrt(DBL_MIN)`).
const ZERO_NORM_SQ: f64 = 1.4916681462400413e-154;

/// The combinations of a world of `n` ranks, in rounds: every pair `(left, right)` of a round
/// combines the result held at rank slot `right` into the one at `left`; a round depends only
/// on rounds before it. Slot 0 holds the final result.
pub(crate) fn rounds(n: usize) -> Vec<Vec<(usize, usize)>> {
    fn walk(lo: usize, hi: usize, out: &mut Vec<Vec<(usize, usize)>>) -> usize {
        if hi - lo <= 1 {
            return 0;
        }
        let mid = lo + (hi - lo).div_ceil(2);
        let height = 1 + walk(lo, mid, out).max(walk(mid, hi, out));
        if out.len() < height {
            out.resize(height, Vec::new());
        }
        out[height - 1].push((lo, mid));
        height
    }
    let mut out = Vec::new();
    if n > 1 {
        walk(0, n, &mut out);
    }
    for round in &mut out {
        round.sort_unstable();
    }
    out
}

/// The coefficients `(ca, cb)` that combine `a` and `b` as `ca·a + cb·b`, from `a·b`, `‖a‖²`
/// and `‖b‖²`.
pub(crate) fn coefficients(dot: f64, a_sq: f64, b_sq: f64) -> (f64, f64) {
    let scale = |norm_sq: f64| {
        if norm_sq >= ZERO_NORM_SQ {
            1.0 - dot / (2.0 * norm_sq)
        } else {
            1.0
        }
    };
    (scale(a_sq), scale(b_sq))
}

/// `[a·b, ‖a‖², ‖b‖²]`, accumulated in `f64` over eight lanes.
fn dots<T: Element>(a: &[T], b: &[T]) -> [f64; 3] {
    let (mut ab, mut aa, mut bb) = ([0.0f64; 8], [0.0f64; 8], [0.0f64; 8]);
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            let (x, y) = (x[i].to_f64(), y[i].to_f64());
            ab[i] += x * y;
            aa[i] += x * x;
            bb[i] += y * y;
        }
    }
    for (i, (x, y)) in ra.iter().zip(rb).enumerate() {
        let (x, y) = (x.to_f64(), y.to_f64());
        ab[i] += x * y;
        aa[i] += x * x;
        bb[i] += y * y;
    }
    [ab.iter().sum(), aa.iter().sum(), bb.iter().sum()]
}

/// `a = ca·a + cb·b`, element by element.
fn scale_add<T: Element>(a: &mut [T], ca: f64, b: &[T], cb: f64) {
    for (x, y) in a.iter_mut().zip(b) {
        *x = T::from_f64(ca * x.to_f64() + cb * y.to_f64());
    }
}

/// The pieces of tensors (prefix sums `starts`) that fall into the block `[lo, hi)`:
/// `(tensor, start, end)`, offsets relative to the block.
fn pieces_in(starts: &[usize], lo: usize, hi: usize) -> Vec<(usize, usize, usize)> {
    starts
        .windows(2)
        .enumerate()
        .filter_map(|(t, w)| {
            let (s, e) = (w[0].max(lo), w[1].min(hi));
            (s < e).then(|| (t, s - lo, e - lo))
        })
        .collect()
}

impl Communicator {
    /// Adasum over every rank's `bufs`, each buffer a tensor of its own; afterwards every rank
    /// holds the same result in `bufs`.
    ///
    /// # Errors
    /// [`CommError::InvalidArgument`] for an integer type (on every rank); a mismatch when the
    /// ranks disagree on the buffers; a transport error when a peer fails.
    pub(crate) fn adasum<T: Element>(&mut self, bufs: &mut [&mut [T]]) -> Result<()> {
        if !T::FLOAT {
            return Err(CommError::InvalidArgument {
                op: "allreduce",
                detail: format!(
                    "Adasum combines floating-point tensors (f16, bf16, f32, f64), not {}",
                    T::DTYPE
                ),
            });
        }
        let n = self.size();
        if n == 1 {
            return Ok(());
        }
        let mut starts = Vec::with_capacity(bufs.len() + 1);
        starts.push(0);
        for b in bufs.iter() {
            starts.push(starts[starts.len() - 1] + b.len());
        }
        let total = starts[starts.len() - 1];
        let blocks = block_bounds(total, n);
        let splits: Vec<usize> = blocks.windows(2).map(|w| w[1] - w[0]).collect();
        let (mut whole, mut mine): (Vec<T>, Vec<T>) = self
            .adasum
            .take()
            .and_then(|b| b.downcast().ok())
            .map_or_else(Default::default, |b| *b);
        let done = self.adasum_in(bufs, &starts, &splits, &mut whole, &mut mine);
        self.adasum = Some(Box::new((whole, mine)));
        done
    }

    /// [`Communicator::adasum`] with its working buffers: `whole` holds the fused input, then
    /// the gathered result; `mine` every rank's block of this rank.
    fn adasum_in<T: Element>(
        &mut self,
        bufs: &mut [&mut [T]],
        starts: &[usize],
        splits: &[usize],
        whole: &mut Vec<T>,
        mine: &mut Vec<T>,
    ) -> Result<()> {
        let n = self.size();
        let total = starts[starts.len() - 1];
        let blocks = block_bounds(total, n);
        // Block r of every rank's buffer, in rank order.
        if let [one] = bufs {
            self.alltoall_to(one, splits, mine)?;
        } else {
            whole.clear();
            bufs.iter().for_each(|b| whole.extend_from_slice(b));
            self.alltoall_to(whole, splits, mine)?;
        }
        let r = self.rank();
        let len = splits[r];
        let pieces = pieces_in(starts, blocks[r], blocks[r + 1]);
        let tensors = bufs.len();
        for round in rounds(n) {
            let mut sums = vec![0.0f64; round.len() * tensors * 3];
            for (k, &(left, right)) in round.iter().enumerate() {
                let (a, b) = (&mine[left * len..], &mine[right * len..]);
                for &(t, s, e) in &pieces {
                    let d = dots(&a[s..e], &b[s..e]);
                    sums[(k * tensors + t) * 3..][..3].copy_from_slice(&d);
                }
            }
            self.allreduce(&mut sums, ReduceOp::Sum)?;
            for (k, &(left, right)) in round.iter().enumerate() {
                let (head, tail) = mine.split_at_mut(right * len);
                let (a, b) = (&mut head[left * len..], &tail[..len]);
                for &(t, s, e) in &pieces {
                    let d = &sums[(k * tensors + t) * 3..][..3];
                    let (ca, cb) = coefficients(d[0], d[1], d[2]);
                    scale_add(&mut a[s..e], ca, &b[s..e], cb);
                }
            }
        }
        self.allgather_to(&mine[..len], 1, whole)?;
        let all = &whole[..];
        if all.len() != total {
            return Err(CommError::InvalidArgument {
                op: "allreduce",
                detail: format!(
                    "Adasum gathered {} elements for {total} (ranks disagree on the tensors)",
                    all.len()
                ),
            });
        }
        for (b, w) in bufs.iter_mut().zip(starts.windows(2)) {
            b.copy_from_slice(&all[w[0]..w[1]]);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn powers_of_two_pair_neighbours_then_pairs() {
        assert_eq!(rounds(1), Vec::<Vec<(usize, usize)>>::new());
        assert_eq!(rounds(2), vec![vec![(0, 1)]]);
        assert_eq!(rounds(4), vec![vec![(0, 1), (2, 3)], vec![(0, 2)]]);
        assert_eq!(
            rounds(8),
            vec![
                vec![(0, 1), (2, 3), (4, 5), (6, 7)],
                vec![(0, 2), (4, 6)],
                vec![(0, 4)]
            ]
        );
    }

    #[test]
    fn other_sizes_split_with_the_larger_half_first() {
        assert_eq!(rounds(3), vec![vec![(0, 1)], vec![(0, 2)]]);
        assert_eq!(
            rounds(5),
            vec![vec![(0, 1), (3, 4)], vec![(0, 2)], vec![(0, 3)]]
        );
        assert_eq!(
            rounds(6),
            vec![vec![(0, 1), (3, 4)], vec![(0, 2), (3, 5)], vec![(0, 3)]]
        );
    }

    #[test]
    fn every_rank_is_combined_exactly_once() {
        for n in 1..70 {
            let mut alive = vec![true; n];
            for round in rounds(n) {
                for (l, r) in round {
                    assert!(alive[l] && alive[r] && l < r, "n={n}: ({l},{r})");
                    alive[r] = false;
                }
            }
            assert_eq!(alive.iter().filter(|a| **a).count(), 1, "n={n}");
            assert!(alive[0], "n={n}");
        }
    }

    #[test]
    fn orthogonal_gradients_add_and_equal_ones_average() {
        assert_eq!(coefficients(0.0, 4.0, 9.0), (1.0, 1.0));
        assert_eq!(coefficients(4.0, 4.0, 4.0), (0.5, 0.5));
        // A zero gradient leaves the other as it is.
        assert_eq!(coefficients(0.0, 0.0, 2.0), (1.0, 1.0));
    }

    #[test]
    fn dots_and_scale_add_match_a_plain_loop() {
        let a: Vec<f32> = (0..37).map(|i| i as f32 * 0.5 - 3.0).collect();
        let b: Vec<f32> = (0..37).map(|i| (i % 7) as f32 - 2.0).collect();
        let plain = |f: &dyn Fn(f64, f64) -> f64| {
            a.iter()
                .zip(&b)
                .map(|(x, y)| f(f64::from(*x), f64::from(*y)))
                .sum::<f64>()
        };
        let d = dots(&a, &b);
        assert_eq!(
            d,
            [
                plain(&|x, y| x * y),
                plain(&|x, _| x * x),
                plain(&|_, y| y * y)
            ]
        );
        let mut c = a.clone();
        scale_add(&mut c, 0.25, &b, -2.0);
        for i in 0..a.len() {
            assert_eq!(
                c[i],
                (0.25 * f64::from(a[i]) - 2.0 * f64::from(b[i])) as f32
            );
        }
    }

    #[test]
    fn a_block_sees_the_pieces_of_the_tensors_it_overlaps() {
        // Tensors of 3, 0 and 5 elements; the block [2, 6).
        assert_eq!(pieces_in(&[0, 3, 3, 8], 2, 6), vec![(0, 0, 1), (2, 1, 4)]);
        assert!(pieces_in(&[0, 3, 3, 8], 8, 8).is_empty());
    }

    #[test]
    fn integers_are_refused() {
        let mut comm = Communicator::single();
        let mut v = [1i32, 2];
        let err = comm.adasum(&mut [&mut v[..]]).unwrap_err();
        assert!(err.to_string().contains("floating-point"), "{err}");
    }
}
