//! Hostile connections to a rank's listener while its world connects: random bytes, a genuine
//! hello cut, flipped, stretched or padded, a dialer that holds another job's token, a recorded
//! handshake replayed on a later connection, a hello that stalls. The listener refuses each
//! (a status byte that says why, or a closed connection), reads no more than a hello and a proof,
//! logs the refusal, and the genuine world still connects and reduces.
//!
//! The hello's layout is written out here (magic, version, from, to, generation, nonce) so that
//! the mutations start from a real one. A stranger never holds the job's token, so the most it can
//! get is the listener's challenge; its proof then fails.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test that cannot set up fails loudly

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use hvd_collectives::{CommConfig, Communicator, ReduceOp};
use proptest::collection::vec;
use proptest::prelude::*;

const TOKEN: &str = "test-secret";
const MAGIC: u32 = 0x4856_4448;
const VERSION: u8 = 7;
/// Rank 0's `to` word for the first of one stream.
const TO_RANK0: u32 = 1 << 28;
const HELLO_LEN: usize = 37;
/// The listener's challenge after a hello it accepts: status 0, its nonce, its proof.
const CHALLENGE_LEN: usize = 1 + 16 + 32;
/// Far beyond anything the tests wait for; a connect that returns is one that went through.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(30);

fn hello(version: u8, from: u32, to: u32, generation: u64, nonce: [u8; 16]) -> Vec<u8> {
    let mut b = MAGIC.to_le_bytes().to_vec();
    b.push(version);
    b.extend_from_slice(&from.to_le_bytes());
    b.extend_from_slice(&to.to_le_bytes());
    b.extend_from_slice(&generation.to_le_bytes());
    b.extend_from_slice(&nonce);
    b
}

/// Edits: cut, flip, insert, repeat a span.
fn mutate(mut b: Vec<u8>, edits: &[(u8, usize, u8, Vec<u8>)]) -> Vec<u8> {
    for (kind, at, byte, bytes) in edits {
        let at = at % (b.len() + 1);
        match kind {
            0 => b.truncate(at),
            1 if at < b.len() => b[at] ^= (*byte).max(1),
            2 => drop(b.splice(at..at, bytes.iter().copied())),
            3 => {
                let span = b[at..(at + usize::from(*byte)).min(b.len())].to_vec();
                b.splice(at..at, span);
            }
            _ => {}
        }
    }
    b
}

fn hostile_hello() -> impl Strategy<Value = Vec<u8>> {
    let genuine = (
        prop_oneof![Just(VERSION), any::<u8>()],
        prop_oneof![Just(1u32), any::<u32>()],
        prop_oneof![Just(TO_RANK0), any::<u32>()],
        prop_oneof![Just(0u64), any::<u64>()],
        any::<[u8; 16]>(),
        // What a stranger sends after the hello, for a proof.
        vec(any::<u8>(), 0..48),
    )
        .prop_map(|(v, from, to, g, nonce, proof)| {
            let mut b = hello(v, from, to, g, nonce);
            b.extend_from_slice(&proof);
            b
        });
    let edited = (
        genuine.clone(),
        vec(
            (0u8..4, any::<usize>(), any::<u8>(), vec(any::<u8>(), 0..16)),
            0..4,
        ),
    )
        .prop_map(|(h, e)| mutate(h, &e));
    prop_oneof![vec(any::<u8>(), 0..96), genuine, edited]
}

/// Sends `bytes` to `addr` and returns what came back once the listener closed the connection.
fn knock(addr: SocketAddr, bytes: &[u8]) -> Vec<u8> {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    // The listener may refuse and close before it read everything.
    let _ = s.write_all(bytes);
    let _ = s.shutdown(Shutdown::Write);
    let mut back = Vec::new();
    match s.read_to_end(&mut back) {
        Ok(_) => back,
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => back,
        Err(e) => panic!("the listener neither answered nor closed: {e}"),
    }
}

/// Whether `back` is a refusal: nothing, a non-zero status, or the challenge and then either
/// nothing (the stranger sent no whole proof) or a non-zero status for its proof.
fn refused(back: &[u8]) -> bool {
    match back.len() {
        0 => true,
        1 => back[0] != 0,
        CHALLENGE_LEN => back[0] == 0,
        n if n == CHALLENGE_LEN + 1 => back[0] == 0 && back[CHALLENGE_LEN] == 1,
        _ => false,
    }
}

