//! Tests against a real Kubernetes API server. They are `#[ignore]`d: no API server runs offline.
//!
//! Run them on kind, with the image built and loaded as in `examples/k8s/README.md`:
//!
//! ```sh
//! kind create cluster --name hvd
//! docker build -t hvd:0.1.0 . && kind load docker-image hvd:0.1.0 --name hvd
//! cargo test -p hvd-operator --test real_cluster -- --ignored --test-threads 1
//! ```
//!
//! They use the current kube context (`KUBECONFIG`), each in a fresh namespace `hvd-test-*` that
//! is deleted when the test ends, pass or fail. `HVD_K8S_IMAGE` picks another image (default
//! `hvd:0.1.0`). The operator runs inside the test process, so no chart is needed; the CRD is
//! applied from the Rust types.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use hvd_discovery::HostSpec;
use hvd_discovery::kubernetes::{PodSelector, watch_with_client};
use hvd_operator::crd::{BlacklistSpec, DiscoverySpec, ElasticJob, ElasticJobSpec};
use hvd_operator::reconcile::{Context, run};
use k8s_openapi::api::core::v1::{Container, Namespace, Pod, PodSpec};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::{Client, CustomResourceExt, ResourceExt};
use tokio::sync::{mpsc, watch};

fn image() -> String {
    std::env::var("HVD_K8S_IMAGE").unwrap_or_else(|_| "hvd:0.1.0".into())
}

/// A fresh namespace, deleted on drop.
struct TestNamespace {
    client: Client,
    name: String,
}

impl TestNamespace {
    async fn create(client: &Client, prefix: &str) -> Self {
        let name = format!("hvd-test-{prefix}-{}", std::process::id());
        let ns: Namespace = serde_json::from_value(serde_json::json!({
            "apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name},
        }))
        .unwrap();
        Api::<Namespace>::all(client.clone())
            .create(&PostParams::default(), &ns)
            .await
            .unwrap();
        TestNamespace {
            client: client.clone(),
            name,
        }
    }
}

impl Drop for TestNamespace {
    fn drop(&mut self) {
        let client = self.client.clone();
        let name = self.name.clone();
        // Drop can't await; a thread with its own runtime deletes the namespace.
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async {
                let _ = Api::<Namespace>::all(client)
                    .delete(&name, &DeleteParams::background())
                    .await;
            });
        })
        .join();
    }
}

async fn apply_crd(client: &Client) {
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    let crd = ElasticJob::crd();
    crds.patch(
        "elasticjobs.hvd.dev",
        &PatchParams::apply("hvd-operator-test").force(),
        &Patch::Apply(&crd),
    )
    .await
    .unwrap();
    // The API serves the new kind a moment after the CRD is accepted.
    tokio::time::sleep(Duration::from_secs(2)).await;
}

