//! Request sequences of [`reconcile`] against a scripted API server (`tower-test`): each scenario
//! lists the calls the reconciler must make, in order; a missing call times out and an extra one
//! fails the reconcile.

use std::sync::Arc;
use std::time::Duration;

use http::{Method, Request, Response};
use k8s_openapi::api::core::v1::Pod;
use kube::Client;
use kube::client::Body;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

use crate::crd::ElasticJob;
use crate::fixtures::{deleting, driver, exited, in_phase, job, with_store, with_uid, worker};
use crate::reconcile::{Context, FINALIZER, reconcile};

type Handle = tower_test::mock::Handle<Request<Body>, Response<Body>>;

/// The scripted API server.
struct ApiServer {
    handle: Handle,
    /// The job, as the status patch's answer.
    job: Value,
}

/// One request the reconciler made.
struct Seen {
    query: String,
    content_type: String,
    body: Value,
}

impl ApiServer {
    /// Expects `method path` next and answers `status` with what `reply` makes of the body.
    async fn expect_status(
        &mut self,
        method: Method,
        path: &str,
        status: u16,
        reply: impl FnOnce(&Value) -> Value,
    ) -> Seen {
        let (req, send) = tokio::time::timeout(Duration::from_secs(5), self.handle.next_request())
            .await
            .unwrap_or_else(|_| panic!("no request; expected {method} {path}"))
            .expect("client gone");
        assert_eq!(
            (req.method(), req.uri().path()),
            (&method, path),
            "unexpected request {} {}",
            req.method(),
            req.uri()
        );
        let query = req.uri().query().unwrap_or_default().to_string();
        let content_type = req
            .headers()
            .get(http::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_string();
        let bytes = req.into_body().collect_bytes().await.unwrap();
        let body: Value = if bytes.is_empty() {
            Value::Null
        } else {
            serde_json::from_slice(&bytes).unwrap()
        };
        let out = serde_json::to_vec(&reply(&body)).unwrap();
        send.send_response(
            Response::builder()
                .status(status)
                .body(Body::from(out))
                .unwrap(),
        );
        Seen {
            query,
            content_type,
            body,
        }
    }

    /// Expects `method path` next and answers 200 with what `reply` makes of the body.
    async fn expect(
        &mut self,
        method: Method,
        path: &str,
        reply: impl FnOnce(&Value) -> Value,
    ) -> Seen {
        self.expect_status(method, path, 200, reply).await
    }

    /// Expects a server-side apply of `path` and echoes the object back.
    async fn expect_apply(&mut self, path: &str) -> Value {
        let seen = self.expect(Method::PATCH, path, Clone::clone).await;
        assert_eq!(seen.content_type, "application/apply-patch+yaml", "{path}");
        assert!(
            seen.query.contains("fieldManager=hvd-operator"),
            "{}",
            seen.query
        );
        assert!(seen.query.contains("force=true"), "{}", seen.query);
        seen.body
    }

    /// Expects an Event with `reason` on the job.
    async fn expect_event(&mut self, reason: &str) -> Value {
        let seen = self
            .expect(
                Method::POST,
                "/apis/events.k8s.io/v1/namespaces/ml/events",
                Clone::clone,
            )
            .await;
        assert_eq!(seen.body["reason"], reason, "{}", seen.body);
        assert_eq!(seen.body["regarding"]["kind"], "ElasticJob");
        seen.body
    }

    /// Expects the pod list of job `name` and answers `pods`.
    async fn expect_pod_list(&mut self, name: &str, pods: &[Pod]) {
        let seen = self
            .expect(Method::GET, "/api/v1/namespaces/ml/pods", |_| {
                json!({"apiVersion": "v1", "kind": "PodList", "metadata": {"resourceVersion": "1"}, "items": pods})
            })
            .await;
        assert!(
            seen.query
                .contains(&format!("labelSelector=hvd.dev%2Fjob%3D{name}")),
            "{}",
            seen.query
        );
    }

    /// Expects the status patch of job `name` and returns the status written.
    async fn expect_status_patch(&mut self, name: &str) -> Value {
        let path = format!("/apis/hvd.dev/v1alpha1/namespaces/ml/elasticjobs/{name}/status");
        let mut job = self.job.clone();
        let seen = self
            .expect(Method::PATCH, &path, |b| {
                job["status"] = b["status"].clone();
                job
            })
            .await;
        assert_eq!(seen.content_type, "application/apply-patch+yaml");
        seen.body["status"].clone()
    }

    /// Expects deletion of pod `name`.
    async fn expect_pod_delete(&mut self, name: &str) {
        let path = format!("/api/v1/namespaces/ml/pods/{name}");
        self.expect(
            Method::DELETE,
            &path,
            |_| json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}}),
        )
        .await;
    }

    /// Expects the driver's ServiceAccount, Role and RoleBinding, the workers' Service and the
    /// driver's Service of job `name` to be applied, in that order; returns the driver's Service.
    async fn expect_shared(&mut self, name: &str) -> Value {
        let sa = self
            .expect_apply(&format!(
                "/api/v1/namespaces/ml/serviceaccounts/{name}-driver"
            ))
            .await;
        assert_eq!(sa["kind"], "ServiceAccount");
        let rbac = "/apis/rbac.authorization.k8s.io/v1/namespaces/ml";
        let role = self
            .expect_apply(&format!("{rbac}/roles/{name}-driver"))
            .await;
        assert_eq!(role["rules"][0]["verbs"], json!(["get", "list", "watch"]));
        self.expect_apply(&format!("{rbac}/rolebindings/{name}-driver"))
            .await;
        let svc = self
            .expect_apply(&format!("/api/v1/namespaces/ml/services/{name}-workers"))
            .await;
        assert_eq!(svc["spec"]["clusterIP"], "None");
        // Every job's driver Service: the metrics of its driver, for one ServiceMonitor.
        let driver = self
            .expect_apply(&format!("/api/v1/namespaces/ml/services/{name}-driver"))
            .await;
        assert_eq!(driver["metadata"]["labels"]["hvd.dev/metrics"], "driver");
        assert_eq!(
            driver["metadata"]["ownerReferences"][0]["kind"],
            "ElasticJob"
        );
        assert_eq!(driver["spec"]["selector"]["hvd.dev/role"], "driver");
        let ports = driver["spec"]["ports"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        assert!(
            ports
                .iter()
                .any(|p| p["name"] == "status" && p["port"] == 8080),
            "{driver}"
        );
        driver
    }

    /// Expects a worker pod to be applied.
    async fn expect_worker_created(&mut self, name: &str) {
        let pod = self
            .expect_apply(&format!("/api/v1/namespaces/ml/pods/{name}"))
            .await;
        assert_eq!(pod["metadata"]["labels"]["hvd.dev/role"], "worker");
        assert_eq!(pod["metadata"]["ownerReferences"][0]["kind"], "ElasticJob");
        self.expect_event("CreatedWorker").await;
    }
}

