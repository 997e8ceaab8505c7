//! Hostile input for the agent: its messages' decoders on random and mutated lines, and a
//! real agent (in process, over sockets) facing strangers that send random bytes, mutated
//! handshakes and oversized lines, and an authenticated peer that sends garbage. Every line
//! decodes or is refused with a message; the agent refuses or answers each peer, never
//! panics, holds no more than a line's limit per connection, and a genuine driver afterwards
//! still starts a process and reads its output.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test that cannot set up fails loudly

use std::time::Duration;

use hvd_agent::auth::{CONTEXT, Handshake, Nonce, Role};
use hvd_agent::{FromAgent, Stream, ToAgent, connect, serve};
use hvd_rendezvous::{decode_line, encode_line};
use lines::{Edit, check, edits};
use proptest::collection::vec;
use proptest::prelude::*;

#[path = "../../rendezvous/tests/lines/mod.rs"]
mod lines;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::sync::oneshot;

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
        text().prop_map(|reason| FromAgent::Error { reason }),
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

/// An agent serving on a free port until the sender is dropped.
async fn agent() -> (String, oneshot::Sender<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let (tx, rx) = oneshot::channel::<()>();
    tokio::spawn(serve(listener, SECRET.into(), async move {
        let _ = rx.await;
    }));
    (addr, tx)
}

/// Sends `bytes` and reads what comes back until the agent closes the connection (a
/// refusal closes it) or, when it keeps it open, until it has been quiet for a while.
async fn knock(addr: &str, bytes: &[u8]) -> Vec<u8> {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    // The agent may refuse and close before it read everything.
    let _ = s.write_all(bytes).await;
    let _ = s.shutdown().await;
    let mut back = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match tokio::time::timeout(T, s.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return back,
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
    /// welcome or a started process); then a genuine driver is served.
    #[test]
    fn strangers_are_refused_and_the_agent_serves_on(strangers in vec(stranger(), 1..6)) {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async {
            let (addr, _stop) = agent().await;
            for s in &strangers {
                refused(&knock(&addr, s).await)?;
            }
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
