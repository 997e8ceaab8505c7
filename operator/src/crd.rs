//! The `ElasticJob` custom resource (`hvd.dev/v1alpha1`): what a user asks for and what the
//! operator reports back.
//!
//! The CRD YAML is generated from these types (`crdgen`), so the schema, its CEL rules, the print
//! columns and the scale subresource all live here.

use k8s_openapi::api::core::v1::{EnvVar, ResourceRequirements};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::core::Message;
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
    /// An etcd that keeps the driver's decisions, so that a lost driver pod is replaced and its
    /// successor adopts the running workers; absent = the job ends with its driver.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state_store: Option<StateStoreSpec>,
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

/// The longest etcd endpoint (`HOST:PORT`): a DNS name of 253 characters and a port.
pub const MAX_ENDPOINT_LEN: usize = 260;
/// The most etcd endpoints a job may name.
pub const MAX_ENDPOINTS: usize = 16;
/// A `HOST:PORT` etcd endpoint, as RE2 (CEL `matches`): a DNS name, an IPv4 address or a
/// bracketed IPv6 address, and a port from 1 to 65535.
pub const ENDPOINT_PATTERN: &str = r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?):([1-9][0-9]{0,3}|[1-5][0-9]{4}|6[0-4][0-9]{3}|65[0-4][0-9]{2}|655[0-2][0-9]|6553[0-5])$";

/// Where the job's drivers keep its state (etcd), so that the operator can replace a lost
/// driver pod while the workers train on.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct StateStoreSpec {
    /// etcd endpoints, `HOST:PORT` each (e.g. `etcd.default.svc:2379`).
    #[schemars(length(min = 1, max = MAX_ENDPOINTS), inner(length(max = MAX_ENDPOINT_LEN)))]
    #[x_kube(validation = endpoints_rule())]
    pub endpoints: Vec<String>,
    /// The job's keys in etcd; default `hvd/<namespace>/<job name>/<job uid>`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 512))]
    #[x_kube(validation = Rule::new(r"self.matches('^[^\\s]*[^/\\s][^\\s]*$')").message("spec.stateStore.prefix must hold something besides slashes and no whitespace"))]
    pub prefix: Option<String>,
    /// Seconds the active driver's lease lives without renewal: how soon a lost driver's
    /// successor may act.
    #[serde(default = "default_ttl")]
    #[schemars(range(min = 1, max = 3600))]
    pub ttl_seconds: u32,
    /// Seconds the workers train on with no driver before they give up.
    #[serde(default = "default_driver_grace")]
    #[schemars(range(min = 1, max = 86400))]
    pub driver_grace_seconds: u32,
    /// Secret (in the job's namespace) with keys `username` and `password` for etcd.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    pub credentials_secret: Option<String>,
    /// How many times a lost driver pod is replaced before the job fails.
    #[serde(default = "default_max_driver_restarts")]
    #[schemars(range(min = 0, max = 1000))]
    pub max_driver_restarts: u32,
}

/// The CEL rule on `endpoints`: every entry matches [`ENDPOINT_PATTERN`]; the message names the
/// first that does not.
fn endpoints_rule() -> kube::core::Rule {
    let re = format!("'{}'", ENDPOINT_PATTERN.replace('\\', "\\\\"));
    kube::core::Rule::new(format!("self.all(e, e.matches({re}))")).message(Message::Expression(
        format!(
            "'spec.stateStore.endpoints: \"' + self.filter(e, !e.matches({re}))[0] + \
             '\" is not HOST:PORT (a DNS name, IPv4 or [IPv6] address, and a port from 1 to 65535)'"
        ),
    ))
}

fn default_ttl() -> u32 {
    10
}

fn default_driver_grace() -> u32 {
    60
}

fn default_max_driver_restarts() -> u32 {
    5
}

