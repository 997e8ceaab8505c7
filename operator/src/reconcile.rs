//! The reconciler: reads a job's pods and its driver's status, runs [`plan`](crate::plan::plan),
//! applies the actions, and writes status and Events. Cleanup on deletion runs under a finalizer.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::{ObjectReference, Pod, Secret, Service, ServiceAccount};
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::controller::{Action as Requeue, Controller};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::finalizer::{Event as Finalizer, finalizer};
use kube::runtime::watcher;
use kube::{Client, Resource, ResourceExt};
use serde::Serialize;
use serde::de::DeserializeOwned;
use tracing::{debug, info, warn};

use crate::crd::ElasticJob;
use crate::driver_status::{self, DriverStatus};
use crate::error::Error;
use crate::metrics::Metrics;
use crate::plan::{
    Action, DeleteReason, REASON_RESTARTS_EXHAUSTED, finished, owned_by, plan, status,
};
use crate::resources::{
    self, FIELD_MANAGER, LABEL_JOB, LABEL_ROLE, Names, ROLE_DRIVER, STATUS_PORT,
};

/// Finalizer that makes the operator stop a job's pods before the job goes away.
pub const FINALIZER: &str = "hvd.dev/cleanup";
/// How often a running job is looked at again (for the driver's blacklist and round).
pub const RESYNC: Duration = Duration::from_secs(10);

/// What every reconcile needs.
#[derive(Clone)]
pub struct Context {
    /// The API client.
    pub client: Client,
    /// Publishes Events on the jobs.
    pub recorder: Recorder,
    /// Port of the drivers' status API ([`STATUS_PORT`]; tests point it elsewhere).
    pub status_port: u16,
    /// How long to wait for a driver's status.
    pub status_timeout: Duration,
    /// Where reconciles are counted and timed.
    pub metrics: Metrics,
}

impl Context {
    /// A context reporting Events as `hvd-operator` (instance `instance`, e.g. the pod name).
    pub fn new(client: Client, instance: Option<String>) -> Self {
        let reporter = Reporter {
            controller: FIELD_MANAGER.into(),
            instance,
        };
        Context {
            recorder: Recorder::new(client.clone(), reporter),
            client,
            status_port: STATUS_PORT,
            status_timeout: Duration::from_secs(2),
            metrics: Metrics::new(),
        }
    }
}

/// Reconciles one job: adds the finalizer first, cleans up on deletion, else applies the plan.
///
/// # Errors
/// [`Error`] when an API call fails; the controller retries after [`error_policy`]'s delay.
pub async fn reconcile(job: Arc<ElasticJob>, ctx: Arc<Context>) -> Result<Requeue, Error> {
    let began = tokio::time::Instant::now();
    let metrics = ctx.metrics.clone();
    let result = reconcile_job(job, ctx).await;
    let error = result.as_ref().err().map(Error::metric_label);
    metrics.reconciled(began.elapsed(), error);
    result
}

async fn reconcile_job(job: Arc<ElasticJob>, ctx: Arc<Context>) -> Result<Requeue, Error> {
    let ns = job
        .namespace()
        .ok_or(Error::MissingField("metadata.namespace"))?;
    let jobs: Api<ElasticJob> = Api::namespaced(ctx.client.clone(), &ns);
    finalizer(&jobs, FINALIZER, job, |event| async {
        match event {
            Finalizer::Apply(job) => apply(job, ctx.clone()).await,
            Finalizer::Cleanup(job) => cleanup(job, ctx.clone()).await,
        }
    })
    .await
    .map_err(|e| Error::Finalizer(Box::new(e)))
}

/// Retry a failed reconcile after 15 s.
pub fn error_policy(job: Arc<ElasticJob>, err: &Error, _ctx: Arc<Context>) -> Requeue {
    warn!(job = %job.name_any(), error = %err, label = err.metric_label(), "reconcile failed");
    Requeue::requeue(Duration::from_secs(15))
}

