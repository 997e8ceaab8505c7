//! Test fixtures: jobs and pods as the API server would return them.

use k8s_openapi::api::core::v1::{
    ContainerState, ContainerStateTerminated, ContainerStatus, EnvVar, Pod, PodCondition, PodStatus,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

use crate::crd::{BlacklistSpec, DiscoverySpec, ElasticJob, ElasticJobSpec, StateStoreSpec};
use crate::resources;

/// A job `name` in namespace `ml` with 2 slots per worker, `min..=max` workers and a uid.
pub fn job(name: &str, min: i32, max: i32) -> ElasticJob {
    let mut j = ElasticJob::new(
        name,
        ElasticJobSpec {
            image: "hvd:test".into(),
            command: vec!["python".into(), "train.py".into()],
            min_replicas: min,
            max_replicas: max,
            replicas: None,
            slots_per_worker: 2,
            resources: None,
            env: vec![EnvVar {
                name: "HOROVOD_CYCLE_TIME".into(),
                value: Some("1".into()),
                ..Default::default()
            }],
            discovery: DiscoverySpec::default(),
            blacklist: BlacklistSpec::default(),
            state_store: None,
        },
    );
    j.metadata.namespace = Some("ml".into());
    j.metadata.uid = Some(format!("uid-{name}"));
    j.metadata.generation = Some(1);
    j
}

/// Worker pod `index` of `job`, running with `ip` and Ready.
pub fn worker(job: &ElasticJob, index: usize, ip: &str) -> Pod {
    let mut p = resources::worker_pod(job, index).unwrap_or_default();
    running(&mut p, ip);
    p
}

/// The driver pod of `job`, running with `ip`.
pub fn driver(job: &ElasticJob, ip: &str) -> Pod {
    let mut p = resources::driver_pod(job).unwrap_or_default();
    running(&mut p, ip);
    p
}

fn running(p: &mut Pod, ip: &str) {
    p.status = Some(PodStatus {
        phase: Some("Running".into()),
        pod_ip: Some(ip.into()),
        conditions: Some(vec![PodCondition {
            type_: "Ready".into(),
            status: "True".into(),
            ..Default::default()
        }]),
        ..Default::default()
    });
}

/// `p` in phase `phase` (`Failed`, `Succeeded`, `Pending`), not Ready, with `reason`.
pub fn in_phase(mut p: Pod, phase: &str, reason: Option<&str>) -> Pod {
    let st = p.status.get_or_insert_with(Default::default);
    st.phase = Some(phase.into());
    st.reason = reason.map(Into::into);
    st.conditions = None;
    p
}

/// `p` with a deletion timestamp: being deleted (a spot preemption, a drain).
pub fn deleting(mut p: Pod) -> Pod {
    p.metadata.deletion_timestamp = Some(Time(k8s_openapi::jiff::Timestamp::UNIX_EPOCH));
    p
}

/// `job` with a state store at `etcd.default.svc:2379` and its defaults (TTL 10 s, grace 60 s,
/// at most `max_restarts` driver replacements).
pub fn with_store(mut job: ElasticJob, max_restarts: u32) -> ElasticJob {
    job.spec.state_store = Some(StateStoreSpec {
        endpoints: vec!["etcd.default.svc:2379".into()],
        prefix: None,
        ttl_seconds: 10,
        driver_grace_seconds: 60,
        credentials_secret: None,
        max_driver_restarts: max_restarts,
    });
    job
}

/// `p` Failed, its `driver` container ended with `code`, its reason `reason`, and `message`
/// as its termination message.
pub fn exited(mut p: Pod, code: i32, reason: Option<&str>, message: Option<&str>) -> Pod {
    p = in_phase(p, "Failed", None);
    let st = p.status.get_or_insert_with(Default::default);
    st.container_statuses = Some(vec![ContainerStatus {
        name: "driver".into(),
        state: Some(ContainerState {
            terminated: Some(ContainerStateTerminated {
                exit_code: code,
                reason: reason.map(Into::into),
                message: message.map(Into::into),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    }]);
    p
}

/// `p` with uid `uid`, as the API server gives every pod.
pub fn with_uid(mut p: Pod, uid: &str) -> Pod {
    p.metadata.uid = Some(uid.into());
    p
}
