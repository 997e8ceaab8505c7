//! The operator's health probes: `GET /healthz` (liveness) answers while the process serves at
//! all; `GET /readyz` (readiness) only once the Kubernetes API has answered, and no longer once
//! a shutdown has begun.

use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};

use hvd_serve::Response;

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

    /// The answer to a GET of `path`.
    pub fn answer(&self, path: &str) -> Response {
        match path {
            "/healthz" => Response::text("200 OK", "ok"),
            "/readyz" => match self.0.load(Ordering::Acquire) {
                READY => Response::text("200 OK", "ok"),
                STOPPING => Response::text("503 Service Unavailable", "shutting down"),
                _ => Response::text("503 Service Unavailable", "waiting for the Kubernetes API"),
            },
            other => Response::error(
                "404 Not Found",
                &format!("no such path: {other}; try /healthz or /readyz"),
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ready_only_between_the_api_answering_and_a_shutdown() {
        let h = Health::new();
        let status = |p: &str| h.answer(p).status;
        assert_eq!(status("/healthz"), "200 OK");
        assert_eq!(status("/readyz"), "503 Service Unavailable");
        assert_eq!(h.answer("/readyz").body, "waiting for the Kubernetes API");
        h.ready();
        assert_eq!(status("/readyz"), "200 OK");
        h.stopping();
        assert_eq!(status("/readyz"), "503 Service Unavailable");
        assert_eq!(h.answer("/readyz").body, "shutting down");
        h.ready(); // a late API answer does not undo the shutdown
        assert_eq!(status("/readyz"), "503 Service Unavailable");
        assert_eq!(status("/healthz"), "200 OK");
        let other = h.answer("/metrics");
        assert_eq!(other.status, "404 Not Found");
        assert!(other.body.contains("/metrics"), "{}", other.body);
    }
}
