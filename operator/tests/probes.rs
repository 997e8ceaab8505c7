//! The `hvd-operator` binary's health probes against a small fake API server: `/healthz`
//! answers from the start; `/readyz` only once the API has answered, and the operator stops
//! cleanly on SIGTERM. A probe port already taken is an error naming the flag.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test that cannot set up fails loudly

#[path = "../../driver/tests/support/promtool.rs"]
mod promtool;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

/// A fake API server: `answering` serves `/version` and empty lists, and holds watches open;
/// otherwise it accepts connections and never answers.
fn fake_api(answering: bool) -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    thread::spawn(move || {
        for stream in listener.incoming().map_while(Result::ok) {
            thread::spawn(move || {
                if answering {
                    serve(stream);
                } else {
                    thread::sleep(Duration::from_secs(300));
                    drop(stream);
                }
            });
        }
    });
    port
}

fn serve(stream: TcpStream) {
    let mut reader = BufReader::new(stream.try_clone().unwrap());
    let mut out = stream;
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).unwrap_or(0) == 0 {
            return;
        }
        let target = line.split(' ').nth(1).unwrap_or("/").to_string();
        loop {
            let mut h = String::new();
            if reader.read_line(&mut h).unwrap_or(0) == 0 || h == "\r\n" {
                break;
            }
        }
        if target.contains("watch=true") || target.contains("watch=1") {
            // A watch that never has news.
            thread::sleep(Duration::from_secs(300));
            return;
        }
        let body = if target.starts_with("/version") {
            r#"{"major":"1","minor":"33","gitVersion":"v1.33.0","gitCommit":"x","gitTreeState":"clean","buildDate":"2025-01-01T00:00:00Z","goVersion":"go1.24","compiler":"gc","platform":"linux/amd64"}"#.to_string()
        } else {
            r#"{"kind":"List","apiVersion":"v1","metadata":{"resourceVersion":"1"},"items":[]}"#
                .to_string()
        };
        let response = format!(
            "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        );
        if out.write_all(response.as_bytes()).is_err() {
            return;
        }
    }
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("hvd-probes-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn kubeconfig(dir: &Path, port: u16) -> String {
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

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Kills the operator when the test ends, however it ends, and removes its scratch directory.
struct Operator(Child, PathBuf);

impl Drop for Operator {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
        let _ = std::fs::remove_dir_all(&self.1);
    }
}

fn operator(api: u16, probe_port: u16, name: &str) -> Operator {
    let dir = scratch(name);
    let child = Command::new(env!("CARGO_BIN_EXE_hvd-operator"))
        .args(["--probe-port", &probe_port.to_string()])
        .env("KUBECONFIG", kubeconfig(&dir, api))
        .env("HOME", &dir)
        .env("RUST_LOG", "info")
        .env_remove("KUBERNETES_SERVICE_HOST")
        .env_remove("KUBERNETES_SERVICE_PORT")
        .stdout(Stdio::piped()) // where its tracing logs go
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    Operator(child, dir)
}

/// The exit status of `child`, which must exit within 30 s (else the test fails with `why`).
fn exit_within_30s(child: &mut Child, why: &str) -> std::process::ExitStatus {
    let start = Instant::now();
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            return s;
        }
        assert!(start.elapsed() < Duration::from_secs(30), "{why}");
        thread::sleep(Duration::from_millis(50));
    }
}

/// Status code and body of `GET path`, or `None` while nothing listens.
fn get(port: u16, path: &str) -> Option<(u16, String)> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: probe\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut text = String::new();
    s.read_to_string(&mut text).ok()?;
    let code = text.split(' ').nth(1)?.parse().ok()?;
    let body = text.split_once("\r\n\r\n")?.1.to_string();
    Some((code, body))
}

/// Polls `GET path` until it answers `code`, for up to 30 s.
fn wait_for(port: u16, path: &str, code: u16) -> String {
    let start = Instant::now();
    loop {
        match get(port, path) {
            Some((c, body)) if c == code => return body,
            other => assert!(
                start.elapsed() < Duration::from_secs(30),
                "{path} never answered {code}; last: {other:?}"
            ),
        }
        thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn not_ready_until_the_api_answers() {
    let api = fake_api(false);
    let port = free_port();
    let _op = operator(api, port, "silent");
    assert_eq!(wait_for(port, "/healthz", 200), "ok");
    let (code, body) = get(port, "/readyz").expect("readyz answers");
    assert_eq!(
        (code, body.as_str()),
        (503, "waiting for the Kubernetes API")
    );
    let (code, body) = get(port, "/metrics").expect("metrics answer");
    assert_eq!(code, 200, "{body}");
    assert!(
        body.contains("# TYPE hvd_operator_reconciles_total counter"),
        "{body}"
    );
    promtool::assert_clean(&body);
    let (code, body) = get(port, "/livez").expect("any path answers");
    assert_eq!(code, 404, "{body}");
}

#[test]
fn ready_once_the_api_answers_then_stops_on_sigterm() {
    let api = fake_api(true);
    let port = free_port();
    let mut op = operator(api, port, "answering");
    assert_eq!(wait_for(port, "/readyz", 200), "ok");
    assert_eq!(get(port, "/healthz").map(|(c, _)| c), Some(200));
    let pid = op.0.id().to_string();
    assert!(
        Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .unwrap()
            .success()
    );
    let status = exit_within_30s(
        &mut op.0,
        "the operator did not stop within 30 s of SIGTERM",
    );
    let mut log = String::new();
    if let Some(mut e) = op.0.stdout.take() {
        let _ = e.read_to_string(&mut log);
    }
    assert!(status.success(), "exit {status}: {log}");
    assert!(log.contains("Kubernetes API reached"), "{log}");
    assert!(
        !log.contains('\u{1b}'),
        "colour codes in a log that is no terminal: {log:?}"
    );
}

#[test]
fn a_taken_probe_port_is_an_error_naming_the_flag() {
    let taken = TcpListener::bind("[::]:0")
        .or_else(|_| TcpListener::bind("0.0.0.0:0"))
        .unwrap();
    let port = taken.local_addr().unwrap().port();
    let api = fake_api(true);
    let mut op = operator(api, port, "taken");
    let out = op.0.stdout.take().unwrap();
    // Read in a thread: an operator that started after all would never close its output.
    let reader = thread::spawn(move || {
        let mut log = String::new();
        let _ = BufReader::new(out).read_to_string(&mut log);
        log
    });
    let status = exit_within_30s(&mut op.0, "the operator started on a taken port");
    let log = reader.join().unwrap();
    assert!(!status.success(), "started on a taken port: {log}");
    assert!(log.contains("--probe-port"), "{log}");
}
