//! Hierarchical allgather: every host gathers its ranks' rows, the hosts' first ranks
//! allgather the host blocks across hosts, and each host broadcasts the whole to its ranks.
//! Across hosts only one rank per host sends, and it sends its host's rows once.

use crate::comm::Communicator;
use crate::dtype::{DType, Element};
use crate::error::{CommError, Result};
use crate::topology::Hierarchy;

impl Communicator {
    /// [`Communicator::allgather`] through the host and cross-host communicators of `h`
    /// (taken out of this one meanwhile, so the world calls below run flat). `local` is this
    /// rank's own check of its arguments; every rank learns every other's first, so that all
    /// fail alike before any rows move.
    pub(crate) fn allgather_by_host<T: Element>(
        &mut self,
        h: &mut Hierarchy,
        input: &[T],
        row_len: usize,
        local: std::result::Result<(), String>,
    ) -> Result<Vec<T>> {
        let n = self.size();
        let meta = [
            input.len() as i64,
            row_len as i64,
            i64::from(T::DTYPE as u8),
            i64::from(local.is_ok()),
        ];
        let all = self.allgather(&meta, meta.len())?;
        let rows: Vec<&[i64]> = all.chunks(meta.len()).collect();
        if let Err(detail) = local {
            return Err(CommError::InvalidArgument {
                op: "allgather",
                detail,
            });
        }
        if let Some(bad) = (0..n).find(|&p| rows[p][3] == 0) {
            return Err(CommError::InvalidArgument {
                op: "allgather",
                detail: format!("rank {bad}'s contribution is not whole rows"),
            });
        }
        let describe = |m: &[i64]| {
            let dtype = u8::try_from(m[2])
                .ok()
                .and_then(DType::from_tag)
                .map_or("?", DType::name);
            format!("allgather of {dtype} rows of {}", m[1])
        };
        if let Some(p) = (1..n).find(|&p| rows[p][1..3] != rows[0][1..3]) {
            return Err(CommError::Mismatch {
                seq: self.calls(),
                rank_a: 0,
                desc_a: describe(rows[0]),
                rank_b: p,
                desc_b: describe(rows[p]),
            });
        }
        let counts: Vec<usize> = rows
            .iter()
            .map(|m| usize::try_from(m[0]).unwrap_or(0))
            .collect();
        let total: usize = counts.iter().sum();
        h.local.forget_timeouts();
        h.cross.forget_timeouts();
        let block = h.local.allgather(input, row_len)?;
        let mut by_host = if h.local.rank() == 0 {
            h.cross.allgather(&block, row_len)?
        } else {
            vec![T::zeroed(); total]
        };
        if by_host.len() != total {
            return Err(CommError::Broken {
                cause: format!(
                    "a hierarchical allgather gathered {} elements, not {total}",
                    by_host.len()
                ),
            });
        }
        h.local.broadcast(&mut by_host, 0)?;
        // `by_host` holds the hosts' blocks in host order, each its ranks in rank order.
        let mut starts = vec![0usize; n + 1];
        for r in 0..n {
            starts[r + 1] = starts[r] + counts[r];
        }
        let mut out = vec![T::zeroed(); total];
        let mut at = 0;
        for g in &h.groups {
            for &r in g {
                let k = counts[r];
                out[starts[r]..starts[r] + k].copy_from_slice(&by_host[at..at + k]);
                at += k;
            }
        }
        Ok(out)
    }
}