/// A bad field of `spec.stateStore`, named with the value at fault.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StateStoreError {
    /// `endpoints` is empty.
    #[error("spec.stateStore.endpoints is empty: name at least one etcd HOST:PORT")]
    NoEndpoints,
    /// One endpoint is not `HOST:PORT`.
    #[error("spec.stateStore.endpoints: {endpoint:?} is not HOST:PORT: {why}")]
    Endpoint {
        /// The entry at fault.
        endpoint: String,
        /// What is wrong with it.
        why: &'static str,
    },
    /// The prefix is empty or holds whitespace.
    #[error(
        "spec.stateStore.prefix {prefix:?} must hold something besides slashes and no whitespace"
    )]
    Prefix {
        /// The prefix at fault.
        prefix: String,
    },
}

/// Checks one `HOST:PORT` endpoint: a host (a bracketed IPv6 address, or a name or IPv4
/// address without `:`, `/`, `,`, `@` or whitespace) and a port from 1 to 65535.
///
/// # Errors
/// [`StateStoreError::Endpoint`] naming the entry.
pub fn check_endpoint(endpoint: &str) -> Result<(), StateStoreError> {
    let bad = |why| StateStoreError::Endpoint {
        endpoint: endpoint.to_string(),
        why,
    };
    let (host, port) = endpoint.rsplit_once(':').ok_or_else(|| bad("no :PORT"))?;
    if !matches!(port.parse::<u16>(), Ok(p) if p > 0) || port.starts_with(['+', '0']) {
        return Err(bad("the port must be a number from 1 to 65535"));
    }
    let name = match host.strip_prefix('[') {
        Some(v6) => {
            let addr = v6
                .strip_suffix(']')
                .ok_or_else(|| bad("an unclosed [IPv6] host"))?;
            if addr.parse::<std::net::Ipv6Addr>().is_err() {
                return Err(bad("the bracketed host is not an IPv6 address"));
            }
            return Ok(());
        }
        None => host,
    };
    if name.is_empty() {
        return Err(bad("no host"));
    }
    let ok = |c: char| c.is_ascii_alphanumeric() || c == '.' || c == '-';
    if !name.chars().all(ok) || name.starts_with(['.', '-']) || name.ends_with(['.', '-']) {
        return Err(bad(
            "the host must be a DNS name, an IPv4 address or a bracketed IPv6 address",
        ));
    }
    Ok(())
}

impl StateStoreSpec {
    /// The job's key prefix: `prefix`, else `hvd/<namespace>/<job>/<uid>` (the uid keeps a
    /// job recreated under the same name from taking over a deleted job's record).
    pub fn prefix_or_default(&self, namespace: &str, job: &str, uid: &str) -> String {
        match &self.prefix {
            Some(p) => p.trim_matches('/').to_string(),
            None => format!("hvd/{namespace}/{job}/{uid}"),
        }
    }

    /// The `--state-store` URL: `etcd://<endpoints joined by ,>/<prefix>`.
    ///
    /// # Errors
    /// [`StateStoreError`] naming the bad endpoint or prefix.
    pub fn url(&self, namespace: &str, job: &str, uid: &str) -> Result<String, StateStoreError> {
        if self.endpoints.is_empty() {
            return Err(StateStoreError::NoEndpoints);
        }
        for e in &self.endpoints {
            check_endpoint(e)?;
        }
        let prefix = self.prefix_or_default(namespace, job, uid);
        if prefix.is_empty() || prefix.chars().any(|c| c.is_whitespace() || c.is_control()) {
            return Err(StateStoreError::Prefix {
                prefix: self.prefix.clone().unwrap_or_default(),
            });
        }
        Ok(format!("etcd://{}/{prefix}", self.endpoints.join(",")))
    }
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
    /// The driver exited non-zero, or (with a state store) was lost more often than allowed.
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
    /// Lost driver pods replaced so far (jobs with a `stateStore`; at most
    /// `spec.stateStore.maxDriverRestarts`).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub driver_restarts: u32,
    /// The uid of the driver pod last seen (jobs with a `stateStore`): a driver pod created
    /// while it is set replaces a lost one, and counts in `driverRestarts`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub driver_uid: Option<String>,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
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
            state_store: None,
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

