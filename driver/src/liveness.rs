//! Who is alive: the heartbeat's decisions, one home for the static and the elastic job. The
//! driver pings every registered worker whose connection is open a few times per
//! `--heartbeat-timeout` ([`ping_period`]); a thread of the worker's own answers, however long
//! its training step. A worker heard from by nothing for the timeout is frozen (stopped, a
//! paused VM, stuck in the kernel): its connection stays open, and only its silence tells it
//! from a slow one. A worker is only blamed for silence across pings the driver sent on time:
//! a driver held up (waiting for its state store, starved of CPU) pings nobody, and the
//! silence that follows is its own. Times are passed in, so the decisions are pure and testable.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// How often registered workers are pinged: often enough that a live one is never near the
/// heartbeat timeout.
pub fn ping_period(heartbeat_timeout: Duration) -> Duration {
    (heartbeat_timeout / 4).max(Duration::from_millis(10))
}

/// When each watched worker was last heard from, and when the driver last pinged.
#[derive(Debug, Clone)]
pub struct Heartbeats {
    timeout: Duration,
    heard: BTreeMap<u64, Instant>,
    last_ping: Option<Instant>,
}

impl Heartbeats {
    /// Nobody watched yet; silence past `timeout` is a freeze.
    pub fn new(timeout: Duration) -> Self {
        Self {
            timeout,
            heard: BTreeMap::new(),
            last_ping: None,
        }
    }

    /// Whether the driver's last ping is further back than two ping periods at `now`: it was
    /// held up, and the watched workers' silence since is not theirs.
    fn behind(&self, now: Instant) -> bool {
        self.last_ping
            .is_some_and(|p| now.saturating_duration_since(p) > 2 * ping_period(self.timeout))
    }

    /// Every watched worker's silence starts again at `now`: the driver was away (held still
    /// while its state store was unreachable, or behind on its pings).
    pub fn restart(&mut self, now: Instant) {
        for t in self.heard.values_mut() {
            *t = (*t).max(now);
        }
    }

    /// The driver pinged every watched worker at `now`. After a gap in its pings, their
    /// silence starts again.
    pub fn pinged(&mut self, now: Instant) {
        if self.behind(now) {
            self.restart(now);
        }
        self.last_ping = Some(now);
    }

    /// Starts watching `worker` (its connection opened), as heard from at `now`.
    pub fn watch(&mut self, worker: u64, now: Instant) {
        self.heard.insert(worker, now);
    }

    /// `worker` said something at `now`; unwatched workers stay unwatched.
    pub fn heard(&mut self, worker: u64, now: Instant) {
        if let Some(t) = self.heard.get_mut(&worker) {
            *t = (*t).max(now);
        }
    }

    /// Stops watching `worker`: its connection closed or it ended, and that is what counts.
    pub fn forget(&mut self, worker: u64) {
        self.heard.remove(&worker);
    }

    /// The watched workers, to ping.
    pub fn watched(&self) -> impl Iterator<Item = u64> + '_ {
        self.heard.keys().copied()
    }

    /// When the first watched worker becomes silent for the timeout, if any is watched.
    pub fn next_silence(&self) -> Option<Instant> {
        self.heard.values().min().map(|&t| t + self.timeout)
    }

    /// The workers silent for the timeout at `now`, with how long, by id; they are no longer
    /// watched, so each is declared once. None while the driver is behind on its pings.
    pub fn take_silent(&mut self, now: Instant) -> Vec<(u64, Duration)> {
        if self.behind(now) {
            self.restart(now);
            return Vec::new();
        }
        let silent: Vec<(u64, Duration)> = self
            .heard
            .iter()
            .map(|(&w, &t)| (w, now.saturating_duration_since(t)))
            .filter(|&(_, s)| s >= self.timeout)
            .collect();
        for (w, _) in &silent {
            self.heard.remove(w);
        }
        silent
    }
}

/// What makes a rank a straggler (`--straggler-factor`, `--straggler-policy`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StragglerPolicy {
    /// A rank whose step takes this many times the median rank's is slow.
    pub factor: f64,
    /// It must stay slow for this many steps…
    pub steps: u64,
    /// …and this long, to be reported.
    pub sustained: Duration,
    /// Whether its host is removed (gracefully, and cooled down by the blacklist), not only
    /// reported.
    pub evict: bool,
}

impl Default for StragglerPolicy {
    fn default() -> Self {
        Self {
            factor: 1.3,
            steps: 20,
            sustained: Duration::from_secs(5),
            evict: false,
        }
    }
}