/// The pod an Event is about, so that events on different pods are not folded into one series.
fn pod_ref(names: &Names, pod: &str) -> ObjectReference {
    ObjectReference {
        api_version: Some("v1".into()),
        kind: Some("Pod".into()),
        name: Some(pod.into()),
        namespace: Some(names.namespace.clone()),
        ..Default::default()
    }
}

async fn publish(
    ctx: &Context,
    job: &ElasticJob,
    type_: EventType,
    (reason, action): (&str, &str),
    note: String,
    pod: Option<ObjectReference>,
) {
    let event = Event {
        type_,
        reason: reason.into(),
        note: Some(note),
        action: action.into(),
        secondary: pod,
    };
    // An Event is a courtesy: failing to write one must not fail the reconcile.
    if let Err(e) = ctx.recorder.publish(&event, &job.object_ref(&())).await {
        warn!(job = %job.name_any(), error = %e, reason, "cannot publish event");
    }
}

fn driver_addr(job: &ElasticJob, pods: &[Pod], names: &Names, port: u16) -> Option<SocketAddr> {
    let driver = names.driver();
    let pod = pods.iter().find(|p| {
        owned_by(job, p)
            && p.metadata.name.as_deref() == Some(&driver)
            && p.labels().get(LABEL_ROLE).map(String::as_str) == Some(ROLE_DRIVER)
    })?;
    let status = pod.status.as_ref()?;
    if status.phase.as_deref() != Some("Running") || pod.metadata.deletion_timestamp.is_some() {
        return None;
    }
    let ip: IpAddr = status.pod_ip.as_deref()?.parse().ok()?;
    Some(SocketAddr::new(ip, port))
}

/// Applies the objects a running job needs besides its pods: the driver's ServiceAccount, Role
/// and RoleBinding, the workers' Service, and the driver's Service (its metrics, and with a
/// state store its rendezvous). Applied on every reconcile, so that one removed by hand or by
/// the garbage collection of a deleted job of the same name comes back.
async fn apply_shared(job: &ElasticJob, ctx: &Context, ns: &str) -> Result<(), Error> {
    ssa::<ServiceAccount>(ctx, ns, &resources::driver_service_account(job)?).await?;
    ssa::<Role>(ctx, ns, &resources::driver_role(job)?).await?;
    ssa::<RoleBinding>(ctx, ns, &resources::driver_role_binding(job)?).await?;
    ssa::<Service>(ctx, ns, &resources::worker_service(job)?).await?;
    ssa::<Service>(ctx, ns, &resources::driver_service(job)?).await?;
    Ok(())
}

async fn apply(job: Arc<ElasticJob>, ctx: Arc<Context>) -> Result<Requeue, Error> {
    // Before any pod is created: a pod created by this reconcile is newer than what it sees.
    let now = Time(k8s_openapi::jiff::Timestamp::now());
    let names = Names::of(&job)?;
    let pods_api: Api<Pod> = Api::namespaced(ctx.client.clone(), &names.namespace);
    let pods = pods_api
        .list(&ListParams::default().labels(&names.job_selector()))
        .await?
        .items;
    // Pods are made from the spec the job started with; a later edit waits for a new job.
    let started = resources::as_started(&job, &pods);
    if !finished(&started, &pods) {
        apply_shared(&started, &ctx, &names.namespace).await?;
    }
    let driver = match driver_addr(&job, &pods, &names, ctx.status_port) {
        Some(addr) => match driver_status::fetch(addr, ctx.status_timeout).await {
            Ok(s) => Some(s),
            Err(e) => {
                debug!(job = %names.job, error = %e, "no driver status");
                None
            }
        },
        None => None,
    };
    let actions = plan(&started, &pods, driver.as_ref());
    for action in &actions {
        execute(&started, &names, &ctx, action).await?;
    }
    write_status(&job, &names, &ctx, &pods, driver.as_ref(), &actions, &now).await?;
    let done = job.status.as_ref().is_some_and(|s| s.phase.is_terminal());
    Ok(if done && actions.is_empty() {
        Requeue::await_change()
    } else {
        Requeue::requeue(RESYNC)
    })
}

