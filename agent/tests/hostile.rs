//! Hostile input for the agent: its messages' decoders on random and mutated lines, and a
//! real agent (in process, over sockets) facing strangers that send random bytes, mutated
//! handshakes and oversized or endless lines, and an authenticated peer that sends garbage
//! or deeply nested JSON. Every line decodes or is refused with a message; the agent refuses
//! (and logs, with the peer's address) or answers each peer, never panics, reads no more than
//! a line's limit of one it refuses, and a genuine driver afterwards still starts a process
//! and reads its output. The driver's side too: `connect` against fake agents that send
//! garbage, mutated challenges and welcomes or endless lines fails with an error naming the
//! agent (and succeeds only on a genuine welcome), and [`Events::next`] reports each line
//! after the handshake as its message or as an error.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test that cannot set up fails loudly

mod support;

use std::time::Duration;

use std::sync::{Arc, Mutex};

use hvd_agent::auth::{CONTEXT, Handshake, Nonce, Role, Tag};
use hvd_agent::{AgentError, FromAgent, Held, Limits, Stream, ToAgent, connect};
use hvd_rendezvous::{MAX_LINE, ProtocolError, decode_line, encode_line};
use lines::{Edit, check, edits};
use proptest::collection::vec;
use proptest::prelude::*;

#[path = "../../rendezvous/tests/lines/mod.rs"]
mod lines;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

const SECRET: &str = "hostile-test-secret";
const T: Duration = Duration::from_secs(10);

fn text() -> impl Strategy<Value = String> {
    prop_oneof!["(?s).{0,24}", "[a-z0-9./ -]{0,16}"]
}

fn to_agent() -> impl Strategy<Value = ToAgent> {
    prop_oneof![
        (text(), text()).prop_map(|(mac, nonce)| ToAgent::Auth { mac, nonce }),
        (
            any::<u64>(),
            vec(text(), 0..4),
            vec((text(), text()), 0..3),
            proptest::option::of(text())
        )
            .prop_map(|(id, argv, env, cwd)| ToAgent::Start { id, argv, env, cwd }),
        (any::<u64>(), any::<u64>()).prop_map(|(id, grace_ms)| ToAgent::Stop { id, grace_ms }),
        (text(), any::<u64>()).prop_map(|(job, grace_ms)| ToAgent::Claim { job, grace_ms }),
    ]
}

fn from_agent() -> impl Strategy<Value = FromAgent> {
    prop_oneof![
        text().prop_map(|nonce| FromAgent::Challenge { nonce }),
        text().prop_map(|mac| FromAgent::Welcome { mac }),
        text().prop_map(|reason| FromAgent::Refused { reason }),
        (any::<u64>(), any::<u32>()).prop_map(|(id, pid)| FromAgent::Started { id, pid }),
        (any::<u64>(), text()).prop_map(|(id, error)| FromAgent::StartFailed { id, error }),
        (any::<u64>(), any::<bool>(), text()).prop_map(|(id, err, line)| FromAgent::Output {
            id,
            stream: if err { Stream::Stderr } else { Stream::Stdout },
            line,
        }),
        (
            any::<u64>(),
            proptest::option::of(any::<i32>()),
            proptest::option::of(any::<i32>())
        )
            .prop_map(|(id, code, signal)| FromAgent::Exited { id, code, signal }),
        (
            any::<u64>(),
            proptest::option::of(any::<i32>()),
            proptest::option::of(any::<i32>())
        )
            .prop_map(|(id, code, signal)| FromAgent::Dying { id, code, signal }),
        text().prop_map(|reason| FromAgent::Error { reason }),
        (vec((any::<u64>(), any::<u32>()), 0..4), any::<u64>()).prop_map(
            |(held, dropped_lines)| FromAgent::Claimed {
                processes: held.into_iter().map(|(id, pid)| Held { id, pid }).collect(),
                dropped_lines,
            }
        ),
    ]
}

/// Fragments a hostile peer would try: unknown types, repeated fields, numbers past their
/// types, invalid UTF-8, deep nesting.
const FRAGMENTS: &[&[u8]] = &[
    br#","id":18446744073709551616"#,
    br#","type":"exec""#,
    br#","argv":["sh","-c","reboot"],"argv":[]"#,
    br#","grace_ms":-1"#,
    b"[[[[[[[[[[[[[[[[[[[[",
    b"\xff\xfe\xc3\x28",
];

