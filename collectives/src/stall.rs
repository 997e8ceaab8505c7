//! The engine's stall check: ops some ranks submitted and others have not, for too long.
//!
//! An op pending on some needed ranks but not all is a stall in the making: a rank that took
//! another branch, skipped a parameter, or stopped. Past the warning time it is reported
//! (naming the ranks that have not submitted it), again every warning time while it waits;
//! past the shutdown time (when set) it fails on every rank instead of hanging. Every rank
//! runs the same check on the same announcements against rank 0's clock, so all agree on
//! what fails and when.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use crate::error::CommError;
use crate::negotiation::Sig;

/// The stall check's memory: when each waiting op was first seen and last warned of, on rank
/// 0's clock (milliseconds).
#[derive(Debug, Default)]
pub(crate) struct StallCheck {
    first_seen: HashMap<String, u64>,
    warned: HashMap<String, u64>,
}

/// What one check found.
#[derive(Debug, Default)]
pub(crate) struct Stalls {
    /// "'name' (missing ranks [..])" for each op to warn of now.
    pub(crate) warnings: Vec<String>,
    /// Ops to fail on every rank, and why.
    pub(crate) failed: Vec<(String, CommError)>,
}

impl StallCheck {
    /// Checks one cycle: `lists` holds every rank's pending ops, `needed` the ranks an op
    /// must be pending on to run, `clock` rank 0's clock. Warns after `warning`, fails after
    /// `shutdown` (never when zero or below `warning`).
    pub(crate) fn check(
        &mut self,
        lists: &[Vec<Sig>],
        needed: &[usize],
        clock: u64,
        warning: Duration,
        shutdown: Duration,
    ) -> Stalls {
        let sets: Vec<HashSet<&str>> = lists
            .iter()
            .map(|l| l.iter().map(|s| s.name.as_str()).collect())
            .collect();
        let waiting: HashSet<&str> = sets
            .iter()
            .flatten()
            .copied()
            .filter(|name| !needed.iter().all(|&r| sets[r].contains(name)))
            .collect();
        self.first_seen.retain(|k, _| waiting.contains(k.as_str()));
        self.warned.retain(|k, _| waiting.contains(k.as_str()));
        let warning_ms = warning.as_millis() as u64;
        let shutdown_ms = Some(shutdown)
            .filter(|d| !d.is_zero() && *d >= warning)
            .map(|d| d.as_millis() as u64);
        let mut names: Vec<&str> = waiting.into_iter().collect();
        names.sort_unstable();
        let mut out = Stalls::default();
        for name in names {
            let first = *self.first_seen.entry(name.to_string()).or_insert(clock);
            let waited = clock.saturating_sub(first);
            let have: Vec<usize> = (0..sets.len())
                .filter(|&r| sets[r].contains(name))
                .collect();
            let missing: Vec<usize> = needed
                .iter()
                .copied()
                .filter(|&r| !sets[r].contains(name))
                .collect();
            if shutdown_ms.is_some_and(|s| waited >= s) {
                out.failed.push((
                    name.to_string(),
                    CommError::InvalidArgument {
                        op: "engine",
                        detail: format!(
                            "op '{name}' was submitted by ranks {have:?} but not by ranks \
                             {missing:?} within {shutdown:?} (stalled)"
                        ),
                    },
                ));
                self.first_seen.remove(name);
                self.warned.remove(name);
                continue;
            }
            let last = self.warned.get(name).copied().unwrap_or(first);
            if waited >= warning_ms && clock.saturating_sub(last) >= warning_ms {
                self.warned.insert(name.to_string(), clock);
                out.warnings
                    .push(format!("'{name}' (missing ranks {missing:?})"));
            }
        }
        out
    }

    /// Forgets every op (the check is off).
    pub(crate) fn clear(&mut self) {
        self.first_seen.clear();
        self.warned.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::{DType, ReduceOp};
    use crate::wire::Kind;

    fn op(name: &str) -> Sig {
        Sig {
            name: name.into(),
            dtype: DType::F32,
            kind: Kind::Allreduce,
            param: ReduceOp::Sum as u64,
            count: 1,
        }
    }

    const S: Duration = Duration::from_secs(1);

    #[test]
    fn an_op_missing_on_a_rank_is_warned_of_each_warning_time_then_failed() {
        let lists = vec![vec![op("a"), op("b")], vec![op("b")], vec![op("b")]];
        let need = [0, 1, 2];
        let mut c = StallCheck::default();
        let at = |c: &mut StallCheck, ms| c.check(&lists, &need, ms, S, 3 * S);
        assert!(at(&mut c, 100).warnings.is_empty(), "first seen at 100");
        assert!(at(&mut c, 1099).warnings.is_empty());
        assert_eq!(at(&mut c, 1100).warnings, ["'a' (missing ranks [1, 2])"]);
        assert!(
            at(&mut c, 1500).warnings.is_empty(),
            "once per warning time"
        );
        assert_eq!(at(&mut c, 2100).warnings.len(), 1);
        let failed = at(&mut c, 3100).failed;
        let [(name, CommError::InvalidArgument { detail, .. })] = &failed[..] else {
            panic!("{failed:?}");
        };
        assert_eq!(name, "a");
        assert_eq!(
            detail,
            "op 'a' was submitted by ranks [0] but not by ranks [1, 2] within 3s (stalled)"
        );
    }

    #[test]
    fn an_op_that_arrives_is_forgotten_and_no_shutdown_never_fails() {
        let mut c = StallCheck::default();
        let waiting = vec![vec![op("a")], vec![]];
        assert!(
            c.check(&waiting, &[0, 1], 0, S, Duration::ZERO)
                .failed
                .is_empty()
        );
        // Rank 1 submits it: nothing waits, its first sighting is forgotten.
        let both = vec![vec![op("a")], vec![op("a")]];
        let s = c.check(&both, &[0, 1], 5000, S, Duration::ZERO);
        assert!(s.warnings.is_empty() && s.failed.is_empty());
        // Waiting again from 6000: a fresh start, and a shutdown below the warning is none.
        assert!(
            c.check(&waiting, &[0, 1], 6000, S, S / 2)
                .warnings
                .is_empty()
        );
        let s = c.check(&waiting, &[0, 1], 60_000, S, S / 2);
        assert_eq!(s.warnings.len(), 1);
        assert!(s.failed.is_empty());
    }

    #[test]
    fn a_joined_rank_is_not_waited_for() {
        let mut c = StallCheck::default();
        // Rank 0 joined: an op on ranks 1 and 2 is not stalled for want of rank 0.
        let lists = vec![vec![], vec![op("a")], vec![op("a")]];
        let s = c.check(&lists, &[1, 2], 10_000, S, 2 * S);
        assert!(s.warnings.is_empty() && s.failed.is_empty());
        let s = c.check(&lists, &[1, 2], 20_000, S, 2 * S);
        assert!(s.warnings.is_empty() && s.failed.is_empty());
    }
}
