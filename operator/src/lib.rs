//! The `ElasticJob` operator: the custom resource and its reconciler.
//!
//! Layout:
//! - [`crd`]: the `ElasticJob` types (`hvd.dev/v1alpha1`), from which `crdgen` prints the CRD.
//! - [`resources`]: pure builders of the objects a job owns (driver and worker pods, the
//!   headless Service, the Secret, the driver's Service (status and metrics port, and the
//!   rendezvous with a state store), ServiceAccount, Role and RoleBinding).
//! - [`plan`]: the decisions, as pure functions of the observed pods and driver status;
//!   `driver_fate` decides what becomes of the driver pod (replaced when a job with a state
//!   store loses it).
//! - [`driver_status`]: the driver's `GET /status` report and a minimal client for it.
//! - [`reconcile`]: the kube-rs controller that observes, plans, applies and reports.
//! - [`leader`]: running the controller only while holding the Lease.
//! - [`probes`]: the HTTP endpoint: `/healthz`, `/readyz` and `/metrics`.
//! - [`metrics`]: the operator's metrics (reconciles, errors, durations).

pub mod crd;
mod driver_fate;
pub mod driver_status;
mod error;
pub mod leader;
pub mod metrics;
pub mod plan;
pub mod probes;
pub mod reconcile;
pub mod resources;

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod fixtures;
#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod mock_api;

pub use crd::{ElasticJob, ElasticJobSpec, ElasticJobStatus, Phase};
pub use error::Error;