async fn write_status(
    job: &ElasticJob,
    names: &Names,
    ctx: &Context,
    pods: &[Pod],
    driver: Option<&DriverStatus>,
    actions: &[Action],
    now: &Time,
) -> Result<(), Error> {
    let new = status(job, pods, driver, actions, now);
    let old_phase = job.status.as_ref().map(|s| s.phase);
    if job.status.as_ref() == Some(&new) {
        return Ok(());
    }
    let jobs: Api<ElasticJob> = Api::namespaced(ctx.client.clone(), &names.namespace);
    let patch = serde_json::json!({
        "apiVersion": "hvd.dev/v1alpha1",
        "kind": "ElasticJob",
        "status": new,
    });
    let params = PatchParams::apply(FIELD_MANAGER).force();
    jobs.patch_status(&names.job, &params, &Patch::Apply(&patch))
        .await?;
    if old_phase != Some(new.phase) {
        info!(job = %names.job, phase = ?new.phase, workers = new.workers, "job phase");
        if new.phase.is_terminal() {
            let type_ = if new.phase == crate::crd::Phase::Failed {
                EventType::Warning
            } else {
                EventType::Normal
            };
            let exhausted = new
                .conditions
                .iter()
                .find(|c| c.type_ == "Ready" && c.reason == REASON_RESTARTS_EXHAUSTED);
            let note = match exhausted {
                Some(c) => c.message.clone(),
                None => format!("the driver pod finished: {:?}", new.phase),
            };
            let reason = format!("{:?}", new.phase);
            publish(ctx, job, type_, (&reason, "Finish"), note, None).await;
        }
    }
    Ok(())
}

async fn ssa<K>(ctx: &Context, ns: &str, obj: &K) -> Result<(), Error>
where
    K: Resource<Scope = k8s_openapi::NamespaceResourceScope>
        + Clone
        + DeserializeOwned
        + Serialize
        + std::fmt::Debug,
    K::DynamicType: Default,
{
    let api: Api<K> = Api::namespaced(ctx.client.clone(), ns);
    let name = obj.meta().name.clone().unwrap_or_default();
    // Server-side apply wants apiVersion and kind in the body.
    let mut value = serde_json::to_value(obj)?;
    if let Some(map) = value.as_object_mut() {
        map.insert(
            "apiVersion".into(),
            K::api_version(&Default::default()).into(),
        );
        map.insert("kind".into(), K::kind(&Default::default()).into());
    }
    api.patch(
        &name,
        &PatchParams::apply(FIELD_MANAGER).force(),
        &Patch::Apply(&value),
    )
    .await?;
    Ok(())
}