    fn with_endpoints(endpoints: &[&str]) -> ElasticJob {
        let mut job = ElasticJob::new("t", spec(1, 2, None));
        job.spec.state_store = Some(
            serde_json::from_value(serde_json::json!({
                "endpoints": endpoints,
            }))
            .unwrap(),
        );
        job
    }

    #[test]
    fn state_store_defaults() {
        let s: StateStoreSpec =
            serde_json::from_value(serde_json::json!({"endpoints": ["etcd:2379"]})).unwrap();
        assert_eq!(
            (s.ttl_seconds, s.driver_grace_seconds, s.max_driver_restarts),
            (10, 60, 5)
        );
        assert_eq!(
            (s.prefix.as_deref(), s.credentials_secret.as_deref()),
            (None, None)
        );
        assert_eq!(
            s.url("ml", "train", "u1").unwrap(),
            "etcd://etcd:2379/hvd/ml/train/u1"
        );
        let err = serde_json::from_value::<StateStoreSpec>(serde_json::json!({})).unwrap_err();
        assert!(err.to_string().contains("endpoints"), "{err}");
    }

    const GOOD: &[&str] = &[
        "etcd.default.svc:2379",
        "etcd:1",
        "10.0.0.1:65535",
        "[::1]:2379",
        "[fd00::5]:2379",
        "etcd-0.etcd-headless.default.svc.cluster.local:2379",
    ];
    const BAD: &[&str] = &[
        "etcd",
        "etcd:",
        ":2379",
        "etcd:0",
        "etcd:65536",
        "etcd:02379",
        "etcd:+1",
        "http://etcd:2379",
        "etcd/x:2379",
        "etcd,b:2379",
        "-etcd:2379",
        "etcd.:2379",
        "et cd:2379",
        "::1:2379",
        "[::1:2379",
        "[not-v6]:2379",
    ];

    #[test]
    fn endpoints_are_checked_naming_the_bad_entry() {
        for e in GOOD {
            check_endpoint(e).unwrap_or_else(|err| panic!("{e}: {err}"));
        }
        for e in BAD {
            let err = check_endpoint(e).unwrap_err();
            assert!(err.to_string().contains(&format!("{e:?}")), "{err}");
        }
        let mut s: StateStoreSpec =
            serde_json::from_value(serde_json::json!({"endpoints": []})).unwrap();
        assert_eq!(s.url("ml", "t", "u"), Err(StateStoreError::NoEndpoints));
        s.endpoints = vec!["etcd:2379".into()];
        for bad in ["/", "a b", "//"] {
            s.prefix = Some(bad.into());
            assert!(
                matches!(s.url("ml", "t", "u"), Err(StateStoreError::Prefix { .. })),
                "{bad}"
            );
        }
    }

    /// The CRD's CEL rule agrees with [`check_endpoint`], and its message names the bad entry.
    #[test]
    fn the_cel_rule_on_endpoints_agrees_and_names_the_entry() {
        for e in GOOD {
            kube::core::cel::validate_cel(&with_endpoints(&["etcd:2379", e]))
                .unwrap_or_else(|err| panic!("{e}: {err:?}"));
        }
        for e in BAD {
            let err =
                kube::core::cel::validate_cel(&with_endpoints(&["etcd:2379", e])).expect_err(e);
            let text = format!("{err:?}");
            assert!(
                text.contains(&format!("spec.stateStore.endpoints: \\\"{e}\\\"")),
                "{e}: {text}"
            );
        }
    }

    #[test]
    fn the_cel_rule_on_prefix_refuses_slashes_only_and_whitespace() {
        let mut job = with_endpoints(&["etcd:2379"]);
        for (prefix, ok) in [("hvd/a", true), ("/x/", true), ("/", false), ("a b", false)] {
            job.spec.state_store.as_mut().unwrap().prefix = Some(prefix.into());
            let res = kube::core::cel::validate_cel(&job);
            assert_eq!(res.is_ok(), ok, "{prefix}: {res:?}");
        }
    }
}
