//! `GET /status`: the elastic job's state as JSON, for the Kubernetes operator (the driver's
//! pod may only read pods, so the operator polls this and writes the job's status itself).
//! Served by `hvd-serve`'s minimal HTTP/1.1 server.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use hvd_serve::Response;
use serde::Serialize;
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::elastic::core::{JobPhase, Snapshot};

/// The state the endpoint serves: the core's snapshot and the wall-clock time of the core's
/// zero, to turn its cooldown ends into Unix times.
#[derive(Debug, Clone)]
pub struct Published {
    /// The core's view.
    pub snapshot: Snapshot,
    /// The wall-clock time the core's clock started at.
    pub epoch: SystemTime,
}

/// The JSON body of `GET /status`.
#[derive(Debug, Serialize)]
struct Body<'a> {
    phase: &'static str,
    generation: u64,
    workers: usize,
    hosts: Vec<HostBody<'a>>,
    blacklisted: Vec<Blacklisted<'a>>,
    resets: u64,
}

#[derive(Debug, Serialize)]
struct HostBody<'a> {
    host: &'a str,
    slots: usize,
}

#[derive(Debug, Serialize)]
struct Blacklisted<'a> {
    host: &'a str,
    /// Unix milliseconds when the cooldown ends; `null` for good.
    until_ms: Option<u64>,
}

fn phase_name(p: JobPhase) -> &'static str {
    match p {
        JobPhase::Pending => "Pending",
        JobPhase::Running => "Running",
        JobPhase::Rescaling => "Rescaling",
        JobPhase::Succeeded => "Succeeded",
        JobPhase::Failed => "Failed",
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
    let body = Body {
        phase: phase_name(s.phase),
        generation: s.generation,
        workers: s.workers,
        hosts: s
            .hosts
            .iter()
            .map(|(host, slots)| HostBody {
                host,
                slots: *slots,
            })
            .collect(),
        blacklisted: s
            .blacklisted
            .iter()
            .map(|(host, until)| Blacklisted {
                host,
                until_ms: until.map(unix_ms),
            })
            .collect(),
        resets: s.resets,
    };
    serde_json::to_string(&body)
        .unwrap_or_else(|e| serde_json::json!({ "error": e.to_string() }).to_string())
}

/// The answer to a GET of `path`.
fn reply(path: &str, state: &Published) -> Response {
    match path {
        "/status" => Response::json("200 OK", render(state)),
        other => Response::error(
            "404 Not Found",
            &format!("no such path: {other}; try /status"),
        ),
    }
}

/// Serves `GET /status` on `listener` with the latest state from `state`, until aborted.
pub async fn serve(listener: TcpListener, state: watch::Receiver<Published>) {
    hvd_serve::serve(listener, "status endpoint", move |path: &str| {
        reply(path, &state.borrow())
    })
    .await;
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
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
            },
            epoch: UNIX_EPOCH,
        }
    }

    #[test]
    fn other_paths_are_json_errors_naming_them() {
        let p = published();
        let r = reply("/caf\u{e9}\"\\\t", &p);
        assert_eq!(r.status, "404 Not Found");
        let v: serde_json::Value = serde_json::from_str(&r.body).unwrap();
        assert_eq!(
            v["error"], "no such path: /caf\u{e9}\"\\\t; try /status",
            "{}",
            r.body
        );
        let r = reply("/status", &p);
        assert_eq!((r.status, r.content_type), ("200 OK", "application/json"));
        let v: serde_json::Value = serde_json::from_str(&r.body).unwrap();
        assert_eq!(v["hosts"][0]["host"], "h\u{e9}");
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
