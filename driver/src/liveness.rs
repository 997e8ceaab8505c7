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

    #[test]
    fn pings_come_four_times_per_timeout_and_never_faster_than_every_10_ms() {
        assert_eq!(ping_period(ms(1000)), ms(250));
        assert_eq!(ping_period(ms(10_000)), ms(2500));
        assert_eq!(ping_period(ms(8)), ms(10));
    }
}