/// Connects rank `rank` of a world of two holding `token` and sums its rank + 1 with the
/// other's.
fn rank_with(
    rank: usize,
    token: &str,
    l: &TcpListener,
    addrs: &[SocketAddr],
) -> Result<f32, String> {
    let mut cfg = CommConfig::new(rank, 2, token);
    cfg.connect_timeout = CONNECT_TIMEOUT;
    cfg.streams = 1;
    let mut comm = Communicator::connect(cfg, l, addrs).map_err(|e| e.to_string())?;
    let mut v = [rank as f32 + 1.0];
    comm.allreduce(&mut v, ReduceOp::Sum).unwrap();
    Ok(v[0])
}

fn rank(rank: usize, l: &TcpListener, addrs: &[SocketAddr]) -> f32 {
    rank_with(rank, TOKEN, l, addrs).expect("the genuine world connects")
}

fn listeners() -> ([TcpListener; 2], [SocketAddr; 2]) {
    let l = [
        TcpListener::bind("127.0.0.1:0").unwrap(),
        TcpListener::bind("127.0.0.1:0").unwrap(),
    ];
    let addrs = [l[0].local_addr().unwrap(), l[1].local_addr().unwrap()];
    (l, addrs)
}

proptest! {
    // Each case builds a world; a few dozen cover every kind of edit many times over.
    #![proptest_config(ProptestConfig::with_cases(32))]

    /// Strangers' hellos while rank 0 waits for rank 1: each is refused, and then rank 1
    /// connects and the world reduces.
    #[test]
    fn hostile_hellos_are_refused_and_the_world_still_connects(
        hellos in vec(hostile_hello(), 1..16),
    ) {
        let ([l0, l1], addrs) = listeners();
        let sums = thread::scope(|s| {
            let r0 = s.spawn(|| rank(0, &l0, &addrs));
            for h in &hellos {
                let back = knock(addrs[0], h);
                assert!(refused(&back), "{h:?} got {back:?}");
            }
            let r1 = s.spawn(|| rank(1, &l1, &addrs));
            [r0.join().unwrap(), r1.join().unwrap()]
        });
        prop_assert_eq!(sums, [3.0, 3.0]);
    }
}

/// The refusals say why: a wrong round, a rank out of the world, another protocol version, a
/// stream count that differs, and a proof that is not one.
#[test]
fn well_formed_strangers_learn_why_they_are_refused() {
    let ([l0, l1], addrs) = listeners();
    let n = [7u8; 16];
    thread::scope(|s| {
        let r0 = s.spawn(|| rank(0, &l0, &addrs));
        let cases = [
            (hello(VERSION, 1, TO_RANK0, 9, n), 2),
            (hello(VERSION, 5, TO_RANK0, 0, n), 3),
            (hello(VERSION, 1, TO_RANK0 | 3, 0, n), 3),
            (hello(VERSION + 1, 1, TO_RANK0, 0, n), 4),
            (hello(VERSION - 1, 1, TO_RANK0, 0, n), 4),
            (hello(VERSION, 1, 2 << 28, 0, n), 5),
        ];
        for (h, status) in cases {
            assert_eq!(knock(addrs[0], &h), [status], "{h:?}");
        }
        let mut forged = hello(VERSION, 1, TO_RANK0, 0, n);
        forged.extend_from_slice(&[0u8; 32]);
        let back = knock(addrs[0], &forged);
        assert_eq!(back.len(), CHALLENGE_LEN + 1, "{back:?}");
        assert_eq!((back[0], back[CHALLENGE_LEN]), (0, 1), "{back:?}");
        let r1 = s.spawn(|| rank(1, &l1, &addrs));
        assert_eq!([r0.join().unwrap(), r1.join().unwrap()], [3.0, 3.0]);
    });
}

/// A rank that holds another job's token learns that its peer is not of its job, and is not
/// admitted; the genuine rank connects after it.
#[test]
fn a_rank_with_another_jobs_token_is_refused() {
    let ([l0, l1], addrs) = listeners();
    thread::scope(|s| {
        let r0 = s.spawn(|| rank(0, &l0, &addrs));
        let imposter = rank_with(1, "another-job", &l1, &addrs).unwrap_err();
        assert!(imposter.contains("another job's token"), "{imposter}");
        let r1 = s.spawn(|| rank(1, &l1, &addrs));
        assert_eq!([r0.join().unwrap(), r1.join().unwrap()], [3.0, 3.0]);
    });
}

