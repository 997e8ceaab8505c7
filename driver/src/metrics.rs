//! The elastic driver's metrics, served on `GET /metrics` beside `/status`: the job's state
//! (phase, round, workers, hosts, blacklist), what it went through (resets, failures,
//! discovery runs, failovers, how long rounds and recoveries took) and how fast it trains
//! (rank 0's step and allreduce rates, reported on its rendezvous connection).
//!
//! [`Metrics`] holds the registry and its handles (atomics, shared with the endpoint);
//! [`Observer`] turns what the job loop sees into them. It is given the core's time, so it
//! is tested without clocks.

use std::sync::Arc;
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::{Registry, Unit};

use crate::elastic::core::{Core, Input, JobPhase, Snapshot, WorkerId};

/// Buckets of the duration histograms: 10 ms to 10 minutes (a round between live workers
/// takes milliseconds; one that waits for new processes or hosts, seconds to minutes).
pub const DURATION_BUCKETS: [f64; 15] = [
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
];

/// Every phase, in the order the gauge lists them.
const PHASES: [JobPhase; 5] = [
    JobPhase::Pending,
    JobPhase::Running,
    JobPhase::Rescaling,
    JobPhase::Succeeded,
    JobPhase::Failed,
];

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PhaseLabel {
    phase: &'static str,
}

/// Which service refused a connection, and why (a label from the service's fixed set).
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RefusedLabel {
    service: &'static str,
    reason: &'static str,
}

/// Who gave a host notice.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct NoticeLabel {
    source: &'static str,
}

/// A rank of the current round, and its host.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RankLabel {
    rank: String,
    host: String,
}

type Rate = Gauge<f64, std::sync::atomic::AtomicU64>;

/// Rank 0's counts since its process started, as it reports them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Progress {
    /// Training steps (commits of the elastic state).
    pub steps: u64,
    /// Allreduce calls.
    pub allreduces: u64,
    /// Bytes allreduced.
    pub allreduce_bytes: u64,
    /// By rank, the thousandths of the time the median rank waits for it at the collectives
    /// (empty where the engine does not run).
    pub lateness_permille: Vec<u32>,
}

/// The driver's metrics. Clones share the same values.
#[derive(Debug, Clone)]
pub struct Metrics {
    registry: Arc<Registry>,
    phase: Family<PhaseLabel, Gauge>,
    generation: Gauge,
    workers: Gauge,
    hosts: Gauge,
    blacklisted: Gauge,
    resets: Counter,
    round_duration: Histogram,
    recovery_duration: Histogram,
    discovery_runs: Counter,
    discovery_failures: Counter,
    discovery_duration: Histogram,
    heartbeat_failures: Counter,
    worker_failures: Counter,
    failovers: Counter,
    refused: Family<RefusedLabel, Counter>,
    notices: Family<NoticeLabel, Counter>,
    lateness: Family<RankLabel, Rate>,
    steps: Rate,
    allreduces: Rate,
    allreduce_bytes: Rate,
}

