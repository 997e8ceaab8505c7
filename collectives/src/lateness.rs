//! How much each rank holds the others up at the collectives: the measure a straggler (a
//! throttled CPU, a noisy neighbour, a failing NIC, a paused VM) shows first, since in
//! data-parallel training the slowest rank sets everyone's pace.
//!
//! Every rank sees every rank's announcement at every negotiation cycle, on rank 0's clock.
//! Two things show a rank late in a cycle, and the larger counts:
//! - its ops arrive after the others': an op's arrival on a rank is the clock of the first
//!   cycle it announced it in, and when the op is agreed, a rank's lateness is its arrival
//!   minus the median rank's (a rank slow to compute, whose engine thread keeps cycling);
//! - the others wait for it in the negotiation itself: each rank announces how long its
//!   previous negotiation waited, and a rank's lateness is the median wait less its own (a rank
//!   whose engine thread is held up too: stopped, starved of CPU).
//!
//! Each rank's lateness is summed over the cycles and divided by the time they spanned, both
//! decayed with a time constant of [`WINDOW`]: the fraction of the time the median rank spends
//! waiting for it. A rank the others wait for a fraction `f` of the time computes `1 / (1 - f)`
//! times as long as the median rank. Every rank computes the same numbers; rank 0 reports them.

use std::collections::HashMap;
use std::time::Duration;

use crate::negotiation::Sig;

/// The time constant of the running fraction.
pub const WINDOW: Duration = Duration::from_secs(5);

/// Each rank's running fraction of the time the others wait for it.
#[derive(Debug, Default)]
pub(crate) struct Lateness {
    /// Per pending op, the clock of the cycle each rank first announced it in.
    first_seen: HashMap<String, Vec<Option<u64>>>,
    /// Per rank, decayed milliseconds of lateness.
    late_ms: Vec<f64>,
    /// Decayed milliseconds the cycles spanned.
    span_ms: f64,
    /// The previous cycle's clock.
    last_clock: Option<u64>,
}

impl Lateness {
    /// Takes one cycle: `lists` holds every rank's pending ops, `waited_us` how long each
    /// rank's previous negotiation waited, `needed` the ranks that take part (a joined rank
    /// does not), `ready` the ops agreed now, `clock` rank 0's clock in milliseconds.
    pub(crate) fn cycle(
        &mut self,
        lists: &[Vec<Sig>],
        waited_us: &[u32],
        needed: &[usize],
        ready: &[String],
        clock: u64,
    ) {
        let n = lists.len();
        if self.late_ms.len() != n {
            *self = Self::default();
            self.late_ms = vec![0.0; n];
        }
        for (rank, list) in lists.iter().enumerate() {
            for sig in list {
                let seen = self
                    .first_seen
                    .entry(sig.name.clone())
                    .or_insert_with(|| vec![None; n]);
                if let Some(slot) = seen.get_mut(rank) {
                    slot.get_or_insert(clock);
                }
            }
        }
        let mut late = vec![0f64; n];
        for name in ready {
            let Some(seen) = self.first_seen.remove(name) else {
                continue;
            };
            let arrivals: Vec<u64> = needed
                .iter()
                .filter_map(|&r| seen.get(r).copied().flatten())
                .collect();
            let Some(median) = median(arrivals) else {
                continue;
            };
            for &r in needed {
                if let (Some(Some(t)), Some(l)) = (seen.get(r), late.get_mut(r)) {
                    *l = l.max(t.saturating_sub(median) as f64);
                }
            }
        }
        let waits: Vec<u64> = needed
            .iter()
            .filter_map(|&r| waited_us.get(r).map(|&w| u64::from(w)))
            .collect();
        if let Some(median) = median(waits) {
            for &r in needed {
                if let (Some(&w), Some(l)) = (waited_us.get(r), late.get_mut(r)) {
                    *l = l.max(median.saturating_sub(u64::from(w)) as f64 / 1000.0);
                }
            }
        }
        // Ops no rank announces any more (failed, or the engine moved on) are forgotten.
        self.first_seen
            .retain(|name, _| lists.iter().any(|l| l.iter().any(|s| &s.name == name)));
        let dt = self
            .last_clock
            .map_or(0.0, |c| clock.saturating_sub(c) as f64);
        self.last_clock = Some(clock);
        let decay = (-dt / WINDOW.as_secs_f64() / 1000.0).exp();
        self.span_ms = self.span_ms * decay + dt;
        for (sum, l) in self.late_ms.iter_mut().zip(late) {
            *sum = *sum * decay + l;
        }
    }

