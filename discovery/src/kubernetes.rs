//! Hosts from the Kubernetes API: the job's worker pods that are Ready, not being deleted and
//! not about to be disrupted.
//!
//! [`hosts_from_pods`] is the pure rule that turns pods into hosts; [`watch`] keeps a pod cache
//! current through a kube-rs watcher (a list, then a watch, re-listed with backoff after errors) and
//! sends the whole host set whenever it changes. A pod that turns NotReady or gets a deletion
//! timestamp or the `DisruptionTarget` condition (an eviction, a preemption, a node drain or
//! taint manager's decision, set before the kubelet's SIGTERM) leaves the set on the event that
//! says so, which is what lets a spot-preemption notice reach the driver before the node goes
//! away. Such a pod, while still Ready, is also reported as [`LeavingPod`]: the driver takes it
//! as the host's notice (source `kubernetes`, the deadline its deletion time) and drains its
//! workers gracefully.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, SystemTime};

use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::Pod;
use kube::Client;
use kube::api::Api;
use kube::runtime::{WatchStreamExt, watcher};
use tokio::sync::mpsc;

use crate::HostSpec;

/// The pod annotation that overrides the slot count of one worker pod.
pub const DEFAULT_SLOTS_ANNOTATION: &str = "hvd.dev/slots";

/// Which pods are hosts, and how to address them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodSelector {
    /// Namespace of the pods; `None` uses the client's default (in a pod: its own namespace).
    pub namespace: Option<String>,
    /// Label selector of the worker pods, e.g. `hvd.dev/job=train,hvd.dev/role=worker`.
    pub label_selector: String,
    /// Slots of a pod without the slots annotation.
    pub default_slots: usize,
    /// Annotation whose value is a pod's slot count ([`DEFAULT_SLOTS_ANNOTATION`] by default).
    pub slots_annotation: String,
    /// Headless Service of the workers: when set, hosts are stable DNS names
    /// `<hostname or pod name>.<service>.<namespace>.svc` instead of pod IPs.
    pub service: Option<String>,
}

impl PodSelector {
    /// A selector for pods labelled `label_selector` in the default namespace, addressed by IP,
    /// with `default_slots` slots unless annotated otherwise.
    pub fn new(label_selector: impl Into<String>, default_slots: usize) -> Self {
        PodSelector {
            namespace: None,
            label_selector: label_selector.into(),
            default_slots,
            slots_annotation: DEFAULT_SLOTS_ANNOTATION.to_string(),
            service: None,
        }
    }
}

/// Why pods could not be turned into hosts, or the API could not be watched.
#[derive(Debug, thiserror::Error)]
pub enum KubeDiscoveryError {
    /// A pod's slots annotation is not a positive integer.
    #[error("pod '{pod}': annotation {annotation}='{value}' is not a positive slot count")]
    BadSlots {
        /// The pod.
        pod: String,
        /// The annotation key.
        annotation: String,
        /// The value as written.
        value: String,
    },
    /// The selector's default slot count is zero.
    #[error("pod '{pod}' has no {annotation} annotation and the default slot count is 0")]
    ZeroDefaultSlots {
        /// The pod that needed the default.
        pod: String,
        /// The annotation it lacks.
        annotation: String,
    },
    /// The label selector is empty, which would select every pod in the namespace.
    #[error("the pod label selector is empty; name the worker pods, e.g. 'app=train,role=worker'")]
    EmptySelector,
    /// No Kubernetes client could be built (no in-cluster config and no kubeconfig).
    #[error("cannot connect to the Kubernetes API: {0}")]
    Client(#[source] kube::Error),
    /// The list or watch failed; the watch retries with backoff.
    #[error("watching pods '{selector}' failed: {source}")]
    Watch {
        /// The label selector being watched.
        selector: String,
        /// What the API server or the connection said.
        #[source]
        source: watcher::Error,
    },
}

/// True when the pod's `Ready` condition is `True`.
fn is_ready(pod: &Pod) -> bool {
    pod.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

/// True when the pod's `DisruptionTarget` condition is `True`: Kubernetes is about to evict or
/// preempt it, or its node is draining or tainted.
fn is_disruption_target(pod: &Pod) -> bool {
    pod.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| {
            cs.iter()
                .any(|c| c.type_ == "DisruptionTarget" && c.status == "True")
        })
}

/// A Ready pod that Kubernetes is about to take away (a deletion timestamp, or the
/// `DisruptionTarget` condition): its host has notice.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeavingPod {
    /// Its host, addressed as a host of the set would be.
    pub host: String,
    /// When it will be killed: its deletion timestamp (the end of its grace period); `None`
    /// when only the condition says it will go.
    pub deadline: Option<SystemTime>,
}

