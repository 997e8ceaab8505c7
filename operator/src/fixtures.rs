//! Test fixtures: jobs and pods as the API server would return them.

use k8s_openapi::api::core::v1::{EnvVar, Pod, PodCondition, PodStatus};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

use crate::crd::{BlacklistSpec, DiscoverySpec, ElasticJob, ElasticJobSpec};
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