/// A rank found slow: how much it holds the others up, and how many times the median rank's
/// step its own takes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Straggler {
    /// Its rank in the current round.
    pub rank: usize,
    /// The fraction of the time the median rank waits for it.
    pub held_up: f64,
    /// Its step time over the median rank's: `1 / (1 - held_up)`.
    pub factor: f64,
}

/// Which ranks are stragglers, from rank 0's reports: by rank, the thousandths of the time the
/// median rank waits for it. Everything starts over when the round changes (a new world has
/// new ranks, and joins and resets are not slowness).
#[derive(Debug, Clone)]
pub struct Stragglers {
    policy: StragglerPolicy,
    generation: u64,
    /// The round's first report: when, and at which step.
    start: Option<(Instant, u64)>,
    /// The round's last report, for its step period.
    last: Option<(Instant, u64)>,
    /// Per rank: since when (and which step) it has been slow, if it is.
    slow_since: Vec<Option<(Instant, u64)>>,
    /// Ranks reported in this round.
    reported: Vec<bool>,
}

/// A rank's step over the median rank's, when the median waits for it a fraction `held_up` of
/// the time.
pub fn step_factor(held_up: f64) -> f64 {
    if held_up < 1.0 {
        1.0 / (1.0 - held_up)
    } else {
        f64::INFINITY
    }
}

impl Stragglers {
    /// Nothing seen yet.
    pub fn new(policy: StragglerPolicy) -> Self {
        Self {
            policy,
            generation: 0,
            start: None,
            last: None,
            slow_since: Vec::new(),
            reported: Vec::new(),
        }
    }

    /// The policy.
    pub fn policy(&self) -> StragglerPolicy {
        self.policy
    }

    /// The round's step period so far, once it has stepped.
    pub fn period(&self) -> Option<Duration> {
        let ((t0, s0), (t1, s1)) = (self.start?, self.last?);
        let steps = u32::try_from(s1.checked_sub(s0)?).ok().filter(|&d| d > 0)?;
        Some(t1.checked_duration_since(t0)? / steps)
    }