/// A context over a mock API server, with driver status read from `status_port`.
fn setup(status_port: u16) -> (Arc<Context>, ApiServer) {
    let (svc, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    let client = Client::new(svc, "default");
    let mut ctx = Context::new(client, Some("test".into()));
    ctx.status_port = status_port;
    ctx.status_timeout = Duration::from_secs(2);
    (
        Arc::new(ctx),
        ApiServer {
            handle,
            job: Value::Null,
        },
    )
}

fn with_finalizer(mut j: ElasticJob) -> ElasticJob {
    j.metadata.finalizers = Some(vec![FINALIZER.into()]);
    j
}

/// A driver `GET /status` endpoint on 127.0.0.1 answering `body`; stopped on drop.
struct FakeDriver {
    port: u16,
    task: JoinHandle<()>,
}

impl FakeDriver {
    async fn start(body: Value) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let body = body.to_string();
        let task = tokio::spawn(async move {
            while let Ok((mut s, _)) = listener.accept().await {
                let mut buf = [0u8; 1024];
                let _ = s.read(&mut buf).await;
                let resp =
                    format!("HTTP/1.0 200 OK\r\ncontent-type: application/json\r\n\r\n{body}");
                let _ = s.write_all(resp.as_bytes()).await;
            }
        });
        FakeDriver { port, task }
    }
}

