//! Tensor fusion: the allreduces agreed in one cycle, reduced as few large ones.
//!
//! Consecutive allreduces of one element type and reduction are packed into one fusion
//! buffer of up to `fusion_bytes` and reduced as one ([`plan`], a pure function); every other
//! collective runs alone, in its place in the agreed order. Ranks of one host (and Adasum,
//! which combines tensor by tensor) reduce a batch where its tensors lie, as one grouped
//! allreduce, with no copy into the buffer.

use std::ops::Range;
use std::time::Instant;

use crate::buffer::HugeBuffer;
use crate::comm::Communicator;
use crate::dtype::{DType, Element, ReduceOp, by_dtype};
use crate::error::{CommError, Result};

/// How a run of agreed ops goes: one op alone, or a run of allreduces reduced together.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Batch {
    /// The op at this index runs by itself (it is not an allreduce).
    Alone(usize),
    /// The allreduces at these indices are reduced as one.
    Fused(Range<usize>),
}

/// Splits the agreed ops, in order, into batches. `ops[i]` is `Some((dtype, reduction,
/// bytes))` for an allreduce, `None` for any other collective. An allreduce joins the batch
/// before it when the type and reduction match and the batch stays within `fusion_bytes`; a
/// larger one goes in a batch of its own.
pub(crate) fn plan(ops: &[Option<(DType, ReduceOp, usize)>], fusion_bytes: usize) -> Vec<Batch> {
    let mut out = Vec::new();
    // The open batch: where it starts, its type and reduction, its bytes.
    let mut open: Option<(usize, DType, ReduceOp, usize)> = None;
    for (i, op) in ops.iter().enumerate() {
        let Some((dtype, reduction, bytes)) = *op else {
            if let Some((start, ..)) = open.take() {
                out.push(Batch::Fused(start..i));
            }
            out.push(Batch::Alone(i));
            continue;
        };
        open = match open {
            Some((start, d, r, b)) if d == dtype && r == reduction && b + bytes <= fusion_bytes => {
                Some((start, d, r, b + bytes))
            }
            Some((start, ..)) => {
                out.push(Batch::Fused(start..i));
                Some((i, dtype, reduction, bytes))
            }
            None => Some((i, dtype, reduction, bytes)),
        };
    }
    if let Some((start, ..)) = open {
        out.push(Batch::Fused(start..ops.len()));
    }
    out
}

/// Allreduces tensors of one `dtype`, each given as its bytes, as one grouped allreduce on
/// their own memory.
pub(crate) fn group_in_place(
    comm: &mut Communicator,
    dtype: DType,
    op: ReduceOp,
    tensors: Vec<&mut [u8]>,
) -> Result<()> {
    fn typed<T: Element>(
        comm: &mut Communicator,
        op: ReduceOp,
        tensors: Vec<&mut [u8]>,
    ) -> Result<()> {
        // A batch holds one dtype, so every tensor's bytes are `T`s, aligned as `T`.
        let mut slices: Vec<&mut [T]> = tensors
            .into_iter()
            .map(bytemuck::try_cast_slice_mut::<u8, T>)
            .collect::<std::result::Result<_, _>>()
            .map_err(|e| CommError::InvalidArgument {
                op: "allreduce",
                detail: format!("a fused tensor is not a slice of {}: {e}", T::DTYPE),
            })?;
        comm.grouped_allreduce(&mut slices, op)
    }
    by_dtype!(dtype, typed(comm, op, tensors))
}

/// The fusion buffer, in its own mapping from 2 MiB on (huge pages where the kernel has
/// them), so it goes back to the system when the engine stops whatever malloc's mmap
/// threshold; it only grows, to the largest batch so far.
#[derive(Default)]
pub(crate) struct FusionBuffer {
    words: HugeBuffer<u64>,
}