impl LeavingPod {
    /// How long it has left at `now` (`None`: unknown).
    pub fn within(&self, now: SystemTime) -> Option<Duration> {
        self.deadline
            .map(|d| d.duration_since(now).unwrap_or(Duration::ZERO))
    }
}

/// What the selected pods offer: the hosts, and the hosts that have notice.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PodSet {
    /// The hosts, sorted by pod name.
    pub hosts: Vec<HostSpec>,
    /// Pods about to be taken away, sorted by pod name.
    pub leaving: Vec<LeavingPod>,
}

/// The hosts among some pods, and the pods left out because their slot count is unusable.
#[derive(Debug, Default)]
pub struct PodHosts {
    /// The hosts, sorted by pod name.
    pub hosts: Vec<HostSpec>,
    /// Pods about to be taken away, sorted by pod name.
    pub leaving: Vec<LeavingPod>,
    /// One error per pod left out: [`KubeDiscoveryError::BadSlots`] or
    /// [`KubeDiscoveryError::ZeroDefaultSlots`], naming the pod.
    pub skipped: Vec<KubeDiscoveryError>,
}

/// The pod's address as a host: its stable DNS name under `sel.service`, else its IP.
fn address(pod: &Pod, name: &str, sel: &PodSelector) -> Option<String> {
    match &sel.service {
        Some(svc) => {
            let hostname = pod
                .spec
                .as_ref()
                .and_then(|s| s.hostname.as_deref())
                .unwrap_or(name);
            let ns = pod
                .metadata
                .namespace
                .as_deref()
                .or(sel.namespace.as_deref())
                .unwrap_or("default");
            (!hostname.is_empty()).then(|| format!("{hostname}.{svc}.{ns}.svc"))
        }
        None => pod
            .status
            .as_ref()
            .and_then(|s| s.pod_ip.as_deref())
            .filter(|ip| !ip.is_empty())
            .map(str::to_string),
    }
}

/// The end of the pod's grace period, from its deletion timestamp.
fn deletion_time(pod: &Pod) -> Option<SystemTime> {
    let ms = pod.metadata.deletion_timestamp.as_ref()?.0.as_millisecond();
    let ms = u64::try_from(ms).ok()?;
    SystemTime::UNIX_EPOCH.checked_add(Duration::from_millis(ms))
}

/// The hosts among `pods`, sorted by pod name: pods that are Ready, have no deletion timestamp
/// and no `DisruptionTarget` condition, and have an address (a pod IP, or any name when `sel.service` gives them stable DNS).
///
/// Slots come from the `sel.slots_annotation` annotation, else `sel.default_slots`. A pod whose
/// annotation is not a positive integer, or that needs a default of 0, is left out and reported
/// in [`PodHosts::skipped`]: one malformed pod does not hide the others.
pub fn hosts_from_pods<'a>(pods: impl IntoIterator<Item = &'a Pod>, sel: &PodSelector) -> PodHosts {
    let mut by_name: Vec<(&str, HostSpec)> = Vec::new();
    let mut leaving: Vec<(&str, LeavingPod)> = Vec::new();
    let mut skipped = Vec::new();
    for pod in pods {
        let name = pod.metadata.name.as_deref().unwrap_or_default();
        if !is_ready(pod) {
            continue;
        }
        let Some(host) = address(pod, name, sel) else {
            continue;
        };
        if pod.metadata.deletion_timestamp.is_some() || is_disruption_target(pod) {
            let deadline = deletion_time(pod);
            leaving.push((name, LeavingPod { host, deadline }));
            continue;
        }
        match slots_of(pod, name, sel) {
            Ok(slots) => by_name.push((name, HostSpec { host, slots })),
            Err(e) => skipped.push(e),
        }
    }
    by_name.sort_by(|a, b| a.0.cmp(b.0));
    leaving.sort_by(|a, b| a.0.cmp(b.0));
    PodHosts {
        hosts: by_name.into_iter().map(|(_, h)| h).collect(),
        leaving: leaving.into_iter().map(|(_, l)| l).collect(),
        skipped,
    }
}

