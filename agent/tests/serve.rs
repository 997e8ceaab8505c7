//! The agent's server and client together, in process, over real sockets and real processes:
//! output and exits, stopping with and without a grace, authentication both ways, and no
//! orphans when the driver's connection drops (nor when a process's leader exits first),
//! lines cut across reads, the last output before an exit, connection limits and keepalive.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::time::Duration;

use hvd_agent::auth::{CONTEXT, Handshake, Nonce, Role, Tag};
use hvd_agent::{
    AgentError, Events, FromAgent, Held, Limits, Requests, Stream, ToAgent, connect, serve,
};
use hvd_rendezvous::{decode_line, encode_line};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpListener;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::sync::oneshot;

const SECRET: &str = "test-secret-1234";
const T: Duration = Duration::from_secs(10);

/// An agent serving on a free port until the returned sender is dropped.
async fn agent() -> (String, oneshot::Sender<()>) {
    support::agent_with(SECRET, Limits::default()).await
}

/// An agent with the given connection limits, serving until the sender is dropped.
async fn limited_agent(limits: Limits) -> (String, oneshot::Sender<()>) {
    support::agent_with(SECRET, limits).await
}

/// A connection to an agent driven byte by byte, without the client library.
struct Raw {
    r: BufReader<OwnedReadHalf>,
    w: OwnedWriteHalf,
}

impl Raw {
    /// Connected; the agent's challenge not read yet.
    async fn connect(addr: &str) -> Raw {
        let (r, w) = tokio::net::TcpStream::connect(addr)
            .await
            .unwrap()
            .into_split();
        Raw {
            r: BufReader::new(r),
            w,
        }
    }

    /// Connected with a receive buffer of `rcvbuf` bytes (the kernel doubles it), so that a
    /// reader that does not read stops the agent soon.
    async fn with_rcvbuf(addr: &str, rcvbuf: u32) -> Raw {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.set_recv_buffer_size(rcvbuf).unwrap();
        let (r, w) = socket
            .connect(addr.parse().unwrap())
            .await
            .unwrap()
            .into_split();
        Raw {
            r: BufReader::new(r),
            w,
        }
    }

    /// Connected and authenticated.
    async fn authenticated(addr: &str) -> Raw {
        let c = Raw::connect(addr).await;
        c.authenticate().await
    }

    /// Answers the challenge and checks the welcome.
    async fn authenticate(mut self) -> Raw {
        let c = &mut self;
        let FromAgent::Challenge { nonce } = c.recv().await.unwrap() else {
            panic!("no challenge")
        };
        let theirs = Nonce::from_hex(&nonce).unwrap();
        let hs = Handshake::new(SECRET, CONTEXT, Role::Dialer).unwrap();
        c.send(&ToAgent::Auth {
            mac: hs.proof(&theirs).to_hex(),
            nonce: hs.nonce().to_hex(),
        })
        .await;
        match c.recv().await {
            Some(FromAgent::Welcome { mac: m }) => {
                hs.verify(&theirs, &Tag::from_hex(&m).unwrap()).unwrap();
            }
            other => panic!("{other:?}"),
        }
        self
    }

    async fn send(&mut self, msg: &ToAgent) {
        self.w.write_all(&encode_line(msg).unwrap()).await.unwrap();
    }

    /// The next message, `None` at the end of the connection.
    async fn recv(&mut self) -> Option<FromAgent> {
        let mut line = String::new();
        let n = tokio::time::timeout(T, self.r.read_line(&mut line))
            .await
            .expect("agent answered in time")
            .unwrap();
        (n > 0).then(|| decode_line(line.as_bytes()).unwrap())
    }
}

fn sh(id: u64, script: &str) -> ToAgent {
    ToAgent::Start {
        id,
        argv: vec!["sh".into(), "-c".into(), script.into()],
        env: vec![],
        cwd: None,
    }
}

