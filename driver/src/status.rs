//! The driver's HTTP API on `--status-port`: `GET /status`, the elastic job's state as JSON,
//! for the Kubernetes operator (the driver's pod may only read pods, so the operator polls this
//! and writes the job's status itself); `GET /metrics`, the job's metrics for Prometheus; and
//! `GET /`, a page a person reads (`status_page.html`: no external assets), which draws that
//! same JSON and refreshes it every 2 s. [`router`] builds it; `hvd-serve` serves it.

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::extract::State;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use hvd_serve::Router;
use hvd_serve::status::{
    BlacklistedHost, DriverPhase, DriverStatus, NoticedHost, RankLateness, StatusHost, StatusRound,
};
use tokio::sync::watch;

use crate::elastic::core::{JobPhase, Round, Snapshot};
use crate::log_tail;
use crate::metrics::Metrics;

/// The page `GET /` serves; the status document replaces its placeholder.
const PAGE: &str = include_str!("status_page.html");

/// Where the page takes the status document it first draws.
const PAGE_STATUS: &str = "/*STATUS*/";

/// The state the endpoint serves: the core's snapshot and the wall-clock time of the core's
/// zero, to turn its cooldown ends into Unix times.
#[derive(Debug, Clone)]
pub struct Published {
    /// The core's view.
    pub snapshot: Snapshot,
    /// The wall-clock time the core's clock started at.
    pub epoch: SystemTime,
    /// How much each rank of the current round holds the others up, as rank 0 last reported
    /// (shared: it changes about once a second).
    pub lateness: Arc<[RankLateness]>,
    /// The core's last rounds (shared: they change only when a round completes).
    pub rounds: Arc<[Round]>,
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

/// The status document for `p`, with the driver's recent `log` lines.
pub fn document(p: &Published, log: Vec<String>) -> DriverStatus {
    let s = &p.snapshot;
    let unix_ms = |d: Duration| {
        (p.epoch + d)
            .duration_since(UNIX_EPOCH)
            .map_or(0, |t| u64::try_from(t.as_millis()).unwrap_or(u64::MAX))
    };
    DriverStatus {
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
        rounds: p
            .rounds
            .iter()
            .map(|r| StatusRound {
                generation: r.generation,
                at_ms: unix_ms(r.at),
                workers: r.size as u64,
                causes: r.causes.clone(),
            })
            .collect(),
        noticed: s
            .noticed
            .iter()
            .map(|(host, source, until)| NoticedHost {
                host: host.clone(),
                source: source.to_string(),
                until_ms: unix_ms(*until),
            })
            .collect(),
        lateness: p.lateness.to_vec(),
        log,
    }
}

/// The JSON text of `doc`.
pub fn render(doc: &DriverStatus) -> String {
    serde_json::to_string(doc)
        .unwrap_or_else(|e| serde_json::json!({ "error": e.to_string() }).to_string())
}

/// The status page with `doc` in it, so that it draws the job before its first refresh. In
/// the page's script element `<` may not appear; JSON has it only inside strings, where
/// `\u003c` means the same.
pub fn page(doc: &DriverStatus) -> String {
    let json = render(doc)
        .replace('<', "\\u003c")
        .replace('>', "\\u003e")
        .replace('&', "\\u0026");
    PAGE.replacen(PAGE_STATUS, &json, 1)
}

/// What the handlers read: the latest published state and the metrics.
#[derive(Clone)]
struct Api {
    state: watch::Receiver<Published>,
    metrics: Metrics,
}

/// The driver's API: `GET /status` from the latest `state`, `GET /metrics` from `metrics`,
/// `GET /` the page; another method gets 405, another path a JSON 404.
pub fn router(state: watch::Receiver<Published>, metrics: Metrics) -> Router {
    Router::new()
        .route("/", get(status_page))
        .route("/status", get(status))
        .route("/metrics", get(metrics_text))
        .fallback(hvd_serve::not_found("/, /status or /metrics"))
        .with_state(Api { state, metrics })
}

async fn status(State(api): State<Api>) -> Response {
    let body = render(&document(&api.state.borrow(), log_tail::recent()));
    ([(header::CONTENT_TYPE, "application/json")], body).into_response()
}

async fn status_page(State(api): State<Api>) -> Response {
    let body = page(&document(&api.state.borrow(), log_tail::recent()));
    (
        [
            (header::CONTENT_TYPE, "text/html; charset=utf-8"),
            (header::CACHE_CONTROL, "no-store"),
        ],
        body,
    )
        .into_response()
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
    use crate::elastic::core::{CauseKind, ResetCause};

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
            lateness: Arc::new([]),
            rounds: Arc::new([]),
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
            v["error"], "no such path: /caf%C3%A9; try /, /status or /metrics",
            "{body}"
        );
        for path in ["/", "/status", "/metrics"] {
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
                noticed: vec![(
                    "10.0.0.4".into(),
                    hvd_rendezvous::NoticeSource::Aws,
                    Duration::from_secs(180),
                )],
            },
            epoch: UNIX_EPOCH + Duration::from_secs(1000),
            lateness: Arc::new([RankLateness {
                rank: 0,
                host: "10.0.0.1".into(),
                seconds: 0.5,
                factor: 2.0,
            }]),
            rounds: Arc::new([
                Round {
                    generation: 2,
                    at: Duration::from_millis(250),
                    size: 4,
                    causes: vec![],
                },
                Round {
                    generation: 3,
                    at: Duration::from_millis(900),
                    size: 2,
                    causes: vec![ResetCause {
                        kind: CauseKind::Frozen,
                        host: "10.0.0.2".into(),
                        detail: "stopped answering".into(),
                    }],
                },
            ]),
        };
        let v: serde_json::Value =
            serde_json::from_str(&render(&document(&p, vec!["a line".into()]))).unwrap();
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
                "resets": 2,
                "rounds": [
                    {"generation": 2, "at_ms": 1_000_250, "workers": 4, "causes": []},
                    {"generation": 3, "at_ms": 1_000_900, "workers": 2, "causes": [
                        {"kind": "frozen", "host": "10.0.0.2", "detail": "stopped answering"}
                    ]}
                ],
                "noticed": [{"host": "10.0.0.4", "source": "aws", "until_ms": 1_180_000}],
                "lateness": [{"rank": 0, "host": "10.0.0.1", "seconds": 0.5, "factor": 2.0}],
                "log": ["a line"]
            })
        );
    }

    #[tokio::test]
    async fn the_page_is_html_with_the_status_in_it_that_no_text_can_break_out_of() {
        let (app, tx) = app();
        tx.send_modify(|p| {
            p.snapshot.hosts = vec![("</script><b>&".into(), 1)];
        });
        let (code, kind, body) = get(app, Method::GET, "/").await;
        assert_eq!(
            (code, kind.as_str()),
            (StatusCode::OK, "text/html; charset=utf-8")
        );
        assert!(body.starts_with("<!doctype html>"), "{body}");
        assert!(!body.contains(PAGE_STATUS), "the placeholder was replaced");
        // The only closing script tags are the page's own two.
        assert_eq!(body.matches("</script>").count(), 2);
        let start = body.find(r#"type="application/json">"#).unwrap() + 24;
        let json = &body[start..start + body[start..].find("</script>").unwrap()];
        let doc: DriverStatus = serde_json::from_str(json).unwrap();
        assert_eq!(doc.hosts[0].host, "</script><b>&");
        // Nothing is fetched from elsewhere: it works offline.
        for outside in ["http://", "https://", "//cdn", "@import"] {
            let found = body
                .match_indices(outside)
                .map(|(i, _)| &body[i.saturating_sub(20)..i + 40])
                .find(|around| !around.contains("www.w3.org/2000/svg"));
            assert!(found.is_none(), "{outside}: {found:?}");
        }
    }
}