    /// One report at `now` of round `generation`: `steps` so far, and by rank the thousandths
    /// of the time the median rank waits for it. Returns the ranks that have just been slow
    /// long enough (for the policy's steps and time), each once a round.
    pub fn observe(
        &mut self,
        now: Instant,
        generation: u64,
        steps: u64,
        held_up_permille: &[u32],
    ) -> Vec<Straggler> {
        if generation != self.generation || self.slow_since.len() != held_up_permille.len() {
            self.generation = generation;
            self.start = Some((now, steps));
            self.last = Some((now, steps));
            self.slow_since = vec![None; held_up_permille.len()];
            self.reported = vec![false; held_up_permille.len()];
            return Vec::new();
        }
        self.last = Some((now, steps));
        let mut out = Vec::new();
        for (rank, &pm) in held_up_permille.iter().enumerate() {
            let held_up = f64::from(pm.min(1000)) / 1000.0;
            let factor = step_factor(held_up);
            if factor < self.policy.factor {
                self.slow_since[rank] = None;
                continue;
            }
            let (since, at) = *self.slow_since[rank].get_or_insert((now, steps));
            let long_enough = now.saturating_duration_since(since) >= self.policy.sustained
                && steps.saturating_sub(at) >= self.policy.steps;
            if long_enough && !self.reported[rank] {
                self.reported[rank] = true;
                out.push(Straggler {
                    rank,
                    held_up,
                    factor,
                });
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn a_worker_is_silent_after_the_timeout_once_and_an_answer_resets_it() {
        let t0 = Instant::now();
        let mut h = Heartbeats::new(ms(1000));
        assert_eq!(h.next_silence(), None, "nobody watched");
        h.watch(1, t0);
        h.watch(2, t0 + ms(100));
        assert_eq!(h.next_silence(), Some(t0 + ms(1000)));
        h.heard(1, t0 + ms(600));
        h.heard(7, t0 + ms(600)); // not watched: stays so
        assert_eq!(h.watched().collect::<Vec<_>>(), vec![1, 2]);
        assert_eq!(h.next_silence(), Some(t0 + ms(1100)));
        assert!(h.take_silent(t0 + ms(1099)).is_empty());
        assert_eq!(h.take_silent(t0 + ms(1300)), vec![(2, ms(1200))]);
        assert!(h.take_silent(t0 + ms(1400)).is_empty(), "declared once");
        assert_eq!(h.take_silent(t0 + ms(1600)), vec![(1, ms(1000))]);
        assert_eq!(h.next_silence(), None);
    }

    #[test]
    fn an_answer_read_late_never_moves_the_clock_back_and_a_forgotten_worker_is_never_silent() {
        let t0 = Instant::now();
        let mut h = Heartbeats::new(ms(500));
        h.watch(3, t0 + ms(400));
        h.heard(3, t0 + ms(100));
        assert_eq!(h.next_silence(), Some(t0 + ms(900)));
        h.forget(3);
        assert!(h.take_silent(t0 + ms(5000)).is_empty());
    }

    #[test]
    fn silence_while_the_driver_pinged_nobody_is_not_the_workers() {
        let t0 = Instant::now();
        let mut h = Heartbeats::new(ms(1000));
        h.watch(1, t0);
        h.pinged(t0);
        h.pinged(t0 + ms(250));
        // The driver is held still for 2.5 s: no pings, no answers read.
        assert!(
            h.take_silent(t0 + ms(2750)).is_empty(),
            "the driver was away"
        );
        // Pinged on time from then on, the worker stays silent: now the silence is its own.
        for k in 0..4 {
            h.pinged(t0 + ms(2750 + 250 * k));
        }
        assert!(
            h.take_silent(t0 + ms(3500)).is_empty(),
            "its silence started again"
        );
        h.pinged(t0 + ms(3750));
        assert_eq!(h.take_silent(t0 + ms(3750)), vec![(1, ms(1000))]);
        // A restart after an outage does the same.
        h.watch(2, t0);
        h.restart(t0 + ms(5000));
        assert_eq!(h.next_silence(), Some(t0 + ms(6000)));
    }

    /// Reports every 500 ms of a round stepping every 100 ms, the median rank waiting for rank
    /// 2 `permille` thousandths of the time.
    fn run(
        s: &mut Stragglers,
        t0: Instant,
        g: u64,
        from: u64,
        reports: u64,
        permille: u32,
    ) -> Vec<Straggler> {
        let mut found = Vec::new();
        for k in 0..reports {
            let now = t0 + ms(500 * (from + k));
            found.extend(s.observe(now, g, 5 * (from + k), &[0, 0, permille, 0]));
        }
        found
    }

    #[test]
    fn a_rank_slow_for_long_enough_is_reported_once_a_round() {
        let t0 = Instant::now();
        let mut s = Stragglers::new(StragglerPolicy::default());
        // Waited for 40% of the time: its step takes 1 / 0.6 = 1.67 times the median's.
        let found = run(&mut s, t0, 1, 0, 10, 400);
        assert!(found.is_empty(), "not yet 5 s: {found:?}");
        assert_eq!(s.period(), Some(ms(100)));
        let found = run(&mut s, t0, 1, 10, 10, 400);
        assert_eq!(found.len(), 1, "{found:?}");
        assert_eq!(found[0].rank, 2);
        assert!((found[0].factor - 1.0 / 0.6).abs() < 0.01, "{found:?}");
        assert!(run(&mut s, t0, 1, 20, 10, 400).is_empty(), "once a round");
    }

    #[test]
    fn a_slight_or_passing_slowness_and_a_new_round_report_nobody() {
        let t0 = Instant::now();
        let mut s = Stragglers::new(StragglerPolicy::default());
        // Waited for 20% of the time: 1.25 times, below 1.3.
        assert!(run(&mut s, t0, 1, 0, 30, 200).is_empty());
        // Slow for 4 s, then well, then slow again: the streak starts over.
        let mut s = Stragglers::new(StragglerPolicy::default());
        assert!(run(&mut s, t0, 1, 0, 8, 400).is_empty());
        assert!(run(&mut s, t0, 1, 8, 1, 0).is_empty());
        assert!(run(&mut s, t0, 1, 9, 9, 400).is_empty());
        // A new round starts over too.
        assert!(run(&mut s, t0, 2, 18, 9, 400).is_empty());
        assert_eq!(run(&mut s, t0, 2, 27, 3, 400).len(), 1);
        assert_eq!(step_factor(0.5), 2.0);
        assert!(step_factor(1.0).is_infinite());
    }

    #[test]
    fn pings_come_four_times_per_timeout_and_never_faster_than_every_10_ms() {
        assert_eq!(ping_period(ms(1000)), ms(250));
        assert_eq!(ping_period(ms(10_000)), ms(2500));
        assert_eq!(ping_period(ms(8)), ms(10));
    }
}
