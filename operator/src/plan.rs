//! The reconciler's decisions as pure functions of what it observed: [`plan`] says which pods to
//! create and delete, [`status`] what to report. No I/O here, so every rule has a unit test.

use std::collections::BTreeSet;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};

use crate::crd::{BlacklistSeen, ElasticJob, ElasticJobStatus, Phase};
use crate::driver_fate::{DriverFate, driver_record, fate};
use crate::driver_status::{BlacklistedHost, DriverPhase, DriverStatus};
use crate::resources::{LABEL_ROLE, Names, ROLE_DRIVER, ROLE_WORKER};

/// One change the reconciler makes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Create the job's Secret and the driver pod (the ServiceAccount, RBAC and Service are
    /// applied on every reconcile of a running job, apart from the plan).
    CreateDriver,
    /// Delete the job's failed driver pod so that a new one can take its name (jobs with a
    /// state store; the workers keep training meanwhile).
    DeleteDriver {
        /// How it failed (e.g. `Failed (exit 137, OOMKilled)`).
        state: String,
    },
    /// Create worker pod number `index`.
    CreateWorker {
        /// Its index (`<job>-worker-<index>`).
        index: usize,
    },
    /// Delete a worker pod.
    DeleteWorker {
        /// The pod.
        name: String,
        /// Why.
        why: DeleteReason,
    },
}

/// Why a worker pod is deleted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeleteReason {
    /// It failed or was evicted (its phase is Failed or Succeeded); a new pod replaces it.
    Failed {
        /// The pod's phase, with its status reason (e.g. `Failed (Evicted)`).
        state: String,
    },
    /// The driver blacklisted its host; a new pod (a new host) replaces it.
    Blacklisted {
        /// The host as the driver named it.
        host: String,
    },
    /// More workers than `spec.replicas`.
    ScaleDown,
    /// The job is over.
    JobFinished,
}

impl DeleteReason {
    /// The Event reason for this deletion.
    pub fn event_reason(&self) -> &'static str {
        match self {
            DeleteReason::Failed { .. } => "ReplacingFailedWorker",
            DeleteReason::Blacklisted { .. } => "RemovingBlacklistedWorker",
            DeleteReason::ScaleDown => "ScaledDown",
            DeleteReason::JobFinished => "JobFinished",
        }
    }
}

/// A worker pod of the job, classified.
struct Worker<'a> {
    index: usize,
    name: &'a str,
    pod: &'a Pod,
}

pub(crate) fn phase_of(pod: &Pod) -> &str {
    pod.status
        .as_ref()
        .and_then(|s| s.phase.as_deref())
        .unwrap_or("Pending")
}

fn is_ready(pod: &Pod) -> bool {
    pod.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

pub(crate) fn is_deleting(pod: &Pod) -> bool {
    pod.metadata.deletion_timestamp.is_some()
}

fn role(pod: &Pod) -> Option<&str> {
    pod.metadata
        .labels
        .as_ref()?
        .get(LABEL_ROLE)
        .map(String::as_str)
}

/// True when `job` (this very job: same uid) is `pod`'s controller. A pod of a deleted job of
/// the same name, still being removed, carries the same labels but another uid.
pub fn owned_by(job: &ElasticJob, pod: &Pod) -> bool {
    let Some(uid) = job.metadata.uid.as_deref() else {
        return false;
    };
    pod.metadata.owner_references.as_ref().is_some_and(|refs| {
        refs.iter()
            .any(|r| r.controller == Some(true) && r.uid == uid)
    })
}

fn workers<'a>(job: &ElasticJob, names: &Names, pods: &'a [Pod]) -> Vec<Worker<'a>> {
    pods.iter()
        .filter(|p| owned_by(job, p))
        .filter(|p| role(p) == Some(ROLE_WORKER))
        .filter_map(|pod| {
            let name = pod.metadata.name.as_deref()?;
            Some(Worker {
                index: names.worker_index(name)?,
                name,
                pod,
            })
        })
        .collect()
}

fn driver_pod<'a>(job: &ElasticJob, names: &Names, pods: &'a [Pod]) -> Option<&'a Pod> {
    let want = names.driver();
    pods.iter().find(|p| {
        owned_by(job, p)
            && role(p) == Some(ROLE_DRIVER)
            && p.metadata.name.as_deref() == Some(&want)
    })
}

/// Names held by pods that are not this job's (a deleted job's of the same name): no pod of
/// this job can be created under them until they are gone.
fn foreign_names<'a>(job: &ElasticJob, pods: &'a [Pod]) -> BTreeSet<&'a str> {
    pods.iter()
        .filter(|p| !owned_by(job, p))
        .filter_map(|p| p.metadata.name.as_deref())
        .collect()
}

