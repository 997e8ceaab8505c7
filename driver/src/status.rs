//! The driver's HTTP API on `--status-port`: `GET /status`, the elastic job's state as JSON,
//! for the Kubernetes operator (the driver's pod may only read pods, so the operator polls this
//! and writes the job's status itself), and `GET /metrics`, the job's metrics for Prometheus.
//! [`router`] builds it; `hvd-serve` serves it.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::extract::State;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use hvd_serve::Router;
use hvd_serve::status::{BlacklistedHost, DriverPhase, DriverStatus, StatusHost};
use tokio::sync::watch;

use crate::elastic::core::{JobPhase, Snapshot};
use crate::metrics::Metrics;

/// The state the endpoint serves: the core's snapshot and the wall-clock time of the core's
/// zero, to turn its cooldown ends into Unix times.
#[derive(Debug, Clone)]
pub struct Published {
    /// The core's view.
    pub snapshot: Snapshot,
    /// The wall-clock time the core's clock started at.
    pub epoch: SystemTime,
}

/// The phase `/status` and the metrics' `phase` label report for the core's `p`.
pub fn phase(p: JobPhase) -> DriverPhase {
    match p {
        JobPhase::Pending => DriverPhase::Pending,
        JobPhase::Running => DriverPhase::Running,
        JobPhase::Rescaling => DriverPhase::Rescaling,
        JobPhase::Succeeded => DriverPhase::Succeeded,
        JobPhase::Failed => DriverPhase::Failed,
    }
}

/// The JSON document for `p`.
pub fn render(p: &Published) -> String {
    let s = &p.snapshot;
    let unix_ms = |d: Duration| {
        (p.epoch + d)
            .duration_since(UNIX_EPOCH)
            .map_or(0, |t| u64::try_from(t.as_millis()).unwrap_or(u64::MAX))
    };
    let body = DriverStatus {
        phase: phase(s.phase),
        generation: s.generation,
        workers: s.workers as u64,
        hosts: s
            .hosts
            .iter()
            .map(|(host, slots)| StatusHost {
                host: host.clone(),
                slots: *slots,
            })
            .collect(),
        blacklisted: s
            .blacklisted
            .iter()
            .map(|(host, until)| BlacklistedHost {
                host: host.clone(),
                until_ms: until.map(unix_ms),
            })
            .collect(),
        resets: s.resets,
    };
    serde_json::to_string(&body)
        .unwrap_or_else(|e| serde_json::json!({ "error": e.to_string() }).to_string())
}

/// What the handlers read: the latest published state and the metrics.
#[derive(Clone)]
struct Api {
    state: watch::Receiver<Published>,
    metrics: Metrics,
}

/// The driver's API: `GET /status` from the latest `state`, `GET /metrics` from `metrics`;
/// another method gets 405, another path a JSON 404.
pub fn router(state: watch::Receiver<Published>, metrics: Metrics) -> Router {
    Router::new()
        .route("/status", get(status))
        .route("/metrics", get(metrics_text))
        .fallback(hvd_serve::not_found("/status or /metrics"))
        .with_state(Api { state, metrics })
}

async fn status(State(api): State<Api>) -> Response {
    let body = render(&api.state.borrow());
    ([(header::CONTENT_TYPE, "application/json")], body).into_response()
}

async fn metrics_text(State(api): State<Api>) -> Response {
    hvd_serve::metrics::response(api.metrics.registry())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use axum::body::Body;
    use axum::http::{Method, Request, StatusCode};
    use tower::ServiceExt;

    use super::*;

    fn published() -> Published {
        Published {
            snapshot: Snapshot {
                phase: JobPhase::Running,
                generation: 1,
                workers: 1,
                hosts: vec![("h\u{e9}".into(), 1)],
                blacklisted: vec![],
                resets: 0,
                noticed: vec![],
            },
            epoch: UNIX_EPOCH,
        }
    }

    async fn get(app: Router, method: Method, path: &str) -> (StatusCode, String, String) {
        let r = app
            .oneshot(
                Request::builder()
                    .method(method)
                    .uri(path)
                    .body(Body::empty())
                    .unwrap(),
            )
            .await
            .unwrap();
        let status = r.status();
        let kind = r
            .headers()
            .get(header::CONTENT_TYPE)
            .map(|v| v.to_str().unwrap().to_string())
            .unwrap_or_default();
        let bytes = axum::body::to_bytes(r.into_body(), 1 << 20).await.unwrap();
        (status, kind, String::from_utf8(bytes.to_vec()).unwrap())
    }

    fn app() -> (Router, watch::Sender<Published>) {
        let (tx, rx) = watch::channel(published());
        (router(rx, Metrics::new(0)), tx)
    }

    #[tokio::test]
    async fn status_metrics_and_json_errors_without_a_socket() {
        let (app, tx) = app();
        let (code, kind, body) = get(app.clone(), Method::GET, "/status").await;
        assert_eq!((code, kind.as_str()), (StatusCode::OK, "application/json"));
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["hosts"][0]["host"], "h\u{e9}");
        // The latest state is served.
        tx.send_modify(|p| p.snapshot.generation = 9);
        let (_, _, body) = get(app.clone(), Method::GET, "/status").await;
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["generation"], 9);
        let (code, kind, body) = get(app.clone(), Method::GET, "/metrics").await;
        assert_eq!(
            (code, kind.as_str()),
            (StatusCode::OK, hvd_serve::metrics::CONTENT_TYPE)
        );
        assert!(body.contains("# TYPE hvd_resets_total counter\n"), "{body}");
        let (code, _, body) = get(app.clone(), Method::GET, "/caf%C3%A9").await;
        assert_eq!(code, StatusCode::NOT_FOUND);
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(
            v["error"], "no such path: /caf%C3%A9; try /status or /metrics",
            "{body}"
        );
        for path in ["/status", "/metrics"] {
            let (code, _, _) = get(app.clone(), Method::POST, path).await;
            assert_eq!(code, StatusCode::METHOD_NOT_ALLOWED, "{path}");
        }
    }

    #[test]
    fn the_document_has_every_field_with_unix_cooldown_ends() {
        let p = Published {
            snapshot: Snapshot {
                phase: JobPhase::Rescaling,
                generation: 3,
                workers: 2,
                hosts: vec![("10.0.0.1".into(), 2)],
                blacklisted: vec![
                    ("10.0.0.2".into(), Some(Duration::from_millis(1500))),
                    ("10.0.0.3".into(), None),
                ],
                resets: 2,
                noticed: vec![],
            },
            epoch: UNIX_EPOCH + Duration::from_secs(1000),
        };
        let v: serde_json::Value = serde_json::from_str(&render(&p)).unwrap();
        assert_eq!(
            v,
            serde_json::json!({
                "phase": "Rescaling",
                "generation": 3,
                "workers": 2,
                "hosts": [{"host": "10.0.0.1", "slots": 2}],
                "blacklisted": [
                    {"host": "10.0.0.2", "until_ms": 1_001_500},
                    {"host": "10.0.0.3", "until_ms": null}
                ],
                "resets": 2
            })
        );
    }
}