/// Logs each skipped pod once while it stays malformed (`warned` holds what was logged); a pod
/// fixed and broken again is logged again. Returns how many warnings it logged.
fn warn_skipped(skipped: &[KubeDiscoveryError], warned: &mut BTreeSet<String>) -> usize {
    let now: BTreeSet<String> = skipped.iter().map(ToString::to_string).collect();
    let mut logged = 0;
    for msg in now.difference(warned) {
        tracing::warn!("{msg}; the pod is left out of the host set");
        logged += 1;
    }
    *warned = now;
    logged
}

fn slots_of(pod: &Pod, name: &str, sel: &PodSelector) -> Result<usize, KubeDiscoveryError> {
    let annotated = pod
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(&sel.slots_annotation));
    match annotated {
        Some(value) => match value.trim().parse::<usize>() {
            Ok(n) if n > 0 => Ok(n),
            _ => Err(KubeDiscoveryError::BadSlots {
                pod: name.to_string(),
                annotation: sel.slots_annotation.clone(),
                value: value.clone(),
            }),
        },
        None if sel.default_slots == 0 => Err(KubeDiscoveryError::ZeroDefaultSlots {
            pod: name.to_string(),
            annotation: sel.slots_annotation.clone(),
        }),
        None => Ok(sel.default_slots),
    }
}

/// Watches the selected pods and sends the full host set, with the pods about to leave, after
/// every completed list and every time either changes; sends `Err` when the watch fails (it keeps retrying with backoff). A pod
/// with an unusable slot count is left out with a warning (once per pod and value). Returns when
/// `tx` is closed, or at once (after sending the error) when no client can be built or the
/// selector is empty.
///
/// The client comes from the environment: in-cluster service-account config, else kubeconfig.
pub async fn watch(sel: PodSelector, tx: mpsc::Sender<Result<PodSet, KubeDiscoveryError>>) {
    match Client::try_default().await {
        Ok(client) => watch_with_client(client, sel, tx).await,
        Err(e) => {
            tracing::error!(error = %e, "no Kubernetes client for pod discovery");
            let _ = tx.send(Err(KubeDiscoveryError::Client(e))).await;
        }
    }
}

/// [`watch`] with a given client (tests pass one backed by a mock API server).
pub async fn watch_with_client(
    client: Client,
    sel: PodSelector,
    tx: mpsc::Sender<Result<PodSet, KubeDiscoveryError>>,
) {
    if sel.label_selector.trim().is_empty() {
        let _ = tx.send(Err(KubeDiscoveryError::EmptySelector)).await;
        return;
    }
    let api: Api<Pod> = match &sel.namespace {
        Some(ns) => Api::namespaced(client, ns),
        None => Api::default_namespaced(client),
    };
    let cfg = watcher::Config::default().labels(&sel.label_selector);
    let mut events = watcher(api, cfg).default_backoff().boxed();
    let mut cache = PodCache::default();
    let mut last_sent: Option<PodSet> = None;
    let mut warned = BTreeSet::new();
    loop {
        let step = tokio::select! {
            () = tx.closed() => return,
            step = events.try_next() => step,
        };
        let event = match step {
            Ok(Some(event)) => event,
            // The backoff-wrapped watcher never ends on its own; treat an end like a closed sink.
            Ok(None) => return,
            Err(source) => {
                tracing::warn!(error = %source, selector = %sel.label_selector, "pod watch failed; retrying");
                let err = KubeDiscoveryError::Watch {
                    selector: sel.label_selector.clone(),
                    source,
                };
                if tx.send(Err(err)).await.is_err() {
                    return;
                }
                continue;
            }
        };
        let listed = cache.apply(event);
        if !cache.live() {
            continue;
        }
        let PodHosts {
            hosts,
            leaving,
            skipped,
        } = hosts_from_pods(cache.pods.values(), &sel);
        warn_skipped(&skipped, &mut warned);
        let set = PodSet { hosts, leaving };
        if !listed && last_sent.as_ref() == Some(&set) {
            continue;
        }
        tracing::debug!(
            hosts = set.hosts.len(),
            leaving = set.leaving.len(),
            "pod host set"
        );
        last_sent = Some(set.clone());
        if tx.send(Ok(set)).await.is_err() {
            return;
        }
    }
}