/// Waits up to `within` for `pid` to stop running.
async fn gone_within(pid: i32, within: Duration) -> bool {
    let deadline = std::time::Instant::now() + within;
    while alive(pid) {
        if std::time::Instant::now() > deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    true
}

async fn next(ev: &mut Events) -> FromAgent {
    tokio::time::timeout(T, ev.next())
        .await
        .expect("agent answered in time")
        .expect("a message")
        .expect("connection open")
}

/// Collects messages about `id` until its exit: (stdout lines, stderr lines, exit). A
/// failure may be told early (`Dying`, when it is seen before the process is reaped): then
/// once, before the exit, with the same status.
async fn run_to_exit(
    ev: &mut Events,
    id: u64,
) -> (Vec<String>, Vec<String>, (Option<i32>, Option<i32>)) {
    let (mut out, mut err) = (Vec::new(), Vec::new());
    let mut dying = None;
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
            FromAgent::Dying {
                id: i,
                code,
                signal,
            } if i == id => {
                assert!(dying.is_none(), "told dying twice");
                assert_ne!(
                    (code, signal),
                    (Some(0), None),
                    "an exit 0 is not a failure"
                );
                dying = Some((code, signal));
            }
            FromAgent::Exited {
                id: i,
                code,
                signal,
            } if i == id => {
                if let Some(early) = dying {
                    assert_eq!(early, (code, signal), "the early status is the exit's");
                }
                return (out, err, (code, signal));
            }
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

#[tokio::test]
async fn a_request_cut_across_reads_survives_a_process_exit() {
    let (addr, _stop) = agent().await;
    let mut c = Raw::authenticated(&addr).await;
    c.send(&sh(1, "sleep 0.2")).await;
    assert!(matches!(
        c.recv().await,
        Some(FromAgent::Started { id: 1, .. })
    ));
    // Half a request arrives, then process 1 exits, then the rest of the request.
    let line = encode_line(&sh(2, "echo two")).unwrap();
    let (head, tail) = line.split_at(line.len() / 2);
    c.w.write_all(head).await.unwrap();
    assert!(matches!(
        c.recv().await,
        Some(FromAgent::Exited { id: 1, .. })
    ));
    tokio::time::sleep(Duration::from_millis(200)).await;
    c.w.write_all(tail).await.unwrap();
    let mut seen = Vec::new();
    loop {
        match c.recv().await.unwrap() {
            FromAgent::Exited { id: 2, code, .. } => {
                assert_eq!(code, Some(0));
                break;
            }
            FromAgent::Error { reason } => panic!("the request was cut: {reason}"),
            other => seen.push(other),
        }
    }
    assert!(
        seen.contains(&FromAgent::Output {
            id: 2,
            stream: Stream::Stdout,
            line: "two".into()
        }),
        "{seen:?}"
    );
}

#[tokio::test]
async fn the_client_keeps_a_message_cut_across_reads_when_its_read_is_cancelled() {
    // A fake agent that authenticates properly, then sends one message in two pieces.
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    tokio::spawn(async move {
        let (s, _) = listener.accept().await.unwrap();
        let (r, mut w) = s.into_split();
        let hs = Handshake::new(SECRET, CONTEXT, Role::Listener).unwrap();
        let challenge = FromAgent::Challenge {
            nonce: hs.nonce().to_hex(),
        };
        w.write_all(&encode_line(&challenge).unwrap())
            .await
            .unwrap();
        let mut line = String::new();
        BufReader::new(r).read_line(&mut line).await.unwrap();
        let Ok(ToAgent::Auth { nonce: theirs, .. }) = decode_line(line.as_bytes()) else {
            panic!("{line}")
        };
        let welcome = FromAgent::Welcome {
            mac: hs.proof(&Nonce::from_hex(&theirs).unwrap()).to_hex(),
        };
        w.write_all(&encode_line(&welcome).unwrap()).await.unwrap();
        let out = FromAgent::Output {
            id: 4,
            stream: Stream::Stderr,
            line: "Traceback (most recent call last):".into(),
        };
        let out = encode_line(&out).unwrap();
        let (head, tail) = out.split_at(out.len() / 2);
        w.write_all(head).await.unwrap();
        tokio::time::sleep(Duration::from_millis(300)).await;
        w.write_all(tail).await.unwrap();
        tokio::time::sleep(T).await;
    });
    let (mut ev, _rq) = connect(&addr, SECRET, T).await.unwrap();
    // The read waits beside a timer that keeps winning, as in a driver's select loop.
    let deadline = std::time::Instant::now() + T;
    let msg = loop {
        assert!(std::time::Instant::now() < deadline, "no message");
        tokio::select! {
            m = ev.next() => break m.unwrap().unwrap(),
            () = tokio::time::sleep(Duration::from_millis(50)) => {}
        }
    };
    assert_eq!(
        msg,
        FromAgent::Output {
            id: 4,
            stream: Stream::Stderr,
            line: "Traceback (most recent call last):".into()
        }
    );
}

/// Where [`term_ignoring_child`] passes the child's pid to its leader.
fn pid_file(tag: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("hvd-agent-test-{}-{tag}", std::process::id()))
}

/// Shell commands that start a child ignoring SIGTERM and print its pid once it does.
fn term_ignoring_child(tag: &str) -> String {
    let f = pid_file(tag).display().to_string();
    format!(
        "rm -f {f}; sh -c 'trap \"\" TERM; echo $$ > {f}.tmp; mv {f}.tmp {f}; exec sleep 30' & \
         while [ ! -s {f} ]; do sleep 0.01; done; cat {f}; rm -f {f};"
    )
}

#[tokio::test]
async fn stop_kills_a_term_ignoring_child_once_its_leader_exited() {
    let (addr, _stop) = agent().await;
    let (mut ev, mut rq) = connect(&addr, SECRET, T).await.unwrap();
    start(
        &mut rq,
        1,
        &format!("{} wait", term_ignoring_child("stop")),
        &[],
    )
    .await;
    started(&mut ev, 1).await;
    let child: i32 = match next(&mut ev).await {
        FromAgent::Output { line, .. } => line.trim().parse().unwrap(),
        other => panic!("{other:?}"),
    };
    // The leader dies of the SIGTERM at once; the child would outlive the whole grace.
    rq.send(&ToAgent::Stop {
        id: 1,
        grace_ms: 20_000,
    })
    .await
    .unwrap();
    assert_eq!(run_to_exit(&mut ev, 1).await.2, (None, Some(15)));
    assert!(
        gone_within(child, Duration::from_secs(3)).await,
        "the child that ignored SIGTERM outlived its stopped leader"
    );
    // The leader may have died before it removed the file.
    let _ = std::fs::remove_file(pid_file("stop"));
}

#[tokio::test]
async fn a_child_left_by_an_exited_leader_does_not_outlive_the_driver() {
    let (addr, _stop) = agent().await;
    let (mut ev, mut rq) = connect(&addr, SECRET, T).await.unwrap();
    start(
        &mut rq,
        1,
        &format!("{} exit 0", term_ignoring_child("exit")),
        &[],
    )
    .await;
    started(&mut ev, 1).await;
    let (out, _, exit) = run_to_exit(&mut ev, 1).await;
    assert_eq!(exit, (Some(0), None));
    let child: i32 = out[0].trim().parse().unwrap();
    drop((ev, rq));
    assert!(
        gone_within(child, Duration::from_secs(3)).await,
        "a child of an exited process outlived its driver"
    );
}

#[tokio::test]
async fn the_last_lines_of_a_crash_arrive_before_its_exit_when_the_driver_lags() {
    let (addr, _stop) = agent().await;
    let mut c = Raw::with_rcvbuf(&addr, 4096).await.authenticate().await;
    // Output without end in the background, until the agent's queue and the socket are
    // full; then a traceback of many lines, then death by SIGKILL.
    c.send(&sh(
        1,
        "yes x & sleep 1.5; i=0; while [ $i -lt 20 ]; do echo trace $i >&2; i=$((i+1)); done; \
         kill -9 $$",
    ))
    .await;
    // The driver is busy elsewhere while the process writes and dies.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let mut err = Vec::new();
    let exit = loop {
        match c.recv().await.unwrap() {
            FromAgent::Output {
                stream: Stream::Stdout,
                line,
                ..
            } => assert_eq!(line, "x"),
            FromAgent::Output { line, .. } => err.push(line),
            FromAgent::Exited { code, signal, .. } => break (code, signal),
            FromAgent::Started { .. } | FromAgent::Dying { .. } => {}
            other => panic!("{other:?}"),
        }
    };
    assert_eq!(exit, (None, Some(9)));
    let trace: Vec<String> = (0..20).map(|i| format!("trace {i}")).collect();
    assert_eq!(err, trace, "the whole traceback before the exit");
}

#[tokio::test]
async fn a_long_line_before_authentication_is_refused_at_once() {
    let (addr, _stop) = agent().await;
    let mut c = Raw::connect(&addr).await;
    assert!(matches!(c.recv().await, Some(FromAgent::Challenge { .. })));
    c.w.write_all(&[b'x'; 8192]).await.unwrap();
    // No newline: the agent must not wait for one (nor for its 10 s timeout).
    let answer = tokio::time::timeout(Duration::from_secs(3), c.recv())
        .await
        .expect("refused before the authentication timeout");
    match answer {
        Some(FromAgent::Refused { reason }) => {
            assert!(reason.contains("longer than 4096"), "{reason}")
        }
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn connections_authenticating_at_once_are_limited() {
    let (addr, _stop) = limited_agent(Limits {
        connections: 8,
        unauthenticated: 1,
        ..Limits::default()
    })
    .await;
    let mut first = Raw::connect(&addr).await;
    let FromAgent::Challenge { nonce } = first.recv().await.unwrap() else {
        panic!("no challenge")
    };
    // While `first` has not answered, another connection is refused and told why.
    let err = connect(&addr, SECRET, T).await.unwrap_err();
    assert!(
        matches!(&err, AgentError::Refused { reason, .. } if reason.contains("too many")),
        "{err:?}"
    );
    let hs = Handshake::new(SECRET, CONTEXT, Role::Dialer).unwrap();
    first
        .send(&ToAgent::Auth {
            mac: hs.proof(&Nonce::from_hex(&nonce).unwrap()).to_hex(),
            nonce: hs.nonce().to_hex(),
        })
        .await;
    assert!(matches!(
        first.recv().await,
        Some(FromAgent::Welcome { .. })
    ));
    // Authenticated, it no longer counts.
    connect(&addr, SECRET, T).await.unwrap();
}

#[tokio::test]
async fn open_connections_are_limited() {
    let (addr, _stop) = limited_agent(Limits {
        connections: 2,
        unauthenticated: 2,
        ..Limits::default()
    })
    .await;
    let a = connect(&addr, SECRET, T).await.unwrap();
    let _b = connect(&addr, SECRET, T).await.unwrap();
    // A third is closed without a challenge.
    let mut c = Raw::connect(&addr).await;
    assert_eq!(c.recv().await, None);
    // Once one ends, there is room again.
    drop(a);
    let deadline = std::time::Instant::now() + T;
    loop {
        match connect(&addr, SECRET, T).await {
            Ok(_) => break,
            Err(e) => assert!(std::time::Instant::now() < deadline, "{e}"),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The keepalive timer of the IPv4 TCP socket from `local` to `remote` (`/proc/net/tcp`),
/// in seconds, when one is pending.
fn keepalive_timer(local: std::net::SocketAddr, remote: std::net::SocketAddr) -> Option<f64> {
    let hex = |a: std::net::SocketAddr| {
        let std::net::IpAddr::V4(ip) = a.ip() else {
            panic!("IPv4 only")
        };
        format!("{:08X}:{:04X}", u32::from_le_bytes(ip.octets()), a.port())
    };
    let (local, remote) = (hex(local), hex(remote));
    let table = std::fs::read_to_string("/proc/net/tcp").unwrap();
    let row = table.lines().skip(1).find(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        f[1] == local && f[2] == remote
    })?;
    // Field 5 is "tr:when": timer kind 2 is the keepalive timer, `when` in USER_HZ ticks.
    let (kind, when) = row.split_whitespace().nth(5)?.split_once(':')?;
    (kind == "02").then(|| u64::from_str_radix(when, 16).unwrap() as f64 / 100.0)
}

#[tokio::test]
async fn both_ends_of_a_connection_keep_it_alive() {
    // Driver and agent sides both on a listener and a socket this test can name.
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let agent_addr = listener.local_addr().unwrap();
    let (tx, rx) = oneshot::channel::<()>();
    tokio::spawn(serve(listener, SECRET.into(), async move {
        let _ = rx.await;
    }));
    let _stop = tx;
    let (_ev, _rq) = connect(&agent_addr.to_string(), SECRET, T).await.unwrap();
    let table = std::fs::read_to_string("/proc/net/tcp").unwrap();
    // The driver's end: the one connected to the agent's port from a port of its own.
    let port = |f: &str| u16::from_str_radix(f.rsplit_once(':').unwrap().1, 16).unwrap();
    let driver_port = table
        .lines()
        .skip(1)
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .find(|f| port(f[2]) == agent_addr.port() && f[1].starts_with("0100007F"))
        .map(|f| port(f[1]))
        .expect("the driver's socket");
    let driver: std::net::SocketAddr = ([127, 0, 0, 1], driver_port).into();
    // Data in flight shows the retransmission timer instead: wait for the ACKs.
    for (end, local, remote) in [
        ("driver", driver, agent_addr),
        ("agent", agent_addr, driver),
    ] {
        let deadline = std::time::Instant::now() + Duration::from_secs(3);
        let when = loop {
            let when = keepalive_timer(local, remote);
            if when.is_some() || std::time::Instant::now() > deadline {
                break when;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        assert!(
            when.is_some_and(|s| s > 20.0 && s <= 30.0),
            "the {end}'s end has no 30 s keepalive timer: {when:?}"
        );
    }
}

/// Claims `job` with `grace_ms`; returns the processes handed over and the lines dropped.
async fn claim(rq: &mut Requests, ev: &mut Events, job: &str, grace_ms: u64) -> (Vec<Held>, u64) {
    rq.send(&ToAgent::Claim {
        job: job.into(),
        grace_ms,
    })
    .await
    .unwrap();
    match next(ev).await {
        FromAgent::Claimed {
            processes,
            dropped_lines,
        } => (processes, dropped_lines),
        other => panic!("expected claimed, got {other:?}"),
    }
}

/// A driver that claimed its job goes away: its processes run on, what they write is kept,
/// and the next connection that claims the job gets them, the lines written meanwhile and,
/// for one that ended meanwhile, its exit; it can stop them as its own.
#[tokio::test]
async fn a_claimed_job_outlives_its_driver_and_goes_to_the_next_claim() {
    let (addr, _stop) = agent().await;
    let (mut ev, mut rq) = connect(&addr, SECRET, T).await.unwrap();
    assert_eq!(claim(&mut rq, &mut ev, "jobs/a", 10_000).await, (vec![], 0));
    start(
        &mut rq,
        7,
        "i=0; while true; do i=$((i+1)); echo $i; sleep 0.02; done",
        &[],
    )
    .await;
    start(&mut rq, 8, "sleep 0.3; echo last words; exit 3", &[]).await;
    // The counter's lines may come before the second start's answer.
    let (mut pid, mut pid8, mut last) = (None, None, 0u64);
    while pid.is_none() || pid8.is_none() || last < 3 {
        match next(&mut ev).await {
            FromAgent::Started { id: 7, pid: p } => pid = Some(p),
            FromAgent::Started { id: 8, pid: p } => pid8 = Some(p),
            FromAgent::Output { id: 7, line, .. } => last = line.parse().unwrap(),
            other => panic!("unexpected {other:?}"),
        }
    }
    let (pid, pid8) = (pid.unwrap(), pid8.unwrap());
    drop((ev, rq));
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert!(alive(pid as i32), "the process did not outlive its driver");
    // Another job's claim gets nothing of this one.
    let (mut ev3, mut rq3) = connect(&addr, SECRET, T).await.unwrap();
    assert_eq!(claim(&mut rq3, &mut ev3, "jobs/b", 1000).await, (vec![], 0));
    let (mut ev2, mut rq2) = connect(&addr, SECRET, T).await.unwrap();
    let (held, dropped) = claim(&mut rq2, &mut ev2, "jobs/a", 10_000).await;
    assert_eq!(dropped, 0);
    assert_eq!(held, vec![Held { id: 7, pid }, Held { id: 8, pid: pid8 }]);
    // Every line the counter wrote while no driver was there, in order, then live ones; and
    // the exit of the one that ended meanwhile, after its last words.
    let (mut next_n, mut words, mut exit8) = (None::<u64>, false, None);
    while next_n.is_none_or(|n| n < 60) || exit8.is_none() {
        match next(&mut ev2).await {
            FromAgent::Output { id: 7, line, .. } => {
                let n: u64 = line.parse().unwrap();
                if let Some(want) = next_n {
                    assert_eq!(n, want, "a line was lost or repeated");
                } else {
                    assert!(
                        n <= last + 1,
                        "lines before the claim were lost: {last} -> {n}"
                    );
                }
                next_n = Some(n + 1);
            }
            FromAgent::Output { id: 8, line, .. } => words = line == "last words",
            FromAgent::Exited { id: 8, code, .. } => exit8 = Some(code),
            FromAgent::Dying { id: 8, code, .. } => assert_eq!(code, Some(3)),
            other => panic!("unexpected {other:?}"),
        }
    }
    assert!(
        words,
        "the last words of the process that ended meanwhile were lost"
    );
    assert_eq!(exit8, Some(Some(3)));
    rq2.send(&ToAgent::Stop { id: 7, grace_ms: 0 })
        .await
        .unwrap();
    loop {
        match next(&mut ev2).await {
            FromAgent::Exited { id: 7, signal, .. } => {
                assert_eq!(signal, Some(9));
                break;
            }
            FromAgent::Output { id: 7, .. } | FromAgent::Dying { id: 7, .. } => {}
            other => panic!("unexpected {other:?}"),
        }
    }
}

/// Nobody claims the job within its grace: its processes are stopped then, not before.
#[tokio::test]
async fn a_claimed_job_nobody_takes_over_is_stopped_after_its_grace() {
    let (addr, _stop) = agent().await;
    let (mut ev, mut rq) = connect(&addr, SECRET, T).await.unwrap();
    claim(&mut rq, &mut ev, "jobs/grace", 800).await;
    start(&mut rq, 1, "exec sleep 30", &[]).await;
    let pid = started(&mut ev, 1).await as i32;
    let gone = std::time::Instant::now();
    drop((ev, rq));
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert!(alive(pid), "stopped before the grace ended");
    assert!(
        gone_within(pid, Duration::from_secs(5)).await,
        "still running after the grace"
    );
    let took = gone.elapsed();
    assert!(took >= Duration::from_millis(800), "{took:?}");
    // A claim after the grace finds nothing.
    let (mut ev2, mut rq2) = connect(&addr, SECRET, T).await.unwrap();
    assert_eq!(
        claim(&mut rq2, &mut ev2, "jobs/grace", 800).await,
        (vec![], 0)
    );
}

/// While no driver is connected the agent keeps a bounded amount of output: the oldest lines
/// go first and the count of those dropped comes with the claim; exits are always kept.
#[tokio::test]
async fn output_kept_for_a_missing_driver_is_bounded() {
    let (addr, _stop) = agent().await;
    let (mut ev, mut rq) = connect(&addr, SECRET, T).await.unwrap();
    claim(&mut rq, &mut ev, "jobs/flood", 30_000).await;
    start(&mut rq, 1, "sleep 0.3; seq 1 1000000; echo done", &[]).await;
    let pid = started(&mut ev, 1).await as i32;
    drop((ev, rq));
    // All of its output comes while no driver is connected, however loaded the machine.
    assert!(
        gone_within(pid, Duration::from_secs(60)).await,
        "the flood did not end"
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (mut ev2, mut rq2) = connect(&addr, SECRET, T).await.unwrap();
    let (_, dropped) = claim(&mut rq2, &mut ev2, "jobs/flood", 30_000).await;
    let (out, _, exit) = run_to_exit(&mut ev2, 1).await;
    assert_eq!(exit, (Some(0), None));
    assert_eq!(out.last().map(String::as_str), Some("done"));
    let kept: usize = out.iter().map(String::len).sum();
    assert!(dropped > 0, "nothing dropped of 6.9 MB");
    assert!(kept <= 4 * 1024 * 1024, "kept {kept} bytes");
    assert_eq!(
        dropped as usize + out.len(),
        1_000_001,
        "lines neither kept nor counted"
    );
    // The kept lines are the newest, in order.
    let first: usize = out[0].parse().unwrap();
    assert_eq!(first as u64, dropped + 1);
}

/// A new driver claims a job whose old connection is still open (its host vanished and the
/// agent has not noticed yet): the old connection lets go and the new one gets the processes.
#[tokio::test]
async fn a_second_claim_takes_the_job_from_a_connection_still_open() {
    let (addr, _stop) = agent().await;
    let (mut ev, mut rq) = connect(&addr, SECRET, T).await.unwrap();
    claim(&mut rq, &mut ev, "jobs/kick", 10_000).await;
    start(&mut rq, 4, "exec sleep 30", &[]).await;
    let pid = started(&mut ev, 4).await;
    let (mut ev2, mut rq2) = connect(&addr, SECRET, T).await.unwrap();
    let (held, _) = claim(&mut rq2, &mut ev2, "jobs/kick", 10_000).await;
    assert_eq!(held, vec![Held { id: 4, pid }]);
    // The old connection is closed by the agent.
    let closed = tokio::time::timeout(T, async {
        loop {
            match ev.next().await {
                Ok(None) | Err(_) => return,
                Ok(Some(_)) => {}
            }
        }
    })
    .await;
    assert!(closed.is_ok(), "the old connection stayed open");
    assert!(alive(pid as i32));
    rq2.send(&ToAgent::Stop { id: 4, grace_ms: 0 })
        .await
        .unwrap();
    assert_eq!(run_to_exit(&mut ev2, 4).await.2, (None, Some(9)));
    // A claim must come first, and once.
    let (mut ev3, mut rq3) = connect(&addr, SECRET, T).await.unwrap();
    start(&mut rq3, 1, "exec sleep 30", &[]).await;
    started(&mut ev3, 1).await;
    rq3.send(&ToAgent::Claim {
        job: "jobs/late".into(),
        grace_ms: 1,
    })
    .await
    .unwrap();
    match next(&mut ev3).await {
        FromAgent::Error { reason } => assert!(reason.contains("before"), "{reason}"),
        other => panic!("{other:?}"),
    }
}
