//! The `ElasticJob` custom resource (`hvd.dev/v1alpha1`): what a user asks for and what the
//! operator reports back.
//!
//! The CRD YAML is generated from these types (`crdgen`), so the schema, its CEL rules, the print
//! columns and the scale subresource all live here.

use k8s_openapi::api::core::v1::{EnvVar, ResourceRequirements};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::{CustomResource, CustomResourceExt, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// API group of the hvd resources.
pub const GROUP: &str = "hvd.dev";
/// The longest job name: worker pod names (`<job>-worker-<n>`) must stay valid DNS labels.
pub const MAX_JOB_NAME_LEN: usize = 45;
/// The most worker pods a job may ask for (the schema's `maximum` of min/maxReplicas).
pub const MAX_REPLICAS: i32 = 4096;
/// The most training processes per worker pod (the schema's `maximum` of slotsPerWorker).
pub const MAX_SLOTS_PER_WORKER: i32 = 256;

/// What the job runs and how far it may shrink and grow.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "hvd.dev",
    version = "v1alpha1",
    kind = "ElasticJob",
    namespaced,
    status = "ElasticJobStatus",
    shortname = "ej",
    category = "all",
    derive = "PartialEq",
    doc = "An elastic training job whose hosts are pods.",
    validation = Rule::new("self.spec.minReplicas <= self.spec.maxReplicas").message("spec.minReplicas must not exceed spec.maxReplicas"),
    validation = Rule::new("!has(self.spec.replicas) || (self.spec.replicas >= self.spec.minReplicas && self.spec.replicas <= self.spec.maxReplicas)").message("spec.replicas must lie within [spec.minReplicas, spec.maxReplicas]"),
    validation = Rule::new("size(self.metadata.name) <= 45").message("metadata.name must be at most 45 characters (worker pod names must stay DNS labels)"),
    printcolumn(name = "Phase", type_ = "string", json_path = ".status.phase"),
    printcolumn(name = "Workers", type_ = "integer", json_path = ".status.workers"),
    printcolumn(name = "Min", type_ = "integer", json_path = ".spec.minReplicas"),
    printcolumn(name = "Max", type_ = "integer", json_path = ".spec.maxReplicas"),
    printcolumn(name = "Round", type_ = "integer", json_path = ".status.round"),
    printcolumn(name = "Age", type_ = "date", json_path = ".metadata.creationTimestamp"),
    scale(
        spec_replicas_path = ".spec.replicas",
        status_replicas_path = ".status.workers",
        label_selector_path = ".status.selector"
    )
)]
#[serde(rename_all = "camelCase")]
pub struct ElasticJobSpec {
    /// Container image of the driver and worker pods; holds horovodrun, hvd-agent and the training program.
    #[x_kube(validation = Rule::new("self != ''").message("spec.image must not be empty"))]
    pub image: String,
    /// The training program and its arguments, run once per slot.
    #[x_kube(validation = Rule::new("size(self) >= 1").message("spec.command must name a program"))]
    pub command: Vec<String>,
    /// The fewest worker pods the job trains with.
    #[schemars(range(min = 1, max = MAX_REPLICAS))]
    pub min_replicas: i32,
    /// The most worker pods the job grows to.
    #[schemars(range(min = 1, max = MAX_REPLICAS))]
    pub max_replicas: i32,
    /// Worker pods wanted now, within [minReplicas, maxReplicas]; defaults to maxReplicas. The scale subresource sets it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replicas: Option<i32>,
    /// Training processes per worker pod (one per GPU).
    #[serde(default = "one")]
    #[schemars(range(min = 1, max = MAX_SLOTS_PER_WORKER))]
    pub slots_per_worker: i32,
    /// Compute resources of each worker pod.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<ResourceRequirements>,
    /// Environment of the training processes (set on the driver and the worker pods).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub env: Vec<EnvVar>,
    /// How the driver finds its hosts among the job's worker pods.
    #[serde(default)]
    pub discovery: DiscoverySpec,
    /// How long a failed worker's host is kept out of the job.
    #[serde(default)]
    pub blacklist: BlacklistSpec,
}

fn one() -> i32 {
    1
}

/// How the driver finds its hosts among the job's worker pods.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DiscoverySpec {
    /// Pod annotation that overrides slotsPerWorker for one pod.
    #[serde(default = "default_slots_annotation")]
    pub slots_annotation: String,
    /// Address workers by stable DNS names through the job's headless Service (true) or by pod IP (false).
    #[serde(default = "yes")]
    pub dns: bool,
}

fn default_slots_annotation() -> String {
    hvd_discovery::kubernetes::DEFAULT_SLOTS_ANNOTATION.to_string()
}

fn yes() -> bool {
    true
}

// By hand, so that `discovery: {}` and an absent `discovery` mean the same defaults.
impl Default for DiscoverySpec {
    fn default() -> Self {
        DiscoverySpec {
            slots_annotation: default_slots_annotation(),
            dns: true,
        }
    }
}

/// How long a failed worker's host is kept out of the job.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct BlacklistSpec {
    /// Seconds [lo, hi] a failed host stays blacklisted (lo·2^(n−1) capped at hi); absent = for good.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self[0] >= 1 && self[0] <= self[1]").message("blacklist.cooldownRange must be [lo, hi] with 1 <= lo <= hi"))]
    pub cooldown_range: Option<[u64; 2]>,
}

/// The job's lifecycle phase.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum Phase {
    /// Pods are being created or the driver has not reported yet.
    #[default]
    Pending,
    /// Training with the wanted number of workers.
    Running,
    /// Workers are being added, removed or replaced.
    Rescaling,
    /// The driver exited 0.
    Succeeded,
    /// The driver exited non-zero.
    Failed,
}