impl Metrics {
    /// Fresh metrics of a job that `failovers` drivers took over so far.
    pub fn new(failovers: u64) -> Self {
        let mut r = Registry::default();
        let phase = Family::<PhaseLabel, Gauge>::default();
        r.register(
            "hvd_job_phase",
            "Where the job stands: 1 for its current phase, 0 for the others",
            phase.clone(),
        );
        let refused = Family::<RefusedLabel, Counter>::default();
        r.register(
            "hvd_refused_connections",
            "Connections the driver's services refused (strangers, wrong secrets, garbage), \
             by service and reason",
            refused.clone(),
        );
        let notices = Family::<NoticeLabel, Counter>::default();
        r.register(
            "hvd_preemption_notices",
            "Hosts that gave notice they are going away (a SIGTERM to a worker, a cloud's \
             preemption notice), by source; each host's first notice counts",
            notices.clone(),
        );
        for source in hvd_rendezvous::NoticeSource::ALL {
            // Created at 0, so every source is exported before its first notice.
            drop(notices.get_or_create(&NoticeLabel {
                source: source.name(),
            }));
        }
        let lateness = Family::<RankLabel, Rate>::default();
        r.register_with_unit(
            "hvd_rank_lateness",
            "How long the median rank of the current round waits for each rank at the \
             collectives, per training step, over about the last 5 s (from rank 0's engine)",
            Unit::Seconds,
            lateness.clone(),
        );
        let gauge = |r: &mut Registry, name: &str, help: &str| {
            let g = Gauge::default();
            r.register(name, help, g.clone());
            g
        };
        let counter = |r: &mut Registry, name: &str, help: &str| {
            let c = Counter::default();
            r.register(name, help, c.clone());
            c
        };
        let seconds = |r: &mut Registry, name: &str, help: &str| {
            let h = Histogram::new(DURATION_BUCKETS);
            r.register_with_unit(name, help, Unit::Seconds, h.clone());
            h
        };
        let rate = |r: &mut Registry, name: &str, help: &str| {
            let g = Rate::default();
            r.register(name, help, g.clone());
            g
        };
        let m = Self {
            generation: gauge(
                &mut r,
                "hvd_generation",
                "The last completed rendezvous round (0: none yet)",
            ),
            workers: gauge(&mut r, "hvd_workers", "Workers of the last round"),
            hosts: gauge(&mut r, "hvd_hosts", "Hosts of the last round"),
            blacklisted: gauge(
                &mut r,
                "hvd_blacklisted_hosts",
                "Hosts kept out of the job now, for a failure",
            ),
            resets: counter(
                &mut r,
                "hvd_resets",
                "Rounds after the first: membership changes and recoveries",
            ),
            round_duration: seconds(
                &mut r,
                "hvd_round_duration",
                "How long each round took to form, from the end of training in the round \
                 before (or the job's start) to the rank table",
            ),
            recovery_duration: seconds(
                &mut r,
                "hvd_recovery_duration",
                "How long the job took to train again after a worker failed",
            ),
            discovery_runs: counter(
                &mut r,
                "hvd_discovery_runs",
                "Host discovery runs (discovery script runs, or host sets from a pod watch)",
            ),
            discovery_failures: counter(
                &mut r,
                "hvd_discovery_failures",
                "Host discovery runs that failed",
            ),
            discovery_duration: seconds(
                &mut r,
                "hvd_discovery_duration",
                "How long each run of the host discovery script took",
            ),
            heartbeat_failures: counter(
                &mut r,
                "hvd_heartbeat_failures",
                "Workers declared failed for answering no ping for the heartbeat timeout",
            ),
            worker_failures: counter(
                &mut r,
                "hvd_worker_failures",
                "Workers that failed: exited with an error, killed, unresponsive or never started",
            ),
            failovers: counter(
                &mut r,
                "hvd_driver_failovers",
                "Times a driver took the job over from its predecessor (with a state store)",
            ),
            steps: rate(
                &mut r,
                "hvd_training_steps_per_second",
                "Training steps per second, as rank 0 reports them",
            ),
            allreduces: rate(
                &mut r,
                "hvd_allreduces_per_second",
                "Allreduce calls per second on rank 0, as it reports them",
            ),
            allreduce_bytes: rate(
                &mut r,
                "hvd_allreduce_bytes_per_second",
                "Bytes allreduced per second on rank 0, as it reports them",
            ),
            phase,
            refused,
            notices,
            lateness,
            registry: Arc::new(r),
        };
        m.failovers.inc_by(failovers);
        m
    }

    /// A connection `service` refused for `reason`.
    pub fn refused(&self, service: &'static str, reason: &'static str) {
        self.refused
            .get_or_create(&RefusedLabel { service, reason })
            .inc();
    }

    /// Each rank's lateness in seconds a step, by rank with its host; the ranks of an older
    /// round are dropped.
    pub fn lateness(&self, by_rank: &[(f64, &str)]) {
        self.lateness.clear();
        for (rank, (secs, host)) in by_rank.iter().enumerate() {
            self.lateness
                .get_or_create(&RankLabel {
                    rank: rank.to_string(),
                    host: (*host).to_string(),
                })
                .set(*secs);
        }
    }

    /// The registry, for the endpoint.
    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    /// One run of a discovery script that took `took`, and whether it failed.
    pub fn discovery_run(&self, took: Option<Duration>, failed: bool) {
        self.discovery_runs.inc();
        if failed {
            self.discovery_failures.inc();
        }
        if let Some(t) = took {
            self.discovery_duration.observe(t.as_secs_f64());
        }
    }
}

