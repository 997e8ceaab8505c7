//! Hosts whose workers failed, kept out of the job for an exponentially growing cooldown
//! (`horovodrun --blacklist-cooldown-range LO HI`), or for good when no range is given.
//!
//! The blacklist reads no clock and draws no random numbers: the caller passes `now` (time since
//! the job started) and the jitter fraction, so every transition can be replayed in a test.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

/// A cooldown range that can't be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CooldownRangeError {
    /// The lower bound is zero, so a failed host would never stay out.
    #[error("blacklist cooldown lower bound must be above zero")]
    ZeroLo,
    /// The upper bound is below the lower one.
    #[error("blacklist cooldown upper bound {hi:?} is below the lower bound {lo:?}")]
    HiBelowLo {
        /// The lower bound.
        lo: Duration,
        /// The upper bound.
        hi: Duration,
    },
}

/// Bounds of the blacklist cooldown: the first failure waits `lo`, each further one doubles it,
/// up to `hi`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct CooldownRange {
    /// Cooldown after a host's first failure, and the unit of jitter.
    pub lo: Duration,
    /// The longest cooldown before jitter.
    pub hi: Duration,
}

impl CooldownRange {
    /// Checks `0 < lo <= hi`.
    ///
    /// # Errors
    /// [`CooldownRangeError`] saying which bound is wrong.
    pub fn new(lo: Duration, hi: Duration) -> Result<Self, CooldownRangeError> {
        if lo.is_zero() {
            return Err(CooldownRangeError::ZeroLo);
        }
        if hi < lo {
            return Err(CooldownRangeError::HiBelowLo { lo, hi });
        }
        Ok(Self { lo, hi })
    }

    /// Cooldown for a host's `failures`-th failure (1-based): `min(lo·2^(n−1), hi) + jitter·lo`.
    ///
    /// `jitter` is a fraction in `[0, 1)` that spreads hosts failing together; values outside are
    /// clamped and NaN counts as 0.
    pub fn cooldown(&self, failures: u32, jitter: f64) -> Duration {
        let doublings = failures.saturating_sub(1);
        let base = 1u32
            .checked_shl(doublings)
            .and_then(|factor| self.lo.checked_mul(factor))
            .map_or(self.hi, |d| d.min(self.hi));
        let jitter = if jitter.is_nan() {
            0.0
        } else {
            jitter.clamp(0.0, 1.0)
        };
        base.saturating_add(self.lo.mul_f64(jitter))
    }
}

/// A host entering the blacklist, for the caller to act on and log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Blacklisting {
    /// The host.
    pub host: String,
    /// Failures of this host so far, this one included; never reset.
    pub failures: u32,
    /// How long it stays out; `None` means for the rest of the job.
    pub cooldown: Option<Duration>,
    /// When (since job start) it may come back; `None` means never.
    pub until: Option<Duration>,
}

impl fmt::Display for Blacklisting {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.cooldown, self.until) {
            (Some(cooldown), Some(until)) => write!(
                f,
                "host {} blacklisted after failure {} for {cooldown:?} (until {until:?})",
                self.host, self.failures
            ),
            _ => write!(
                f,
                "host {} blacklisted permanently after failure {}",
                self.host, self.failures
            ),
        }
    }
}

/// A host whose cooldown has ended, so it may be used again.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Released {
    /// The host.
    pub host: String,
    /// Its failures so far; the next one doubles the cooldown.
    pub failures: u32,
    /// When (since job start) its cooldown ended.
    pub at: Duration,
}

impl fmt::Display for Released {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "host {} released from blacklist at {:?} ({} failure{} so far)",
            self.host,
            self.at,
            self.failures,
            if self.failures == 1 { "" } else { "s" }
        )
    }
}

/// Where one host stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
enum State {
    /// Usable (never blacklisted, or released).
    Free,
    /// Blacklisted until this time; still listed here after it passes until `expire` reports it.
    Until(Duration),
    /// Blacklisted for the rest of the job.
    Forever,
}

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
struct Entry {
    failures: u32,
    state: State,
}

impl Entry {
    fn out_at(&self, now: Duration) -> bool {
        match self.state {
            State::Free => false,
            State::Until(until) => now < until,
            State::Forever => true,
        }
    }
}

/// Failed hosts and their cooldowns; a pure state machine driven by the caller's clock. It
/// serializes whole (a successor driver reads it back from the state store).
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Blacklist {
    cooldown: Option<CooldownRange>,
    // Ordered so listings and releases come out in a stable order.
    hosts: BTreeMap<String, Entry>,
}