impl Phase {
    /// True for Succeeded and Failed: nothing more will run.
    pub fn is_terminal(self) -> bool {
        matches!(self, Phase::Succeeded | Phase::Failed)
    }
}

/// What the operator and the job's driver last observed.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ElasticJobStatus {
    /// Pending, Running, Rescaling, Succeeded or Failed.
    #[serde(default)]
    pub phase: Phase,
    /// Ready worker pods (the scale subresource's current replicas).
    #[serde(default)]
    pub workers: i32,
    /// The driver's rendezvous round.
    #[serde(default)]
    pub round: u64,
    /// Elastic resets the driver has gone through.
    #[serde(default)]
    pub resets: u64,
    /// Hosts the driver keeps out of the job.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub blacklisted: Vec<String>,
    /// When the operator first saw each of the driver's blacklist entries. With pod IPs as host
    /// names, a pod created after its entry holds a recycled IP, not the blacklisted host.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub blacklist_seen: Vec<BlacklistSeen>,
    /// Latest observations of the job's state (`Ready`, `DriverReachable`, `SpecApplied`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
    /// Label selector of the worker pods, for the scale subresource.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selector: Option<String>,
    /// The `metadata.generation` this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
}

/// One blacklist entry of the driver and when the operator first saw it.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct BlacklistSeen {
    /// The host as the driver named it.
    pub host: String,
    /// The end of its cooldown as the driver reported it (Unix ms); absent when out for good. A
    /// new end means a new failure, hence a new entry.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub until_ms: Option<u64>,
    /// When the operator first saw the entry.
    pub since: Time,
}

impl ElasticJobSpec {
    /// Worker pods wanted now: `replicas` (default `maxReplicas`) clamped to [`minReplicas`, `maxReplicas`], and never negative.
    pub fn desired_workers(&self) -> usize {
        let max = self.max_replicas.max(self.min_replicas).max(0);
        let want = self
            .replicas
            .unwrap_or(max)
            .clamp(self.min_replicas.max(0), max);
        usize::try_from(want).unwrap_or(0)
    }
}

/// The CRD as YAML, as `crdgen` prints it and the Helm chart stores it.
///
/// # Errors
/// When the CRD cannot be serialized (a bug in the types).
pub fn crd_yaml() -> Result<String, serde_norway::Error> {
    serde_norway::to_string(&ElasticJob::crd())
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    fn spec(min: i32, max: i32, replicas: Option<i32>) -> ElasticJobSpec {
        ElasticJobSpec {
            image: "img".into(),
            command: vec!["train".into()],
            min_replicas: min,
            max_replicas: max,
            replicas,
            slots_per_worker: 1,
            resources: None,
            env: vec![],
            discovery: DiscoverySpec::default(),
            blacklist: BlacklistSpec::default(),
        }
    }

    #[test]
    fn desired_workers_defaults_to_max_and_clamps() {
        assert_eq!(spec(2, 8, None).desired_workers(), 8);
        assert_eq!(spec(2, 8, Some(4)).desired_workers(), 4);
        assert_eq!(spec(2, 8, Some(1)).desired_workers(), 2);
        assert_eq!(spec(2, 8, Some(20)).desired_workers(), 8);
    }

    #[test]
    fn absent_and_empty_discovery_get_the_same_defaults() {
        let a: ElasticJobSpec = serde_json::from_value(serde_json::json!({
            "image": "i", "command": ["c"], "minReplicas": 1, "maxReplicas": 2,
        }))
        .unwrap();
        let b: ElasticJobSpec = serde_json::from_value(serde_json::json!({
            "image": "i", "command": ["c"], "minReplicas": 1, "maxReplicas": 2, "discovery": {},
        }))
        .unwrap();
        assert_eq!(a.discovery, b.discovery);
        assert_eq!(a.discovery.slots_annotation, "hvd.dev/slots");
        assert!(a.discovery.dns);
        assert_eq!(a.slots_per_worker, 1);
    }

    #[test]
    fn crd_has_scale_subresource_print_columns_and_rules() {
        let crd = ElasticJob::crd();
        assert_eq!(crd.metadata.name.as_deref(), Some("elasticjobs.hvd.dev"));
        let v = &crd.spec.versions[0];
        assert_eq!(v.name, "v1alpha1");
        let scale = v.subresources.as_ref().unwrap().scale.as_ref().unwrap();
        assert_eq!(scale.spec_replicas_path, ".spec.replicas");
        assert_eq!(scale.status_replicas_path, ".status.workers");
        assert_eq!(
            scale.label_selector_path.as_deref(),
            Some(".status.selector")
        );
        let cols: Vec<_> = v
            .additional_printer_columns
            .as_ref()
            .unwrap()
            .iter()
            .map(|c| c.name.as_str())
            .collect();
        assert_eq!(cols, ["Phase", "Workers", "Min", "Max", "Round", "Age"]);
        let yaml = crd_yaml().unwrap();
        assert!(
            yaml.contains("self.spec.minReplicas <= self.spec.maxReplicas"),
            "{yaml}"
        );
    }

    #[test]
    fn crd_bounds_replicas_and_slots() {
        let crd = serde_json::to_value(ElasticJob::crd()).unwrap();
        let spec = &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"];
        for (field, max) in [
            ("minReplicas", MAX_REPLICAS),
            ("maxReplicas", MAX_REPLICAS),
            ("slotsPerWorker", MAX_SLOTS_PER_WORKER),
        ] {
            let bound = |key: &str| spec[field][key].as_f64();
            assert_eq!(
                bound("maximum"),
                Some(f64::from(max)),
                "{field}: {}",
                spec[field]
            );
            assert_eq!(bound("minimum"), Some(1.0), "{field}: {}", spec[field]);
        }
    }
}