fn mutate(line: Vec<u8>, edits: &[Edit]) -> Vec<u8> {
    lines::mutate(line, edits, FRAGMENTS)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn random_bytes_decode_or_are_refused(line in vec(any::<u8>(), 0..256)) {
        check::<ToAgent>(&line)?;
        check::<FromAgent>(&line)?;
    }

    #[test]
    fn mutated_requests_decode_or_are_refused(msg in to_agent(), e in edits()) {
        let line = encode_line(&msg).unwrap();
        prop_assert_eq!(decode_line::<ToAgent>(&line).unwrap(), msg);
        let line = mutate(line, &e);
        check::<ToAgent>(&line)?;
        check::<FromAgent>(&line)?;
    }

    #[test]
    fn mutated_reports_decode_or_are_refused(msg in from_agent(), e in edits()) {
        let line = encode_line(&msg).unwrap();
        prop_assert_eq!(decode_line::<FromAgent>(&line).unwrap(), msg);
        let line = mutate(line, &e);
        check::<FromAgent>(&line)?;
        check::<ToAgent>(&line)?;
    }
}

/// An agent serving on a free port until the returned sender is dropped.
async fn agent() -> (String, oneshot::Sender<()>) {
    support::agent_with(SECRET, Limits::default()).await
}

/// Sends `bytes` and reads what comes back until the agent closes the connection (a
/// refusal closes it); returns that and the address the bytes came from.
async fn knock(addr: &str, bytes: &[u8]) -> (Vec<u8>, String) {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let from = s.local_addr().unwrap().to_string();
    // The agent may refuse and close before it read everything.
    let _ = s.write_all(bytes).await;
    let _ = s.shutdown().await;
    let mut back = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match tokio::time::timeout(T, s.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return (back, from),
            Ok(Ok(n)) => back.extend_from_slice(&buf[..n]),
            Err(_) => panic!("the agent neither answered nor closed: {back:?}"),
        }
    }
}

/// Each line the agent sent is one of its messages; the first is its challenge, and nothing
/// after it says welcome.
fn refused(back: &[u8]) -> Result<(), TestCaseError> {
    let msgs: Vec<FromAgent> = back
        .split_inclusive(|&b| b == b'\n')
        .map(|l| decode_line::<FromAgent>(l).expect("the agent speaks its protocol"))
        .collect();
    prop_assert!(
        matches!(msgs.first(), Some(FromAgent::Challenge { .. })),
        "{:?}",
        msgs
    );
    prop_assert!(
        !msgs
            .iter()
            .any(|m| matches!(m, FromAgent::Welcome { .. } | FromAgent::Started { .. })),
        "a stranger got in: {:?}",
        msgs
    );
    Ok(())
}

/// What a stranger without the secret sends: random bytes, an answer to the challenge with
/// a made-up MAC (mutated or not), a request without authenticating, an oversized line.
fn stranger() -> impl Strategy<Value = Vec<u8>> {
    let auth = (any::<[u8; 32]>(), any::<[u8; 16]>()).prop_map(|(mac, nonce)| {
        let hex = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<String>();
        encode_line(&ToAgent::Auth {
            mac: hex(&mac),
            nonce: hex(&nonce),
        })
        .unwrap()
    });
    let request = Just(
        encode_line(&ToAgent::Start {
            id: 1,
            argv: vec!["touch".into(), "/tmp/hvd-hostile-agent-got-in".into()],
            env: vec![],
            cwd: None,
        })
        .unwrap(),
    );
    prop_oneof![
        vec(any::<u8>(), 0..256),
        (auth.clone(), edits()).prop_map(|(l, e)| mutate(l, &e)),
        auth,
        request,
        Just(vec![b'x'; 8 << 10]),
    ]
}

