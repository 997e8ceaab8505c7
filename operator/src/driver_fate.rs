//! What becomes of a job's driver pod ([`fate`]): kept, created, replaced after a loss (jobs
//! with a state store), or the end of the job. A pure function of the job and its driver pod,
//! used by [`plan`](crate::plan::plan) and [`status`](crate::plan::status).

use k8s_openapi::api::core::v1::{ContainerStateTerminated, Pod};

use crate::crd::{ElasticJob, Phase};
use crate::driver_status::DriverStatus;
use crate::plan::{driver_phase, is_deleting, phase_of};
use crate::resources::DRIVER_CONTAINER;

/// Ready-condition reason of a job failed because its driver was lost too often.
pub const REASON_RESTARTS_EXHAUSTED: &str = "DriverRestartsExhausted";
/// Ready-condition reason while a lost driver pod is being replaced.
pub const REASON_REPLACING_DRIVER: &str = "ReplacingDriver";

/// What becomes of the job's driver pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum DriverFate {
    /// Running, starting, or going away: nothing to do.
    Keep,
    /// There is none: create one. `lost` when one existed before (a replacement).
    Create {
        /// A driver pod of this job existed before (jobs with a state store only).
        lost: bool,
    },
    /// A job with a state store lost its driver pod to a failure: delete it, so that its
    /// successor can be created under its name.
    Replace {
        /// How it failed.
        state: String,
    },
    /// The job is over.
    Ended {
        /// Succeeded or Failed.
        phase: Phase,
        /// Why, when the operator ended it (too many lost drivers).
        why: Option<String>,
    },
}

/// The terminated state of the driver container, if it ended.
fn driver_terminated(pod: &Pod) -> Option<&ContainerStateTerminated> {
    pod.status
        .as_ref()?
        .container_statuses
        .as_ref()?
        .iter()
        .find(|c| c.name == DRIVER_CONTAINER)?
        .state
        .as_ref()?
        .terminated
        .as_ref()
}

/// How a failed driver pod failed: its phase with the pod's reason (`Evicted`), or the
/// container's exit code and reason (`exit 137, OOMKilled`).
fn failure(pod: &Pod) -> String {
    let phase = phase_of(pod);
    let pod_reason = pod.status.as_ref().and_then(|s| s.reason.as_deref());
    let detail = match (pod_reason, driver_terminated(pod)) {
        (Some(r), _) => Some(r.to_string()),
        (None, Some(t)) => Some(match t.reason.as_deref() {
            Some(r) => format!("exit {}, {r}", t.exit_code),
            None => format!("exit {}", t.exit_code),
        }),
        (None, None) => None,
    };
    match detail {
        Some(d) => format!("{phase} ({d})"),
        None => phase.to_string(),
    }
}

/// True when the driver's termination message is a status report (`GET /status`'s JSON)
/// whose phase says the job ended: the driver ended the job, it was not lost.
fn ended_by_driver(pod: &Pod) -> bool {
    driver_terminated(pod)
        .and_then(|t| t.message.as_deref())
        .and_then(|m| serde_json::from_str::<DriverStatus>(m.trim()).ok())
        .is_some_and(|s| driver_phase(&s).is_terminal())
}

/// Why the job fails when its driver is lost once more than `spec.stateStore.maxDriverRestarts`.
fn exhausted(state: &str, restarts: u32) -> String {
    format!(
        "the driver pod {state} after {restarts} replacements, the most \
         spec.stateStore.maxDriverRestarts allows: the job failed"
    )
}

/// What becomes of the driver pod `pod` of `job` (none when it is missing).
///
/// - Succeeded: the job succeeded. Without a state store, Failed: the job failed.
/// - With a state store, a Failed pod (evicted, OOM-killed, crashed, stepped down) is
///   replaced unless the job's status, or the driver's termination message, already said
///   the job ended (then the job failed); a missing pod is recreated. Each replacement of a
///   pod that existed counts in `status.driverRestarts`; a loss beyond
///   `maxDriverRestarts` fails the job.
/// - Otherwise the job's recorded terminal phase, if any, stands.
pub(crate) fn fate(job: &ElasticJob, pod: Option<&Pod>) -> DriverFate {
    let status = job.status.as_ref();
    let recorded = status.map(|s| s.phase).filter(|p| p.is_terminal());
    let store = job.spec.state_store.as_ref();
    let restarts = status.map_or(0, |s| s.driver_restarts);
    let exhausted_at = store.map(|s| s.max_driver_restarts);
    let Some(pod) = pod else {
        if let Some(phase) = recorded {
            return DriverFate::Ended { phase, why: None };
        }
        let lost = store.is_some() && status.is_some_and(|s| s.driver_uid.is_some());
        if lost && exhausted_at.is_some_and(|max| restarts >= max) {
            return DriverFate::Ended {
                phase: Phase::Failed,
                why: Some(exhausted("was deleted", restarts)),
            };
        }
        return DriverFate::Create { lost };
    };
    match phase_of(pod) {
        "Succeeded" => DriverFate::Ended {
            phase: Phase::Succeeded,
            why: None,
        },
        "Failed" => match exhausted_at {
            None => DriverFate::Ended {
                phase: Phase::Failed,
                why: None,
            },
            Some(_) if recorded.is_some() || ended_by_driver(pod) => DriverFate::Ended {
                phase: Phase::Failed,
                why: None,
            },
            Some(max) if restarts >= max => DriverFate::Ended {
                phase: Phase::Failed,
                why: Some(exhausted(&format!("ended {}", failure(pod)), restarts)),
            },
            Some(_) if is_deleting(pod) => DriverFate::Keep,
            Some(_) => DriverFate::Replace {
                state: failure(pod),
            },
        },
        _ => match recorded {
            Some(phase) => DriverFate::Ended { phase, why: None },
            None => DriverFate::Keep,
        },
    }
}