/// Forwards one connection to `to`, recording what the dialer sent.
fn recording_proxy(to: SocketAddr) -> (SocketAddr, Arc<Mutex<Vec<u8>>>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let sent = Arc::new(Mutex::new(Vec::new()));
    let record = Arc::clone(&sent);
    thread::spawn(move || {
        let (mut dialer, _) = l.accept().unwrap();
        let mut listener = TcpStream::connect(to).unwrap();
        let mut back_dialer = dialer.try_clone().unwrap();
        let mut back_listener = listener.try_clone().unwrap();
        thread::spawn(move || {
            let _ = std::io::copy(&mut back_listener, &mut back_dialer);
            let _ = back_dialer.shutdown(Shutdown::Write);
        });
        let mut buf = [0u8; 4096];
        loop {
            match dialer.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    record.lock().unwrap().extend_from_slice(&buf[..n]);
                    if listener.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
            }
        }
        let _ = listener.shutdown(Shutdown::Write);
    });
    (addr, sent)
}

/// A genuine rank 1's handshake, recorded on the wire, is refused when replayed to a later
/// world of the same round numbers: the listener's fresh nonce makes the old proof worthless.
#[test]
fn a_recorded_handshake_replayed_later_is_refused() {
    let ([l0, l1], addrs) = listeners();
    let (proxy, recorded) = recording_proxy(addrs[0]);
    thread::scope(|s| {
        let r0 = s.spawn(|| rank(0, &l0, &addrs));
        let r1 = s.spawn(|| rank(1, &l1, &[proxy, addrs[1]]));
        assert_eq!([r0.join().unwrap(), r1.join().unwrap()], [3.0, 3.0]);
    });
    let replay = recorded.lock().unwrap()[..HELLO_LEN + 32].to_vec();
    let ([l0, l1], addrs) = listeners();
    thread::scope(|s| {
        let r0 = s.spawn(|| rank(0, &l0, &addrs));
        let back = knock(addrs[0], &replay);
        assert_eq!(back.len(), CHALLENGE_LEN + 1, "{back:?}");
        assert_eq!((back[0], back[CHALLENGE_LEN]), (0, 1), "{back:?}");
        let r1 = s.spawn(|| rank(1, &l1, &addrs));
        assert_eq!([r0.join().unwrap(), r1.join().unwrap()], [3.0, 3.0]);
    });
}

/// A stranger that sends half a hello and then nothing holds the listener for the hello
/// timeout at most; the world connects after it.
#[test]
fn a_stalled_hello_only_delays_the_world() {
    let ([l0, l1], addrs) = listeners();
    let started = Instant::now();
    thread::scope(|s| {
        let r0 = s.spawn(|| rank(0, &l0, &addrs));
        let mut stalled = TcpStream::connect(addrs[0]).unwrap();
        stalled
            .write_all(&hello(VERSION, 1, TO_RANK0, 0, [1; 16])[..10])
            .unwrap();
        let r1 = s.spawn(|| rank(1, &l1, &addrs));
        assert_eq!([r0.join().unwrap(), r1.join().unwrap()], [3.0, 3.0]);
        drop(stalled);
    });
    assert!(
        started.elapsed() < CONNECT_TIMEOUT,
        "{:?}",
        started.elapsed()
    );
}

/// A flood of strangers at a rank's listener while its world forms (300 connections sending
/// garbage before the genuine peer dials): every one is refused, and the rank's log names the
/// first refusal of the address and reason and counts the rest, a few lines instead of one
/// per connection.
#[test]
fn a_flood_of_strangers_while_the_mesh_forms_is_counted_not_logged_one_by_one() {
    let log = Arc::new(Mutex::new(Vec::<u8>::new()));
    let sink = Arc::clone(&log);
    let subscriber = tracing_subscriber::fmt()
        .with_writer(move || LogWriter(Arc::clone(&sink)))
        .with_ansi(false)
        .finish();
    // The rank whose log is read runs on this thread, where the subscriber is the default.
    let _logging = tracing::subscriber::set_default(subscriber);
    let ([l0, l1], addrs) = listeners();
    let sum = thread::scope(|s| {
        s.spawn(|| {
            for _ in 0..300 {
                assert!(refused(&knock(addrs[0], b"GET / HTTP/1.0\r\n\r\n")));
            }
            rank(1, &l1, &addrs)
        });
        rank(0, &l0, &addrs)
    });
    assert_eq!(sum, 3.0);
    let text = String::from_utf8_lossy(&log.lock().unwrap()).into_owned();
    assert_eq!(
        text.matches("peer connection refused").count(),
        1,
        "the first refusal alone is logged one by one:\n{text}"
    );
    let counted = hvd_auth::refusals::counted_in(&text, "peer", None);
    assert_eq!(counted, 299, "{text}");
}

/// A writer into a shared buffer, for a subscriber whose lines a test reads.
struct LogWriter(Arc<Mutex<Vec<u8>>>);

impl Write for LogWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}
