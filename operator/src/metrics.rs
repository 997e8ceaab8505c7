//! The operator's metrics, served on `GET /metrics` beside its probes: reconciles, their
//! errors by kind and their duration.

use std::sync::Arc;
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::{Registry, Unit};

/// Buckets of the reconcile duration: 1 ms (nothing to change) to a minute (a slow API server).
const BUCKETS: [f64; 12] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0, 60.0,
];

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ErrorLabel {
    error: &'static str,
}

/// The operator's metrics. Clones share the same values.
#[derive(Debug, Clone)]
pub struct Metrics {
    registry: Arc<Registry>,
    reconciles: Counter,
    errors: Family<ErrorLabel, Counter>,
    duration: Histogram,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Fresh metrics.
    pub fn new() -> Self {
        let mut r = Registry::default();
        let reconciles = Counter::default();
        r.register(
            "hvd_operator_reconciles",
            "Reconciles of ElasticJobs, failed or not",
            reconciles.clone(),
        );
        let errors = Family::<ErrorLabel, Counter>::default();
        r.register(
            "hvd_operator_reconcile_errors",
            "Reconciles that failed, by the kind of error",
            errors.clone(),
        );
        let duration = Histogram::new(BUCKETS);
        r.register_with_unit(
            "hvd_operator_reconcile_duration",
            "How long each reconcile took",
            Unit::Seconds,
            duration.clone(),
        );
        Self {
            registry: Arc::new(r),
            reconciles,
            errors,
            duration,
        }
    }

    /// The registry, for the endpoint.
    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    /// One reconcile that took `took` and failed with an error labelled `error` (its
    /// `metric_label`), if it failed.
    pub fn reconciled(&self, took: Duration, error: Option<&'static str>) {
        self.reconciles.inc();
        self.duration.observe(took.as_secs_f64());
        if let Some(error) = error {
            self.errors.get_or_create(&ErrorLabel { error }).inc();
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn reconciles_errors_and_durations_are_counted() {
        let m = Metrics::new();
        m.reconciled(Duration::from_millis(3), None);
        m.reconciled(Duration::from_millis(40), Some("kube"));
        let text = hvd_serve::metrics::render(m.registry()).unwrap();
        for line in [
            "# TYPE hvd_operator_reconciles_total counter",
            "hvd_operator_reconciles_total 2",
            "hvd_operator_reconcile_errors_total{error=\"kube\"} 1",
            "hvd_operator_reconcile_duration_seconds_count 2",
            "hvd_operator_reconcile_duration_seconds_bucket{le=\"0.005\"} 1",
        ] {
            assert!(text.lines().any(|l| l == line), "no {line} in\n{text}");
        }
    }
}