fn phase_label(p: JobPhase) -> &'static str {
    crate::status::phase(p).name()
}

/// Turns what the job loop sees into the metrics: snapshots of the core after every event,
/// the inputs that are failures, and rank 0's progress reports. Owned by the job loop.
#[derive(Debug)]
pub struct Observer {
    metrics: Metrics,
    /// The resets of the last snapshot.
    resets: u64,
    /// The round of the last snapshot.
    generation: u64,
    /// When the round being formed began (the job's start for the first).
    round_began: Option<Duration>,
    /// When the first failure not yet recovered from happened.
    failed_at: Option<Duration>,
    /// The last progress report, from which worker, and when.
    progress: Option<(WorkerId, Duration, Progress)>,
}

impl Observer {
    /// Observes into `metrics`, starting from the core's state `start` at `now` (a driver that
    /// takes a job over starts from its predecessor's round and resets).
    pub fn new(metrics: Metrics, now: Duration, start: &Snapshot) -> Self {
        metrics.resets.inc_by(start.resets);
        let mut o = Self {
            metrics,
            resets: start.resets,
            generation: start.generation,
            round_began: None,
            failed_at: None,
            progress: None,
        };
        o.snapshot(now, start);
        o
    }

    /// The metrics it writes to.
    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// An input about to be fed to `core` at `now`: a live worker's failure starts a
    /// recovery.
    pub fn input(&mut self, now: Duration, input: &Input, core: &Core) {
        let failed = match input {
            Input::Exited { worker, exit } => !exit.success && core.is_live(*worker),
            // The core acts only on live workers' silence; so does the count.
            Input::Unresponsive { worker, .. } if core.is_live(*worker) => {
                self.metrics.heartbeat_failures.inc();
                true
            }
            Input::Notice { host, source, .. } if !core.is_noticed(host) => {
                self.metrics
                    .notices
                    .get_or_create(&NoticeLabel {
                        source: source.name(),
                    })
                    .inc();
                false
            }
            _ => false,
        };
        if failed {
            self.metrics.worker_failures.inc();
            self.failed_at.get_or_insert(now);
        }
    }

    /// The core's state after an event at `now`.
    pub fn snapshot(&mut self, now: Duration, s: &Snapshot) {
        let m = &self.metrics;
        for p in PHASES {
            m.phase
                .get_or_create(&PhaseLabel {
                    phase: phase_label(p),
                })
                .set(i64::from(p == s.phase));
        }
        let count = |n: usize| i64::try_from(n).unwrap_or(i64::MAX);
        m.generation
            .set(i64::try_from(s.generation).unwrap_or(i64::MAX));
        m.workers.set(count(s.workers));
        m.hosts.set(count(s.hosts.len()));
        m.blacklisted.set(count(s.blacklisted.len()));
        if s.resets > self.resets {
            m.resets.inc_by(s.resets - self.resets);
            self.resets = s.resets;
        }
        if s.generation > self.generation {
            self.generation = s.generation;
            let began = self.round_began.take().unwrap_or(now);
            m.round_duration
                .observe(now.saturating_sub(began).as_secs_f64());
            if let Some(failed) = self.failed_at.take() {
                m.recovery_duration
                    .observe(now.saturating_sub(failed).as_secs_f64());
            }
        }
        if matches!(s.phase, JobPhase::Pending | JobPhase::Rescaling) {
            self.round_began.get_or_insert(now);
        } else {
            self.round_began = None;
        }
        // Rates hold only while the job trains: a rescale or an end sets them to 0, and the
        // next rank 0 starts over.
        if s.phase != JobPhase::Running {
            self.progress = None;
            self.zero_rates();
        }
    }

    fn zero_rates(&self) {
        let m = &self.metrics;
        m.steps.set(0.0);
        m.allreduces.set(0.0);
        m.allreduce_bytes.set(0.0);
    }