impl Blacklist {
    /// An empty blacklist; without a range, blacklisted hosts never come back (Horovod's default).
    pub fn new(cooldown: Option<CooldownRange>) -> Self {
        Self {
            cooldown,
            hosts: BTreeMap::new(),
        }
    }

    /// Records that a worker on `host` failed at `now` and keeps the host out.
    ///
    /// Returns `None`, and changes nothing, while the host is already out (several workers of
    /// one host usually fail together; that is one failure, not several doublings). A host whose
    /// cooldown has passed but that [`expire`](Self::expire) has not yet reported is blacklisted
    /// anew, and that pending release is dropped.
    pub fn blacklist(&mut self, host: &str, now: Duration, jitter: f64) -> Option<Blacklisting> {
        let entry = self.hosts.entry(host.to_string()).or_insert(Entry {
            failures: 0,
            state: State::Free,
        });
        if entry.out_at(now) {
            return None;
        }
        entry.failures = entry.failures.saturating_add(1);
        let cooldown = self
            .cooldown
            .map(|range| range.cooldown(entry.failures, jitter));
        let until = cooldown.map(|c| now.saturating_add(c));
        entry.state = until.map_or(State::Forever, State::Until);
        Some(Blacklisting {
            host: host.to_string(),
            failures: entry.failures,
            cooldown,
            until,
        })
    }

    /// Whether `host` is kept out at `now`.
    pub fn is_blacklisted(&self, host: &str, now: Duration) -> bool {
        self.hosts.get(host).is_some_and(|e| e.out_at(now))
    }

    /// Failures recorded for `host` (0 if it never failed).
    pub fn failures(&self, host: &str) -> u32 {
        self.hosts.get(host).map_or(0, |e| e.failures)
    }

    /// Ends every cooldown that is over at `now` and reports each host once, earliest first.
    ///
    /// Released hosts keep their failure count, so their next failure doubles the cooldown.
    pub fn expire(&mut self, now: Duration) -> Vec<Released> {
        let mut out = Vec::new();
        for (host, entry) in &mut self.hosts {
            if let State::Until(at) = entry.state
                && at <= now
            {
                entry.state = State::Free;
                out.push(Released {
                    host: host.clone(),
                    failures: entry.failures,
                    at,
                });
            }
        }
        out.sort_by_key(|r| r.at);
        out
    }

    /// The earliest pending cooldown end, for the caller's timer; it may already have passed if
    /// [`expire`](Self::expire) has not been called since.
    pub fn next_expiry(&self) -> Option<Duration> {
        self.hosts
            .values()
            .filter_map(|e| match e.state {
                State::Until(at) => Some(at),
                State::Free | State::Forever => None,
            })
            .min()
    }

