//! `horovodrun --discovery kubernetes` end to end against a small fake API server: the driver
//! lists and watches the selected pods, trains `elastic_counter` on the Ready ones (their pod
//! IPs are 127.0.0.x), and leaves a pod gracefully when a watch event says it is no longer
//! Ready. Without any cluster configuration the job fails naming the cause.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test that cannot set up fails loudly

mod support;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::Duration;

use serde_json::{Value, json};
use support::{Job, check_counter, example, scratch, steps_rerun};

const COUNTER: &[&str] = &["--steps", "250", "--commit-every", "5", "--step-ms", "10"];

/// Pod discovery of the fake API server's `app=train` pods, 2 slots each unless annotated.
const POD_DISCOVERY: &[&str] = &[
    "--discovery",
    "kubernetes",
    "--selector",
    "app=train",
    "--slots",
    "2",
];

/// A pod of namespace `ns1`; `ready` sets its Ready condition.
fn pod(name: &str, ip: &str, ready: bool, slots: Option<&str>) -> Value {
    let mut p = json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "ns1", "uid": format!("uid-{name}"),
                     "labels": {"app": "train"}},
        "spec": {"containers": [{"name": "worker", "image": "hvd"}]},
        "status": {"podIP": ip, "phase": "Running",
                   "conditions": [{"type": "Ready", "status": if ready { "True" } else { "False" }}]}
    });
    if let Some(s) = slots {
        p["metadata"]["annotations"] = json!({"hvd.dev/slots": s});
    }
    p
}

/// The API server's state: pods by name, the watch events so far, and the requests seen.
#[derive(Default)]
struct State {
    pods: Vec<Value>,
    events: Vec<Value>,
    version: u64,
    requests: Vec<String>,
}

/// Just enough of the Kubernetes API for a pod list and watch, over plain HTTP/1.1.
struct FakeApi {
    port: u16,
    state: Arc<Mutex<State>>,
}

impl FakeApi {
    fn start(pods: Vec<Value>) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let state = Arc::new(Mutex::new(State {
            pods,
            version: 1,
            ..State::default()
        }));
        let shared = state.clone();
        thread::spawn(move || {
            for stream in listener.incoming().map_while(Result::ok) {
                let state = shared.clone();
                thread::spawn(move || serve(stream, &state));
            }
        });
        Self { port, state }
    }

    /// Replaces a pod and sends the change to every watch.
    fn modify(&self, new: Value) {
        let mut st = self.state.lock().unwrap();
        st.version += 1;
        let mut new = new;
        new["metadata"]["resourceVersion"] = json!(st.version.to_string());
        let name = new["metadata"]["name"].clone();
        st.pods.retain(|p| p["metadata"]["name"] != name);
        st.pods.push(new.clone());
        st.events.push(json!({"type": "MODIFIED", "object": new}));
    }

    fn requests(&self) -> Vec<String> {
        self.state.lock().unwrap().requests.clone()
    }
}

/// Answers the requests of one connection: lists with a body, watches as a stream that
/// carries every event added after it began.
fn serve(stream: TcpStream, state: &Arc<Mutex<State>>) {
    let mut reader = BufReader::new(stream.try_clone().unwrap());
    let mut w = stream;
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).unwrap_or(0) == 0 {
            return;
        }
        loop {
            let mut h = String::new();
            if reader.read_line(&mut h).unwrap_or(0) == 0 || h == "\r\n" {
                break;
            }
        }
        let target = line.split(' ').nth(1).unwrap_or_default().to_string();
        state.lock().unwrap().requests.push(target.clone());
        if !target.starts_with("/api/v1/namespaces/ns1/pods") {
            let body = r#"{"kind":"Status","apiVersion":"v1","status":"Failure","reason":"NotFound","code":404}"#;
            let _ = write!(
                w,
                "HTTP/1.1 404 Not Found\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
                body.len()
            );
            continue;
        }
        if target.contains("watch=true") || target.contains("watch=1") {
            let _ = write!(
                w,
                "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
            );
            let mut sent = state.lock().unwrap().events.len();
            loop {
                let new: Vec<Value> = state.lock().unwrap().events[sent..].to_vec();
                for ev in new {
                    let data = format!("{ev}\n");
                    if write!(w, "{:x}\r\n{data}\r\n", data.len()).is_err() {
                        return;
                    }
                    sent += 1;
                }
                thread::sleep(Duration::from_millis(20));
            }
        }
        let st = state.lock().unwrap();
        let body = json!({
            "apiVersion": "v1", "kind": "PodList",
            "metadata": {"resourceVersion": st.version.to_string()},
            "items": st.pods,
        })
        .to_string();
        drop(st);
        let _ = write!(
            w,
            "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        );
    }
}

/// A kubeconfig pointing at the fake API server, in `dir`.
fn kubeconfig(dir: &std::path::Path, port: u16) -> String {
    let path = dir.join("kubeconfig");
    std::fs::write(
        &path,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster:\n    server: http://127.0.0.1:{port}\n\
             contexts:\n- name: fake\n  context:\n    cluster: fake\n    user: fake\n    namespace: ns1\n\
             current-context: fake\nusers:\n- name: fake\n  user: {{}}\n"
        ),
    )
    .unwrap();
    path.display().to_string()
}

fn horovodrun(dir: &std::path::Path, kubeconfig: &str, flags: &[&str]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_horovodrun"));
    cmd.args(flags)
        .arg(example("elastic_counter"))
        .args(COUNTER)
        .env("KUBECONFIG", kubeconfig)
        .env("HOME", dir)
        .env_remove("KUBERNETES_SERVICE_HOST")
        .env_remove("KUBERNETES_SERVICE_PORT");
    cmd
}