impl FusionBuffer {
    /// Copies `tensors` (of one `dtype`) into the buffer back to back, allreduces them as one
    /// and copies the results back. `phase(name, since)` is called as each phase ends: the
    /// copy in, the allreduce, the copy out.
    pub(crate) fn allreduce(
        &mut self,
        comm: &mut Communicator,
        dtype: DType,
        op: ReduceOp,
        tensors: &mut [&mut [u8]],
        mut phase: impl FnMut(&'static str, Instant),
    ) -> Result<()> {
        let start = Instant::now();
        let total: usize = tensors.iter().map(|t| t.len()).sum();
        let words = total.div_ceil(8);
        if self.words.len() < words {
            // Rounded up to limit regrowth.
            let grown = words.next_power_of_two().max(words);
            self.words = HugeBuffer::zeroed(grown).map_err(|source| CommError::Io {
                context: format!("allocating a fusion buffer of {} bytes", grown * 8),
                source,
            })?;
        }
        {
            let buf: &mut [u8] = bytemuck::cast_slice_mut(&mut self.words[..]);
            let mut at = 0;
            for t in tensors.iter() {
                buf[at..at + t.len()].copy_from_slice(t);
                at += t.len();
            }
        }
        phase("MEMCPY_IN_FUSION_BUFFER", start);
        let start = Instant::now();
        reduce_bytes(comm, dtype, op, &mut self.words[..words], total)?;
        phase("ALLREDUCE", start);
        let start = Instant::now();
        let buf: &[u8] = bytemuck::cast_slice(&self.words[..]);
        let mut at = 0;
        for t in tensors.iter_mut() {
            let len = t.len();
            t.copy_from_slice(&buf[at..at + len]);
            at += len;
        }
        phase("MEMCPY_OUT_FUSION_BUFFER", start);
        Ok(())
    }
}

/// Allreduces the first `bytes` of an 8-byte-aligned buffer as elements of `dtype`.
fn reduce_bytes(
    comm: &mut Communicator,
    dtype: DType,
    op: ReduceOp,
    buf: &mut [u64],
    bytes: usize,
) -> Result<()> {
    fn typed<T: Element>(comm: &mut Communicator, op: ReduceOp, raw: &mut [u8]) -> Result<()> {
        comm.allreduce(bytemuck::cast_slice_mut::<u8, T>(raw), op)
    }
    let raw = &mut bytemuck::cast_slice_mut::<u64, u8>(buf)[..bytes];
    by_dtype!(dtype, typed(comm, op, raw))
}

#[cfg(test)]
mod tests {
    use super::*;
    use Batch::{Alone, Fused};

    const F32_SUM: Option<(DType, ReduceOp, usize)> = Some((DType::F32, ReduceOp::Sum, 40));

    #[test]
    fn consecutive_allreduces_of_one_type_and_reduction_fuse_up_to_the_limit() {
        let ops = [F32_SUM, F32_SUM, F32_SUM, F32_SUM];
        assert_eq!(plan(&ops, 120), [Fused(0..3), Fused(3..4)]);
        assert_eq!(plan(&ops, 160), [Fused(0..4)]);
        assert_eq!(plan(&[], 160), []);
    }

    #[test]
    fn another_collective_type_or_reduction_ends_a_batch() {
        let f64_sum = Some((DType::F64, ReduceOp::Sum, 8));
        let f32_max = Some((DType::F32, ReduceOp::Max, 8));
        let ops = [F32_SUM, None, F32_SUM, f64_sum, f32_max, F32_SUM, None];
        assert_eq!(
            plan(&ops, 1 << 20),
            [
                Fused(0..1),
                Alone(1),
                Fused(2..3),
                Fused(3..4),
                Fused(4..5),
                Fused(5..6),
                Alone(6)
            ]
        );
    }

    #[test]
    fn a_tensor_larger_than_the_limit_goes_in_a_batch_of_its_own() {
        let big = Some((DType::F32, ReduceOp::Sum, 1000));
        assert_eq!(
            plan(&[F32_SUM, big, F32_SUM], 100),
            [Fused(0..1), Fused(1..2), Fused(2..3)]
        );
        // A limit of zero fuses nothing.
        assert_eq!(plan(&[F32_SUM, F32_SUM], 0), [Fused(0..1), Fused(1..2)]);
    }

    #[test]
    fn every_op_is_in_exactly_one_batch_in_order() {
        let ops: Vec<_> = (0..50)
            .map(|i| match i % 7 {
                0 => None,
                3 => Some((DType::F64, ReduceOp::Sum, i * 3)),
                _ => Some((DType::F32, ReduceOp::Sum, i * 5)),
            })
            .collect();
        let mut next = 0;
        for b in plan(&ops, 200) {
            let r = match b {
                Alone(i) => i..i + 1,
                Fused(r) => r,
            };
            assert_eq!(r.start, next);
            next = r.end;
        }
        assert_eq!(next, ops.len());
    }
}
