//! `GET /status`: the elastic job's state as JSON, for the Kubernetes operator (the driver's
//! pod may only read pods, so the operator polls this and writes the job's status itself).
//! A minimal HTTP/1.1 server: one request per connection, answered and closed.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::Serialize;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

use crate::elastic::core::{JobPhase, Snapshot};

/// Longest request head read.
const MAX_HEAD: usize = 8 * 1024;
/// How long a client has to send its request.
const READ_TIMEOUT: Duration = Duration::from_secs(5);

/// The state the endpoint serves: the core's snapshot and the wall-clock time of the core's
/// zero, to turn its cooldown ends into Unix times.
#[derive(Debug, Clone)]
pub struct Published {
    /// The core's view.
    pub snapshot: Snapshot,
    /// The wall-clock time the core's clock started at.
    pub epoch: SystemTime,
}

/// The JSON body of `GET /status`.
#[derive(Debug, Serialize)]
struct Body<'a> {
    phase: &'static str,
    generation: u64,
    workers: usize,
    hosts: Vec<HostBody<'a>>,
    blacklisted: Vec<Blacklisted<'a>>,
    resets: u64,
}

#[derive(Debug, Serialize)]
struct HostBody<'a> {
    host: &'a str,
    slots: usize,
}

#[derive(Debug, Serialize)]
struct Blacklisted<'a> {
    host: &'a str,
    /// Unix milliseconds when the cooldown ends; `null` for good.
    until_ms: Option<u64>,
}

fn phase_name(p: JobPhase) -> &'static str {
    match p {
        JobPhase::Pending => "Pending",
        JobPhase::Running => "Running",
        JobPhase::Rescaling => "Rescaling",
        JobPhase::Succeeded => "Succeeded",
        JobPhase::Failed => "Failed",
    }
}

/// The JSON document for `p`.
pub fn render(p: &Published) -> String {
    let s = &p.snapshot;
    let unix_ms = |d: Duration| {
        (p.epoch + d)
            .duration_since(UNIX_EPOCH)
            .map_or(0, |t| u64::try_from(t.as_millis()).unwrap_or(u64::MAX))
    };
    let body = Body {
        phase: phase_name(s.phase),
        generation: s.generation,
        workers: s.workers,
        hosts: s
            .hosts
            .iter()
            .map(|(host, slots)| HostBody {
                host,
                slots: *slots,
            })
            .collect(),
        blacklisted: s
            .blacklisted
            .iter()
            .map(|(host, until)| Blacklisted {
                host,
                until_ms: until.map(unix_ms),
            })
            .collect(),
        resets: s.resets,
    };
    serde_json::to_string(&body).unwrap_or_else(|e| error_body(&e.to_string()))
}

/// A JSON error document `{"error": why}`, escaped whatever `why` holds.
fn error_body(why: &str) -> String {
    serde_json::json!({ "error": why }).to_string()
}

/// The status line, extra headers and body answering `req`.
fn reply(req: Request, state: &Published) -> (&'static str, &'static str, String) {
    match req {
        Request::Status => ("200 OK", "", render(state)),
        Request::NotFound(path) => (
            "404 Not Found",
            "",
            error_body(&format!("no such path: {path}; try /status")),
        ),
        Request::NotAllowed(m) => (
            "405 Method Not Allowed",
            "Allow: GET\r\n",
            error_body(&format!("method {m} not allowed; use GET")),
        ),
        Request::Bad => ("400 Bad Request", "", error_body("not an HTTP/1.x request")),
    }
}

/// What a request head asks for.
#[derive(Debug, PartialEq, Eq)]
pub enum Request {
    /// `GET /status` (a query string is ignored).
    Status,
    /// A GET of another path.
    NotFound(String),
    /// Another method.
    NotAllowed(String),
    /// Not an HTTP request line.
    Bad,
}

/// Parses the request line of `head`.
pub fn parse(head: &[u8]) -> Request {
    let line = head.split(|&b| b == b'\n').next().unwrap_or_default();
    let line = String::from_utf8_lossy(line);
    let mut parts = line.trim_end_matches('\r').split(' ');
    let (Some(method), Some(target), Some(version), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Request::Bad;
    };
    if !version.starts_with("HTTP/1.") || !target.starts_with('/') {
        return Request::Bad;
    }
    if method != "GET" {
        return Request::NotAllowed(method.to_string());
    }
    match target.split('?').next() {
        Some("/status") => Request::Status,
        _ => Request::NotFound(target.to_string()),
    }
}

