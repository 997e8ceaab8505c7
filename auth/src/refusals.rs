//! Refused connections, reported without flooding a log.
//!
//! Anyone who can reach a port can open connections that a service refuses; one log line per
//! refusal lets them fill the disk behind the log. A service keeps a [`Refusals`] and reports
//! the first refusal of each peer address and reason in full, then only a count per reason, at
//! most once per interval. The decisions are here, pure (time is given); the service logs and
//! counts its metrics from them.

use std::collections::{BTreeMap, HashSet};
use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

/// How many (peer address, reason) pairs are remembered as reported in full; refusals beyond
/// that are only counted, so that a flood from many addresses cannot grow the memory either.
pub const REMEMBERED: usize = 4096;

/// How a service reports refusals by default: a count per reason at most this often.
pub const SUMMARY_EVERY: Duration = Duration::from_secs(5);

/// How often a service checks whether a summary is due: the first count after a quiet spell
/// comes within this, later ones [`SUMMARY_EVERY`] apart.
pub const SUMMARY_CHECK: Duration = Duration::from_secs(1);

/// Why a service refused a connection: a label from the service's fixed set (for the log's
/// counts and a metric), and what happened (for the log, and for the peer where it is told).
#[derive(Debug)]
pub struct Refused {
    /// The label, such as `wrong_secret`.
    pub reason: &'static str,
    /// What happened.
    pub detail: String,
}

impl Refused {
    /// A refusal for `reason`.
    pub fn new(reason: &'static str, detail: impl Into<String>) -> Self {
        Self {
            reason,
            detail: detail.into(),
        }
    }

    /// A refusal for a failure of the connection itself.
    pub fn io(e: &std::io::Error) -> Self {
        Self::new("io", e.to_string())
    }
}

/// What a service does with one refusal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Report {
    /// The first of its peer address and reason: log it with its details.
    Full,
    /// Counted in the next summary.
    Counted,
}

/// One service's refusals: those reported in full, and the counts since the last summary.
#[derive(Debug)]
pub struct Refusals {
    every: Duration,
    reported: HashSet<(IpAddr, &'static str)>,
    counted: BTreeMap<&'static str, u64>,
    last: Option<Instant>,
}

impl Refusals {
    /// Refusals summarized at most once per `every`.
    pub fn new(every: Duration) -> Self {
        Self {
            every,
            reported: HashSet::new(),
            counted: BTreeMap::new(),
            last: None,
        }
    }

    /// Records a refusal of `peer` for `reason` (a short label from a fixed set, such as
    /// `wrong_secret`) and says how to report it.
    pub fn refuse(&mut self, peer: IpAddr, reason: &'static str) -> Report {
        let peer = match peer {
            IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(peer, IpAddr::V4),
            v4 => v4,
        };
        if self.reported.len() < REMEMBERED && self.reported.insert((peer, reason)) {
            return Report::Full;
        }
        *self.counted.entry(reason).or_default() += 1;
        Report::Counted
    }

    /// The refusals counted since the last summary, by reason, when `every` has passed since
    /// it (at once, before the first); none while nothing was counted.
    pub fn summary(&mut self, now: Instant) -> Option<Vec<(&'static str, u64)>> {
        let soon = self
            .last
            .is_some_and(|last| now.saturating_duration_since(last) < self.every);
        if self.counted.is_empty() || soon {
            return None;
        }
        self.last = Some(now);
        Some(std::mem::take(&mut self.counted).into_iter().collect())
    }

    /// Everything counted and not yet summarized, at once (a service that stops).
    pub fn flush(&mut self) -> Vec<(&'static str, u64)> {
        std::mem::take(&mut self.counted).into_iter().collect()
    }

    /// Records and logs a refusal of `peer`, whose connection is a `what` connection (`driver`
    /// at an agent, `rendezvous` at the driver, `peer` in the mesh), as [`Refusals::refuse`]
    /// decides: a warning with `detail` the first time for its address and reason, else
    /// nothing until the summary. Returns the decision.
    pub fn log(
        &mut self,
        what: &str,
        peer: SocketAddr,
        reason: &'static str,
        detail: &str,
    ) -> Report {
        let report = self.refuse(peer.ip(), reason);
        if report == Report::Full {
            tracing::warn!(%peer, reason, detail, "{what} connection refused");
        }
        report
    }