async fn execute(
    job: &ElasticJob,
    names: &Names,
    ctx: &Context,
    action: &Action,
) -> Result<(), Error> {
    let ns = &names.namespace;
    match action {
        Action::CreateDriver => {
            // Created once and never applied again: a new random value would cut off running
            // agents. Its name carries the job's uid, so an existing one is this job's.
            let secrets: Api<Secret> = Api::namespaced(ctx.client.clone(), ns);
            let secret =
                resources::secret(job, &resources::new_secret()?, &resources::new_secret()?)?;
            match secrets.create(&PostParams::default(), &secret).await {
                Ok(_) => {}
                Err(kube::Error::Api(e)) if e.code == 409 => {}
                Err(e) => return Err(e.into()),
            }
            ssa::<Pod>(ctx, ns, &resources::driver_pod(job)?).await?;
            info!(job = %names.job, "driver created");
            let note = format!("created driver pod {}", names.driver());
            let pod = Some(pod_ref(names, &names.driver()));
            publish(
                ctx,
                job,
                EventType::Normal,
                ("CreatedDriver", "Create"),
                note,
                pod,
            )
            .await;
        }
        Action::DeleteDriver { state } => {
            let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), ns);
            let name = names.driver();
            match pods.delete(&name, &DeleteParams::default()).await {
                Ok(_) => {}
                Err(kube::Error::Api(e)) if e.code == 404 => {}
                Err(e) => return Err(e.into()),
            }
            warn!(job = %names.job, pod = %name, %state, "driver lost; replacing it");
            let note = format!(
                "deleted driver pod {name} ({state}); a new driver takes over the job and its \
                 running workers"
            );
            publish(
                ctx,
                job,
                EventType::Warning,
                ("ReplacingDriver", "Delete"),
                note,
                Some(pod_ref(names, &name)),
            )
            .await;
        }
        Action::CreateWorker { index } => {
            ssa::<Pod>(ctx, ns, &resources::worker_pod(job, *index)?).await?;
            let note = format!("created worker pod {}", names.worker(*index));
            info!(job = %names.job, pod = %names.worker(*index), "worker created");
            let pod = Some(pod_ref(names, &names.worker(*index)));
            publish(
                ctx,
                job,
                EventType::Normal,
                ("CreatedWorker", "Create"),
                note,
                pod,
            )
            .await;
        }
        Action::DeleteWorker { name, why } => {
            let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), ns);
            match pods.delete(name, &DeleteParams::default()).await {
                Ok(_) => {}
                Err(kube::Error::Api(e)) if e.code == 404 => {}
                Err(e) => return Err(e.into()),
            }
            let note = match why {
                DeleteReason::Failed { state } => format!("deleted worker pod {name}: {state}"),
                DeleteReason::Blacklisted { host } => {
                    format!("deleted worker pod {name}: the driver blacklisted {host}")
                }
                DeleteReason::ScaleDown => format!("deleted worker pod {name}: scaled down"),
                DeleteReason::JobFinished => format!("deleted worker pod {name}: the job finished"),
            };
            info!(job = %names.job, pod = %name, reason = why.event_reason(), "worker deleted");
            let type_ = match why {
                DeleteReason::Failed { .. } | DeleteReason::Blacklisted { .. } => {
                    EventType::Warning
                }
                _ => EventType::Normal,
            };
            let pod = Some(pod_ref(names, name));
            publish(ctx, job, type_, (why.event_reason(), "Delete"), note, pod).await;
        }
    }
    Ok(())
}

/// Deletes the job's pods at once (the rest goes with the job through owner references).
///
/// One delete per pod rather than a delete-collection, so the operator needs no
/// `deletecollection` right.
async fn cleanup(job: Arc<ElasticJob>, ctx: Arc<Context>) -> Result<Requeue, Error> {
    let names = Names::of(&job)?;
    let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), &names.namespace);
    let listed = pods
        .list(&ListParams::default().labels(&names.job_selector()))
        .await?
        .items;
    for pod in listed
        .iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
    {
        let name = pod.name_any();
        match pods.delete(&name, &DeleteParams::background()).await {
            Ok(_) => {}
            Err(kube::Error::Api(e)) if e.code == 404 => {}
            Err(e) => return Err(e.into()),
        }
    }
    info!(job = %names.job, pods = listed.len(), "job deleted; its pods are being removed");
    let note = format!("deleting the {} pods of job {}", listed.len(), names.job);
    let reason = ("Cleanup", "Delete");
    publish(&ctx, &job, EventType::Normal, reason, note, None).await;
    Ok(Requeue::await_change())
}

/// Runs the controller over the jobs of `namespace` (all namespaces when `None`) until
/// `shutdown` resolves.
pub async fn run(
    ctx: Context,
    namespace: Option<String>,
    shutdown: impl std::future::Future<Output = ()> + Send + Sync + 'static,
) {
    let client = ctx.client.clone();
    let (jobs, pods): (Api<ElasticJob>, Api<Pod>) = match &namespace {
        Some(ns) => (
            Api::namespaced(client.clone(), ns),
            Api::namespaced(client, ns),
        ),
        None => (Api::all(client.clone()), Api::all(client)),
    };
    Controller::new(jobs, watcher::Config::default().any_semantic())
        .owns(pods, watcher::Config::default().labels(LABEL_JOB))
        .graceful_shutdown_on(shutdown)
        .run(reconcile, error_policy, Arc::new(ctx))
        .for_each(|res| async move {
            match res {
                Ok((obj, _)) => debug!(job = %obj.name, "reconciled"),
                Err(e) => debug!(error = %e, "reconcile error"),
            }
        })
        .await;
}