/// The blacklisted host that names worker `w`, if any: its DNS name or pod name, or its IP
/// unless the pod was created after the operator first saw the entry (the IP was recycled).
fn blacklisted_as(
    job: &ElasticJob,
    names: &Names,
    w: &Worker<'_>,
    blacklisted: &[BlacklistedHost],
) -> Option<String> {
    let stable = [names.worker_dns(w.name), w.name.to_string()];
    if let Some(b) = blacklisted.iter().find(|b| stable.contains(&b.host)) {
        return Some(b.host.clone());
    }
    let ip = w.pod.status.as_ref()?.pod_ip.as_deref()?;
    let entry = blacklisted.iter().find(|b| b.host == ip)?;
    let seen = job
        .status
        .as_ref()
        .and_then(|s| s.blacklist_seen.iter().find(|e| is_seen(e, entry)));
    let created = w.pod.metadata.creation_timestamp.as_ref();
    match (seen, created) {
        // Creation times have whole seconds: a pod of the same second counts as newer.
        (Some(seen), Some(created)) if created.0.as_second() >= seen.since.0.as_second() => None,
        _ => Some(entry.host.clone()),
    }
}

/// True when `seen` records the driver's blacklist entry `entry`.
fn is_seen(seen: &BlacklistSeen, entry: &BlacklistedHost) -> bool {
    seen.host == entry.host && seen.until_ms == entry.until_ms
}

pub use crate::driver_fate::{REASON_REPLACING_DRIVER, REASON_RESTARTS_EXHAUSTED};

/// True when the job is over: its driver pod finished, or its status says so.
pub fn finished(job: &ElasticJob, pods: &[Pod]) -> bool {
    Names::of(job).is_ok_and(|names| {
        matches!(
            fate(job, driver_pod(job, &names, pods)),
            DriverFate::Ended { .. }
        )
    })
}

/// What to change so that the job's pods match its spec, given its pods (all pods labelled with
/// the job) and the driver's last status report, if it could be read.
///
/// - Only the job's own pods (its uid in their controller reference) count. While a pod of a
///   deleted job of the same name holds the driver's name, nothing is done; worker indices such
///   pods hold are skipped.
/// - The driver (and its Secret) is created when its pod is missing and the job has not
///   finished. With a state store, a failed driver pod is deleted to be replaced, and a
///   missing one recreated, up to `maxDriverRestarts` replacements (see `fate`); the workers
///   are kept meanwhile.
/// - Worker pods that failed or were evicted, and those whose host the driver blacklisted, are
///   deleted; pods being deleted (a spot preemption) are not counted. A blacklisted pod IP does
///   not count against a pod created after the entry was first seen (a recycled IP).
/// - Live workers are kept at `spec.replicas` clamped to [min, max]: the surplus is deleted
///   (not-Ready first, then the highest index) and the shortfall created with the lowest indices
///   no pod holds and the driver has not blacklisted.
/// - Once the job is over (its driver pod finished and is not replaced, or its status says
///   so), every worker pod is deleted and nothing is created.
///
/// Order: delete or create the driver, then deletions, then creations.
pub fn plan(job: &ElasticJob, pods: &[Pod], driver: Option<&DriverStatus>) -> Vec<Action> {
    let Ok(names) = Names::of(job) else {
        return Vec::new();
    };
    let workers = workers(job, &names, pods);
    let driver_pod = driver_pod(job, &names, pods);
    let foreign = foreign_names(job, pods);
    let mut actions = Vec::new();

    match fate(job, driver_pod) {
        DriverFate::Ended { .. } => {
            for w in workers.iter().filter(|w| !is_deleting(w.pod)) {
                actions.push(Action::DeleteWorker {
                    name: w.name.to_string(),
                    why: DeleteReason::JobFinished,
                });
            }
            return actions;
        }
        DriverFate::Create { .. } => {
            if foreign.contains(names.driver().as_str()) {
                // The deleted job's driver pod is still going away; its name is not free yet.
                return actions;
            }
            actions.push(Action::CreateDriver);
        }
        DriverFate::Replace { state } => actions.push(Action::DeleteDriver { state }),
        DriverFate::Keep => {}
    }

    let entries: &[BlacklistedHost] = driver.map_or(&[], |d| &d.blacklisted);
    let blacklisted: BTreeSet<&str> = entries.iter().map(|b| b.host.as_str()).collect();
    let mut live: Vec<&Worker<'_>> = Vec::new();
    for w in workers.iter().filter(|w| !is_deleting(w.pod)) {
        let phase = phase_of(w.pod);
        if phase == "Failed" || phase == "Succeeded" {
            let reason = w.pod.status.as_ref().and_then(|s| s.reason.as_deref());
            let state = match reason {
                Some(r) => format!("{phase} ({r})"),
                None => phase.to_string(),
            };
            actions.push(Action::DeleteWorker {
                name: w.name.to_string(),
                why: DeleteReason::Failed { state },
            });
        } else if let Some(host) = blacklisted_as(job, &names, w, entries) {
            actions.push(Action::DeleteWorker {
                name: w.name.to_string(),
                why: DeleteReason::Blacklisted { host },
            });
        } else {
            live.push(w);
        }
    }

    let desired = job.spec.desired_workers();
    if live.len() > desired {
        // Not-Ready pods first (they do no work yet), then the newest (highest index).
        live.sort_by_key(|w| (is_ready(w.pod), std::cmp::Reverse(w.index)));
        for w in &live[..live.len() - desired] {
            actions.push(Action::DeleteWorker {
                name: w.name.to_string(),
                why: DeleteReason::ScaleDown,
            });
        }
    } else {
        let taken: BTreeSet<usize> = workers.iter().map(|w| w.index).collect();
        let free = (0..)
            .filter(|i| !taken.contains(i))
            .filter(|i| {
                let name = names.worker(*i);
                !foreign.contains(name.as_str())
                    && !blacklisted.contains(names.worker_dns(&name).as_str())
                    && !blacklisted.contains(name.as_str())
            })
            .take(desired - live.len());
        actions.extend(free.map(|index| Action::CreateWorker { index }));
    }
    actions
}

