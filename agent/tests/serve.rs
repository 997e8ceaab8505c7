//! The agent's server and client together, in process, over real sockets and real processes:
//! output and exits, stopping with and without a grace, authentication both ways, and no
//! orphans when the driver's connection drops.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use hvd_agent::{AgentError, Events, FromAgent, Requests, Stream, ToAgent, connect, serve};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpListener;
use tokio::sync::oneshot;

const SECRET: &str = "test-secret-1234";
const T: Duration = Duration::from_secs(10);

/// An agent serving on a free port until the returned sender is dropped.
async fn agent() -> (String, oneshot::Sender<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let (tx, rx) = oneshot::channel::<()>();
    tokio::spawn(serve(listener, SECRET.into(), async move {
        let _ = rx.await;
    }));
    (addr, tx)
}

async fn next(ev: &mut Events) -> FromAgent {
    tokio::time::timeout(T, ev.next())
        .await
        .expect("agent answered in time")
        .expect("a message")
        .expect("connection open")
}

/// Collects messages about `id` until its exit: (stdout lines, stderr lines, exit).
async fn run_to_exit(
    ev: &mut Events,
    id: u64,
) -> (Vec<String>, Vec<String>, (Option<i32>, Option<i32>)) {
    let (mut out, mut err) = (Vec::new(), Vec::new());
    loop {
        match next(ev).await {
            FromAgent::Output {
                id: i,
                stream,
                line,
            } if i == id => match stream {
                Stream::Stdout => out.push(line),
                Stream::Stderr => err.push(line),
            },
            FromAgent::Exited {
                id: i,
                code,
                signal,
            } if i == id => return (out, err, (code, signal)),
            FromAgent::Started { .. } => {}
            other => panic!("unexpected {other:?}"),
        }
    }
}

async fn start(rq: &mut Requests, id: u64, script: &str, env: &[(&str, &str)]) {
    rq.send(&ToAgent::Start {
        id,
        argv: vec!["sh".into(), "-c".into(), script.into()],
        env: env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        cwd: Some("/tmp".into()),
    })
    .await
    .unwrap();
}

async fn started(ev: &mut Events, id: u64) -> u32 {
    match next(ev).await {
        FromAgent::Started { id: i, pid } if i == id => pid,
        other => panic!("expected started {id}, got {other:?}"),
    }
}

fn alive(pid: i32) -> bool {
    // A zombie counts as gone: it runs nothing.
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
        s.rsplit_once(')')
            .is_some_and(|(_, r)| !r.trim_start().starts_with('Z'))
    })
}

#[tokio::test]
async fn output_env_cwd_and_exit_code_come_back() {
    let (addr, _stop) = agent().await;
    let (mut ev, mut rq) = connect(&addr, SECRET, T).await.unwrap();
    start(
        &mut rq,
        1,
        "echo \"$GREETING\"; pwd; echo oops >&2; exit 3",
        &[("GREETING", "hi there")],
    )
    .await;
    let (out, err, exit) = run_to_exit(&mut ev, 1).await;
    assert_eq!(out, ["hi there", "/tmp"]);
    assert_eq!(err, ["oops"]);
    assert_eq!(exit, (Some(3), None));
}

#[tokio::test]
async fn stop_sends_sigterm_then_sigkill_after_the_grace() {
    let (addr, _stop) = agent().await;
    let (mut ev, mut rq) = connect(&addr, SECRET, T).await.unwrap();
    start(&mut rq, 1, "exec sleep 30", &[]).await;
    started(&mut ev, 1).await;
    rq.send(&ToAgent::Stop {
        id: 1,
        grace_ms: 5000,
    })
    .await
    .unwrap();
    assert_eq!(
        run_to_exit(&mut ev, 1).await.2,
        (None, Some(15)),
        "SIGTERM suffices"
    );

    // Ignores SIGTERM (and so does the sleep it starts): only SIGKILL ends it.
    start(&mut rq, 2, "trap '' TERM; echo ready; sleep 30", &[]).await;
    started(&mut ev, 2).await;
    assert!(matches!(
        next(&mut ev).await,
        FromAgent::Output { id: 2, .. }
    ));
    let t = std::time::Instant::now();
    rq.send(&ToAgent::Stop {
        id: 2,
        grace_ms: 300,
    })
    .await
    .unwrap();
    assert_eq!(run_to_exit(&mut ev, 2).await.2, (None, Some(9)));
    assert!(
        t.elapsed() >= Duration::from_millis(300),
        "{:?}",
        t.elapsed()
    );

    start(&mut rq, 3, "trap '' TERM; sleep 30", &[]).await;
    started(&mut ev, 3).await;
    rq.send(&ToAgent::Stop { id: 3, grace_ms: 0 })
        .await
        .unwrap();
    assert_eq!(
        run_to_exit(&mut ev, 3).await.2,
        (None, Some(9)),
        "no grace: SIGKILL"
    );
}