    /// Each rank's fraction of the time the median rank waits for it, by rank, from 0 to 1.
    pub(crate) fn fractions(&self) -> Vec<f64> {
        self.late_ms
            .iter()
            .map(|&l| {
                if self.span_ms > 0.0 {
                    (l / self.span_ms).min(1.0)
                } else {
                    0.0
                }
            })
            .collect()
    }
}

/// The median (the upper one of an even count); `None` for fewer than two values.
fn median(mut v: Vec<u64>) -> Option<u64> {
    if v.len() < 2 {
        return None;
    }
    v.sort_unstable();
    Some(v[v.len() / 2])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::DType;
    use crate::wire::Kind;

    fn sig(name: &str) -> Sig {
        Sig {
            name: name.into(),
            kind: Kind::Allreduce,
            dtype: DType::F32,
            param: 0,
            count: 1,
        }
    }

    /// A 100 ms step of `n` ranks in 1 ms cycles, rank `slow` announcing its op `by` ms after
    /// the others (its engine cycling meanwhile).
    fn step(l: &mut Lateness, n: usize, name: &str, slow: usize, by: u64, t: u64) {
        let needed: Vec<usize> = (0..n).collect();
        let waits = vec![100u32; n];
        let idle: Vec<Vec<Sig>> = vec![vec![]; n];
        for c in 0..(100 - by) {
            l.cycle(&idle, &waits, &needed, &[], t + c);
        }
        let others: Vec<Vec<Sig>> = (0..n)
            .map(|r| if r == slow { vec![] } else { vec![sig(name)] })
            .collect();
        for c in (100 - by)..99 {
            l.cycle(&others, &waits, &needed, &[], t + c);
        }
        let all: Vec<Vec<Sig>> = vec![vec![sig(name)]; n];
        l.cycle(&all, &waits, &needed, &[name.to_string()], t + 99);
    }

    #[test]
    fn a_rank_slow_to_compute_holds_the_others_up_its_share_of_the_time() {
        let mut l = Lateness::default();
        for k in 0..200 {
            step(&mut l, 4, &format!("grad.{k}"), 3, 30, 100 * k);
        }
        let f = l.fractions();
        assert!((f[3] - 0.3).abs() < 0.02, "{f:?}");
        assert_eq!(&f[..3], &[0.0, 0.0, 0.0]);
    }

    #[test]
    fn a_rank_the_negotiation_waits_for_shows_by_the_others_waits() {
        // Rank 1 is stopped 60 ms of every 100: every other rank's negotiation waits 60 ms
        // once a step, its own does not.
        let mut l = Lateness::default();
        let needed = [0, 1, 2];
        for k in 0..200u64 {
            let t = 100 * k;
            l.cycle(
                &[vec![], vec![], vec![]],
                &[60_000, 0, 60_000],
                &needed,
                &[],
                t,
            );
            l.cycle(
                &[vec![], vec![], vec![]],
                &[50, 50, 50],
                &needed,
                &[],
                t + 99,
            );
        }
        let f = l.fractions();
        assert!((f[1] - 0.6).abs() < 0.02, "{f:?}");
        assert!(f[0] < 0.01 && f[2] < 0.01, "{f:?}");
    }

    #[test]
    fn the_fraction_follows_the_last_seconds_and_leaves_out_joined_ranks() {
        let mut l = Lateness::default();
        for k in 0..100 {
            step(&mut l, 3, &format!("a.{k}"), 2, 50, 100 * k);
        }
        for k in 0..300 {
            step(&mut l, 3, &format!("b.{k}"), 2, 0, 10_000 + 100 * k);
        }
        let f = l.fractions();
        assert!(f[2] < 0.01, "recovered ranks lose their lateness: {f:?}");
        // Rank 2 joined: it is not needed, and an op it never announces is not late there.
        let mut l = Lateness::default();
        let lists = vec![vec![sig("x")], vec![sig("x")], vec![]];
        l.cycle(&lists, &[0, 0, 0], &[0, 1], &["x".to_string()], 5);
        l.cycle(&lists, &[0, 0, 900_000], &[0, 1], &[], 6);
        assert_eq!(l.fractions(), vec![0.0, 0.0, 0.0]);
    }
}