/// The driver's phase as a job phase; one this build does not know (a newer driver's) counts
/// as Running.
pub(crate) fn driver_phase(s: &DriverStatus) -> Phase {
    match s.phase {
        DriverPhase::Rescaling => Phase::Rescaling,
        DriverPhase::Pending => Phase::Pending,
        DriverPhase::Succeeded => Phase::Succeeded,
        DriverPhase::Failed => Phase::Failed,
        DriverPhase::Running | DriverPhase::Unknown => Phase::Running,
    }
}

fn condition(
    prev: &[Condition],
    type_: &str,
    ok: bool,
    reason: &str,
    message: String,
    generation: Option<i64>,
    now: &Time,
) -> Condition {
    let status = if ok { "True" } else { "False" };
    let since = prev
        .iter()
        .find(|c| c.type_ == type_ && c.status == status)
        .map_or_else(|| now.clone(), |c| c.last_transition_time.clone());
    Condition {
        type_: type_.into(),
        status: status.into(),
        reason: reason.into(),
        message,
        last_transition_time: since,
        observed_generation: generation,
    }
}

/// The status to report after `actions`, at time `now`.
///
/// - `phase`: Succeeded or Failed once the driver pod finished; Pending until the driver has
///   reported; Rescaling while pods are created or deleted or Ready workers differ from the wanted
///   count, or the driver says so; else Running.
/// - `workers`: Ready, live worker pods. `round`, `resets`, `blacklisted`: from the driver, else
///   kept from the last status. `blacklistSeen`: each of the driver's entries with the time it
///   was first seen (`now` for a new one).
/// - Conditions `Ready` (phase is Running), `DriverReachable` and `SpecApplied` (False, naming
///   the fields, while the spec differs from the one the running job's pods are made from);
///   a condition keeps its transition time while its status holds.
pub fn status(
    job: &ElasticJob,
    pods: &[Pod],
    driver: Option<&DriverStatus>,
    actions: &[Action],
    now: &Time,
) -> ElasticJobStatus {
    let prev = job.status.clone().unwrap_or_default();
    let Ok(names) = Names::of(job) else {
        return prev;
    };
    let started = crate::resources::as_started(job, pods);
    let changed = crate::resources::changed_fields(job, &started);
    let job = &started;
    let workers = workers(job, &names, pods);
    let ready = workers
        .iter()
        .filter(|w| !is_deleting(w.pod) && is_ready(w.pod))
        .filter(|w| {
            !actions
                .iter()
                .any(|a| matches!(a, Action::DeleteWorker { name, .. } if name == w.name))
        })
        .count();
    let desired = job.spec.desired_workers();
    let own_driver = driver_pod(job, &names, pods);
    let fate = fate(job, own_driver);
    let ended = match &fate {
        DriverFate::Ended { phase, .. } => Some(*phase),
        _ => None,
    };
    let phase = match (ended, driver) {
        (Some(done), _) => done,
        (None, None) => Phase::Pending,
        (None, Some(d)) if driver_phase(d).is_terminal() => driver_phase(d),
        (None, Some(d)) => {
            let changing = actions
                .iter()
                .any(|a| !matches!(a, Action::CreateDriver | Action::DeleteDriver { .. }));
            if changing || ready != desired {
                Phase::Rescaling
            } else {
                driver_phase(d)
            }
        }
    };
    let generation = job.metadata.generation;
    let (reachable_reason, reachable_msg) = match driver {
        Some(d) => (
            "StatusRead",
            format!("round {}, {} worker processes", d.generation, d.workers),
        ),
        None => (
            "NoStatus",
            "the driver's status endpoint did not answer".to_string(),
        ),
    };
    // A pod of another job (a deleted one of the same name, being removed or orphaned with
    // `--cascade=orphan`) holding the driver's name keeps this job from starting.
    let squatter = driver_pod(job, &names, pods)
        .is_none()
        .then(|| {
            pods.iter()
                .filter(|p| !owned_by(job, p))
                .find(|p| p.metadata.name.as_deref() == Some(names.driver().as_str()))
        })
        .flatten();
    let created = actions.iter().any(|a| matches!(a, Action::CreateDriver));
    let record = driver_record(job, own_driver, &fate, created);
    let (ready_reason, ready_msg) = match squatter {
        Some(p) if p.metadata.deletion_timestamp.is_none() => (
            "DriverNameTaken".to_string(),
            format!(
                "pod {} belongs to another job (a deleted ElasticJob of this name, whose pods \
                 were orphaned) and is not being deleted: delete it to let this job start",
                names.driver()
            ),
        ),
        Some(_) => (
            "DriverNameTaken".to_string(),
            format!(
                "waiting for pod {} of a deleted ElasticJob of this name to go away",
                names.driver()
            ),
        ),
        None => record.note.unwrap_or_else(|| {
            (
                format!("{phase:?}"),
                format!("{ready} of {desired} workers ready"),
            )
        }),
    };
    let conditions = vec![
        condition(
            &prev.conditions,
            "Ready",
            phase == Phase::Running,
            &ready_reason,
            ready_msg,
            generation,
            now,
        ),
        condition(
            &prev.conditions,
            "DriverReachable",
            driver.is_some(),
            reachable_reason,
            reachable_msg,
            generation,
            now,
        ),
        if changed.is_empty() {
            condition(
                &prev.conditions,
                "SpecApplied",
                true,
                "Current",
                "the job's pods are made from its current spec".into(),
                generation,
                now,
            )
        } else {
            let fields: Vec<String> = changed.iter().map(|f| format!("spec.{f}")).collect();
            condition(
                &prev.conditions,
                "SpecApplied",
                false,
                "ChangedWhileRunning",
                format!(
                    "{} changed after the job started; its pods keep being made from the spec \
                     it started with (only spec.replicas applies to a running job): delete and \
                     recreate the job to apply the change",
                    fields.join(", ")
                ),
                generation,
                now,
            )
        },
    ];
    ElasticJobStatus {
        phase,
        workers: i32::try_from(ready).unwrap_or(i32::MAX),
        round: driver.map_or(prev.round, |d| d.generation),
        resets: driver.map_or(prev.resets, |d| d.resets),
        blacklisted: driver.map_or(prev.blacklisted, |d| {
            d.blacklisted.iter().map(|b| b.host.clone()).collect()
        }),
        blacklist_seen: driver.map_or(prev.blacklist_seen.clone(), |d| {
            d.blacklisted
                .iter()
                .map(|b| {
                    prev.blacklist_seen
                        .iter()
                        .find(|e| is_seen(e, b))
                        .cloned()
                        .unwrap_or_else(|| BlacklistSeen {
                            host: b.host.clone(),
                            until_ms: b.until_ms,
                            since: now.clone(),
                        })
                })
                .collect()
        }),
        conditions,
        selector: Some(names.worker_selector()),
        observed_generation: generation,
        driver_restarts: record.restarts,
        driver_uid: record.uid,
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use crate::driver_status::BlacklistedHost;
    use crate::fixtures::{deleting, driver, in_phase, job, worker};

    fn now() -> Time {
        Time(k8s_openapi::jiff::Timestamp::from_second(1_000).unwrap())
    }

    fn st(blacklisted: &[&str]) -> DriverStatus {
        DriverStatus {
            phase: DriverPhase::Running,
            generation: 7,
            workers: 4,
            blacklisted: blacklisted
                .iter()
                .map(|h| BlacklistedHost {
                    host: h.to_string(),
                    until_ms: Some(5),
                })
                .collect(),
            resets: 2,
            ..Default::default()
        }
    }

    fn creates(actions: &[Action]) -> Vec<usize> {
        actions
            .iter()
            .filter_map(|a| match a {
                Action::CreateWorker { index } => Some(*index),
                _ => None,
            })
            .collect()
    }

    fn deletes(actions: &[Action]) -> Vec<(&str, &DeleteReason)> {
        actions
            .iter()
            .filter_map(|a| match a {
                Action::DeleteWorker { name, why } => Some((name.as_str(), why)),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn new_job_gets_a_driver_and_max_workers() {
        let j = job("t", 2, 3);
        let a = plan(&j, &[], None);
        assert_eq!(a[0], Action::CreateDriver);
        assert_eq!(creates(&a), [0, 1, 2]);
    }

    #[test]
    fn steady_job_needs_nothing() {
        let j = job("t", 1, 2);
        let pods = [
            driver(&j, "10.0.0.100"),
            worker(&j, 0, "10.0.0.1"),
            worker(&j, 1, "10.0.0.2"),
        ];
        assert!(plan(&j, &pods, Some(&st(&[]))).is_empty());
        let s = status(&j, &pods, Some(&st(&[])), &[], &now());
        assert_eq!(s.phase, Phase::Running);
        assert_eq!(s.workers, 2);
        assert_eq!((s.round, s.resets), (7, 2));
        assert_eq!(
            s.selector.as_deref(),
            Some("hvd.dev/job=t,hvd.dev/role=worker")
        );
        assert_eq!(s.conditions[0].status, "True");
    }

    #[test]
    fn scale_down_removes_not_ready_then_highest_index() {
        let mut j = job("t", 1, 4);
        j.spec.replicas = Some(2);
        let pods = [
            driver(&j, "10.0.0.100"),
            worker(&j, 0, "10.0.0.1"),
            in_phase(worker(&j, 1, "10.0.0.2"), "Pending", None),
            worker(&j, 2, "10.0.0.3"),
            worker(&j, 3, "10.0.0.4"),
        ];
        let a = plan(&j, &pods, Some(&st(&[])));
        let d = deletes(&a);
        assert_eq!(
            d.iter().map(|x| x.0).collect::<Vec<_>>(),
            ["t-worker-1", "t-worker-3"]
        );
        assert!(d.iter().all(|x| *x.1 == DeleteReason::ScaleDown));
        assert!(creates(&a).is_empty());
        let s = status(&j, &pods, Some(&st(&[])), &a, &now());
        assert_eq!(s.phase, Phase::Rescaling);
        assert_eq!(s.workers, 2, "pods being removed are not counted");
    }

    #[test]
    fn scale_up_fills_the_lowest_free_indices() {
        let mut j = job("t", 1, 4);
        j.spec.replicas = Some(4);
        let pods = [driver(&j, "10.0.0.100"), worker(&j, 1, "10.0.0.2")];
        assert_eq!(creates(&plan(&j, &pods, None)), [0, 2, 3]);
    }

    #[test]
    fn failed_and_evicted_pods_are_replaced_under_new_names() {
        let j = job("t", 1, 2);
        let pods = [
            driver(&j, "10.0.0.100"),
            in_phase(worker(&j, 0, "10.0.0.1"), "Failed", Some("Evicted")),
            worker(&j, 1, "10.0.0.2"),
        ];
        let a = plan(&j, &pods, None);
        let d = deletes(&a);
        assert_eq!(d.len(), 1);
        assert_eq!(d[0].0, "t-worker-0");
        assert_eq!(
            *d[0].1,
            DeleteReason::Failed {
                state: "Failed (Evicted)".into()
            }
        );
        assert_eq!(creates(&a), [2], "index 0 is still held by the failed pod");
    }

    #[test]
    fn replacements_never_exceed_max() {
        let mut j = job("t", 1, 2);
        j.spec.replicas = Some(9);
        let pods = [
            driver(&j, "10.0.0.100"),
            in_phase(worker(&j, 0, "10.0.0.1"), "Failed", None),
            in_phase(worker(&j, 1, "10.0.0.2"), "Failed", None),
            in_phase(worker(&j, 2, "10.0.0.3"), "Failed", None),
        ];
        let a = plan(&j, &pods, None);
        assert_eq!(deletes(&a).len(), 3);
        assert_eq!(creates(&a), [3, 4]);
    }

    #[test]
    fn blacklisted_hosts_lose_their_pods_by_dns_name_or_ip() {
        let j = job("t", 1, 3);
        let pods = [
            driver(&j, "10.0.0.100"),
            worker(&j, 0, "10.0.0.1"),
            worker(&j, 1, "10.0.0.2"),
            worker(&j, 2, "10.0.0.3"),
        ];
        let a = plan(
            &j,
            &pods,
            Some(&st(&["t-worker-1.t-workers.ml.svc", "10.0.0.3"])),
        );
        let d = deletes(&a);
        assert_eq!(d.len(), 2);
        assert_eq!(d[0].0, "t-worker-1");
        assert_eq!(
            *d[0].1,
            DeleteReason::Blacklisted {
                host: "t-worker-1.t-workers.ml.svc".into()
            }
        );
        assert_eq!(d[1].0, "t-worker-2");
        assert_eq!(creates(&a), [3, 4]);
    }

    #[test]
    fn a_blacklisted_name_is_not_reused_for_a_new_pod() {
        let j = job("t", 1, 2);
        // worker-0 is gone already; its DNS name is still blacklisted.
        let pods = [driver(&j, "10.0.0.100"), worker(&j, 1, "10.0.0.2")];
        let a = plan(&j, &pods, Some(&st(&["t-worker-0.t-workers.ml.svc"])));
        assert_eq!(creates(&a), [2]);
    }

    #[test]
    fn spot_pod_being_deleted_is_replaced_at_once() {
        let j = job("t", 1, 2);
        let pods = [
            driver(&j, "10.0.0.100"),
            deleting(worker(&j, 0, "10.0.0.1")),
            worker(&j, 1, "10.0.0.2"),
        ];
        let a = plan(&j, &pods, Some(&st(&[])));
        assert!(
            deletes(&a).is_empty(),
            "no second delete for a pod already going"
        );
        assert_eq!(creates(&a), [2]);
        let s = status(&j, &pods, Some(&st(&[])), &a, &now());
        assert_eq!(s.workers, 1);
        assert_eq!(s.phase, Phase::Rescaling);
    }

    #[test]
    fn finished_driver_ends_the_job_and_removes_workers() {
        let j = job("t", 1, 2);
        for (pod_phase, job_phase) in [("Succeeded", Phase::Succeeded), ("Failed", Phase::Failed)] {
            let pods = [
                in_phase(driver(&j, "10.0.0.100"), pod_phase, None),
                worker(&j, 0, "10.0.0.1"),
                deleting(worker(&j, 1, "10.0.0.2")),
            ];
            let a = plan(&j, &pods, None);
            assert_eq!(
                a,
                [Action::DeleteWorker {
                    name: "t-worker-0".into(),
                    why: DeleteReason::JobFinished
                }]
            );
            assert_eq!(status(&j, &pods, None, &a, &now()).phase, job_phase);
        }
    }

    #[test]
    fn finished_job_is_not_restarted_when_its_driver_pod_is_gone() {
        let mut j = job("t", 1, 2);
        j.status = Some(ElasticJobStatus {
            phase: Phase::Succeeded,
            ..Default::default()
        });
        assert!(plan(&j, &[], None).is_empty());
        assert_eq!(status(&j, &[], None, &[], &now()).phase, Phase::Succeeded);
    }

    #[test]
    fn lost_driver_pod_is_recreated_while_the_job_runs() {
        let j = job("t", 1, 1);
        let pods = [worker(&j, 0, "10.0.0.1")];
        assert_eq!(plan(&j, &pods, None), [Action::CreateDriver]);
    }

    #[test]
    fn pending_until_the_driver_reports_and_transition_time_is_kept() {
        let j = job("t", 1, 1);
        let pods = [driver(&j, "10.0.0.100"), worker(&j, 0, "10.0.0.1")];
        let s = status(&j, &pods, None, &[], &now());
        assert_eq!(s.phase, Phase::Pending);
        assert_eq!(s.conditions[1].type_, "DriverReachable");
        assert_eq!(s.conditions[1].status, "False");

        let mut j2 = j.clone();
        j2.status = Some(status(&j, &pods, Some(&st(&[])), &[], &now()));
        let later = Time(k8s_openapi::jiff::Timestamp::from_second(2_000).unwrap());
        let s2 = status(&j2, &pods, Some(&st(&[])), &[], &later);
        assert_eq!(
            s2.conditions[0].last_transition_time,
            now(),
            "Ready stayed True"
        );
        let s3 = status(&j2, &pods, None, &[], &later);
        assert_eq!(
            s3.conditions[1].last_transition_time, later,
            "DriverReachable changed"
        );
        assert_eq!(s3.round, 7, "the last known round is kept");
    }

    fn deleted(actions: Vec<Action>) -> Vec<String> {
        deletes(&actions)
            .into_iter()
            .map(|(name, _)| name.to_string())
            .collect()
    }

    /// `p` as a pod of a deleted job of the same name (another uid).
    fn of_old_job(mut p: Pod) -> Pod {
        for r in p.metadata.owner_references.as_mut().unwrap() {
            r.uid = "uid-deleted".into();
        }
        p
    }

    fn at(second: i64) -> Time {
        Time(k8s_openapi::jiff::Timestamp::from_second(second).unwrap())
    }

    fn created(mut p: Pod, second: i64) -> Pod {
        p.metadata.creation_timestamp = Some(at(second));
        p
    }

    #[test]
    fn pods_of_a_deleted_job_of_the_same_name_are_not_this_jobs() {
        let j = job("t", 1, 2);
        // The old job's finished driver is still being removed: it neither ends the new job nor
        // lets a driver be created under its name.
        let old_driver = of_old_job(deleting(in_phase(
            driver(&j, "10.0.0.100"),
            "Succeeded",
            None,
        )));
        let old_worker = of_old_job(deleting(worker(&j, 0, "10.0.0.1")));
        let pods = [old_driver, old_worker.clone()];
        assert!(plan(&j, &pods, None).is_empty(), "wait for the old driver");
        assert!(!finished(&j, &pods));
        assert_eq!(status(&j, &pods, None, &[], &now()).phase, Phase::Pending);

        // Once it is gone, the job starts; the old worker's index stays untouched.
        let a = plan(&j, std::slice::from_ref(&old_worker), None);
        assert_eq!(a[0], Action::CreateDriver);
        assert_eq!(creates(&a), [1, 2]);
        assert!(deletes(&a).is_empty(), "not this job's pod to delete");
        let s = status(&j, &[old_worker], None, &a, &now());
        assert_eq!(s.workers, 0);
    }

    #[test]
    fn a_recycled_ip_does_not_remove_a_newer_pod() {
        let mut j = job("t", 1, 3);
        j.spec.discovery.dns = false;
        j.status = Some(ElasticJobStatus {
            blacklist_seen: vec![BlacklistSeen {
                host: "10.0.0.2".into(),
                until_ms: Some(5),
                since: at(1_000),
            }],
            ..Default::default()
        });
        let pods = [
            driver(&j, "10.0.0.100"),
            worker(&j, 0, "10.0.0.1"),
            // Created after the entry was first seen: it got the blacklisted pod's old IP.
            created(worker(&j, 1, "10.0.0.2"), 1_000),
            // Not seen before: every pod there is older than the entry.
            created(worker(&j, 2, "10.0.0.3"), 1_500),
        ];
        let d = deleted(plan(&j, &pods, Some(&st(&["10.0.0.2", "10.0.0.3"]))));
        assert_eq!(d, ["t-worker-2"]);

        // The pod that held the IP when it was blacklisted goes.
        let old = [
            driver(&j, "10.0.0.100"),
            created(worker(&j, 1, "10.0.0.2"), 999),
        ];
        let d = deleted(plan(&j, &old, Some(&st(&["10.0.0.2"]))));
        assert_eq!(d, ["t-worker-1"]);

        // A new cooldown end is a new failure: the entry is new again.
        let mut again = st(&["10.0.0.2"]);
        again.blacklisted[0].until_ms = Some(9);
        let d = deleted(plan(&j, &pods, Some(&again)));
        assert_eq!(d, ["t-worker-1"]);
    }

    #[test]
    fn blacklist_entries_keep_the_time_they_were_first_seen() {
        let mut j = job("t", 1, 1);
        let pods = [driver(&j, "10.0.0.100"), worker(&j, 0, "10.0.0.1")];
        let s1 = status(&j, &pods, Some(&st(&["10.0.0.9"])), &[], &at(1_000));
        assert_eq!(s1.blacklist_seen.len(), 1);
        assert_eq!(s1.blacklist_seen[0].since, at(1_000));
        j.status = Some(s1);
        let s2 = status(
            &j,
            &pods,
            Some(&st(&["10.0.0.9", "10.0.0.8"])),
            &[],
            &at(2_000),
        );
        let since: Vec<_> = s2
            .blacklist_seen
            .iter()
            .map(|e| (e.host.as_str(), e.since.clone()))
            .collect();
        assert_eq!(since, [("10.0.0.9", at(1_000)), ("10.0.0.8", at(2_000))]);
        j.status = Some(s2);
        let s3 = status(&j, &pods, None, &[], &at(3_000));
        assert_eq!(
            s3.blacklist_seen.len(),
            2,
            "kept while the driver is silent"
        );
        let s4 = status(&j, &pods, Some(&st(&[])), &[], &at(3_000));
        assert!(s4.blacklist_seen.is_empty(), "dropped with the entries");
    }

    #[test]
    fn driver_phase_names_map_to_job_phases() {
        let j = job("t", 1, 1);
        let pods = [driver(&j, "10.0.0.100"), worker(&j, 0, "10.0.0.1")];
        let mut d = st(&[]);
        for (name, phase) in [
            ("Rescaling", Phase::Rescaling),
            ("Pending", Phase::Pending),
            ("Running", Phase::Running),
            ("Succeeded", Phase::Succeeded),
            ("Failed", Phase::Failed),
            ("SomethingNew", Phase::Running),
        ] {
            // As the driver writes it, read as the operator reads it.
            let body = format!("{{\"phase\":\"{name}\"}}");
            d.phase = serde_json::from_str::<DriverStatus>(&body)
                .map(|s| s.phase)
                .unwrap_or_else(|e| panic!("{body}: {e}"));
            assert_eq!(
                status(&j, &pods, Some(&d), &[], &now()).phase,
                phase,
                "{name}"
            );
        }
    }

    /// An edit of a running job's spec is reported, naming the fields, and does not change what
    /// the job's pods are made from: a scale-up beyond the old bounds is clamped to them.
    #[test]
    fn a_spec_edited_while_running_is_reported_and_not_applied() {
        let j = job("t", 1, 2);
        let pods = [
            driver(&j, "10.0.0.100"),
            worker(&j, 0, "10.0.0.1"),
            worker(&j, 1, "10.0.0.2"),
        ];
        let spec_applied = |job: &ElasticJob| {
            let s = status(job, &pods, Some(&st(&[])), &[], &now());
            let c = s.conditions.into_iter().find(|c| c.type_ == "SpecApplied");
            (s.phase, c.unwrap())
        };
        let (_, applied) = spec_applied(&j);
        assert_eq!(
            (applied.status.as_str(), applied.reason.as_str()),
            ("True", "Current")
        );

        let mut edited = j.clone();
        edited.spec.image = "hvd:next".into();
        edited.spec.max_replicas = 5;
        edited.spec.replicas = Some(4);
        edited.spec.env.clear();
        let (phase, applied) = spec_applied(&edited);
        assert_eq!(
            (applied.status.as_str(), applied.reason.as_str()),
            ("False", "ChangedWhileRunning")
        );
        assert!(
            applied.message.starts_with(
                "spec.env, spec.image, spec.maxReplicas changed after the job started"
            ),
            "{}",
            applied.message
        );
        // The job started with at most 2 workers: replicas 4 is clamped to them, so the job
        // is steady and nothing is created.
        let started = crate::resources::as_started(&edited, &pods);
        assert!(plan(&started, &pods, Some(&st(&[]))).is_empty());
        assert_eq!(phase, Phase::Running);
    }

    /// A pod of a deleted job of the same name holding the driver's name is named in the Ready
    /// condition: as going away while it is deleted, as needing a delete when orphaned.
    #[test]
    fn a_pod_holding_the_drivers_name_is_named() {
        let j = job("t", 1, 1);
        let mut old = driver(&j, "10.0.0.100");
        for r in old.metadata.owner_references.as_mut().unwrap() {
            r.uid = "uid-deleted".into();
        }
        let ready = |pods: &[Pod]| {
            let s = status(&j, pods, None, &[], &now());
            s.conditions
                .into_iter()
                .find(|c| c.type_ == "Ready")
                .unwrap()
        };
        let orphaned = ready(std::slice::from_ref(&old));
        assert_eq!(orphaned.reason, "DriverNameTaken");
        assert!(
            orphaned.message.contains("is not being deleted: delete it"),
            "{}",
            orphaned.message
        );
        assert!(plan(&j, std::slice::from_ref(&old), None).is_empty());
        let going = ready(&[deleting(old)]);
        assert!(
            going.message.starts_with("waiting for pod t-driver"),
            "{}",
            going.message
        );
        assert_eq!(ready(&[]).reason, "Pending");
    }
}
