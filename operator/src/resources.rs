//! The Kubernetes objects an `ElasticJob` owns, built as pure values: the job Secret, the
//! workers' headless Service, the driver's Service, ServiceAccount, Role and RoleBinding, the
//! driver Pod and the worker Pods. The reconciler applies them with server-side apply.

use std::collections::BTreeMap;

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::{
    Container, ContainerPort, EnvVar, EnvVarSource, Pod, PodSpec, Probe, Secret, SecretKeySelector,
    SecretVolumeSource, Service, ServiceAccount, ServicePort, ServiceSpec, TCPSocketAction, Volume,
    VolumeMount,
};
use k8s_openapi::api::rbac::v1::{PolicyRule, Role, RoleBinding, RoleRef, Subject};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::{Resource, ResourceExt};

use crate::crd::ElasticJob;
use crate::error::Error;

/// Label naming the job a pod belongs to.
pub const LABEL_JOB: &str = "hvd.dev/job";
/// Label naming a pod's role: [`ROLE_WORKER`] or [`ROLE_DRIVER`].
pub const LABEL_ROLE: &str = "hvd.dev/role";
/// Role label value of worker pods.
pub const ROLE_WORKER: &str = "worker";
/// Role label value of the driver pod.
pub const ROLE_DRIVER: &str = "driver";
/// Port of the `hvd-agent` in every worker pod.
pub const AGENT_PORT: u16 = 7077;
/// Port of the driver's status API (`GET /status` and `GET /metrics`).
pub const STATUS_PORT: u16 = 8080;
/// Label on every job's driver Service, by which one ServiceMonitor selects the drivers of all
/// jobs; its value is [`METRICS_DRIVER`].
pub const LABEL_METRICS: &str = "hvd.dev/metrics";
/// Value of [`LABEL_METRICS`] on the driver Services.
pub const METRICS_DRIVER: &str = "driver";
/// Name of the driver's status port, in its pod and in its Service (a ServiceMonitor's
/// `endpoints[].port`).
pub const STATUS_PORT_NAME: &str = "status";
/// Rendezvous port of a job with a state store: fixed, because the workers of a lost driver
/// redial the same address to reach its successor.
pub const RENDEZVOUS_PORT: u16 = 7078;
// The environment the driver and agent pods get, named where `horovodrun` and `hvd-agent`
// read it: the job's secret (the same for every driver of a job with a state store), the etcd
// credentials (from `spec.stateStore.credentialsSecret`), the host the driver gives its workers
// for the rendezvous (the driver Service's DNS name, which outlives the driver pod), and the
// secret the driver and the agents share.
pub use hvd_rendezvous::{
    ENV_AGENT_SECRET, ENV_RENDEZVOUS_HOST, ENV_SECRET as ENV_JOB_SECRET,
    ENV_STATE_STORE_PASSWORD as ENV_STORE_PASSWORD, ENV_STATE_STORE_USERNAME as ENV_STORE_USERNAME,
};
/// Key of the job's secret ([`ENV_JOB_SECRET`]) in the job's Secret; apart from
/// [`SECRET_KEY`] so that the training processes, which are given the job's secret, never
/// learn the agents'.
pub const JOB_SECRET_KEY: &str = "job";
/// Key of the etcd user name in `spec.stateStore.credentialsSecret`.
pub const CREDENTIALS_USERNAME_KEY: &str = "username";
/// Key of the etcd password in `spec.stateStore.credentialsSecret`.
pub const CREDENTIALS_PASSWORD_KEY: &str = "password";
/// Key of the shared secret in the job's Secret.
pub const SECRET_KEY: &str = "secret";
/// Where the job's Secret is mounted in the driver and worker pods (read-only).
pub const SECRET_DIR: &str = "/var/run/secrets/hvd.dev";
/// The file the worker pods' agents read the shared secret from (`--secret-file`).
pub const SECRET_FILE: &str = "/var/run/secrets/hvd.dev/secret";
/// Name of the Secret volume in the driver and worker pods.
const SECRET_VOLUME: &str = "hvd-secret";
/// Name of the driver pod's container.
pub const DRIVER_CONTAINER: &str = "driver";
/// Field manager of every server-side apply the operator makes.
pub const FIELD_MANAGER: &str = "hvd-operator";

const MANAGED_BY: (&str, &str) = ("app.kubernetes.io/managed-by", "hvd-operator");

/// Names of the objects of one job, derived from the job's name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Names {
    /// The job.
    pub job: String,
    /// Namespace of the job and everything it owns.
    pub namespace: String,
    /// The job's uid: it tells this job's objects from those of a deleted job of the same name.
    pub uid: String,
}

impl Names {
    /// Names for `job`.
    ///
    /// # Errors
    /// [`Error::MissingField`] when the job has no name, namespace or uid (not from the API
    /// server).
    pub fn of(job: &ElasticJob) -> Result<Self, Error> {
        let name = job
            .metadata
            .name
            .clone()
            .ok_or(Error::MissingField("metadata.name"))?;
        let namespace = job
            .namespace()
            .ok_or(Error::MissingField("metadata.namespace"))?;
        let uid = job
            .metadata
            .uid
            .clone()
            .ok_or(Error::MissingField("metadata.uid"))?;
        Ok(Names {
            job: name,
            namespace,
            uid,
        })
    }
    /// The Secret holding [`SECRET_KEY`]. It carries the job's uid: a job recreated under the
    /// same name gets a Secret of its own, never the deleted job's (which garbage collection is
    /// about to remove).
    pub fn secret(&self) -> String {
        format!("{}-secret-{}", self.job, self.uid)
    }
    /// The workers' headless Service.
    pub fn service(&self) -> String {
        format!("{}-workers", self.job)
    }
    /// The driver pod, and its ServiceAccount, Role and RoleBinding.
    pub fn driver(&self) -> String {
        format!("{}-driver", self.job)
    }
    /// The driver's Service: its status and metrics port, and with a state store a name for
    /// the rendezvous that survives the driver pod being replaced.
    pub fn driver_service(&self) -> String {
        self.driver()
    }
    /// The DNS name of [`Names::driver_service`].
    pub fn driver_dns(&self) -> String {
        format!("{}.{}.svc", self.driver_service(), self.namespace)
    }
    /// Worker pod number `index`.
    pub fn worker(&self, index: usize) -> String {
        format!("{}-worker-{index}", self.job)
    }
    /// The index of a worker pod name of this job, if it is one.
    pub fn worker_index(&self, pod_name: &str) -> Option<usize> {
        pod_name
            .strip_prefix(&self.job)?
            .strip_prefix("-worker-")?
            .parse()
            .ok()
    }
    /// Label selector of all the job's pods.
    pub fn job_selector(&self) -> String {
        format!("{LABEL_JOB}={}", self.job)
    }
    /// Label selector of the job's worker pods (the driver's `--selector`, the scale selector).
    pub fn worker_selector(&self) -> String {
        format!("{LABEL_JOB}={},{LABEL_ROLE}={ROLE_WORKER}", self.job)
    }
    /// The DNS name a worker pod has through the headless Service.
    pub fn worker_dns(&self, pod_name: &str) -> String {
        format!("{pod_name}.{}.{}.svc", self.service(), self.namespace)
    }
}