    /// Rank 0 (`worker`) reported its counts at `now`: the rates since its last report.
    /// A report from another worker (a new rank 0) or with smaller counts (a new process)
    /// starts over, the rates at 0 until its next report.
    pub fn progress(&mut self, now: Duration, worker: WorkerId, p: Progress) {
        if let Some((w, then, last)) = self.progress.replace((worker, now, p.clone())) {
            if w != worker {
                self.zero_rates();
            }
            let secs = now.saturating_sub(then).as_secs_f64();
            let grew = p.steps >= last.steps
                && p.allreduces >= last.allreduces
                && p.allreduce_bytes >= last.allreduce_bytes;
            if w == worker && grew && secs > 0.0 {
                let per_s = |a: u64, b: u64| (a - b) as f64 / secs;
                let m = &self.metrics;
                m.steps.set(per_s(p.steps, last.steps));
                m.allreduces.set(per_s(p.allreduces, last.allreduces));
                m.allreduce_bytes
                    .set(per_s(p.allreduce_bytes, last.allreduce_bytes));
            }
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::elastic::core::{Config, ExitInfo};

    fn snap(phase: JobPhase, generation: u64, resets: u64) -> Snapshot {
        Snapshot {
            phase,
            generation,
            workers: 2,
            hosts: vec![("a".into(), 1), ("b".into(), 1)],
            blacklisted: vec![("c".into(), None)],
            resets,
            noticed: vec![],
        }
    }

    fn text(m: &Metrics) -> String {
        hvd_serve::metrics::render(m.registry()).unwrap()
    }

    fn value(text: &str, series: &str) -> f64 {
        text.lines()
            .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
            .unwrap_or_else(|| panic!("no {series} in\n{text}"))
            .parse()
            .unwrap()
    }

    fn secs(s: f64) -> Duration {
        Duration::from_secs_f64(s)
    }

    #[test]
    fn each_hosts_first_notice_is_counted_by_source_and_none_is_a_failure() {
        let m = Metrics::new(0);
        let mut o = Observer::new(m.clone(), Duration::ZERO, &snap(JobPhase::Running, 1, 0));
        let mut core = Core::new(Config {
            np: 1,
            min_np: 1,
            max_np: 2,
            elastic_timeout: secs(60.0),
            round_timeout: secs(60.0),
            reset_limit: None,
            cooldown: None,
            seed: 1,
        });
        let t = text(&m);
        for source in hvd_rendezvous::NoticeSource::ALL {
            let series = format!("hvd_preemption_notices_total{{source=\"{source}\"}}");
            assert_eq!(
                value(&t, &series),
                0.0,
                "every source is exported from the start"
            );
        }
        let notice = |host: &str, source| Input::Notice {
            host: host.into(),
            source,
            within: Some(secs(120.0)),
        };
        for (i, input) in [
            notice("a", hvd_rendezvous::NoticeSource::Aws),
            notice("a", hvd_rendezvous::NoticeSource::Sigterm),
            notice("b", hvd_rendezvous::NoticeSource::Sigterm),
        ]
        .into_iter()
        .enumerate()
        {
            let now = secs(1.0 + i as f64);
            o.input(now, &input, &core);
            core.handle(now, input);
        }
        let t = text(&m);
        assert_eq!(
            value(&t, "hvd_preemption_notices_total{source=\"aws\"}"),
            1.0
        );
        assert_eq!(
            value(&t, "hvd_preemption_notices_total{source=\"sigterm\"}"),
            1.0,
            "a's second notice is not counted again"
        );
        assert_eq!(value(&t, "hvd_worker_failures_total"), 0.0);
    }

    #[test]
    fn rounds_recoveries_and_resets_are_timed_and_counted() {
        let m = Metrics::new(2);
        let mut o = Observer::new(m.clone(), Duration::ZERO, &snap(JobPhase::Pending, 0, 0));
        o.snapshot(secs(1.5), &snap(JobPhase::Running, 1, 0));
        // A live worker fails at 10 s; the round that replaces it completes at 12 s.
        let core = Core::new(Config {
            np: 1,
            min_np: 1,
            max_np: 1,
            elastic_timeout: secs(60.0),
            round_timeout: secs(60.0),
            reset_limit: None,
            cooldown: None,
            seed: 1,
        });
        let exit = Input::Exited {
            worker: 0,
            exit: ExitInfo {
                success: false,
                description: "killed".into(),
            },
        };
        o.input(secs(9.0), &exit, &core); // not a worker of this core: not a failure
        o.snapshot(secs(10.0), &snap(JobPhase::Rescaling, 1, 0));
        o.snapshot(secs(12.0), &snap(JobPhase::Running, 2, 1));
        let t = text(&m);
        assert_eq!(value(&t, "hvd_generation"), 2.0);
        assert_eq!(value(&t, "hvd_resets_total"), 1.0);
        assert_eq!(value(&t, "hvd_driver_failovers_total"), 2.0);
        assert_eq!(value(&t, "hvd_round_duration_seconds_count"), 2.0);
        assert_eq!(value(&t, "hvd_round_duration_seconds_sum"), 3.5);
        assert_eq!(value(&t, "hvd_recovery_duration_seconds_count"), 0.0);
        assert_eq!(value(&t, "hvd_job_phase{phase=\"Running\"}"), 1.0);
        assert_eq!(value(&t, "hvd_job_phase{phase=\"Rescaling\"}"), 0.0);
        assert_eq!(value(&t, "hvd_blacklisted_hosts"), 1.0);
        assert_eq!(value(&t, "hvd_hosts"), 2.0);
    }

    #[test]
    fn a_failure_is_timed_until_the_next_round() {
        let m = Metrics::new(0);
        let mut o = Observer::new(m.clone(), Duration::ZERO, &snap(JobPhase::Running, 3, 2));
        o.failed_at = Some(secs(20.0));
        o.metrics.worker_failures.inc();
        o.snapshot(secs(20.0), &snap(JobPhase::Rescaling, 3, 2));
        o.snapshot(secs(20.25), &snap(JobPhase::Running, 4, 3));
        let t = text(&m);
        assert_eq!(value(&t, "hvd_resets_total"), 3.0);
        assert_eq!(value(&t, "hvd_recovery_duration_seconds_count"), 1.0);
        assert_eq!(value(&t, "hvd_recovery_duration_seconds_sum"), 0.25);
        assert_eq!(value(&t, "hvd_round_duration_seconds_sum"), 0.25);
        assert_eq!(value(&t, "hvd_worker_failures_total"), 1.0);
    }

    #[test]
    fn rates_come_from_consecutive_reports_of_one_worker() {
        let m = Metrics::new(0);
        let mut o = Observer::new(m.clone(), Duration::ZERO, &snap(JobPhase::Running, 1, 0));
        let p = |steps, allreduces, allreduce_bytes| Progress {
            lateness_permille: vec![],
            steps,
            allreduces,
            allreduce_bytes,
        };
        o.progress(secs(1.0), 4, p(10, 20, 800));
        assert_eq!(value(&text(&m), "hvd_training_steps_per_second"), 0.0);
        o.progress(secs(3.0), 4, p(30, 60, 2400));
        let t = text(&m);
        assert_eq!(value(&t, "hvd_training_steps_per_second"), 10.0);
        assert_eq!(value(&t, "hvd_allreduces_per_second"), 20.0);
        assert_eq!(value(&t, "hvd_allreduce_bytes_per_second"), 800.0);
        // A new rank 0: its first report sets the rates to 0, its second sets them.
        o.progress(secs(4.0), 7, p(1, 1, 1));
        assert_eq!(value(&text(&m), "hvd_training_steps_per_second"), 0.0);
        o.progress(secs(5.0), 7, p(6, 1, 1));
        assert_eq!(value(&text(&m), "hvd_training_steps_per_second"), 5.0);
        // A rescale (and an end) sets them to 0, and the next report starts over.
        o.snapshot(secs(6.0), &snap(JobPhase::Rescaling, 1, 1));
        assert_eq!(value(&text(&m), "hvd_training_steps_per_second"), 0.0);
        o.snapshot(secs(7.0), &snap(JobPhase::Running, 2, 1));
        o.progress(secs(8.0), 7, p(16, 1, 1));
        assert_eq!(value(&text(&m), "hvd_training_steps_per_second"), 0.0);
        o.progress(secs(9.0), 7, p(18, 1, 1));
        assert_eq!(value(&text(&m), "hvd_training_steps_per_second"), 2.0);
    }

    #[test]
    fn discovery_runs_failures_and_durations() {
        let m = Metrics::new(0);
        m.discovery_run(Some(secs(0.02)), false);
        m.discovery_run(Some(secs(0.5)), true);
        m.discovery_run(None, false);
        let t = text(&m);
        assert_eq!(value(&t, "hvd_discovery_runs_total"), 3.0);
        assert_eq!(value(&t, "hvd_discovery_failures_total"), 1.0);
        assert_eq!(value(&t, "hvd_discovery_duration_seconds_count"), 2.0);
    }
}