    /// Hosts kept out at `now`, sorted by name.
    pub fn blacklisted(&self, now: Duration) -> Vec<&str> {
        self.hosts
            .iter()
            .filter(|(_, e)| e.out_at(now))
            .map(|(h, _)| h.as_str())
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(secs: u64) -> Duration {
        Duration::from_secs(secs)
    }

    fn range(lo: u64, hi: u64) -> CooldownRange {
        CooldownRange::new(s(lo), s(hi)).unwrap()
    }

    #[test]
    fn range_validation() {
        assert_eq!(
            CooldownRange::new(s(0), s(10)),
            Err(CooldownRangeError::ZeroLo)
        );
        let e = CooldownRange::new(s(10), s(5)).unwrap_err();
        assert_eq!(
            e,
            CooldownRangeError::HiBelowLo {
                lo: s(10),
                hi: s(5)
            }
        );
        assert_eq!(
            e.to_string(),
            "blacklist cooldown upper bound 5s is below the lower bound 10s"
        );
        assert_eq!(range(10, 10).cooldown(3, 0.0), s(10));
    }

    #[test]
    fn cooldown_doubles_up_to_hi() {
        let r = range(10, 100);
        let got: Vec<_> = (1..=6).map(|n| r.cooldown(n, 0.0)).collect();
        assert_eq!(got, [10, 20, 40, 80, 100, 100].map(s));
        assert_eq!(r.cooldown(2, 0.5), s(25));
        assert_eq!(r.cooldown(6, 0.25), Duration::from_millis(102_500));
        // Huge counts and odd jitter neither overflow nor panic.
        assert_eq!(r.cooldown(u32::MAX, 0.0), s(100));
        assert_eq!(r.cooldown(40, f64::NAN), s(100));
        assert_eq!(r.cooldown(1, -3.0), s(10));
        assert_eq!(r.cooldown(1, 7.0), s(20));
    }

    #[test]
    fn doubling_sequence_through_the_blacklist() {
        let mut b = Blacklist::new(Some(range(10, 100)));
        let mut now = s(5);
        let mut cooldowns = Vec::new();
        for n in 1..=6 {
            let got = b.blacklist("h", now, 0.5).unwrap();
            assert_eq!(got.failures, n);
            let c = got.cooldown.unwrap();
            assert_eq!(got.until, Some(now + c));
            cooldowns.push(c);
            now += c;
            let released = b.expire(now);
            assert_eq!(
                released,
                vec![Released {
                    host: "h".into(),
                    failures: n,
                    at: now
                }]
            );
            now += s(1);
        }
        assert_eq!(cooldowns, [15, 25, 45, 85, 105, 105].map(s));
        assert_eq!(b.failures("h"), 6);
    }

    #[test]
    fn permanent_without_range() {
        let mut b = Blacklist::new(None);
        let got = b.blacklist("h", s(3), 0.9).unwrap();
        assert_eq!(
            got,
            Blacklisting {
                host: "h".into(),
                failures: 1,
                cooldown: None,
                until: None
            }
        );
        assert_eq!(
            got.to_string(),
            "host h blacklisted permanently after failure 1"
        );
        assert!(b.is_blacklisted("h", s(1_000_000)));
        assert_eq!(b.expire(s(1_000_000)), vec![]);
        assert_eq!(b.next_expiry(), None);
        assert_eq!(b.blacklist("h", s(10), 0.0), None);
        assert_eq!(b.failures("h"), 1);
        assert_eq!(b.blacklisted(s(10)), vec!["h"]);
    }

    #[test]
    fn expiry_is_reported_once() {
        let mut b = Blacklist::new(Some(range(10, 100)));
        let got = b.blacklist("h", s(0), 0.0).unwrap();
        assert_eq!(
            got.to_string(),
            "host h blacklisted after failure 1 for 10s (until 10s)"
        );
        assert!(b.is_blacklisted("h", s(9)));
        assert_eq!(b.expire(s(9)), vec![]);
        assert!(!b.is_blacklisted("h", s(10)));
        let released = b.expire(s(12));
        assert_eq!(released.len(), 1);
        assert_eq!(
            released[0].to_string(),
            "host h released from blacklist at 10s (1 failure so far)"
        );
        assert_eq!(b.expire(s(12)), vec![]);
        assert_eq!(b.expire(s(500)), vec![]);
        assert!(!b.is_blacklisted("h", s(500)));
        assert_eq!(b.blacklisted(s(500)), Vec::<&str>::new());
        // The count survives release: the next failure doubles.
        assert_eq!(b.blacklist("h", s(600), 0.0).unwrap().cooldown, Some(s(20)));
    }

    #[test]
    fn next_expiry_and_listing() {
        let mut b = Blacklist::new(Some(range(10, 100)));
        assert_eq!(b.next_expiry(), None);
        b.blacklist("b", s(0), 0.0);
        b.blacklist("b", s(0), 0.0);
        b.blacklist("a", s(3), 0.0);
        b.blacklist("c", s(1), 0.5);
        // b until 10, a until 13, c until 16.
        assert_eq!(b.next_expiry(), Some(s(10)));
        assert_eq!(b.blacklisted(s(5)), vec!["a", "b", "c"]);
        assert_eq!(b.blacklisted(s(10)), vec!["a", "c"]);
        // Not yet expired: still pending for the timer.
        assert_eq!(b.next_expiry(), Some(s(10)));
        let hosts: Vec<_> = b
            .expire(s(20))
            .into_iter()
            .map(|r| (r.host, r.at))
            .collect();
        assert_eq!(
            hosts,
            vec![
                ("b".into(), s(10)),
                ("a".into(), s(13)),
                ("c".into(), s(16))
            ]
        );
        assert_eq!(b.next_expiry(), None);
        assert!(!b.is_blacklisted("never", s(0)));
        assert_eq!(b.failures("never"), 0);
    }

    #[test]
    fn repeated_blacklist_during_cooldown_is_a_no_op() {
        let mut b = Blacklist::new(Some(range(10, 100)));
        assert!(b.blacklist("h", s(0), 0.0).is_some());
        assert_eq!(b.blacklist("h", s(5), 0.0), None);
        assert_eq!(b.blacklist("h", s(9), 0.9), None);
        assert_eq!(b.failures("h"), 1);
        assert_eq!(b.next_expiry(), Some(s(10)));
        // Once the cooldown is over it counts again, even before `expire` ran; the stale release
        // is dropped rather than reported after the new blacklisting.
        let again = b.blacklist("h", s(10), 0.0).unwrap();
        assert_eq!((again.failures, again.until), (2, Some(s(30))));
        assert_eq!(b.expire(s(29)), vec![]);
        assert_eq!(b.expire(s(30)).len(), 1);
    }
}