impl Drop for FakeDriver {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A driver reporting `report`, a context that reads it, and the scripted API server.
async fn running_job(report: Value) -> (FakeDriver, Arc<Context>, ApiServer) {
    let fake = FakeDriver::start(report).await;
    let (ctx, server) = setup(fake.port);
    (fake, ctx, server)
}

/// The driver pod (at 127.0.0.1, where [`FakeDriver`] listens) and workers 0 and 1, worker 0
/// passed through `first`.
fn driver_and_two_workers(j: &ElasticJob, first: impl FnOnce(Pod) -> Pod) -> Vec<Pod> {
    vec![
        driver(j, "127.0.0.1"),
        first(worker(j, 0, "10.0.0.1")),
        worker(j, 1, "10.0.0.2"),
    ]
}

fn driver_report(blacklisted: &[&str]) -> Value {
    json!({
        "phase": "Running", "generation": 4, "workers": 4,
        "hosts": [], "resets": 1,
        "blacklisted": blacklisted.iter().map(|h| json!({"host": h, "until_ms": 99})).collect::<Vec<_>>(),
    })
}

/// Runs `reconcile(job)` while `script` plays the API server; both must finish in time.
async fn run_scenario<F>(
    job: ElasticJob,
    ctx: Arc<Context>,
    mut server: ApiServer,
    script: impl FnOnce(ApiServer) -> F,
) where
    F: std::future::Future<Output = ()> + Send + 'static,
{
    server.job = serde_json::to_value(&job).unwrap();
    let srv = tokio::spawn(script(server));
    tokio::time::timeout(Duration::from_secs(10), reconcile(Arc::new(job), ctx))
        .await
        .expect("reconcile hung")
        .expect("reconcile failed");
    tokio::time::timeout(Duration::from_secs(5), srv)
        .await
        .expect("expected requests were not all made")
        .expect("the scripted API server failed");
}

#[tokio::test]
async fn create_adds_the_finalizer_first() {
    let (ctx, server) = setup(1);
    let j = job("train", 1, 2);
    run_scenario(j.clone(), ctx, server, |mut s| async move {
        let path = "/apis/hvd.dev/v1alpha1/namespaces/ml/elasticjobs/train";
        let seen = s
            .expect(Method::PATCH, path, |_| {
                serde_json::to_value(with_finalizer(j)).unwrap()
            })
            .await;
        assert_eq!(seen.content_type, "application/json-patch+json");
        assert!(seen.body.to_string().contains(FINALIZER), "{}", seen.body);
    })
    .await;
}

#[tokio::test]
async fn create_makes_driver_rbac_service_secret_and_workers() {
    let (ctx, server) = setup(1);
    let j = with_finalizer(job("train", 1, 2));
    run_scenario(j, ctx, server, |mut s| async move {
        s.expect_pod_list("train", &[]).await;
        s.expect_shared("train").await;
        let secret = s
            .expect(Method::POST, "/api/v1/namespaces/ml/secrets", Clone::clone)
            .await;
        assert_eq!(secret.body["metadata"]["name"], "train-secret-uid-train");
        let driver = s
            .expect_apply("/api/v1/namespaces/ml/pods/train-driver")
            .await;
        let cmd = driver["spec"]["containers"][0]["command"]
            .as_array()
            .unwrap()
            .clone();
        assert_eq!(cmd[0], "horovodrun");
        assert!(cmd.contains(&json!("--discovery")));
        s.expect_event("CreatedDriver").await;
        s.expect_worker_created("train-worker-0").await;
        s.expect_worker_created("train-worker-1").await;
        let status = s.expect_status_patch("train").await;
        assert_eq!(status["phase"], "Pending");
        assert_eq!(status["selector"], "hvd.dev/job=train,hvd.dev/role=worker");
    })
    .await;
}

#[tokio::test]
async fn rescale_down_deletes_the_newest_worker() {
    let (_fake, ctx, server) = running_job(driver_report(&[])).await;
    let mut j = with_finalizer(job("train", 1, 3));
    j.spec.replicas = Some(1);
    let pods = driver_and_two_workers(&j, |p| p);
    run_scenario(j, ctx, server, |mut s| async move {
        s.expect_pod_list("train", &pods).await;
        s.expect_shared("train").await;
        s.expect_pod_delete("train-worker-1").await;
        s.expect_event("ScaledDown").await;
        let status = s.expect_status_patch("train").await;
        assert_eq!(status["phase"], "Rescaling");
        assert_eq!(status["workers"], 1);
        assert_eq!(status["round"], 4, "the round comes from the driver");
    })
    .await;
}

#[tokio::test]
async fn rescale_up_creates_workers() {
    let (_fake, ctx, server) = running_job(driver_report(&[])).await;
    let mut j = with_finalizer(job("train", 1, 3));
    j.spec.replicas = Some(2);
    let pods = vec![driver(&j, "127.0.0.1"), worker(&j, 0, "10.0.0.1")];
    run_scenario(j, ctx, server, |mut s| async move {
        s.expect_pod_list("train", &pods).await;
        s.expect_shared("train").await;
        s.expect_worker_created("train-worker-1").await;
        s.expect_status_patch("train").await;
    })
    .await;
}

/// A running job whose image was edited: the worker it adds is made from the image the job
/// started with, and the status says the edit is not applied, naming it.
#[tokio::test]
async fn edited_job_keeps_making_pods_from_its_started_spec() {
    let (_fake, ctx, server) = running_job(driver_report(&[])).await;
    let started = with_finalizer(job("train", 1, 3));
    let mut j = started.clone();
    j.spec.image = "hvd:next".into();
    j.spec.replicas = Some(2);
    let pods = vec![
        driver(&started, "127.0.0.1"),
        worker(&started, 0, "10.0.0.1"),
    ];
    run_scenario(j, ctx, server, |mut s| async move {
        s.expect_pod_list("train", &pods).await;
        s.expect_shared("train").await;
        let pod = s
            .expect_apply("/api/v1/namespaces/ml/pods/train-worker-1")
            .await;
        assert_eq!(pod["spec"]["containers"][0]["image"], "hvd:test", "{pod}");
        s.expect_event("CreatedWorker").await;
        let status = s.expect_status_patch("train").await;
        let applied = status["conditions"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["type"] == "SpecApplied")
            .cloned()
            .unwrap();
        assert_eq!(applied["status"], "False", "{applied}");
        assert_eq!(applied["reason"], "ChangedWhileRunning", "{applied}");
        assert!(
            applied["message"]
                .as_str()
                .unwrap()
                .starts_with("spec.image changed"),
            "{applied}"
        );
    })
    .await;
}

#[tokio::test]
async fn failed_worker_is_deleted_and_replaced() {
    let (_fake, ctx, server) = running_job(driver_report(&[])).await;
    let j = with_finalizer(job("train", 1, 2));
    let pods = driver_and_two_workers(&j, |p| in_phase(p, "Failed", Some("Evicted")));
    run_scenario(j, ctx, server, |mut s| async move {
        s.expect_pod_list("train", &pods).await;
        s.expect_shared("train").await;
        s.expect_pod_delete("train-worker-0").await;
        let ev = s.expect_event("ReplacingFailedWorker").await;
        assert!(ev["note"].as_str().unwrap().contains("Evicted"), "{ev}");
        assert_eq!(ev["type"], "Warning");
        s.expect_worker_created("train-worker-2").await;
        s.expect_status_patch("train").await;
    })
    .await;
}

#[tokio::test]
async fn blacklisted_host_loses_its_pod() {
    let blacklisted = "train-worker-1.train-workers.ml.svc";
    let (_fake, ctx, server) = running_job(driver_report(&[blacklisted])).await;
    let j = with_finalizer(job("train", 1, 2));
    let pods = driver_and_two_workers(&j, |p| p);
    run_scenario(j, ctx, server, |mut s| async move {
        s.expect_pod_list("train", &pods).await;
        s.expect_shared("train").await;
        s.expect_pod_delete("train-worker-1").await;
        s.expect_event("RemovingBlacklistedWorker").await;
        s.expect_worker_created("train-worker-2").await;
        let status = s.expect_status_patch("train").await;
        assert_eq!(status["blacklisted"], json!([blacklisted]));
    })
    .await;
}

#[tokio::test]
async fn spot_pod_being_deleted_is_replaced_without_a_second_delete() {
    let (_fake, ctx, server) = running_job(driver_report(&[])).await;
    let j = with_finalizer(job("train", 1, 2));
    let pods = driver_and_two_workers(&j, deleting);
    run_scenario(j, ctx, server, |mut s| async move {
        s.expect_pod_list("train", &pods).await;
        s.expect_shared("train").await;
        s.expect_worker_created("train-worker-2").await;
        let status = s.expect_status_patch("train").await;
        assert_eq!(status["workers"], 1);
    })
    .await;
}

#[tokio::test]
async fn steady_job_applies_its_service_account_rbac_and_service_again() {
    // Garbage collection (or a person) removed them: every reconcile brings them back.
    let (_fake, ctx, server) = running_job(driver_report(&[])).await;
    let j = with_finalizer(job("train", 1, 2));
    let pods = driver_and_two_workers(&j, |p| p);
    run_scenario(j, ctx, server, |mut s| async move {
        s.expect_pod_list("train", &pods).await;
        s.expect_shared("train").await;
        let status = s.expect_status_patch("train").await;
        assert_eq!(status["phase"], "Running");
    })
    .await;
}

/// `p` as a pod of a deleted job of the same name, still being removed.
fn of_deleted_job(p: Pod) -> Pod {
    let mut p = deleting(p);
    for r in p.metadata.owner_references.as_mut().unwrap() {
        r.uid = "uid-deleted".into();
    }
    p
}

#[tokio::test]
async fn recreated_job_waits_for_the_deleted_jobs_driver_pod() {
    let (ctx, server) = setup(1);
    let j = with_finalizer(job("train", 1, 1));
    let pods = vec![of_deleted_job(in_phase(
        driver(&j, "10.0.0.100"),
        "Succeeded",
        None,
    ))];
    run_scenario(j, ctx, server, |mut s| async move {
        s.expect_pod_list("train", &pods).await;
        s.expect_shared("train").await;
        let status = s.expect_status_patch("train").await;
        assert_eq!(
            status["phase"], "Pending",
            "the old driver's end is not this job's"
        );
        let ready = &status["conditions"][0];
        assert_eq!(ready["reason"], "DriverNameTaken", "{ready}");
        assert!(
            ready["message"]
                .as_str()
                .unwrap()
                .contains("waiting for pod train-driver of a deleted ElasticJob"),
            "{ready}"
        );
    })
    .await;
}

#[tokio::test]
async fn recreated_job_gets_its_own_secret_and_ignores_the_old_pods() {
    let (ctx, server) = setup(1);
    let mut j = with_finalizer(job("train", 1, 2));
    j.metadata.uid = Some("uid-new".into());
    let old = job("train", 1, 2);
    let pods = vec![of_deleted_job(worker(&old, 0, "10.0.0.1"))];
    run_scenario(j, ctx, server, |mut s| async move {
        s.expect_pod_list("train", &pods).await;
        s.expect_shared("train").await;
        let secret = s
            .expect(Method::POST, "/api/v1/namespaces/ml/secrets", Clone::clone)
            .await;
        assert_eq!(secret.body["metadata"]["name"], "train-secret-uid-new");
        let driver = s
            .expect_apply("/api/v1/namespaces/ml/pods/train-driver")
            .await;
        assert_eq!(
            driver["spec"]["volumes"][0]["secret"]["secretName"],
            "train-secret-uid-new"
        );
        s.expect_event("CreatedDriver").await;
        // Index 0 is still held by the old job's pod.
        s.expect_worker_created("train-worker-1").await;
        s.expect_worker_created("train-worker-2").await;
        let status = s.expect_status_patch("train").await;
        assert_eq!(status["phase"], "Pending");
        assert_eq!(status["workers"], 0);
    })
    .await;
}

#[tokio::test]
async fn deletion_removes_pods_then_the_finalizer() {
    let (ctx, server) = setup(1);
    let mut j = with_finalizer(job("train", 1, 2));
    j.metadata.deletion_timestamp = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
        k8s_openapi::jiff::Timestamp::UNIX_EPOCH,
    ));
    let gone = j.clone();
    // worker-0 is already going: no second delete for it.
    let pods = driver_and_two_workers(&j, deleting);
    run_scenario(j, ctx, server, |mut s| async move {
        s.expect_pod_list("train", &pods).await;
        s.expect_pod_delete("train-driver").await;
        s.expect_pod_delete("train-worker-1").await;
        s.expect_event("Cleanup").await;
        let path = "/apis/hvd.dev/v1alpha1/namespaces/ml/elasticjobs/train";
        let seen = s
            .expect(Method::PATCH, path, |_| {
                let mut j = gone;
                j.metadata.finalizers = None;
                serde_json::to_value(j).unwrap()
            })
            .await;
        assert_eq!(seen.content_type, "application/json-patch+json");
        assert!(seen.body.to_string().contains("remove"), "{}", seen.body);
    })
    .await;
}