/// The pods the watcher has reported, with the re-list buffer of the watcher's `Init` phase.
#[derive(Default)]
struct PodCache {
    pods: BTreeMap<String, Pod>,
    relisting: Option<BTreeMap<String, Pod>>,
    listed_once: bool,
}

impl PodCache {
    /// Applies one watcher event; true when it completed a list.
    fn apply(&mut self, event: watcher::Event<Pod>) -> bool {
        match event {
            watcher::Event::Init => {
                self.relisting = Some(BTreeMap::new());
                false
            }
            watcher::Event::InitApply(pod) => {
                if let Some(buf) = &mut self.relisting {
                    buf.insert(key(&pod), pod);
                }
                false
            }
            watcher::Event::InitDone => {
                self.pods = self.relisting.take().unwrap_or_default();
                self.listed_once = true;
                true
            }
            watcher::Event::Apply(pod) => {
                self.pods.insert(key(&pod), pod);
                false
            }
            watcher::Event::Delete(pod) => {
                self.pods.remove(&key(&pod));
                false
            }
        }
    }

    /// True once a full list has been seen and no re-list is in progress.
    fn live(&self) -> bool {
        self.listed_once && self.relisting.is_none()
    }
}

fn key(pod: &Pod) -> String {
    format!(
        "{}/{}",
        pod.metadata.namespace.as_deref().unwrap_or_default(),
        pod.metadata.name.as_deref().unwrap_or_default()
    )
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use http::{Request, Response};
    use k8s_openapi::api::core::v1::{PodCondition, PodSpec, PodStatus};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
    use kube::client::Body;
    use std::time::Duration;

    fn pod(name: &str, ip: Option<&str>, ready: bool) -> Pod {
        Pod {
            metadata: ObjectMeta {
                name: Some(name.into()),
                namespace: Some("ml".into()),
                resource_version: Some("1".into()),
                ..Default::default()
            },
            spec: Some(PodSpec::default()),
            status: Some(PodStatus {
                pod_ip: ip.map(Into::into),
                phase: Some("Running".into()),
                conditions: Some(vec![PodCondition {
                    type_: "Ready".into(),
                    status: if ready { "True" } else { "False" }.into(),
                    ..Default::default()
                }]),
                ..Default::default()
            }),
        }
    }

    fn annotated(mut p: Pod, value: &str) -> Pod {
        p.metadata.annotations = Some(
            [(DEFAULT_SLOTS_ANNOTATION.to_string(), value.to_string())]
                .into_iter()
                .collect(),
        );
        p
    }

    fn deleting(mut p: Pod) -> Pod {
        p.metadata.deletion_timestamp = Some(Time(k8s_openapi::jiff::Timestamp::UNIX_EPOCH));
        p
    }

    fn sel() -> PodSelector {
        PodSelector::new("app=train,role=worker", 2)
    }

    fn hs(host: &str, slots: usize) -> HostSpec {
        HostSpec {
            host: host.into(),
            slots,
        }
    }

    #[test]
    fn ready_pods_with_ips_are_hosts_sorted_by_name() {
        let pods = [
            pod("w-2", Some("10.0.0.2"), true),
            pod("w-1", Some("10.0.0.1"), true),
        ];
        let hosts = hosts_from_pods(&pods, &sel()).hosts;
        assert_eq!(hosts, vec![hs("10.0.0.1", 2), hs("10.0.0.2", 2)]);
    }

    #[test]
    fn not_ready_deleting_and_ipless_pods_are_left_out() {
        let pods = [
            pod("a", Some("10.0.0.1"), false),
            deleting(pod("b", Some("10.0.0.2"), true)),
            pod("c", None, true),
            pod("d", Some("10.0.0.4"), true),
        ];
        let found = hosts_from_pods(&pods, &sel());
        assert_eq!(found.hosts, vec![hs("10.0.0.4", 2)]);
        assert_eq!(found.leaving.len(), 1, "{:?}", found.leaving);
        assert_eq!(found.leaving[0].host, "10.0.0.2");
    }

    #[test]
    fn a_deleting_pod_has_until_its_deletion_time_a_disrupted_one_an_unknown_time() {
        let mut p = pod("b", Some("10.0.0.2"), true);
        let at = k8s_openapi::jiff::Timestamp::from_second(1_795_000_030).unwrap();
        p.metadata.deletion_timestamp = Some(Time(at));
        let found = hosts_from_pods([&p], &sel());
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_795_000_000);
        assert_eq!(found.leaving[0].within(now), Some(Duration::from_secs(30)));
        assert_eq!(
            found.leaving[0].within(now + Duration::from_secs(40)),
            Some(Duration::ZERO),
            "past its deadline"
        );
        // Not Ready any more: it is neither a host nor leaving one.
        let mut p = deleting(pod("c", Some("10.0.0.3"), false));
        p.metadata.name = Some("c".into());
        assert!(hosts_from_pods([&p], &sel()).leaving.is_empty());
    }

    #[test]
    fn a_pod_kubernetes_is_about_to_disrupt_is_left_out_before_its_sigterm() {
        let target = |status: &str| {
            let mut p = pod("b", Some("10.0.0.2"), true);
            if let Some(cs) = p.status.as_mut().and_then(|s| s.conditions.as_mut()) {
                cs.push(PodCondition {
                    type_: "DisruptionTarget".into(),
                    status: status.into(),
                    reason: Some("PreemptionByScheduler".into()),
                    ..PodCondition::default()
                });
            }
            p
        };
        let pods = [pod("a", Some("10.0.0.1"), true), target("True")];
        let found = hosts_from_pods(&pods, &sel());
        assert_eq!(found.hosts, vec![hs("10.0.0.1", 2)]);
        assert_eq!(
            found.leaving,
            vec![LeavingPod {
                host: "10.0.0.2".into(),
                deadline: None
            }]
        );
        let pods = [pod("a", Some("10.0.0.1"), true), target("False")];
        assert_eq!(
            hosts_from_pods(&pods, &sel()).hosts.len(),
            2,
            "a condition that is False"
        );
    }

    #[test]
    fn pod_without_conditions_is_not_ready() {
        let mut p = pod("a", Some("10.0.0.1"), true);
        p.status.as_mut().unwrap().conditions = None;
        assert!(hosts_from_pods([&p], &sel()).hosts.is_empty());
    }

    #[test]
    fn annotation_overrides_default_slots() {
        let pods = [annotated(pod("a", Some("10.0.0.1"), true), " 8 ")];
        assert_eq!(
            hosts_from_pods(&pods, &sel()).hosts,
            vec![hs("10.0.0.1", 8)]
        );
    }

    #[test]
    fn bad_annotation_skips_that_pod_only_and_names_it_with_the_value() {
        for bad in ["zero", "0", "-1", ""] {
            let pods = [
                annotated(pod("w-7", Some("10.0.0.1"), true), bad),
                pod("w-8", Some("10.0.0.2"), true),
            ];
            let found = hosts_from_pods(&pods, &sel());
            assert_eq!(found.hosts, vec![hs("10.0.0.2", 2)], "{bad}");
            assert_eq!(found.skipped.len(), 1);
            let err = &found.skipped[0];
            let msg = err.to_string();
            assert!(matches!(err, KubeDiscoveryError::BadSlots { .. }), "{msg}");
            assert!(
                msg.contains("w-7") && msg.contains(&format!("'{bad}'")),
                "{msg}"
            );
        }
    }

    #[test]
    fn zero_default_slots_is_an_error_only_when_needed() {
        let mut s = sel();
        s.default_slots = 0;
        let ok = [annotated(pod("a", Some("10.0.0.1"), true), "3")];
        let found = hosts_from_pods(&ok, &s);
        assert_eq!(found.hosts, vec![hs("10.0.0.1", 3)]);
        assert!(found.skipped.is_empty());
        let bad = [pod("b", Some("10.0.0.2"), true)];
        let found = hosts_from_pods(&bad, &s);
        assert!(found.hosts.is_empty());
        let err = &found.skipped[0];
        assert!(
            matches!(err, KubeDiscoveryError::ZeroDefaultSlots { .. }),
            "{err}"
        );
        assert!(err.to_string().contains("'b'"), "{err}");
    }

    #[test]
    fn service_gives_stable_dns_names() {
        let mut s = sel();
        s.service = Some("train-workers".into());
        let mut with_hostname = pod("train-worker-1", None, true);
        with_hostname.spec.as_mut().unwrap().hostname = Some("w1".into());
        let pods = [with_hostname, pod("train-worker-0", Some("10.0.0.9"), true)];
        assert_eq!(
            hosts_from_pods(&pods, &s).hosts,
            vec![
                hs("train-worker-0.train-workers.ml.svc", 2),
                hs("w1.train-workers.ml.svc", 2)
            ]
        );
    }

    // === mock API server ===

    type Handle = tower_test::mock::Handle<Request<Body>, Response<Body>>;

    fn json_response(v: &serde_json::Value) -> Response<Body> {
        Response::builder()
            .body(Body::from(serde_json::to_vec(v).unwrap()))
            .unwrap()
    }

    async fn next(
        handle: &mut Handle,
    ) -> (
        Request<Body>,
        tower_test::mock::SendResponse<Response<Body>>,
    ) {
        tokio::time::timeout(Duration::from_secs(5), handle.next_request())
            .await
            .expect("the watcher made no request")
            .expect("the client is gone")
    }

    type HostRx = mpsc::Receiver<Result<PodSet, KubeDiscoveryError>>;

    /// Starts [`watch_with_client`] on namespace `ml` against a mock API server.
    fn start_watch() -> (Handle, HostRx, tokio::task::JoinHandle<()>) {
        let (svc, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        let client = Client::new(svc, "default");
        let (tx, rx) = mpsc::channel(4);
        let mut s = sel();
        s.namespace = Some("ml".into());
        (handle, rx, tokio::spawn(watch_with_client(client, s, tx)))
    }

    async fn recv_set(rx: &mut HostRx) -> PodSet {
        tokio::time::timeout(Duration::from_secs(5), rx.recv())
            .await
            .expect("no host set sent")
            .expect("watch ended")
            .expect("watch sent an error")
    }

    async fn recv(rx: &mut HostRx) -> Vec<HostSpec> {
        recv_set(rx).await.hosts
    }

    #[tokio::test]
    async fn watch_sends_initial_set_then_drops_a_deleted_pod_at_once() {
        let (mut handle, mut rx, task) = start_watch();

        // 1. The initial list.
        let (req, send) = next(&mut handle).await;
        assert_eq!(req.method(), http::Method::GET);
        assert_eq!(req.uri().path(), "/api/v1/namespaces/ml/pods");
        let query = req.uri().query().unwrap_or_default().to_string();
        assert!(
            query.contains("labelSelector=app%3Dtrain%2Crole%3Dworker"),
            "{query}"
        );
        assert!(!query.contains("watch=true"), "{query}");
        let a = pod("w-0", Some("10.0.0.1"), true);
        let b = pod("w-1", Some("10.0.0.2"), true);
        send.send_response(json_response(&serde_json::json!({
            "apiVersion": "v1", "kind": "PodList",
            "metadata": {"resourceVersion": "10"},
            "items": [a, b],
        })));
        assert_eq!(
            recv(&mut rx).await,
            vec![hs("10.0.0.1", 2), hs("10.0.0.2", 2)]
        );

        // 2. The watch: w-1 gets a deletion timestamp (a spot-preemption notice).
        let (req, send) = next(&mut handle).await;
        let query = req.uri().query().unwrap_or_default().to_string();
        assert!(query.contains("watch=true"), "{query}");
        assert!(query.contains("resourceVersion=10"), "{query}");
        let mut gone = deleting(pod("w-1", Some("10.0.0.2"), true));
        gone.metadata.resource_version = Some("11".into());
        let line =
            serde_json::to_vec(&serde_json::json!({"type": "MODIFIED", "object": gone})).unwrap();
        send.send_response(Response::builder().body(Body::from(line)).unwrap());
        let set = recv_set(&mut rx).await;
        assert_eq!(set.hosts, vec![hs("10.0.0.1", 2)]);
        assert_eq!(
            set.leaving,
            vec![LeavingPod {
                host: "10.0.0.2".into(),
                deadline: Some(SystemTime::UNIX_EPOCH),
            }],
            "the deleting pod's host has notice"
        );

        task.abort();
    }

    #[tokio::test]
    async fn watch_reports_api_errors_and_keeps_going() {
        tokio::time::pause();
        let (mut handle, mut rx, task) = start_watch();

        let (_req, send) = next(&mut handle).await;
        send.send_response(
            Response::builder()
                .status(403)
                .body(Body::from(
                    serde_json::to_vec(&serde_json::json!({
                        "apiVersion": "v1", "kind": "Status", "status": "Failure",
                        "message": "pods is forbidden", "reason": "Forbidden", "code": 403
                    }))
                    .unwrap(),
                ))
                .unwrap(),
        );
        let err = tokio::time::timeout(Duration::from_secs(5), rx.recv())
            .await
            .unwrap()
            .unwrap()
            .unwrap_err();
        assert!(err.to_string().contains("app=train,role=worker"), "{err}");

        // The watcher lists again after its backoff, and the hosts arrive.
        let (req, send) = next(&mut handle).await;
        assert_eq!(req.uri().path(), "/api/v1/namespaces/ml/pods");
        send.send_response(json_response(&serde_json::json!({
            "apiVersion": "v1", "kind": "PodList",
            "metadata": {"resourceVersion": "5"},
            "items": [pod("w-0", Some("10.0.0.1"), true)],
        })));
        assert_eq!(recv(&mut rx).await, vec![hs("10.0.0.1", 2)]);
        task.abort();
    }

    #[tokio::test]
    async fn watch_leaves_out_a_badly_annotated_pod_and_sends_the_rest() {
        let (mut handle, mut rx, task) = start_watch();
        let (_req, send) = next(&mut handle).await;
        send.send_response(json_response(&serde_json::json!({
            "apiVersion": "v1", "kind": "PodList",
            "metadata": {"resourceVersion": "3"},
            "items": [
                annotated(pod("w-0", Some("10.0.0.1"), true), "lots"),
                pod("w-1", Some("10.0.0.2"), true),
            ],
        })));
        assert_eq!(recv(&mut rx).await, vec![hs("10.0.0.2", 2)]);
        task.abort();
    }

    #[test]
    fn a_skipped_pod_is_warned_about_once_per_value() {
        let mut warned = BTreeSet::new();
        let bad = |v: &str| {
            hosts_from_pods(&[annotated(pod("w-0", Some("10.0.0.1"), true), v)], &sel()).skipped
        };
        assert_eq!(warn_skipped(&bad("x"), &mut warned), 1);
        assert_eq!(
            warn_skipped(&bad("x"), &mut warned),
            0,
            "same pod, same value"
        );
        assert_eq!(warn_skipped(&bad("y"), &mut warned), 1, "a new value");
        assert_eq!(warn_skipped(&[], &mut warned), 0);
        assert_eq!(
            warn_skipped(&bad("y"), &mut warned),
            1,
            "broken again after a fix"
        );
    }

    #[tokio::test]
    async fn empty_selector_is_refused_without_a_request() {
        let (svc, _handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        let client = Client::new(svc, "default");
        let (tx, mut rx) = mpsc::channel(1);
        watch_with_client(client, PodSelector::new(" ", 1), tx).await;
        let err = rx.recv().await.unwrap().unwrap_err();
        assert!(matches!(err, KubeDiscoveryError::EmptySelector), "{err}");
    }

    #[test]
    fn cache_relist_replaces_pods() {
        let mut c = PodCache::default();
        assert!(!c.apply(watcher::Event::Init));
        c.apply(watcher::Event::InitApply(pod("a", Some("1.1.1.1"), true)));
        assert!(!c.live());
        assert!(c.apply(watcher::Event::InitDone));
        assert!(c.live());
        c.apply(watcher::Event::Init);
        assert!(!c.live(), "a re-list in progress is not a complete view");
        c.apply(watcher::Event::InitApply(pod("b", Some("1.1.1.2"), true)));
        c.apply(watcher::Event::InitDone);
        assert_eq!(c.pods.keys().collect::<Vec<_>>(), vec!["ml/b"]);
        c.apply(watcher::Event::Apply(pod("c", Some("1.1.1.3"), true)));
        c.apply(watcher::Event::Delete(pod("b", Some("1.1.1.2"), true)));
        assert_eq!(c.pods.keys().collect::<Vec<_>>(), vec!["ml/c"]);
    }

    #[test]
    fn watch_futures_can_be_spawned() {
        fn assert_send<T: Send + 'static>(_: &T) {}
        let (tx, _rx) = mpsc::channel(1);
        assert_send(&watch(sel(), tx));
    }
}