/// The driver's part of a job's status.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct DriverRecord {
    /// Lost driver pods replaced so far (`status.driverRestarts`).
    pub restarts: u32,
    /// The uid of the driver pod last seen (`status.driverUid`).
    pub uid: Option<String>,
    /// The Ready condition's reason and message, when the driver's fate sets them.
    pub note: Option<(String, String)>,
}

/// The driver's part of `job`'s status, given its driver pod `pod`, its `fate`, and whether
/// this reconcile creates a driver pod (`created`). Only jobs with a state store count
/// replacements: a driver pod created while one was seen before (the uid is still recorded)
/// is one, and clears the uid until the new pod is seen. A job failed for too many
/// replacements keeps saying why.
pub(crate) fn driver_record(
    job: &ElasticJob,
    pod: Option<&Pod>,
    fate: &DriverFate,
    created: bool,
) -> DriverRecord {
    let prev = job.status.clone().unwrap_or_default();
    let Some(store) = job.spec.state_store.as_ref() else {
        return DriverRecord {
            restarts: prev.driver_restarts,
            uid: None,
            note: None,
        };
    };
    let replaced = created && prev.driver_uid.is_some();
    let restarts = prev.driver_restarts + u32::from(replaced);
    let uid = match pod {
        // Every pod from the API server has a uid; the name stands in for one without.
        Some(p) => p.metadata.uid.clone().or_else(|| p.metadata.name.clone()),
        None if replaced => None,
        None => prev.driver_uid.clone(),
    };
    let max = store.max_driver_restarts;
    let replacing = |what: &str| {
        Some((
            REASON_REPLACING_DRIVER.to_string(),
            format!(
                "{what}: replacing it ({restarts} replacements so far, at most {max}); the \
                 workers train on"
            ),
        ))
    };
    let note = match fate {
        DriverFate::Ended { why: Some(why), .. } => {
            Some((REASON_RESTARTS_EXHAUSTED.to_string(), why.clone()))
        }
        DriverFate::Ended {
            phase: Phase::Failed,
            why: None,
        } => prev
            .conditions
            .iter()
            .find(|c| c.type_ == "Ready" && c.reason == REASON_RESTARTS_EXHAUSTED)
            .map(|c| (c.reason.clone(), c.message.clone())),
        DriverFate::Replace { state } => replacing(&format!("the driver pod ended {state}")),
        DriverFate::Create { lost: true } => replacing("the driver pod was lost"),
        _ => None,
    };
    DriverRecord {
        restarts,
        uid,
        note,
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

    use super::*;
    use crate::crd::ElasticJobStatus;
    use crate::driver_status::DriverStatus;
    use crate::fixtures::{deleting, driver, exited, in_phase, job, with_store, with_uid, worker};
    use crate::plan::{Action, DeleteReason, plan, status};

    fn now() -> Time {
        Time(k8s_openapi::jiff::Timestamp::from_second(1_000).unwrap())
    }

    /// A job with a state store (at most `max` replacements) whose status says the driver pod
    /// `uid` was seen and `restarts` replacements were made.
    fn seen(max: u32, restarts: u32, uid: &str) -> ElasticJob {
        let mut j = with_store(job("t", 1, 2), max);
        j.status = Some(ElasticJobStatus {
            phase: crate::crd::Phase::Running,
            driver_restarts: restarts,
            driver_uid: Some(uid.into()),
            ..Default::default()
        });
        j
    }

    fn workers(j: &ElasticJob) -> Vec<Pod> {
        vec![worker(j, 0, "10.0.0.1"), worker(j, 1, "10.0.0.2")]
    }

    fn with_driver(j: &ElasticJob, d: Pod) -> Vec<Pod> {
        let mut pods = workers(j);
        pods.insert(0, d);
        pods
    }

    fn ready(s: &ElasticJobStatus) -> (String, String) {
        let c = s.conditions.iter().find(|c| c.type_ == "Ready").unwrap();
        (c.reason.clone(), c.message.clone())
    }

    fn no_worker_deleted(actions: &[Action]) {
        assert!(
            !actions
                .iter()
                .any(|a| matches!(a, Action::DeleteWorker { .. })),
            "workers must outlive a lost driver: {actions:?}"
        );
    }

    #[test]
    fn a_deleted_driver_is_recreated_and_counted_once() {
        let j = seen(5, 1, "uid-d1");
        let pods = workers(&j);
        let a = plan(&j, &pods, None);
        assert_eq!(a, [Action::CreateDriver]);
        let s = status(&j, &pods, None, &a, &now());
        assert_eq!(s.driver_restarts, 2);
        assert_eq!(
            s.driver_uid, None,
            "counted: the next create is not a second loss"
        );
        assert!(!s.phase.is_terminal());
        let (reason, msg) = ready(&s);
        assert_eq!(reason, REASON_REPLACING_DRIVER);
        assert!(
            msg.contains("was lost") && msg.contains("2 replacements so far, at most 5"),
            "{msg}"
        );

        // The next reconcile sees the new pod: no second count, its uid recorded.
        let mut j2 = j.clone();
        j2.status = Some(s);
        let pods = with_driver(&j2, with_uid(driver(&j2, "10.0.0.9"), "uid-d2"));
        let a = plan(&j2, &pods, None);
        assert!(a.is_empty(), "{a:?}");
        let s = status(&j2, &pods, None, &a, &now());
        assert_eq!(
            (s.driver_restarts, s.driver_uid.as_deref()),
            (2, Some("uid-d2"))
        );
    }

    #[test]
    fn an_evicted_driver_is_deleted_to_be_replaced_and_workers_stay() {
        let j = seen(5, 0, "uid-d1");
        let pods = with_driver(
            &j,
            in_phase(driver(&j, "10.0.0.9"), "Failed", Some("Evicted")),
        );
        let a = plan(&j, &pods, None);
        assert_eq!(
            a,
            [Action::DeleteDriver {
                state: "Failed (Evicted)".into()
            }]
        );
        no_worker_deleted(&a);
        let s = status(&j, &pods, None, &a, &now());
        assert!(!s.phase.is_terminal(), "{:?}", s.phase);
        assert_eq!(s.driver_restarts, 0, "counted when the new pod is created");
        let (reason, msg) = ready(&s);
        assert_eq!(reason, REASON_REPLACING_DRIVER);
        assert!(msg.contains("Failed (Evicted)"), "{msg}");
    }

    #[test]
    fn an_oom_killed_driver_is_replaced() {
        let j = seen(5, 0, "uid-d1");
        let oom = exited(driver(&j, "10.0.0.9"), 137, Some("OOMKilled"), None);
        let pods = with_driver(&j, oom);
        let a = plan(&j, &pods, None);
        assert_eq!(
            a,
            [Action::DeleteDriver {
                state: "Failed (exit 137, OOMKilled)".into()
            }]
        );
        // A driver that stepped down (its lease lost) is replaced too.
        let pods = with_driver(&j, exited(driver(&j, "10.0.0.9"), 75, Some("Error"), None));
        assert_eq!(
            plan(&j, &pods, None),
            [Action::DeleteDriver {
                state: "Failed (exit 75, Error)".into()
            }]
        );
    }

    #[test]
    fn a_failed_driver_being_deleted_is_waited_for() {
        let j = seen(5, 0, "uid-d1");
        let pods = with_driver(
            &j,
            deleting(in_phase(driver(&j, "10.0.0.9"), "Failed", None)),
        );
        assert!(plan(&j, &pods, None).is_empty());
    }

    #[test]
    fn a_driver_failing_after_a_terminal_status_ends_the_job() {
        let mut j = seen(5, 0, "uid-d1");
        j.status.as_mut().unwrap().phase = crate::crd::Phase::Failed;
        let pods = with_driver(&j, exited(driver(&j, "10.0.0.9"), 1, Some("Error"), None));
        let a = plan(&j, &pods, None);
        assert_eq!(a.len(), 2);
        assert!(a.iter().all(|a| matches!(
            a,
            Action::DeleteWorker {
                why: DeleteReason::JobFinished,
                ..
            }
        )));
        assert_eq!(status(&j, &pods, None, &a, &now()).phase, Phase::Failed);
    }

    #[test]
    fn a_driver_whose_termination_message_says_the_job_ended_is_not_replaced() {
        let j = seen(5, 0, "uid-d1");
        let msg = r#"{"phase":"Failed","generation":3}"#;
        let pods = with_driver(
            &j,
            exited(driver(&j, "10.0.0.9"), 1, Some("Error"), Some(msg)),
        );
        let a = plan(&j, &pods, None);
        assert!(
            a.iter().all(|a| matches!(a, Action::DeleteWorker { .. })),
            "{a:?}"
        );
        assert_eq!(status(&j, &pods, None, &a, &now()).phase, Phase::Failed);
        // A message that is no status report (a panic's last words) is a loss.
        let pods = with_driver(
            &j,
            exited(driver(&j, "10.0.0.9"), 101, None, Some("panicked")),
        );
        assert_eq!(
            plan(&j, &pods, None),
            [Action::DeleteDriver {
                state: "Failed (exit 101)".into()
            }]
        );
    }

    #[test]
    fn the_restart_cap_fails_the_job_and_says_why() {
        // The driver pod failed once more than allowed: the job fails, the pod stays for its
        // logs, the workers go.
        let j = seen(2, 2, "uid-d3");
        let pods = with_driver(
            &j,
            exited(driver(&j, "10.0.0.9"), 137, Some("OOMKilled"), None),
        );
        let a = plan(&j, &pods, None);
        assert_eq!(a.len(), 2, "{a:?}");
        assert!(a.iter().all(|a| matches!(a, Action::DeleteWorker { .. })));
        let s = status(&j, &pods, None, &a, &now());
        assert_eq!(s.phase, Phase::Failed);
        let (reason, msg) = ready(&s);
        assert_eq!(reason, REASON_RESTARTS_EXHAUSTED);
        assert!(
            msg.contains("exit 137, OOMKilled")
                && msg.contains("after 2 replacements")
                && msg.contains("maxDriverRestarts"),
            "{msg}"
        );
        // Later reconciles keep the reason.
        let mut j2 = j.clone();
        j2.status = Some(s);
        let s2 = status(&j2, &pods, None, &[], &now());
        assert_eq!(ready(&s2), (reason, msg));

        // A deleted driver beyond the cap: the same, and no new driver.
        let j = seen(0, 0, "uid-d1");
        let a = plan(&j, &workers(&j), None);
        assert!(!a.contains(&Action::CreateDriver), "{a:?}");
        let s = status(&j, &workers(&j), None, &a, &now());
        assert_eq!(s.phase, Phase::Failed);
        assert!(ready(&s).1.contains("was deleted"), "{:?}", ready(&s));
    }

    #[test]
    fn the_first_driver_of_a_job_is_no_replacement() {
        let j = with_store(job("t", 1, 2), 5);
        let a = plan(&j, &[], None);
        assert_eq!(a[0], Action::CreateDriver);
        let s = status(&j, &[], None, &a, &now());
        assert_eq!((s.driver_restarts, s.driver_uid.as_deref()), (0, None));
        assert_eq!(ready(&s).0, "Pending");
    }

    #[test]
    fn a_succeeded_driver_ends_a_job_with_a_store() {
        let j = seen(5, 0, "uid-d1");
        let pods = with_driver(&j, in_phase(driver(&j, "10.0.0.9"), "Succeeded", None));
        let a = plan(&j, &pods, None);
        assert!(a.iter().all(|a| matches!(a, Action::DeleteWorker { .. })));
        assert_eq!(status(&j, &pods, None, &a, &now()).phase, Phase::Succeeded);
    }

    #[test]
    fn without_a_store_a_failed_driver_fails_the_job() {
        let j = job("t", 1, 2);
        let oom = exited(driver(&j, "10.0.0.9"), 137, Some("OOMKilled"), None);
        assert_eq!(
            fate(&j, Some(&oom)),
            DriverFate::Ended {
                phase: Phase::Failed,
                why: None
            }
        );
        let s = status(&j, &with_driver(&j, oom), None, &[], &now());
        assert_eq!((s.driver_restarts, s.driver_uid), (0, None));
    }

    #[test]
    fn a_running_driver_with_a_terminal_report_ends_the_job() {
        let j = seen(5, 0, "uid-d1");
        let d = driver(&j, "10.0.0.9");
        assert_eq!(fate(&j, Some(&d)), DriverFate::Keep);
        let report = DriverStatus {
            phase: hvd_serve::status::DriverPhase::Succeeded,
            ..Default::default()
        };
        let s = status(&j, &with_driver(&j, d), Some(&report), &[], &now());
        assert_eq!(s.phase, Phase::Succeeded);
    }
}
