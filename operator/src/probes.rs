//! The operator's HTTP endpoint: `GET /healthz` (liveness) answers while the process serves at
//! all; `GET /readyz` (readiness) only once the Kubernetes API has answered, and no longer once
//! a shutdown has begun; `GET /metrics` serves the operator's metrics for Prometheus.

use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::get;
use hvd_serve::Router;

use crate::metrics::Metrics;

const STARTING: u8 = 0;
const READY: u8 = 1;
const STOPPING: u8 = 2;

/// Where the operator is in its life, shared between its main task and the probe endpoint.
#[derive(Debug, Clone, Default)]
pub struct Health(Arc<AtomicU8>);

impl Health {
    /// A fresh operator: alive, not yet ready.
    pub fn new() -> Self {
        Self::default()
    }

    /// The Kubernetes API answered: ready (unless a shutdown has begun).
    pub fn ready(&self) {
        let _ = self
            .0
            .compare_exchange(STARTING, READY, Ordering::AcqRel, Ordering::Acquire);
    }

    /// A shutdown has begun: no longer ready.
    pub fn stopping(&self) {
        self.0.store(STOPPING, Ordering::Release);
    }

    /// The readiness answer: status and plain-text reason.
    fn readiness(&self) -> (StatusCode, &'static str) {
        match self.0.load(Ordering::Acquire) {
            READY => (StatusCode::OK, "ok"),
            STOPPING => (StatusCode::SERVICE_UNAVAILABLE, "shutting down"),
            _ => (
                StatusCode::SERVICE_UNAVAILABLE,
                "waiting for the Kubernetes API",
            ),
        }
    }
}

/// The operator's endpoint: `/healthz`, `/readyz` and `/metrics`; another method gets 405,
/// another path a JSON 404.
pub fn router(health: Health, metrics: Metrics) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route(
            "/readyz",
            get(|State((h, _)): State<(Health, Metrics)>| async move {
                h.readiness().into_response()
            }),
        )
        .route(
            "/metrics",
            get(|State((_, m)): State<(Health, Metrics)>| async move {
                hvd_serve::metrics::response(m.registry())
            }),
        )
        .fallback(hvd_serve::not_found("/healthz, /readyz or /metrics"))
        .with_state((health, metrics))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use tower::ServiceExt;

    use super::*;

    /// The answer to a request, without a socket.
    async fn answer(app: Router, method: &str, path: &str) -> (StatusCode, String) {
        let r = app
            .oneshot(
                axum::http::Request::builder()
                    .method(method)
                    .uri(path)
                    .body(axum::body::Body::empty())
                    .unwrap(),
            )
            .await
            .unwrap();
        let status = r.status();
        let body = axum::body::to_bytes(r.into_body(), 1 << 20).await.unwrap();
        (status, String::from_utf8_lossy(&body).into_owned())
    }

    #[tokio::test]
    async fn ready_only_between_the_api_answering_and_a_shutdown() {
        let h = Health::new();
        let app = router(h.clone(), Metrics::new());
        let get = |p: &'static str| answer(app.clone(), "GET", p);
        assert_eq!(get("/healthz").await, (StatusCode::OK, "ok".into()));
        assert_eq!(
            get("/readyz").await,
            (
                StatusCode::SERVICE_UNAVAILABLE,
                "waiting for the Kubernetes API".into()
            )
        );
        h.ready();
        assert_eq!(get("/readyz").await, (StatusCode::OK, "ok".into()));
        h.stopping();
        assert_eq!(
            get("/readyz").await,
            (StatusCode::SERVICE_UNAVAILABLE, "shutting down".into())
        );
        h.ready(); // a late API answer does not undo the shutdown
        assert_eq!(get("/readyz").await.0, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(get("/healthz").await.0, StatusCode::OK);
    }

    #[tokio::test]
    async fn metrics_other_paths_and_other_methods() {
        let app = router(Health::new(), Metrics::new());
        let (code, body) = answer(app.clone(), "GET", "/metrics").await;
        assert_eq!(code, StatusCode::OK);
        assert!(body.contains("hvd_operator_reconciles_total 0\n"), "{body}");
        let (code, body) = answer(app.clone(), "GET", "/livez").await;
        assert_eq!(code, StatusCode::NOT_FOUND);
        assert!(body.contains("/livez"), "{body}");
        for path in ["/healthz", "/readyz", "/metrics"] {
            let (code, _) = answer(app.clone(), "PUT", path).await;
            assert_eq!(code, StatusCode::METHOD_NOT_ALLOWED, "{path}");
        }
    }
}