#[tokio::test]
async fn lost_driver_is_recreated_and_an_existing_secret_is_kept() {
    let (ctx, server) = setup(1);
    let j = with_finalizer(job("train", 1, 1));
    let pods = vec![worker(&j, 0, "10.0.0.1")];
    run_scenario(j, ctx, server, |mut s| async move {
        s.expect_pod_list("train", &pods).await;
        s.expect_shared("train").await;
        let seen = s.expect_status(Method::POST, "/api/v1/namespaces/ml/secrets", 409, |_| {
            json!({"apiVersion": "v1", "kind": "Status", "status": "Failure",
                   "message": "secrets \"train-secret-uid-train\" already exists", "reason": "AlreadyExists", "code": 409})
        })
        .await;
        assert_eq!(seen.body["metadata"]["name"], "train-secret-uid-train");
        s.expect_apply("/api/v1/namespaces/ml/pods/train-driver").await;
        s.expect_event("CreatedDriver").await;
        s.expect_status_patch("train").await;
    })
    .await;
}

#[tokio::test]
async fn finished_job_removes_workers_and_reports_success() {
    let (ctx, server) = setup(1);
    let j = with_finalizer(job("train", 1, 1));
    let pods = vec![
        in_phase(driver(&j, "10.0.0.100"), "Succeeded", None),
        worker(&j, 0, "10.0.0.1"),
    ];
    run_scenario(j, ctx, server, |mut s| async move {
        s.expect_pod_list("train", &pods).await;
        s.expect_pod_delete("train-worker-0").await;
        s.expect_event("JobFinished").await;
        let status = s.expect_status_patch("train").await;
        assert_eq!(status["phase"], "Succeeded");
        s.expect_event("Succeeded").await;
    })
    .await;
}