fn labels(names: &Names, role: Option<&str>) -> BTreeMap<String, String> {
    let mut l = BTreeMap::from([
        (LABEL_JOB.to_string(), names.job.clone()),
        (MANAGED_BY.0.to_string(), MANAGED_BY.1.to_string()),
    ]);
    if let Some(role) = role {
        l.insert(LABEL_ROLE.to_string(), role.to_string());
    }
    l
}

fn owner(job: &ElasticJob) -> Result<OwnerReference, Error> {
    job.controller_owner_ref(&())
        .ok_or(Error::MissingField("metadata.uid"))
}

fn meta(
    job: &ElasticJob,
    names: &Names,
    name: String,
    role: Option<&str>,
) -> Result<ObjectMeta, Error> {
    Ok(ObjectMeta {
        name: Some(name),
        namespace: Some(names.namespace.clone()),
        labels: Some(labels(names, role)),
        owner_references: Some(vec![owner(job)?]),
        ..Default::default()
    })
}

/// The job's Secret with the agents' secret `agents` (hex) under [`SECRET_KEY`] and the job's
/// secret `job_secret` under [`JOB_SECRET_KEY`].
///
/// # Errors
/// [`Error::MissingField`] when the job lacks a name, namespace or uid.
pub fn secret(job: &ElasticJob, agents: &str, job_secret: &str) -> Result<Secret, Error> {
    let names = Names::of(job)?;
    Ok(Secret {
        metadata: meta(job, &names, names.secret(), None)?,
        data: Some(BTreeMap::from([
            (
                SECRET_KEY.to_string(),
                ByteString(agents.as_bytes().to_vec()),
            ),
            (
                JOB_SECRET_KEY.to_string(),
                ByteString(job_secret.as_bytes().to_vec()),
            ),
        ])),
        type_: Some("Opaque".into()),
        ..Default::default()
    })
}