/// Checks that a genuine driver still starts a process through the agent.
async fn genuine_driver_works(addr: &str) {
    let (mut ev, mut rq) = connect(addr, SECRET, T).await.unwrap();
    rq.send(&ToAgent::Start {
        id: 9,
        argv: vec!["sh".into(), "-c".into(), "echo still-serving".into()],
        env: vec![],
        cwd: None,
    })
    .await
    .unwrap();
    let mut saw = false;
    loop {
        let msg = tokio::time::timeout(T, ev.next())
            .await
            .expect("the agent answers")
            .unwrap()
            .expect("open");
        match msg {
            FromAgent::Output { line, .. } => saw |= line == "still-serving",
            FromAgent::Exited { code, .. } => {
                assert_eq!(code, Some(0));
                break;
            }
            FromAgent::Started { .. } => {}
            other => panic!("unexpected {other:?}"),
        }
    }
    assert!(saw, "the process's output came back");
}

proptest! {
    // Each case runs an agent and a few connections.
    #![proptest_config(ProptestConfig::with_cases(24))]

    /// Strangers are refused (the challenge, then a refusal or a closed connection, never a
    /// welcome or a started process) and each refusal is logged with the stranger's address;
    /// then a genuine driver is served.
    #[test]
    fn strangers_are_refused_and_the_agent_serves_on(strangers in vec(stranger(), 1..6)) {
        let log = Log::default();
        let _logging = tracing::subscriber::set_default(log.subscriber());
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async {
            let (addr, _stop) = agent().await;
            let mut froms = Vec::new();
            for s in &strangers {
                let (back, from) = knock(&addr, s).await;
                refused(&back)?;
                froms.push(from);
            }
            // The first refusal of an address for a reason is logged with the peer; the rest
            // are only counted, so every reason appears once (all come from one address).
            let text = log.text();
            let full: Vec<&str> = text
                .lines()
                .filter(|l| l.contains("driver connection refused"))
                .collect();
            prop_assert!(
                full.iter().any(|l| l.contains(&format!("peer={} ", froms[0]))),
                "the first refusal ({}) is not logged:\n{}", froms[0], text
            );
            let mut reasons: Vec<&str> = full
                .iter()
                .filter_map(|l| l.split("reason=").nth(1)?.split(' ').next())
                .collect();
            prop_assert_eq!(reasons.len(), full.len(), "a refusal without a reason:\n{}", text);
            for l in &full {
                prop_assert!(
                    froms.iter().any(|f| l.contains(&format!("peer={f} "))),
                    "a refusal of no stranger: {}", l
                );
            }
            let logged = reasons.len();
            reasons.sort_unstable();
            reasons.dedup();
            prop_assert_eq!(reasons.len(), logged, "a reason logged twice:\n{}", text);
            genuine_driver_works(&addr).await;
            Ok::<(), TestCaseError>(())
        })?;
        prop_assert!(!std::path::Path::new("/tmp/hvd-hostile-agent-got-in").exists());
    }

    /// An authenticated peer sending garbage gets an error for each bad request (or its
    /// connection closed, for an oversized one); the agent serves the next driver.
    #[test]
    fn garbage_after_authentication_is_answered_not_obeyed(lines in vec(vec(any::<u8>(), 1..128), 1..6)) {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async {
            let (addr, _stop) = agent().await;
            let mut s = tokio::net::TcpStream::connect(&addr).await.unwrap();
            let mut back = Vec::new();
            let mut buf = [0u8; 4096];
            // The challenge.
            while !back.contains(&b'\n') {
                let n = tokio::time::timeout(T, s.read(&mut buf)).await.unwrap().unwrap();
                prop_assert!(n > 0);
                back.extend_from_slice(&buf[..n]);
            }
            let Ok(FromAgent::Challenge { nonce }) = decode_line::<FromAgent>(&back) else {
                panic!("no challenge: {back:?}");
            };
            let hs = Handshake::new(SECRET, CONTEXT, Role::Dialer).unwrap();
            let theirs = Nonce::from_hex(&nonce).unwrap();
            let auth = ToAgent::Auth { mac: hs.proof(&theirs).to_hex(), nonce: hs.nonce().to_hex() };
            s.write_all(&encode_line(&auth).unwrap()).await.unwrap();
            let mut sent_garbage = 0;
            for l in &lines {
                let mut l: Vec<u8> = l.iter().map(|&b| if b == b'\n' { b' ' } else { b }).collect();
                if decode_line::<ToAgent>(&l).is_ok() {
                    continue; // a valid request by chance: not garbage
                }
                l.push(b'\n');
                s.write_all(&l).await.unwrap();
                sent_garbage += 1;
            }
            s.shutdown().await.unwrap();
            let mut rest = Vec::new();
            loop {
                match tokio::time::timeout(T, s.read(&mut buf)).await.unwrap() {
                    Ok(0) | Err(_) => break,
                    Ok(n) => rest.extend_from_slice(&buf[..n]),
                }
            }
            let msgs: Vec<FromAgent> = rest
                .split_inclusive(|&b| b == b'\n')
                .map(|l| decode_line::<FromAgent>(l).unwrap())
                .collect();
            prop_assert!(matches!(msgs.first(), Some(FromAgent::Welcome { .. })), "{:?}", msgs);
            let errors = msgs.iter().filter(|m| matches!(m, FromAgent::Error { reason } if reason.starts_with("bad request: "))).count();
            prop_assert_eq!(errors, sent_garbage, "{:?}", msgs);
            genuine_driver_works(&addr).await;
            Ok::<(), TestCaseError>(())
        })?;
    }
}