#[tokio::test]
async fn api_errors_fail_the_reconcile() {
    let (ctx, mut server) = setup(1);
    let j = with_finalizer(job("train", 1, 1));
    let srv = tokio::spawn(async move {
        server
            .expect_status(Method::GET, "/api/v1/namespaces/ml/pods", 403, |_| {
                json!({"apiVersion": "v1", "kind": "Status", "status": "Failure",
                       "message": "pods is forbidden", "reason": "Forbidden", "code": 403})
            })
            .await;
    });
    let err = tokio::time::timeout(Duration::from_secs(10), reconcile(Arc::new(j), ctx))
        .await
        .unwrap()
        .unwrap_err();
    assert!(err.to_string().contains("forbidden"), "{err}");
    srv.await.unwrap();
}

/// A job with a state store whose driver pod was OOM-killed: the operator applies the driver's
/// Service with the rest, deletes the failed pod (its successor takes the name on the next
/// reconcile), keeps every worker, and says so in an Event and the status.
#[tokio::test]
async fn lost_driver_of_a_job_with_a_store_is_replaced_and_its_workers_kept() {
    let (ctx, server) = setup(1);
    let mut j = with_finalizer(with_store(job("train", 1, 2), 5));
    j.status = Some(crate::crd::ElasticJobStatus {
        driver_uid: Some("uid-d1".into()),
        ..Default::default()
    });
    let oom = exited(driver(&j, "10.0.0.100"), 137, Some("OOMKilled"), None);
    let pods = vec![
        with_uid(oom, "uid-d1"),
        worker(&j, 0, "10.0.0.1"),
        worker(&j, 1, "10.0.0.2"),
    ];
    run_scenario(j, ctx, server, |mut s| async move {
        s.expect_pod_list("train", &pods).await;
        let svc = s.expect_shared("train").await;
        assert_eq!(svc["spec"]["selector"]["hvd.dev/role"], "driver");
        assert_eq!(svc["spec"]["ports"][0]["port"], 7078);
        assert_eq!(svc["spec"]["ports"][1]["port"], 8080);
        s.expect_pod_delete("train-driver").await;
        let event = s.expect_event("ReplacingDriver").await;
        assert!(
            event["note"]
                .as_str()
                .unwrap()
                .contains("exit 137, OOMKilled"),
            "{event}"
        );
        let status = s.expect_status_patch("train").await;
        assert_eq!(status["phase"], "Pending");
        assert_eq!(status["conditions"][0]["reason"], "ReplacingDriver");
    })
    .await;
}