/// Polls `check` every second for up to `secs` seconds.
async fn eventually<F, Fut>(secs: u64, what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    for _ in 0..secs {
        if check().await {
            return;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    panic!("timed out waiting for {what}");
}

async fn worker_pods(pods: &Api<Pod>, job: &str) -> Vec<Pod> {
    let sel = format!("hvd.dev/job={job},hvd.dev/role=worker");
    pods.list(&ListParams::default().labels(&sel))
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .collect()
}

#[tokio::test]
#[ignore = "needs a Kubernetes cluster (kind); see the file's header"]
async fn operator_creates_scales_replaces_and_cleans_up() {
    let client = Client::try_default().await.unwrap();
    apply_crd(&client).await;
    let ns = TestNamespace::create(&client, "op").await;
    let (stop_tx, mut stop_rx) = watch::channel(false);
    let ctx = Context::new(client.clone(), Some("real-cluster-test".into()));
    let operator = tokio::spawn(run(ctx, Some(ns.name.clone()), async move {
        let _ = stop_rx.wait_for(|s| *s).await;
    }));

    let jobs: Api<ElasticJob> = Api::namespaced(client.clone(), &ns.name);
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns.name);
    let job = ElasticJob::new(
        "rc",
        ElasticJobSpec {
            image: image(),
            command: vec![
                "elastic_counter".into(),
                "--steps".into(),
                "100000".into(),
                "--step-ms".into(),
                "20".into(),
            ],
            min_replicas: 1,
            max_replicas: 3,
            replicas: Some(3),
            slots_per_worker: 1,
            resources: None,
            env: vec![],
            discovery: DiscoverySpec::default(),
            blacklist: BlacklistSpec {
                cooldown_range: Some([5, 30]),
            },
            state_store: None,
        },
    );
    jobs.create(&PostParams::default(), &job).await.unwrap();

    eventually(120, "a driver pod and 3 worker pods", || async {
        pods.get_opt("rc-driver").await.unwrap().is_some()
            && worker_pods(&pods, "rc").await.len() == 3
    })
    .await;
    let j = jobs.get("rc").await.unwrap();
    assert!(j.finalizers().iter().any(|f| f == "hvd.dev/cleanup"));

    // Scale subresource: down to 2.
    jobs.patch_scale(
        "rc",
        &PatchParams::default(),
        &Patch::Merge(serde_json::json!({"spec": {"replicas": 2}})),
    )
    .await
    .unwrap();
    eventually(60, "2 worker pods after scaling", || async {
        worker_pods(&pods, "rc").await.len() == 2
    })
    .await;

    // A deleted worker (a spot preemption) is replaced under a new name.
    let victim = worker_pods(&pods, "rc").await[0].name_any();
    pods.delete(&victim, &DeleteParams::default())
        .await
        .unwrap();
    eventually(60, "a replacement worker", || async {
        let now = worker_pods(&pods, "rc").await;
        now.len() == 2 && now.iter().all(|p| p.name_any() != victim)
    })
    .await;

    // Deleting the job removes its pods, then the job.
    jobs.delete("rc", &DeleteParams::default()).await.unwrap();
    eventually(60, "the job and its pods to go", || async {
        jobs.get_opt("rc").await.unwrap().is_none()
            && pods
                .list(&ListParams::default().labels("hvd.dev/job=rc"))
                .await
                .unwrap()
                .items
                .iter()
                .all(|p| p.metadata.deletion_timestamp.is_some())
    })
    .await;

    let _ = stop_tx.send(true);
    tokio::time::timeout(Duration::from_secs(30), operator)
        .await
        .unwrap()
        .unwrap();
}

type HostRx = mpsc::Receiver<
    Result<hvd_discovery::kubernetes::PodSet, hvd_discovery::kubernetes::KubeDiscoveryError>,
>;

/// The next host set from the watch, within 2 minutes.
async fn next(rx: &mut HostRx) -> Vec<HostSpec> {
    tokio::time::timeout(Duration::from_secs(120), rx.recv())
        .await
        .expect("no host set within 2 minutes")
        .expect("the watch ended")
        .expect("the watch failed")
        .hosts
}

#[tokio::test]
#[ignore = "needs a Kubernetes cluster (kind); see the file's header"]
async fn pod_discovery_follows_readiness_and_deletion() {
    let client = Client::try_default().await.unwrap();
    let ns = TestNamespace::create(&client, "disc").await;
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns.name);
    let (tx, mut rx) = mpsc::channel(16);
    let mut sel = PodSelector::new("app=disc-test", 3);
    sel.namespace = Some(ns.name.clone());
    let watcher = tokio::spawn(watch_with_client(client.clone(), sel, tx));
    assert!(next(&mut rx).await.is_empty(), "the initial list is empty");

    let pod: Pod = Pod {
        metadata: kube::api::ObjectMeta {
            name: Some("w0".into()),
            labels: Some([("app".to_string(), "disc-test".to_string())].into()),
            ..Default::default()
        },
        spec: Some(PodSpec {
            containers: vec![Container {
                name: "sleep".into(),
                image: Some(image()),
                command: Some(vec!["sleep".into(), "3600".into()]),
                ..Default::default()
            }],
            termination_grace_period_seconds: Some(30),
            ..Default::default()
        }),
        status: None,
    };
    pods.create(&PostParams::default(), &pod).await.unwrap();
    let hosts = loop {
        let hosts = next(&mut rx).await;
        if !hosts.is_empty() {
            break hosts;
        }
    };
    assert_eq!(hosts.len(), 1);
    assert_eq!(hosts[0].slots, 3);
    let ip = pods
        .get("w0")
        .await
        .unwrap()
        .status
        .unwrap()
        .pod_ip
        .unwrap();
    assert_eq!(hosts[0].host, ip);

    // The deletion timestamp alone (the pod still runs out its grace period) removes the host.
    pods.delete("w0", &DeleteParams::default()).await.unwrap();
    assert!(
        next(&mut rx).await.is_empty(),
        "a deleting pod is not a host"
    );
    watcher.abort();
}