    /// Logs the counts since the last summary, one line per reason, when a summary is due:
    /// the refusals of `what` connections not logged one by one.
    pub fn log_summary(&mut self, what: &str, now: Instant) {
        for (reason, refused) in self.summary(now).unwrap_or_default() {
            tracing::warn!(
                reason,
                refused,
                "{what} connections refused since the last count"
            );
        }
    }

    /// Logs whatever was counted and not summarized yet (a service that stops).
    pub fn log_rest(&mut self, what: &str) {
        for (reason, refused) in self.flush() {
            tracing::warn!(
                reason,
                refused,
                "{what} connections refused since the last count"
            );
        }
    }
}

/// The refusals of `what` connections that the count lines of a log report, for `reason` or
/// all: the reading of what [`Refusals::log_summary`] writes (with `tracing`'s default format),
/// for tests and tools that check a service's log.
pub fn counted_in(log: &str, what: &str, reason: Option<&str>) -> u64 {
    let line = format!("{what} connections refused since the last count");
    let label = reason.map(|r| format!("reason=\"{r}\""));
    log.lines()
        .filter(|l| l.contains(&line))
        .filter(|l| label.as_ref().is_none_or(|r| l.contains(r.as_str())))
        .filter_map(|l| {
            l.split("refused=")
                .nth(1)?
                .split(' ')
                .next()?
                .parse::<u64>()
                .ok()
        })
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(last: u8) -> IpAddr {
        IpAddr::from([127, 0, 0, last])
    }

    #[test]
    fn the_first_of_each_peer_and_reason_is_reported_in_full() {
        let mut r = Refusals::new(SUMMARY_EVERY);
        assert_eq!(r.refuse(ip(2), "wrong_secret"), Report::Full);
        assert_eq!(r.refuse(ip(2), "wrong_secret"), Report::Counted);
        assert_eq!(r.refuse(ip(2), "silent"), Report::Full);
        assert_eq!(r.refuse(ip(3), "wrong_secret"), Report::Full);
        // An IPv4 peer seen through a dual-stack listener is the same peer.
        let mapped = IpAddr::V6(std::net::Ipv4Addr::new(127, 0, 0, 3).to_ipv6_mapped());
        assert_eq!(r.refuse(mapped, "wrong_secret"), Report::Counted);
    }

    #[test]
    fn counts_are_summarized_at_most_once_per_interval() {
        let t = Instant::now();
        let every = Duration::from_secs(5);
        let mut r = Refusals::new(every);
        assert_eq!(r.summary(t), None, "nothing counted");
        r.refuse(ip(2), "silent");
        for _ in 0..1000 {
            r.refuse(ip(2), "silent");
            r.refuse(ip(2), "not_hello");
        }
        // The first summary is due at once; the next only `every` later.
        assert_eq!(
            r.summary(t),
            Some(vec![("not_hello", 999), ("silent", 1000)])
        );
        r.refuse(ip(2), "silent");
        assert_eq!(r.summary(t + Duration::from_secs(4)), None, "too soon");
        assert_eq!(r.summary(t + every), Some(vec![("silent", 1)]));
        assert_eq!(r.summary(t + every * 3), None, "counts were taken");
        r.refuse(ip(2), "silent");
        assert_eq!(
            r.summary(t + every * 3),
            Some(vec![("silent", 1)]),
            "after a quiet spell"
        );
    }

    #[test]
    fn a_flood_from_many_addresses_is_remembered_only_up_to_a_bound() {
        let mut r = Refusals::new(SUMMARY_EVERY);
        let mut full = 0;
        for i in 0..(REMEMBERED as u32 + 5000) {
            let peer = IpAddr::from(std::net::Ipv6Addr::from(u128::from(i) + 1));
            if r.refuse(peer, "silent") == Report::Full {
                full += 1;
            }
        }
        assert_eq!(full, REMEMBERED);
        assert_eq!(r.flush(), vec![("silent", 5000)]);
        assert!(r.flush().is_empty());
    }
}