/// The next reconcile finds no driver pod: a new one is created and the replacement counted.
#[tokio::test]
async fn replacement_driver_is_created_and_counted() {
    let (ctx, server) = setup(1);
    let mut j = with_finalizer(with_store(job("train", 1, 1), 5));
    j.status = Some(crate::crd::ElasticJobStatus {
        driver_uid: Some("uid-d1".into()),
        ..Default::default()
    });
    let pods = vec![worker(&j, 0, "10.0.0.1")];
    run_scenario(j, ctx, server, |mut s| async move {
        s.expect_pod_list("train", &pods).await;
        s.expect_shared("train").await;
        let seen = s
            .expect(Method::POST, "/api/v1/namespaces/ml/secrets", Clone::clone)
            .await;
        assert!(seen.body["data"]["job"].is_string(), "{}", seen.body);
        let pod = s
            .expect_apply("/api/v1/namespaces/ml/pods/train-driver")
            .await;
        let cmd = pod["spec"]["containers"][0]["command"].to_string();
        assert!(cmd.contains("--standby"), "{cmd}");
        s.expect_event("CreatedDriver").await;
        let status = s.expect_status_patch("train").await;
        assert_eq!(status["driverRestarts"], 1);
        assert!(status.get("driverUid").is_none(), "{status}");
    })
    .await;
}