/// A fresh random secret: 32 bytes as 64 hex digits.
///
/// # Errors
/// [`Error::Random`] when the OS has no randomness to give.
pub fn new_secret() -> Result<String, Error> {
    let mut bytes = [0u8; 32];
    getrandom::fill(&mut bytes).map_err(|e| Error::Random(e.to_string()))?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

/// The headless Service that gives every worker pod the DNS name `<pod>.<service>.<ns>.svc`.
///
/// # Errors
/// [`Error::MissingField`] when the job lacks a name, namespace or uid.
pub fn worker_service(job: &ElasticJob) -> Result<Service, Error> {
    let names = Names::of(job)?;
    let mut selector = labels(&names, Some(ROLE_WORKER));
    selector.remove(MANAGED_BY.0);
    Ok(Service {
        metadata: meta(job, &names, names.service(), None)?,
        spec: Some(ServiceSpec {
            cluster_ip: Some("None".into()),
            selector: Some(selector),
            // Names resolve as soon as a pod exists, so the driver can probe agents that are
            // starting; readiness still gates discovery.
            publish_not_ready_addresses: Some(true),
            ports: Some(vec![ServicePort {
                name: Some("agent".into()),
                port: i32::from(AGENT_PORT),
                ..Default::default()
            }]),
            ..Default::default()
        }),
        ..Default::default()
    })
}

/// The driver's Service, every job's: the status port ([`STATUS_PORT_NAME`]: `GET /status` and
/// `GET /metrics`) of whichever driver pod the job has now, labelled
/// [`LABEL_METRICS`]`=`[`METRICS_DRIVER`] so that one ServiceMonitor scrapes the drivers of all
/// jobs. With a state store also the rendezvous port under [`Names::driver_dns`]. Not-ready
/// pods count, so the workers reach a successor as soon as it listens.
///
/// # Errors
/// [`Error::MissingField`] when the job lacks a name, namespace or uid.
pub fn driver_service(job: &ElasticJob) -> Result<Service, Error> {
    let names = Names::of(job)?;
    let mut selector = labels(&names, Some(ROLE_DRIVER));
    selector.remove(MANAGED_BY.0);
    let mut metadata = meta(job, &names, names.driver_service(), None)?;
    metadata
        .labels
        .get_or_insert_with(BTreeMap::new)
        .insert(LABEL_METRICS.into(), METRICS_DRIVER.into());
    let service_port = |name: &str, port: u16| ServicePort {
        name: Some(name.into()),
        port: i32::from(port),
        target_port: Some(IntOrString::Int(i32::from(port))),
        ..Default::default()
    };
    let mut ports = Vec::new();
    if job.spec.state_store.is_some() {
        ports.push(service_port("rendezvous", RENDEZVOUS_PORT));
    }
    ports.push(service_port(STATUS_PORT_NAME, STATUS_PORT));
    Ok(Service {
        metadata,
        spec: Some(ServiceSpec {
            selector: Some(selector),
            publish_not_ready_addresses: Some(true),
            ports: Some(ports),
            ..Default::default()
        }),
        ..Default::default()
    })
}

/// The driver's ServiceAccount.
///
/// # Errors
/// [`Error::MissingField`] when the job lacks a name, namespace or uid.
pub fn driver_service_account(job: &ElasticJob) -> Result<ServiceAccount, Error> {
    let names = Names::of(job)?;
    Ok(ServiceAccount {
        metadata: meta(job, &names, names.driver(), None)?,
        ..Default::default()
    })
}

/// The driver's Role: read pods (get, list, watch) in the job's namespace, nothing else.
///
/// # Errors
/// [`Error::MissingField`] when the job lacks a name, namespace or uid.
pub fn driver_role(job: &ElasticJob) -> Result<Role, Error> {
    let names = Names::of(job)?;
    Ok(Role {
        metadata: meta(job, &names, names.driver(), None)?,
        rules: Some(vec![PolicyRule {
            api_groups: Some(vec![String::new()]),
            resources: Some(vec!["pods".into()]),
            verbs: vec!["get".into(), "list".into(), "watch".into()],
            ..Default::default()
        }]),
    })
}

/// Binds [`driver_role`] to [`driver_service_account`].
///
/// # Errors
/// [`Error::MissingField`] when the job lacks a name, namespace or uid.
pub fn driver_role_binding(job: &ElasticJob) -> Result<RoleBinding, Error> {
    let names = Names::of(job)?;
    Ok(RoleBinding {
        metadata: meta(job, &names, names.driver(), None)?,
        role_ref: RoleRef {
            api_group: "rbac.authorization.k8s.io".into(),
            kind: "Role".into(),
            name: names.driver(),
        },
        subjects: Some(vec![Subject {
            kind: "ServiceAccount".into(),
            name: names.driver(),
            namespace: Some(names.namespace.clone()),
            ..Default::default()
        }]),
    })
}

/// The job's environment for the pods; never the user's own [`ENV_AGENT_SECRET`].
fn user_env(job: &ElasticJob) -> Vec<EnvVar> {
    let mut env = job.spec.env.clone();
    env.retain(|e| e.name != ENV_AGENT_SECRET);
    env
}

/// An environment variable read from key `key` of Secret `secret`.
fn from_secret(name: &str, secret: &str, key: &str) -> EnvVar {
    EnvVar {
        name: name.into(),
        value_from: Some(EnvVarSource {
            secret_key_ref: Some(SecretKeySelector {
                name: secret.into(),
                key: key.into(),
                optional: Some(false),
            }),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// The driver's environment: the job's, plus [`ENV_AGENT_SECRET`] from the Secret (`horovodrun`
/// reads the secret from there). With a state store also the job's secret
/// ([`ENV_JOB_SECRET`], the same for every driver of the job), the etcd credentials from
/// `credentialsSecret`, and the Service name to give the workers ([`ENV_RENDEZVOUS_HOST`]);
/// the job's own values of these never reach the driver.
fn driver_env(job: &ElasticJob, names: &Names) -> Vec<EnvVar> {
    let mut env = user_env(job);
    let store = job.spec.state_store.as_ref();
    if store.is_some() {
        let ours = [
            ENV_JOB_SECRET,
            ENV_STORE_USERNAME,
            ENV_STORE_PASSWORD,
            ENV_RENDEZVOUS_HOST,
        ];
        env.retain(|e| !ours.contains(&e.name.as_str()));
    }
    env.push(from_secret(ENV_AGENT_SECRET, &names.secret(), SECRET_KEY));
    let Some(store) = store else {
        return env;
    };
    env.push(from_secret(ENV_JOB_SECRET, &names.secret(), JOB_SECRET_KEY));
    if let Some(creds) = &store.credentials_secret {
        env.push(from_secret(
            ENV_STORE_USERNAME,
            creds,
            CREDENTIALS_USERNAME_KEY,
        ));
        env.push(from_secret(
            ENV_STORE_PASSWORD,
            creds,
            CREDENTIALS_PASSWORD_KEY,
        ));
    }
    env.push(EnvVar {
        name: ENV_RENDEZVOUS_HOST.into(),
        value: Some(names.driver_dns()),
        ..Default::default()
    });
    env
}

/// The Secret as a read-only volume.
fn secret_volume(names: &Names) -> Volume {
    Volume {
        name: SECRET_VOLUME.into(),
        secret: Some(SecretVolumeSource {
            secret_name: Some(names.secret()),
            optional: Some(false),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// The Secret volume mounted read-only at [`SECRET_DIR`].
fn secret_mount() -> VolumeMount {
    VolumeMount {
        name: SECRET_VOLUME.into(),
        mount_path: SECRET_DIR.into(),
        read_only: Some(true),
        ..Default::default()
    }
}

fn tcp_probe(port: u16) -> Probe {
    Probe {
        tcp_socket: Some(TCPSocketAction {
            port: IntOrString::Int(i32::from(port)),
            ..Default::default()
        }),
        period_seconds: Some(2),
        ..Default::default()
    }
}

fn port(name: &str, port: u16) -> ContainerPort {
    ContainerPort {
        name: Some(name.into()),
        container_port: i32::from(port),
        ..Default::default()
    }
}

/// Worker pod number `index`: `hvd-agent --listen [::]:7077 --secret-file SECRET_FILE`
/// (dual-stack; the secret comes from the mounted Secret, never from the environment the
/// training processes inherit), Ready once the agent listens, annotated with its slot count
/// and the spec it was made from, reachable by DNS through the headless Service.
///
/// # Errors
/// [`Error::MissingField`] when the job lacks a name, namespace or uid; [`Error::Json`] when
/// the spec cannot be recorded.
pub fn worker_pod(job: &ElasticJob, index: usize) -> Result<Pod, Error> {
    let names = Names::of(job)?;
    let name = names.worker(index);
    let mut metadata = meta(job, &names, name.clone(), Some(ROLE_WORKER))?;
    metadata.annotations = Some(BTreeMap::from([
        (
            job.spec.discovery.slots_annotation.clone(),
            job.spec.slots_per_worker.to_string(),
        ),
        spec_record(job)?,
    ]));
    let dns = job.spec.discovery.dns;
    Ok(Pod {
        metadata,
        spec: Some(PodSpec {
            hostname: dns.then(|| name.clone()),
            subdomain: dns.then(|| names.service()),
            restart_policy: Some("Never".into()),
            automount_service_account_token: Some(false),
            containers: vec![Container {
                name: "worker".into(),
                image: Some(job.spec.image.clone()),
                command: Some(vec![
                    "hvd-agent".into(),
                    "--listen".into(),
                    format!("[::]:{AGENT_PORT}"),
                    "--secret-file".into(),
                    SECRET_FILE.into(),
                ]),
                ports: Some(vec![port("agent", AGENT_PORT)]),
                env: Some(user_env(job)),
                resources: job.spec.resources.clone(),
                readiness_probe: Some(tcp_probe(AGENT_PORT)),
                volume_mounts: Some(vec![secret_mount()]),
                ..Default::default()
            }],
            volumes: Some(vec![secret_volume(&names)]),
            ..Default::default()
        }),
        status: None,
    })
}

/// Training processes of `replicas` worker pods of `slots` each (at least one pod), in `i64`
/// so that no pair of `i32` spec values can overflow.
fn processes(replicas: i32, slots: i32) -> i64 {
    i64::from(replicas.max(1)) * i64::from(slots)
}

/// The `horovodrun` command line of the driver pod. With a state store it adds
/// `--state-store etcd://<endpoints>/<prefix> --standby` (a replacement waits while its
/// predecessor's lease lives, then adopts the workers), the lease TTL, the workers' grace
/// and the fixed [`RENDEZVOUS_PORT`].
///
/// # Errors
/// [`Error::MissingField`] when the job lacks a name or namespace; [`Error::StateStore`]
/// naming a bad endpoint or prefix.
pub fn driver_command(job: &ElasticJob) -> Result<Vec<String>, Error> {
    let names = Names::of(job)?;
    let spec = &job.spec;
    let slots = spec.slots_per_worker.max(1);
    let mut cmd: Vec<String> = [
        "horovodrun",
        "--launcher",
        "agent",
        "--agent-port",
        &AGENT_PORT.to_string(),
        "--discovery",
        "kubernetes",
        "--selector",
        &names.worker_selector(),
        "--namespace",
        &names.namespace,
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    if spec.discovery.dns {
        cmd.extend(["--service".to_string(), names.service()]);
    }
    let default_annotation = hvd_discovery::kubernetes::DEFAULT_SLOTS_ANNOTATION;
    if spec.discovery.slots_annotation != default_annotation {
        cmd.extend([
            "--slots-annotation".to_string(),
            spec.discovery.slots_annotation.clone(),
        ]);
    }
    cmd.extend([
        "--status-port".to_string(),
        STATUS_PORT.to_string(),
        "--min-np".to_string(),
        processes(spec.min_replicas, slots).to_string(),
        "--max-np".to_string(),
        processes(spec.max_replicas, slots).to_string(),
        "--slots".to_string(),
        slots.to_string(),
    ]);
    if let Some([lo, hi]) = spec.blacklist.cooldown_range {
        cmd.extend([
            "--blacklist-cooldown-range".to_string(),
            lo.to_string(),
            hi.to_string(),
        ]);
    }
    if let Some(store) = &spec.state_store {
        let url = store.url(&names.namespace, &names.job, &names.uid)?;
        cmd.extend([
            "--state-store".to_string(),
            url,
            "--standby".to_string(),
            "--state-store-ttl".to_string(),
            store.ttl_seconds.to_string(),
            "--driver-grace".to_string(),
            store.driver_grace_seconds.to_string(),
            "--rendezvous-port".to_string(),
            RENDEZVOUS_PORT.to_string(),
        ]);
    }
    cmd.push("--".into());
    cmd.extend(spec.command.iter().cloned());
    Ok(cmd)
}

/// Annotation on the driver pod: the job's spec as its pods are made from it (every field but
/// `replicas`), in JSON. A running job keeps making worker pods from it, so that a later edit of
/// the spec never mixes images or settings within one job.
pub const ANNOTATION_SPEC: &str = "hvd.dev/spec";

/// The spec a running job's pods are made from: the one recorded on its driver pod, else on
/// one of its worker pods ([`ANNOTATION_SPEC`]), with the current `replicas`; the job's own
/// spec when no pod of this job has a readable record (none yet, or made by an older
/// operator). So a driver pod recreated while workers run is made from their spec too.
pub fn as_started(job: &ElasticJob, pods: &[Pod]) -> ElasticJob {
    let mut started = job.clone();
    let Ok(names) = Names::of(job) else {
        return started;
    };
    let driver = names.driver();
    let mut ours: Vec<&Pod> = pods
        .iter()
        .filter(|p| crate::plan::owned_by(job, p))
        .collect();
    // The driver's record first, then live workers', then any.
    ours.sort_by_key(|p| {
        (
            p.metadata.name.as_deref() != Some(driver.as_str()),
            p.metadata.deletion_timestamp.is_some(),
        )
    });
    let recorded = ours.iter().find_map(|p| {
        let text = p.metadata.annotations.as_ref()?.get(ANNOTATION_SPEC)?;
        serde_json::from_str::<crate::crd::ElasticJobSpec>(text).ok()
    });
    if let Some(mut spec) = recorded {
        spec.replicas = job.spec.replicas;
        started.spec = spec;
    }
    started
}

/// The spec fields (by their names in the CRD, in alphabetical order) in which `now` differs
/// from `started`; `replicas` is never one of them.
pub fn changed_fields(now: &ElasticJob, started: &ElasticJob) -> Vec<String> {
    let (Ok(serde_json::Value::Object(a)), Ok(serde_json::Value::Object(b))) = (
        serde_json::to_value(&now.spec),
        serde_json::to_value(&started.spec),
    ) else {
        return Vec::new();
    };
    let keys: std::collections::BTreeSet<&String> = a.keys().chain(b.keys()).collect();
    keys.into_iter()
        .filter(|k| *k != "replicas" && a.get(*k) != b.get(*k))
        .cloned()
        .collect()
}

/// The record of the spec `job`'s pods are made from ([`ANNOTATION_SPEC`]).
fn spec_record(job: &ElasticJob) -> Result<(String, String), Error> {
    let mut recorded = job.spec.clone();
    recorded.replicas = None;
    Ok((
        ANNOTATION_SPEC.to_string(),
        serde_json::to_string(&recorded)?,
    ))
}

/// The annotations by which a Prometheus that discovers pods scrapes the driver's
/// `GET /metrics` on its status port (the job's phase, rounds, failures and rates).
fn scrape_annotations() -> [(String, String); 3] {
    [
        ("prometheus.io/scrape".into(), "true".into()),
        ("prometheus.io/port".into(), STATUS_PORT.to_string()),
        ("prometheus.io/path".into(), "/metrics".into()),
    ]
}

/// The driver's container ports: status (`/status` and `/metrics`), and the rendezvous with
/// a state store.
fn driver_ports(job: &ElasticJob) -> Vec<ContainerPort> {
    let mut ports = vec![port(STATUS_PORT_NAME, STATUS_PORT)];
    if job.spec.state_store.is_some() {
        ports.push(port("rendezvous", RENDEZVOUS_PORT));
    }
    ports
}

/// The driver pod: `horovodrun` with Kubernetes discovery of the job's workers, under the
/// driver ServiceAccount (which may only read pods). It never restarts in place: without a
/// state store its exit code is the job's; with one, the operator replaces a lost one.
/// It records the spec it was made from ([`ANNOTATION_SPEC`]).
///
/// # Errors
/// [`Error::MissingField`] when the job lacks a name, namespace or uid; [`Error::Json`] when
/// the spec cannot be recorded.
pub fn driver_pod(job: &ElasticJob) -> Result<Pod, Error> {
    let names = Names::of(job)?;
    let mut metadata = meta(job, &names, names.driver(), Some(ROLE_DRIVER))?;
    let mut annotations = BTreeMap::from([spec_record(job)?]);
    annotations.extend(scrape_annotations());
    metadata.annotations = Some(annotations);
    Ok(Pod {
        metadata,
        spec: Some(PodSpec {
            service_account_name: Some(names.driver()),
            restart_policy: Some("Never".into()),
            containers: vec![Container {
                name: DRIVER_CONTAINER.into(),
                image: Some(job.spec.image.clone()),
                command: Some(driver_command(job)?),
                ports: Some(driver_ports(job)),
                env: Some(driver_env(job, &names)),
                readiness_probe: Some(tcp_probe(STATUS_PORT)),
                volume_mounts: Some(vec![secret_mount()]),
                ..Default::default()
            }],
            volumes: Some(vec![secret_volume(&names)]),
            ..Default::default()
        }),
        status: None,
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use crate::fixtures::job;

    #[test]
    fn names_and_worker_indices() {
        let n = Names::of(&job("train", 2, 4)).unwrap();
        assert_eq!(n.worker(3), "train-worker-3");
        assert_eq!(n.worker_index("train-worker-3"), Some(3));
        assert_eq!(n.worker_index("train-driver"), None);
        assert_eq!(n.worker_index("other-worker-3"), None);
        assert_eq!(n.worker_selector(), "hvd.dev/job=train,hvd.dev/role=worker");
        assert_eq!(
            n.worker_dns("train-worker-0"),
            "train-worker-0.train-workers.ml.svc"
        );
    }

    #[test]
    fn driver_pod_records_the_spec_its_job_started_with() {
        let mut j = job("train", 2, 4);
        j.spec.replicas = Some(3);
        let d = driver_pod(&j).unwrap();
        let text = &d.metadata.annotations.as_ref().unwrap()[ANNOTATION_SPEC];
        let recorded: crate::crd::ElasticJobSpec = serde_json::from_str(text).unwrap();
        assert_eq!(recorded.replicas, None, "replicas is never recorded");
        // Prometheus finds the driver's metrics on its status port.
        let a = d.metadata.annotations.as_ref().unwrap();
        assert_eq!(
            (&a["prometheus.io/port"][..], &a["prometheus.io/path"][..]),
            ("8080", "/metrics")
        );
        assert_eq!(recorded.image, j.spec.image);

        // Later edits: the job keeps its started spec, with the current replicas.
        let mut edited = j.clone();
        edited.spec.image = "hvd:next".into();
        edited.spec.replicas = Some(2);
        edited.spec.resources = Some(Default::default());
        let started = as_started(&edited, std::slice::from_ref(&d));
        assert_eq!(started.spec.image, "hvd:test");
        assert_eq!(started.spec.replicas, Some(2));
        assert_eq!(started.spec.resources, None);
        assert_eq!(changed_fields(&edited, &started), ["image", "resources"]);
        assert!(changed_fields(&j, &as_started(&j, std::slice::from_ref(&d))).is_empty());
        assert_eq!(
            worker_pod(&started, 0).unwrap().spec.unwrap().containers[0]
                .image
                .as_deref(),
            Some("hvd:test")
        );

        // Without its driver pod, a running job's workers carry the record: a recreated
        // driver is made from it too.
        let w = worker_pod(&j, 0).unwrap();
        assert_eq!(
            as_started(&edited, std::slice::from_ref(&w)).spec.image,
            "hvd:test"
        );
        assert_eq!(
            driver_pod(&as_started(&edited, &[w]))
                .unwrap()
                .spec
                .unwrap()
                .containers[0]
                .image
                .as_deref(),
            Some("hvd:test")
        );

        // No pod, another job's, or an unreadable record: the job's own spec.
        assert_eq!(as_started(&edited, &[]).spec.image, "hvd:next");
        let mut foreign = d.clone();
        foreign.metadata.owner_references.as_mut().unwrap()[0].uid = "uid-old".into();
        assert_eq!(as_started(&edited, &[foreign]).spec.image, "hvd:next");
        let mut garbled = d;
        garbled
            .metadata
            .annotations
            .as_mut()
            .unwrap()
            .insert(ANNOTATION_SPEC.into(), "{not json".into());
        assert_eq!(as_started(&edited, &[garbled]).spec.image, "hvd:next");
    }

    #[test]
    fn worker_pod_runs_the_agent_with_labels_annotation_and_owner() {
        let j = job("train", 2, 4);
        let p = worker_pod(&j, 5).unwrap();
        assert_eq!(p.metadata.name.as_deref(), Some("train-worker-5"));
        let labels = p.metadata.labels.as_ref().unwrap();
        assert_eq!(labels[LABEL_JOB], "train");
        assert_eq!(labels[LABEL_ROLE], "worker");
        assert_eq!(
            p.metadata.annotations.as_ref().unwrap()["hvd.dev/slots"],
            "2"
        );
        let owner = &p.metadata.owner_references.as_ref().unwrap()[0];
        assert_eq!(
            (owner.kind.as_str(), owner.controller),
            ("ElasticJob", Some(true))
        );
        let spec = p.spec.as_ref().unwrap();
        assert_eq!(spec.hostname.as_deref(), Some("train-worker-5"));
        assert_eq!(spec.subdomain.as_deref(), Some("train-workers"));
        let c = &spec.containers[0];
        assert_eq!(
            c.command.as_ref().unwrap(),
            &[
                "hvd-agent",
                "--listen",
                "[::]:7077",
                "--secret-file",
                "/var/run/secrets/hvd.dev/secret"
            ]
        );
        let listen: std::net::SocketAddr = c.command.as_ref().unwrap()[2].parse().unwrap();
        assert!(listen.ip().is_unspecified() && listen.is_ipv6(), "{listen}");
        assert_eq!(c.ports.as_ref().unwrap()[0].container_port, 7077);
        assert_secret_mounted(spec, "train-secret-uid-train");
        assert!(
            c.env
                .as_ref()
                .unwrap()
                .iter()
                .all(|e| e.name != ENV_AGENT_SECRET),
            "the training processes would inherit the secret"
        );
        assert!(
            c.env
                .as_ref()
                .unwrap()
                .iter()
                .any(|e| e.name == "HOROVOD_CYCLE_TIME")
        );
    }

    /// The pod mounts Secret `secret` read-only so that [`SECRET_FILE`] is its key.
    fn assert_secret_mounted(spec: &PodSpec, secret: &str) {
        let vol = &spec.volumes.as_ref().unwrap()[0];
        let src = vol.secret.as_ref().unwrap();
        assert_eq!(src.secret_name.as_deref(), Some(secret));
        let mount = &spec.containers[0].volume_mounts.as_ref().unwrap()[0];
        assert_eq!(mount.name, vol.name);
        assert_eq!(mount.read_only, Some(true));
        assert_eq!(
            format!("{}/{SECRET_KEY}", mount.mount_path),
            SECRET_FILE,
            "the agent's --secret-file must be the Secret's key"
        );
    }

    #[test]
    fn user_env_cannot_override_the_secret() {
        let mut j = job("train", 1, 1);
        j.spec.env.push(EnvVar {
            name: ENV_AGENT_SECRET.into(),
            value: Some("guessable".into()),
            ..Default::default()
        });
        let w = worker_pod(&j, 0).unwrap().spec.unwrap();
        assert!(
            w.containers[0]
                .env
                .as_ref()
                .unwrap()
                .iter()
                .all(|e| e.name != ENV_AGENT_SECRET)
        );
        let d = driver_pod(&j).unwrap().spec.unwrap();
        let secret: Vec<_> = d.containers[0]
            .env
            .as_ref()
            .unwrap()
            .iter()
            .filter(|e| e.name == ENV_AGENT_SECRET)
            .collect();
        assert_eq!(secret.len(), 1);
        assert_eq!(secret[0].value, None, "only the Secret's value");
    }

    #[test]
    fn np_bounds_do_not_overflow() {
        let mut j = job("train", 2, 4);
        j.spec.min_replicas = i32::MAX;
        j.spec.max_replicas = i32::MAX;
        j.spec.slots_per_worker = i32::MAX;
        let cmd = driver_command(&j).unwrap();
        let np = |flag: &str| {
            let at = cmd.iter().position(|a| a == flag).unwrap();
            cmd[at + 1].parse::<i64>().unwrap()
        };
        let want = i64::from(i32::MAX) * i64::from(i32::MAX);
        assert_eq!((np("--min-np"), np("--max-np")), (want, want));
    }

    #[test]
    fn driver_command_carries_discovery_bounds_and_program() {
        let mut j = job("train", 2, 4);
        j.spec.blacklist.cooldown_range = Some([10, 300]);
        assert_eq!(
            driver_command(&j).unwrap().join(" "),
            "horovodrun --launcher agent --agent-port 7077 --discovery kubernetes \
             --selector hvd.dev/job=train,hvd.dev/role=worker --namespace ml \
             --service train-workers --status-port 8080 --min-np 4 --max-np 8 --slots 2 \
             --blacklist-cooldown-range 10 300 -- python train.py"
        );
        j.spec.discovery.dns = false;
        j.spec.discovery.slots_annotation = "example.com/gpus".into();
        j.spec.blacklist.cooldown_range = None;
        let cmd = driver_command(&j).unwrap().join(" ");
        assert!(!cmd.contains("--service"), "{cmd}");
        assert!(!cmd.contains("--blacklist-cooldown-range"), "{cmd}");
        assert!(cmd.contains("--slots-annotation example.com/gpus"), "{cmd}");
        let p = worker_pod(&j, 0).unwrap();
        assert_eq!(p.metadata.annotations.unwrap()["example.com/gpus"], "2");
        assert_eq!(p.spec.unwrap().hostname, None);
    }

    #[test]
    fn driver_pod_uses_its_own_service_account_and_never_restarts() {
        let p = driver_pod(&job("train", 1, 1)).unwrap();
        assert_eq!(p.metadata.labels.as_ref().unwrap()[LABEL_ROLE], "driver");
        let spec = p.spec.unwrap();
        assert_secret_mounted(&spec, "train-secret-uid-train");
        let env = spec.containers[0].env.as_ref().unwrap();
        let from = env
            .iter()
            .find(|e| e.name == ENV_AGENT_SECRET)
            .and_then(|e| e.value_from.as_ref()?.secret_key_ref.as_ref())
            .unwrap();
        assert_eq!(
            (from.name.as_str(), from.key.as_str()),
            ("train-secret-uid-train", SECRET_KEY)
        );
        assert_eq!(spec.service_account_name.as_deref(), Some("train-driver"));
        assert_eq!(spec.restart_policy.as_deref(), Some("Never"));
        assert_eq!(
            spec.containers[0].command.as_ref().unwrap()[0],
            "horovodrun"
        );
    }

    #[test]
    fn driver_role_reads_pods_only() {
        let r = driver_role(&job("train", 1, 1)).unwrap();
        let rules = r.rules.unwrap();
        assert_eq!(rules.len(), 1);
        assert_eq!(
            rules[0].resources.as_deref(),
            Some(&["pods".to_string()][..])
        );
        assert_eq!(rules[0].verbs, ["get", "list", "watch"]);
        let b = driver_role_binding(&job("train", 1, 1)).unwrap();
        assert_eq!(b.role_ref.name, "train-driver");
        assert_eq!(b.subjects.unwrap()[0].name, "train-driver");
    }

    #[test]
    fn service_is_headless_over_the_workers() {
        let s = worker_service(&job("train", 1, 1)).unwrap();
        let spec = s.spec.unwrap();
        assert_eq!(spec.cluster_ip.as_deref(), Some("None"));
        let sel = spec.selector.unwrap();
        assert_eq!(sel.len(), 2);
        assert_eq!(sel[LABEL_ROLE], "worker");
    }

    #[test]
    fn secrets_are_random_hex_and_stored_under_the_key() {
        let a = new_secret().unwrap();
        let b = new_secret().unwrap();
        assert_eq!(a.len(), 64);
        assert!(a.chars().all(|c| c.is_ascii_hexdigit()));
        assert_ne!(a, b);
        let s = secret(&job("train", 1, 1), &a, &b).unwrap();
        let data = s.data.unwrap();
        assert_eq!(data[SECRET_KEY].0, a.as_bytes());
        assert_eq!(data[JOB_SECRET_KEY].0, b.as_bytes());
        // A job recreated under the same name never shares the deleted job's Secret.
        let mut again = job("train", 1, 1);
        again.metadata.uid = Some("uid-new".into());
        assert_eq!(
            secret(&again, &a, &b).unwrap().metadata.name.as_deref(),
            Some("train-secret-uid-new")
        );
    }

    #[test]
    fn objects_need_a_uid_for_their_owner_reference() {
        let mut j = job("train", 1, 1);
        j.metadata.uid = None;
        let err = worker_pod(&j, 0).unwrap_err();
        assert!(err.to_string().contains("metadata.uid"), "{err}");
    }

    fn env_of(p: &Pod) -> Vec<EnvVar> {
        p.spec.as_ref().unwrap().containers[0].env.clone().unwrap()
    }

    /// The Secret and key an environment variable is read from.
    fn secret_ref(env: &[EnvVar], name: &str) -> Option<(String, String)> {
        let r = env
            .iter()
            .find(|e| e.name == name)?
            .value_from
            .as_ref()?
            .secret_key_ref
            .as_ref()?;
        Some((r.name.clone(), r.key.clone()))
    }

    #[test]
    fn driver_with_a_store_gets_the_store_flags_a_fixed_port_and_the_job_secret() {
        let mut j = crate::fixtures::with_store(job("train", 2, 4), 5);
        let cmd = driver_command(&j).unwrap().join(" ");
        assert!(
            cmd.ends_with(
                "--state-store etcd://etcd.default.svc:2379/hvd/ml/train/uid-train --standby \
                 --state-store-ttl 10 --driver-grace 60 --rendezvous-port 7078 -- python train.py"
            ),
            "{cmd}"
        );
        let store = j.spec.state_store.as_mut().unwrap();
        store.endpoints = vec!["10.0.0.5:2379".into(), "[fd00::5]:2379".into()];
        store.prefix = Some("/team-a/train/".into());
        store.ttl_seconds = 3;
        store.driver_grace_seconds = 120;
        store.credentials_secret = Some("etcd-auth".into());
        let cmd = driver_command(&j).unwrap().join(" ");
        assert!(
            cmd.contains(
                "--state-store etcd://10.0.0.5:2379,[fd00::5]:2379/team-a/train --standby \
                 --state-store-ttl 3 --driver-grace 120"
            ),
            "{cmd}"
        );

        j.spec.env.push(EnvVar {
            name: ENV_JOB_SECRET.into(),
            value: Some("guessable".into()),
            ..Default::default()
        });
        let pod = driver_pod(&j).unwrap();
        let env = env_of(&pod);
        let names = Names::of(&j).unwrap();
        assert_eq!(
            secret_ref(&env, ENV_JOB_SECRET),
            Some((names.secret(), JOB_SECRET_KEY.into()))
        );
        assert_eq!(
            env.iter().filter(|e| e.name == ENV_JOB_SECRET).count(),
            1,
            "the job's own HVD_SECRET never reaches the driver"
        );
        assert_eq!(
            secret_ref(&env, ENV_AGENT_SECRET),
            Some((names.secret(), SECRET_KEY.into()))
        );
        assert_eq!(
            secret_ref(&env, ENV_STORE_USERNAME),
            Some(("etcd-auth".into(), "username".into()))
        );
        assert_eq!(
            secret_ref(&env, ENV_STORE_PASSWORD),
            Some(("etcd-auth".into(), "password".into()))
        );
        let host = env.iter().find(|e| e.name == ENV_RENDEZVOUS_HOST).unwrap();
        assert_eq!(host.value.as_deref(), Some("train-driver.ml.svc"));
        let ports = pod.spec.unwrap().containers[0].ports.clone().unwrap();
        assert!(ports.iter().any(|p| p.container_port == 7078));
    }

    #[test]
    fn driver_without_a_store_is_as_before() {
        let j = job("train", 2, 4);
        let cmd = driver_command(&j).unwrap().join(" ");
        for flag in ["--state-store", "--standby", "--rendezvous-port"] {
            assert!(!cmd.contains(flag), "{cmd}");
        }
        let pod = driver_pod(&j).unwrap();
        let env = env_of(&pod);
        for name in [ENV_JOB_SECRET, ENV_STORE_USERNAME, ENV_RENDEZVOUS_HOST] {
            assert!(env.iter().all(|e| e.name != name), "{name}");
        }
        assert_eq!(
            pod.spec.unwrap().containers[0]
                .ports
                .as_ref()
                .unwrap()
                .len(),
            1
        );
        // Without credentials, no credential variables.
        let j = crate::fixtures::with_store(j, 5);
        let env = env_of(&driver_pod(&j).unwrap());
        assert!(env.iter().all(|e| e.name != ENV_STORE_PASSWORD));
    }

    #[test]
    fn a_bad_endpoint_is_named() {
        let mut j = crate::fixtures::with_store(job("train", 1, 1), 5);
        j.spec.state_store.as_mut().unwrap().endpoints =
            vec!["etcd:2379".into(), "etcd-1/2379".into()];
        let err = driver_pod(&j).unwrap_err();
        assert!(matches!(err, Error::StateStore(_)), "{err}");
        assert!(err.to_string().contains("\"etcd-1/2379\""), "{err}");
    }

    #[test]
    fn driver_service_selects_the_driver_pod_on_the_rendezvous_port() {
        let j = crate::fixtures::with_store(job("train", 1, 1), 5);
        let s = driver_service(&j).unwrap();
        assert_eq!(s.metadata.name.as_deref(), Some("train-driver"));
        let spec = s.spec.unwrap();
        assert_eq!(spec.cluster_ip, None, "a stable virtual IP, not headless");
        assert_eq!(spec.publish_not_ready_addresses, Some(true));
        let sel = spec.selector.unwrap();
        assert_eq!(sel[LABEL_ROLE], ROLE_DRIVER);
        assert_eq!(sel[LABEL_JOB], "train");
        let ports = spec.ports.unwrap();
        assert_eq!(ports[0].port, i32::from(RENDEZVOUS_PORT));
        // One Service with both ports: the rendezvous, and the status port for the metrics.
        let named: Vec<_> = ports
            .iter()
            .map(|p| (p.name.as_deref().unwrap(), p.port))
            .collect();
        assert_eq!(named, [("rendezvous", 7078), ("status", 8080)]);
        assert_eq!(
            s.metadata.labels.unwrap()[LABEL_METRICS],
            METRICS_DRIVER,
            "the drivers of jobs with a store are scraped too"
        );
        // The driver pod carries what the selector asks for.
        let labels = driver_pod(&j).unwrap().metadata.labels.unwrap();
        assert!(sel.iter().all(|(k, v)| labels.get(k) == Some(v)));
    }

    #[test]
    fn every_job_has_a_driver_service_for_its_metrics() {
        let j = job("train", 1, 1);
        let s = driver_service(&j).unwrap();
        assert_eq!(s.metadata.name.as_deref(), Some("train-driver"));
        assert_eq!(s.metadata.namespace.as_deref(), Some("ml"));
        let labels = s.metadata.labels.as_ref().unwrap();
        assert_eq!(labels[LABEL_METRICS], "driver");
        assert_eq!(labels[LABEL_JOB], "train");
        assert_eq!(labels["app.kubernetes.io/managed-by"], "hvd-operator");
        let owner = &s.metadata.owner_references.as_ref().unwrap()[0];
        assert_eq!(
            (
                owner.kind.as_str(),
                owner.name.as_str(),
                owner.uid.as_str(),
                owner.controller
            ),
            ("ElasticJob", "train", "uid-train", Some(true))
        );
        let spec = s.spec.unwrap();
        let ports = spec.ports.unwrap();
        assert_eq!(ports.len(), 1, "no rendezvous port without a store");
        assert_eq!(ports[0].name.as_deref(), Some(STATUS_PORT_NAME));
        assert_eq!(ports[0].port, 8080);
        assert_eq!(ports[0].target_port, Some(IntOrString::Int(8080)));
        // It reaches the driver pod's status port, where the pod's annotations point too.
        let pod = driver_pod(&j).unwrap();
        let pod_labels = pod.metadata.labels.as_ref().unwrap();
        let sel = spec.selector.unwrap();
        assert_eq!(sel[LABEL_ROLE], ROLE_DRIVER);
        assert!(sel.iter().all(|(k, v)| pod_labels.get(k) == Some(v)));
        let status = pod.spec.unwrap().containers[0]
            .ports
            .clone()
            .unwrap()
            .into_iter()
            .find(|p| p.name.as_deref() == Some(STATUS_PORT_NAME))
            .unwrap();
        assert_eq!(status.container_port, ports[0].port);
        assert_eq!(
            pod.metadata.annotations.unwrap()["prometheus.io/port"],
            ports[0].port.to_string()
        );
        // The driver only, never a worker.
        let workers = worker_pod(&j, 0).unwrap().metadata.labels.unwrap();
        assert!(!sel.iter().all(|(k, v)| workers.get(k) == Some(v)));
    }
}