#[tokio::test]
async fn start_failures_name_the_program_or_directory() {
    let (addr, _stop) = agent().await;
    let (mut ev, mut rq) = connect(&addr, SECRET, T).await.unwrap();
    rq.send(&ToAgent::Start {
        id: 5,
        argv: vec!["/no/such/prog".into()],
        env: vec![],
        cwd: None,
    })
    .await
    .unwrap();
    match next(&mut ev).await {
        FromAgent::StartFailed { id: 5, error } => {
            assert!(error.contains("/no/such/prog"), "{error}")
        }
        other => panic!("{other:?}"),
    }
    rq.send(&ToAgent::Start {
        id: 6,
        argv: vec!["true".into()],
        env: vec![],
        cwd: Some("/no/such/dir".into()),
    })
    .await
    .unwrap();
    match next(&mut ev).await {
        FromAgent::StartFailed { id: 6, error } => {
            assert!(error.contains("/no/such/dir"), "{error}")
        }
        other => panic!("{other:?}"),
    }
    // A live id can't be reused.
    start(&mut rq, 7, "sleep 30", &[]).await;
    started(&mut ev, 7).await;
    start(&mut rq, 7, "true", &[]).await;
    match next(&mut ev).await {
        FromAgent::StartFailed { id: 7, error } => {
            assert!(error.contains("still running"), "{error}")
        }
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn a_wrong_secret_is_refused_and_says_so() {
    let (addr, _stop) = agent().await;
    let err = connect(&addr, "not-the-secret", T).await.unwrap_err();
    assert!(matches!(err, AgentError::Refused { .. }), "{err:?}");
    let msg = err.to_string();
    assert!(msg.contains("wrong secret") && msg.contains(&addr), "{msg}");
    // The agent still serves the right secret afterwards.
    connect(&addr, SECRET, T).await.unwrap();
}

#[tokio::test]
async fn a_request_before_authentication_is_refused() {
    let (addr, _stop) = agent().await;
    let s = tokio::net::TcpStream::connect(&addr).await.unwrap();
    let (r, mut w) = s.into_split();
    let mut r = BufReader::new(r);
    let mut line = String::new();
    r.read_line(&mut line).await.unwrap();
    assert!(line.contains("challenge"), "{line}");
    w.write_all(b"{\"type\":\"start\",\"id\":1,\"argv\":[\"true\"],\"env\":[],\"cwd\":null}\n")
        .await
        .unwrap();
    line.clear();
    tokio::time::timeout(T, r.read_line(&mut line))
        .await
        .unwrap()
        .unwrap();
    assert!(
        line.contains("refused") && line.contains("before authentication"),
        "{line}"
    );
    line.clear();
    assert_eq!(
        tokio::time::timeout(T, r.read_line(&mut line))
            .await
            .unwrap()
            .unwrap(),
        0,
        "closed"
    );
}

#[tokio::test]
async fn a_peer_that_does_not_know_the_secret_is_not_trusted() {
    // A fake agent: a challenge, then a welcome it can't have computed.
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    tokio::spawn(async move {
        let (s, _) = listener.accept().await.unwrap();
        let (r, mut w) = s.into_split();
        w.write_all(b"{\"type\":\"challenge\",\"nonce\":\"00112233445566778899aabbccddeeff\"}\n")
            .await
            .unwrap();
        let mut line = String::new();
        BufReader::new(r).read_line(&mut line).await.unwrap();
        w.write_all(b"{\"type\":\"welcome\",\"mac\":\"00\"}\n")
            .await
            .unwrap();
        tokio::time::sleep(T).await;
    });
    let err = connect(&addr, SECRET, T).await.unwrap_err();
    assert!(matches!(err, AgentError::Impostor { .. }), "{err:?}");
}

#[tokio::test]
async fn an_unreachable_agent_names_its_address() {
    let free = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = free.local_addr().unwrap().to_string();
    drop(free);
    let err = connect(&addr, SECRET, T).await.unwrap_err().to_string();
    assert!(err.contains("cannot reach") && err.contains(&addr), "{err}");
}

#[tokio::test]
async fn a_dropped_connection_kills_every_process_it_started() {
    let (addr, _stop) = agent().await;
    let (mut ev, mut rq) = connect(&addr, SECRET, T).await.unwrap();
    // A process that ignores SIGTERM and has a child of its own in its group.
    start(&mut rq, 1, "trap '' TERM; sleep 30 & echo $!; wait", &[]).await;
    let leader = started(&mut ev, 1).await as i32;
    let child: i32 = match next(&mut ev).await {
        FromAgent::Output { line, .. } => line.trim().parse().unwrap(),
        other => panic!("{other:?}"),
    };
    start(&mut rq, 2, "exec sleep 30", &[]).await;
    let other = started(&mut ev, 2).await as i32;
    assert!(alive(leader) && alive(child) && alive(other));
    // A second driver's processes are not touched.
    let (mut ev2, mut rq2) = connect(&addr, SECRET, T).await.unwrap();
    start(&mut rq2, 1, "exec sleep 30", &[]).await;
    let kept = started(&mut ev2, 1).await as i32;
    drop((ev, rq));
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while [leader, child, other].iter().any(|&p| alive(p)) {
        assert!(
            std::time::Instant::now() < deadline,
            "processes outlived their driver"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(alive(kept), "another connection's process was killed");
    rq2.send(&ToAgent::Stop { id: 1, grace_ms: 0 })
        .await
        .unwrap();
    assert_eq!(run_to_exit(&mut ev2, 1).await.2, (None, Some(9)));
}