#[test]
fn ready_pods_are_the_hosts_and_a_pod_that_turns_unready_leaves_gracefully() {
    let api = FakeApi::start(vec![
        pod("w0", "127.0.0.2", true, Some("2")),
        pod("w1", "127.0.0.3", true, None),
        pod("w2", "127.0.0.4", false, None),
    ]);
    let dir = scratch("kube");
    let config = kubeconfig(&dir, api.port);
    let flags = [
        &["-np", "4", "--min-np", "2", "--max-np", "6"],
        POD_DISCOVERY,
    ]
    .concat();
    let cmd = horovodrun(&dir, &config, &flags);
    let mut job = Job::spawn(dir, cmd);
    job.wait_step(20, 4);
    let hosts: Vec<String> = job.workers().into_iter().map(|w| w.2).collect();
    assert_eq!(
        hosts,
        ["127.0.0.2", "127.0.0.2", "127.0.0.3", "127.0.0.3"],
        "the unready pod is no host"
    );
    let reqs = api.requests();
    assert!(
        reqs.iter()
            .any(|r| r.contains("labelSelector=app%3Dtrain") && !r.contains("watch")),
        "{reqs:?}"
    );
    assert!(
        reqs.iter().any(|r| r.contains("watch=true")),
        "a watch, not polling: {reqs:?}"
    );
    api.modify(pod("w1", "127.0.0.3", false, None));
    job.wait_step(1, 2);
    let (code, err, lines) = job.finish();
    assert_eq!(code, 0, "{err}");
    assert_eq!(check_counter(&lines, 250), 2);
    assert_eq!(
        steps_rerun(&lines),
        0,
        "a pod leaving is a graceful removal"
    );
    assert!(
        err.contains("host left discovery") && err.contains("127.0.0.3"),
        "{err}"
    );
    let lists = api
        .requests()
        .iter()
        .filter(|r| !r.contains("watch"))
        .count();
    assert!(
        lists <= 2,
        "the pods were polled instead of watched: {:?}",
        api.requests()
    );
}

/// A pod Kubernetes is about to take away (here a deletion timestamp 30 s ahead, as a drain or
/// a spot preemption sets it before the kubelet's SIGTERM) is its host's notice: the driver
/// names the source and the deadline, counts it, and drains the host without a rollback or a
/// blacklisting.
#[test]
fn a_pod_about_to_be_deleted_gives_its_host_notice() {
    let api = FakeApi::start(vec![
        pod("w0", "127.0.0.2", true, None),
        pod("w1", "127.0.0.3", true, None),
    ]);
    let dir = scratch("kube-notice");
    let config = kubeconfig(&dir, api.port);
    let flags = [
        &["-np", "4", "--min-np", "2", "--status-port", "0"],
        POD_DISCOVERY,
    ]
    .concat();
    let cmd = horovodrun(&dir, &config, &flags);
    let mut job = Job::spawn(dir, cmd);
    let port = job.status_port();
    job.wait_step(20, 4);
    let mut leaving = pod("w1", "127.0.0.3", true, None);
    leaving["metadata"]["deletionTimestamp"] = json!(support::rfc3339_in(Duration::from_secs(30)));
    leaving["metadata"]["deletionGracePeriodSeconds"] = json!(30);
    api.modify(leaving);
    job.wait_step(1, 2);
    let (_, metrics) = support::http_get(port, "GET", "/metrics");
    let (code, err, lines) = job.finish();
    assert_eq!(code, 0, "{err}");
    assert_eq!(check_counter(&lines, 250), 2);
    assert_eq!(steps_rerun(&lines), 0, "a notice rolls nothing back");
    let notice = err
        .lines()
        .find(|l| l.contains("host gave notice"))
        .unwrap_or_else(|| panic!("no notice: {err}"));
    assert!(
        notice.contains("host=127.0.0.3") && notice.contains("source=kubernetes"),
        "{notice}"
    );
    let deadline: f64 = notice
        .split("deadline_s=")
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .and_then(|d| d.parse().ok())
        .unwrap_or_else(|| panic!("no deadline: {notice}"));
    assert!((25.0..=31.0).contains(&deadline), "{notice}");
    assert!(
        !err.contains("host blacklisted") && !err.contains("worker failed"),
        "{err}"
    );
    assert!(
        metrics.contains("hvd_preemption_notices_total{source=\"kubernetes\"} 1"),
        "{metrics}"
    );
}

#[test]
fn without_a_cluster_the_job_fails_saying_why() {
    let dir = scratch("kube-none");
    let missing = dir.join("no-such-kubeconfig").display().to_string();
    let out = horovodrun(
        &dir,
        &missing,
        &[
            "-np",
            "2",
            "--discovery",
            "kubernetes",
            "--selector",
            "app=train",
        ],
    )
    .output()
    .unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains(
            "host discovery failed on its first run: cannot connect to the Kubernetes API"
        ),
        "{err}"
    );
}

#[test]
fn kubernetes_flags_without_kubernetes_discovery_are_usage_errors() {
    let out = Command::new(env!("CARGO_BIN_EXE_horovodrun"))
        .args(["-np", "1", "--selector", "app=train", "true"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(64));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--selector works with --discovery kubernetes only"),
        "{err}"
    );
    let mut s = String::new();
    let _ = (&out.stdout[..]).read_to_string(&mut s);
    assert!(s.is_empty());
}
