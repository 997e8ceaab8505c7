//! `GET /metrics` in Prometheus' text format (version 0.0.4), from a `prometheus-client`
//! registry.
//!
//! `prometheus-client` writes OpenMetrics, where a counter family `x` has samples `x_total`
//! and `# UNIT` and `# EOF` lines. The classic text format that Prometheus, `promtool` and
//! most scrapers read names the family by its samples (`x_total`) and has neither line, so
//! [`render`] rewrites the one into the other.

use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use prometheus_client::registry::Registry;

/// The `Content-Type` of the classic text exposition.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// The registry's metrics in the classic text format.
///
/// # Errors
/// The registry could not be encoded (a metric's own encoder failed).
pub fn render(registry: &Registry) -> Result<String, std::fmt::Error> {
    let mut open = String::new();
    prometheus_client::encoding::text::encode(&mut open, registry)?;
    Ok(classic(&open))
}

/// Rewrites OpenMetrics text into the classic format: counter families renamed to their
/// `_total` samples, `# UNIT` and `# EOF` dropped.
fn classic(open: &str) -> String {
    let mut out = String::with_capacity(open.len());
    // A family's HELP comes before its TYPE, which says whether it is a counter.
    let mut help: Option<&str> = None;
    for line in open.lines() {
        if line.starts_with("# HELP ") {
            if let Some(h) = help.replace(line) {
                push(&mut out, h);
            }
            continue;
        }
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let counter = rest
                .strip_suffix(" counter")
                .filter(|n| !n.ends_with("_total"));
            match (counter, help.take()) {
                (Some(name), h) => {
                    if let Some(h) = h {
                        let text = h.strip_prefix("# HELP ").unwrap_or(h);
                        let text = text.strip_prefix(name).unwrap_or(text);
                        push(&mut out, &format!("# HELP {name}_total{text}"));
                    }
                    push(&mut out, &format!("# TYPE {name}_total counter"));
                }
                (None, h) => {
                    if let Some(h) = h {
                        push(&mut out, h);
                    }
                    push(&mut out, line);
                }
            }
            continue;
        }
        if let Some(h) = help.take() {
            push(&mut out, h);
        }
        if line.starts_with("# UNIT ") || line == "# EOF" {
            continue;
        }
        push(&mut out, line);
    }
    if let Some(h) = help {
        push(&mut out, h);
    }
    out
}

fn push(out: &mut String, line: &str) {
    out.push_str(line);
    out.push('\n');
}

/// The answer to `GET /metrics`: the exposition, or a 500 naming what failed.
pub fn response(registry: &Registry) -> Response {
    match render(registry) {
        Ok(body) => ([(header::CONTENT_TYPE, CONTENT_TYPE)], body).into_response(),
        Err(e) => {
            tracing::warn!(error = %e, "cannot encode the metrics");
            crate::error(
                StatusCode::INTERNAL_SERVER_ERROR,
                "the metrics could not be encoded",
            )
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use prometheus_client::metrics::counter::Counter;
    use prometheus_client::metrics::gauge::Gauge;
    use prometheus_client::metrics::histogram::Histogram;
    use prometheus_client::registry::Unit;

    use super::*;

    #[test]
    fn counters_are_named_by_their_samples_and_open_metrics_lines_dropped() {
        let mut r = Registry::default();
        let c: Counter = Counter::default();
        c.inc_by(3);
        r.register("hvd_resets", "Rounds after the first", c);
        let g: Gauge = Gauge::default();
        g.set(2);
        r.register("hvd_workers", "Workers of the last round", g);
        let h = Histogram::new([0.1, 1.0]);
        h.observe(0.5);
        r.register_with_unit("hvd_round_duration", "Round time", Unit::Seconds, h);
        let text = render(&r).unwrap();
        assert_eq!(
            text,
            "# HELP hvd_resets_total Rounds after the first.\n\
             # TYPE hvd_resets_total counter\n\
             hvd_resets_total 3\n\
             # HELP hvd_workers Workers of the last round.\n\
             # TYPE hvd_workers gauge\n\
             hvd_workers 2\n\
             # HELP hvd_round_duration_seconds Round time.\n\
             # TYPE hvd_round_duration_seconds histogram\n\
             hvd_round_duration_seconds_sum 0.5\n\
             hvd_round_duration_seconds_count 1\n\
             hvd_round_duration_seconds_bucket{le=\"0.1\"} 0\n\
             hvd_round_duration_seconds_bucket{le=\"1.0\"} 1\n\
             hvd_round_duration_seconds_bucket{le=\"+Inf\"} 1\n"
        );
    }

    #[test]
    fn a_help_without_a_type_is_kept() {
        assert_eq!(classic("# HELP x y\n"), "# HELP x y\n");
        assert_eq!(classic("# HELP x y\nx 1\n"), "# HELP x y\nx 1\n");
    }
}