/// Serves `GET /status` on `listener` with the latest state from `state`, until aborted.
pub async fn serve(listener: TcpListener, state: watch::Receiver<Published>) {
    loop {
        match listener.accept().await {
            Ok((stream, peer)) => {
                let state = state.clone();
                tokio::spawn(async move {
                    if let Err(e) = answer(stream, &state).await {
                        tracing::debug!(%peer, error = %e, "status request failed");
                    }
                });
            }
            Err(e) => {
                tracing::warn!(error = %e, "status endpoint: accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

async fn answer(mut stream: TcpStream, state: &watch::Receiver<Published>) -> std::io::Result<()> {
    let mut head = Vec::new();
    let mut buf = [0u8; 1024];
    let read = async {
        while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < MAX_HEAD {
            let n = stream.read(&mut buf).await?;
            if n == 0 {
                break;
            }
            head.extend_from_slice(&buf[..n]);
        }
        Ok::<_, std::io::Error>(())
    };
    tokio::time::timeout(READ_TIMEOUT, read)
        .await
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "no request in time"))??;
    let (status, extra, body) = reply(parse(&head), &state.borrow());
    let response = format!(
        "HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\
         {extra}Connection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(response.as_bytes()).await?;
    stream.shutdown().await
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn request_lines_are_parsed() {
        assert_eq!(
            parse(b"GET /status HTTP/1.1\r\nHost: x\r\n\r\n"),
            Request::Status
        );
        assert_eq!(parse(b"GET /status?x=1 HTTP/1.0\r\n\r\n"), Request::Status);
        assert_eq!(
            parse(b"GET /metrics HTTP/1.1\r\n\r\n"),
            Request::NotFound("/metrics".into())
        );
        assert_eq!(
            parse(b"POST /status HTTP/1.1\r\n\r\n"),
            Request::NotAllowed("POST".into())
        );
        assert_eq!(parse(b"hello\r\n\r\n"), Request::Bad);
        assert_eq!(parse(b"GET /status SMTP\r\n\r\n"), Request::Bad);
    }

    fn published() -> Published {
        Published {
            snapshot: Snapshot {
                phase: JobPhase::Running,
                generation: 1,
                workers: 1,
                hosts: vec![("h\u{e9}".into(), 1)],
                blacklisted: vec![],
                resets: 0,
            },
            epoch: UNIX_EPOCH,
        }
    }

    #[test]
    fn error_bodies_are_json_whatever_the_path_or_method() {
        let p = published();
        let (status, _, body) = reply(
            parse("GET /caf\u{e9}\"\\\t HTTP/1.1\r\n\r\n".as_bytes()),
            &p,
        );
        assert_eq!(status, "404 Not Found");
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(
            v["error"], "no such path: /caf\u{e9}\"\\\t; try /status",
            "{body}"
        );
        let (status, extra, body) =
            reply(parse("PÖST\u{1} /status HTTP/1.1\r\n\r\n".as_bytes()), &p);
        assert_eq!(
            (status, extra),
            ("405 Method Not Allowed", "Allow: GET\r\n")
        );
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(
            v["error"], "method P\u{d6}ST\u{1} not allowed; use GET",
            "{body}"
        );
        let (status, _, body) = reply(Request::Bad, &p);
        assert_eq!(status, "400 Bad Request");
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["error"], "not an HTTP/1.x request");
        let (status, _, body) = reply(Request::Status, &p);
        assert_eq!(status, "200 OK");
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["hosts"][0]["host"], "h\u{e9}");
    }

    #[test]
    fn the_document_has_every_field_with_unix_cooldown_ends() {
        let p = Published {
            snapshot: Snapshot {
                phase: JobPhase::Rescaling,
                generation: 3,
                workers: 2,
                hosts: vec![("10.0.0.1".into(), 2)],
                blacklisted: vec![
                    ("10.0.0.2".into(), Some(Duration::from_millis(1500))),
                    ("10.0.0.3".into(), None),
                ],
                resets: 2,
            },
            epoch: UNIX_EPOCH + Duration::from_secs(1000),
        };
        let v: serde_json::Value = serde_json::from_str(&render(&p)).unwrap();
        assert_eq!(
            v,
            serde_json::json!({
                "phase": "Rescaling",
                "generation": 3,
                "workers": 2,
                "hosts": [{"host": "10.0.0.1", "slots": 2}],
                "blacklisted": [
                    {"host": "10.0.0.2", "until_ms": 1_001_500},
                    {"host": "10.0.0.3", "until_ms": null}
                ],
                "resets": 2
            })
        );
    }
}