/// A flood of strangers at an agent (300 connections sending an HTTP request): each is
/// refused, and the log names the first refusal of its address and reason and counts the
/// rest, a few lines instead of one per connection.
#[test]
fn a_flood_of_strangers_is_counted_not_logged_one_by_one() {
    let log = Log::default();
    let _logging = tracing::subscriber::set_default(log.subscriber());
    runtime().block_on(async {
        let limits = Limits {
            refusal_summary: Duration::from_millis(200),
            ..Limits::default()
        };
        let (addr, _stop) = support::agent_with(SECRET, limits).await;
        for _ in 0..300 {
            let (back, _) = knock(&addr, b"GET / HTTP/1.0\r\n\r\n").await;
            refused(&back).unwrap();
        }
        let counted = |text: &str| hvd_auth::refusals::counted_in(text, "driver", Some("not_auth"));
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while counted(&log.text()) < 299 {
            assert!(std::time::Instant::now() < deadline, "{}", log.text());
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        genuine_driver_works(&addr).await;
    });
    let text = log.text();
    assert_eq!(
        text.matches("driver connection refused").count(),
        1,
        "the first refusal alone is logged one by one:\n{text}"
    );
    let summaries = text.matches("since the last count").count();
    assert!(summaries <= 10, "{summaries} count lines:\n{text}");
}

/// Log lines written in this thread while its subscriber is the default.
#[derive(Clone, Default)]
struct Log(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Log {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Log {
    fn subscriber(&self) -> impl tracing::Subscriber + Send + Sync + 'static {
        let sink = self.clone();
        tracing_subscriber::fmt()
            .with_writer(move || sink.clone())
            .with_ansi(false)
            .with_max_level(tracing::Level::INFO)
            .finish()
    }

    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// Writes `x` bytes without a newline until the peer stops taking them (or `cap` bytes are
/// written); how many it took.
async fn endless_line(w: &mut (impl AsyncWriteExt + Unpin), cap: usize) -> usize {
    let chunk = vec![b'x'; 64 << 10];
    let mut sent = 0;
    while sent < cap {
        match tokio::time::timeout(T, w.write_all(&chunk)).await {
            Ok(Ok(())) => sent += chunk.len(),
            Ok(Err(_)) => return sent,
            Err(_) => panic!("the peer neither read on nor closed after {sent} bytes"),
        }
    }
    sent
}

/// What an endless line may push into a peer that refuses it: the limit, and what the
/// kernel buffers of a loopback connection hold.
const BUFFERED: usize = 12 << 20;

/// The agent's challenge read from `s`, and the genuine answer to it.
async fn answer_challenge(s: &mut (impl AsyncBufReadExt + Unpin)) -> ToAgent {
    let mut line = Vec::new();
    tokio::time::timeout(T, s.read_until(b'\n', &mut line))
        .await
        .unwrap()
        .unwrap();
    let Ok(FromAgent::Challenge { nonce }) = decode_line::<FromAgent>(&line) else {
        panic!("no challenge: {line:?}");
    };
    let hs = Handshake::new(SECRET, CONTEXT, Role::Dialer).unwrap();
    let theirs = Nonce::from_hex(&nonce).unwrap();
    ToAgent::Auth {
        mac: hs.proof(&theirs).to_hex(),
        nonce: hs.nonce().to_hex(),
    }
}

/// A connection to `addr` that answered the agent's challenge (the welcome not read yet).
async fn authenticated(addr: &str) -> (BufReader<OwnedReadHalf>, OwnedWriteHalf) {
    let (r, mut w) = TcpStream::connect(addr).await.unwrap().into_split();
    let mut r = BufReader::new(r);
    let auth = answer_challenge(&mut r).await;
    w.write_all(&encode_line(&auth).unwrap()).await.unwrap();
    (r, w)
}

/// Every message the agent sends until it closes the connection (or resets it).
async fn messages_until_closed(r: &mut BufReader<OwnedReadHalf>) -> Vec<FromAgent> {
    let mut back = Vec::new();
    let _ = tokio::time::timeout(T, r.read_to_end(&mut back))
        .await
        .expect("the agent closes the connection");
    back.split_inclusive(|&b| b == b'\n')
        .map(|l| decode_line(l).expect("the agent speaks its protocol"))
        .collect()
}

/// An endless line is cut off at its limit, before authentication (refused, saying why)
/// and after it (the connection closed, and logged); the agent reads no more than the limit
/// and what the connection buffers, and serves the next driver.
#[test]
fn endless_lines_are_cut_off_at_their_limit() {
    let log = Log::default();
    let _logging = tracing::subscriber::set_default(log.subscriber());
    runtime().block_on(async {
        let (addr, _stop) = agent().await;
        // Before authenticating.
        let (r, mut w) = TcpStream::connect(&addr).await.unwrap().into_split();
        let reader = tokio::spawn(async move {
            let mut back = Vec::new();
            let _ = BufReader::new(r).read_to_end(&mut back).await;
            back
        });
        let sent = endless_line(&mut w, 256 << 20).await;
        assert!(sent < BUFFERED, "{sent} bytes taken before authentication");
        let back = tokio::time::timeout(T, reader).await.unwrap().unwrap();
        let last = back.split_inclusive(|&b| b == b'\n').next_back().unwrap();
        assert!(
            matches!(decode_line::<FromAgent>(last), Ok(FromAgent::Refused { reason })
                if reason.contains("longer than 4096 bytes before authentication")),
            "{:?}",
            String::from_utf8_lossy(&back)
        );
        // After authenticating.
        let (mut r, mut w) = authenticated(&addr).await;
        let sent = endless_line(&mut w, 256 << 20).await;
        assert!(
            (MAX_LINE..BUFFERED).contains(&sent),
            "{sent} bytes taken after authentication"
        );
        let msgs = messages_until_closed(&mut r).await;
        assert!(matches!(msgs[..], [FromAgent::Welcome { .. }]), "{msgs:?}");
        genuine_driver_works(&addr).await;
    });
    let text = log.text();
    assert!(
        text.contains("request too long; connection closed"),
        "{text}"
    );
    assert!(text.contains(&format!("bytes={}", MAX_LINE + 1)), "{text}");
}

/// JSON nested far deeper than the decoder recurses is answered with an error that says so,
/// from an authenticated peer, and the agent serves on.
#[test]
fn deep_nesting_is_answered_with_an_error() {
    runtime().block_on(async {
        let (addr, _stop) = agent().await;
        let (mut r, mut w) = authenticated(&addr).await;
        for open in [&b"["[..], br#"{"a":"#] {
            let mut line = br#"{"type":"start","argv":"#.to_vec();
            line.extend(open.repeat(200_000));
            line.push(b'\n');
            w.write_all(&line).await.unwrap();
        }
        w.shutdown().await.unwrap();
        let msgs = messages_until_closed(&mut r).await;
        assert!(
            matches!(msgs.first(), Some(FromAgent::Welcome { .. })),
            "{msgs:?}"
        );
        let errors: Vec<&str> = msgs[1..]
            .iter()
            .filter_map(|m| match m {
                FromAgent::Error { reason } => Some(reason.as_str()),
                _ => None,
            })
            .collect();
        assert_eq!(errors.len(), 2, "{msgs:?}");
        for e in errors {
            assert!(
                e.starts_with("bad request: ") && e.contains("recursion limit"),
                "{e}"
            );
        }
        genuine_driver_works(&addr).await;
    });
}

/// A fake agent on a free port that runs `script` on the first connection; its address, and
/// the task (to hold the connection open until the test is done with it).
async fn fake_agent<F, Fut>(script: F) -> (String, JoinHandle<()>)
where
    F: FnOnce(BufReader<TcpStream>) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let task = tokio::spawn(async move {
        let (s, _) = listener.accept().await.unwrap();
        script(BufReader::new(s)).await;
    });
    (addr, task)
}

/// The fake agent's side of a genuine handshake: its challenge, the driver's answer checked;
/// returns the genuine welcome line, not sent yet.
async fn genuine_challenge(s: &mut BufReader<TcpStream>) -> Vec<u8> {
    let hs = Handshake::new(SECRET, CONTEXT, Role::Listener).unwrap();
    let challenge = FromAgent::Challenge {
        nonce: hs.nonce().to_hex(),
    };
    s.get_mut()
        .write_all(&encode_line(&challenge).unwrap())
        .await
        .unwrap();
    let mut line = Vec::new();
    s.read_until(b'\n', &mut line).await.unwrap();
    let Ok(ToAgent::Auth { mac, nonce }) = decode_line::<ToAgent>(&line) else {
        panic!("no answer to the challenge: {line:?}");
    };
    let theirs = Nonce::from_hex(&nonce).unwrap();
    hs.verify(&theirs, &Tag::from_hex(&mac).unwrap()).unwrap();
    encode_line(&FromAgent::Welcome {
        mac: hs.proof(&theirs).to_hex(),
    })
    .unwrap()
}

/// What a fake agent does on the connection: the first line it sends in place of its
/// challenge, or its welcome after a genuine challenge.
#[derive(Debug, Clone)]
enum Fake {
    /// Sends these bytes and closes.
    Bytes(Vec<u8>),
    /// Sends a genuine challenge with these edits, and closes after reading the answer.
    Challenge(Vec<Edit>),
    /// Runs a genuine handshake up to the welcome, sends it with these edits, and closes.
    Welcome(Vec<Edit>),
}

fn fake() -> impl Strategy<Value = Fake> {
    prop_oneof![
        vec(any::<u8>(), 0..256).prop_map(Fake::Bytes),
        edits().prop_map(Fake::Challenge),
        edits().prop_map(Fake::Welcome),
    ]
}

/// The first line a reader of `bytes` takes (all of them, without a newline).
fn first_line(bytes: &[u8]) -> &[u8] {
    bytes.split_inclusive(|&b| b == b'\n').next().unwrap_or(&[])
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// The driver's `connect` against fake agents: an error naming the agent, never a panic
    /// or a hang, and a connection exactly when the welcome it read is the genuine one.
    #[test]
    fn connect_trusts_only_a_genuine_welcome(f in fake()) {
        runtime().block_on(async {
            let (said_tx, said) = oneshot::channel::<(Vec<u8>, Option<Vec<u8>>)>();
            let (addr, fake) = fake_agent(move |mut s| async move {
                let (line, genuine) = match f {
                    Fake::Bytes(b) => (b, None),
                    Fake::Challenge(e) => {
                        let c = encode_line(&FromAgent::Challenge {
                            nonce: Nonce::fresh().unwrap().to_hex(),
                        })
                        .unwrap();
                        (mutate(c, &e), None)
                    }
                    Fake::Welcome(e) => {
                        let welcome = genuine_challenge(&mut s).await;
                        (mutate(welcome.clone(), &e), Some(welcome))
                    }
                };
                let _ = s.get_mut().write_all(&line).await;
                let _ = s.get_mut().shutdown().await;
                let _ = said_tx.send((line, genuine));
                // Held open until the driver has read what it needs.
                let mut rest = Vec::new();
                let _ = s.read_to_end(&mut rest).await;
            })
            .await;
            let got = tokio::time::timeout(T, connect(&addr, SECRET, T))
                .await
                .expect("connect ends within its timeout");
            let (sent, genuine) = said.await.unwrap();
            // A welcome is taken only when it decodes to the genuine one (an edit may only
            // have added whitespace); the rest of the line is never read.
            let trusted = genuine.is_some_and(|g| {
                decode_line::<FromAgent>(first_line(&sent)).ok()
                    == Some(decode_line::<FromAgent>(&g).unwrap())
            });
            match got {
                Ok(_) => prop_assert!(trusted, "connected to a fake that sent {:?}", sent),
                Err(e) => {
                    prop_assert!(!trusted, "the genuine welcome was refused: {}", e);
                    prop_assert!(e.to_string().contains(&addr), "{} does not name {}", e, addr);
                }
            }
            fake.abort();
            Ok::<(), TestCaseError>(())
        })?;
    }

    /// After the handshake, each line an agent sends comes out of [`Events::next`] as the
    /// message it decodes to, or as an error naming the agent; the connection goes on, and
    /// its end is reported as such.
    #[test]
    fn each_report_after_the_handshake_is_a_message_or_an_error(
        lines in vec(prop_oneof![
            vec(any::<u8>(), 0..128),
            (from_agent(), edits()).prop_map(|(m, e)| mutate(encode_line(&m).unwrap(), &e)),
            from_agent().prop_map(|m| encode_line(&m).unwrap()),
        ], 1..8),
    ) {
        // One line each: a newline inside becomes a space, and each ends with one.
        let lines: Vec<Vec<u8>> = lines
            .into_iter()
            .map(|l| {
                let mut l: Vec<u8> = l
                    .into_iter()
                    .filter(|&b| b != b'\n')
                    .collect();
                l.push(b'\n');
                l
            })
            .collect();
        runtime().block_on(async {
            let sent = lines.clone();
            let (addr, fake) = fake_agent(move |mut s| async move {
                let welcome = genuine_challenge(&mut s).await;
                let w = s.get_mut();
                w.write_all(&welcome).await.unwrap();
                for l in &sent {
                    w.write_all(l).await.unwrap();
                }
                w.shutdown().await.unwrap();
                let mut rest = Vec::new();
                let _ = s.read_to_end(&mut rest).await;
            })
            .await;
            let (mut events, _requests) = connect(&addr, SECRET, T).await.unwrap();
            for l in &lines {
                let got = tokio::time::timeout(T, events.next()).await.unwrap();
                match (decode_line::<FromAgent>(l), got) {
                    (Ok(want), Ok(Some(got))) => prop_assert_eq!(want, got),
                    (Err(_), Err(e @ AgentError::Malformed { .. })) => {
                        prop_assert!(e.to_string().contains(&addr), "{}", e);
                    }
                    (want, got) => prop_assert!(false, "{:?} read as {:?}", want, got),
                }
            }
            prop_assert!(matches!(events.next().await, Ok(None)));
            fake.abort();
            Ok::<(), TestCaseError>(())
        })?;
    }
}

/// An agent that sends a line past the limit after the handshake, or an endless one, gets
/// an error naming it and the limit; the driver reads no more than the limit and what the
/// connection buffers.
#[test]
fn an_endless_report_is_refused_at_the_limit() {
    runtime().block_on(async {
        let (taken_tx, taken) = oneshot::channel();
        let (addr, fake) = fake_agent(move |mut s| async move {
            let welcome = genuine_challenge(&mut s).await;
            s.get_mut().write_all(&welcome).await.unwrap();
            let sent = endless_line(s.get_mut(), 256 << 20).await;
            let _ = taken_tx.send(sent);
        })
        .await;
        let (mut events, requests) = connect(&addr, SECRET, T).await.unwrap();
        let err = tokio::time::timeout(T, events.next())
            .await
            .unwrap()
            .unwrap_err();
        assert!(
            matches!(&err, AgentError::Malformed { source: ProtocolError::TooLong(n), .. }
                if *n == MAX_LINE + 1),
            "{err:?}"
        );
        let text = err.to_string();
        assert!(
            text.contains(&addr) && text.contains(&MAX_LINE.to_string()),
            "{text}"
        );
        // The driver gives the connection up.
        drop((events, requests));
        let sent = tokio::time::timeout(T, taken).await.unwrap().unwrap();
        assert!((MAX_LINE..BUFFERED).contains(&sent), "{sent} bytes taken");
        fake.abort();
    });
}
