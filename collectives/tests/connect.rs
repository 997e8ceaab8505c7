//! Building a mesh is abortable like a collective: a rank that never shows up, or one that dies
//! at any point of the connecting, fails the others' connect within milliseconds (through the
//! abort an elastic driver sends, or through the dead rank's closed sockets) instead of after
//! the connect timeout.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test that cannot set up fails loudly

use std::net::{SocketAddr, TcpListener};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use hvd_collectives::{AbortHandle, CommConfig, CommError, Communicator};

/// Far beyond anything these tests wait for: a connect that returns is one that noticed.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(30);
/// What "promptly" means here, generous for a loaded machine.
const PROMPT: Duration = Duration::from_secs(3);

fn listeners(ips: &[&str]) -> (Vec<TcpListener>, Vec<SocketAddr>) {
    let ls: Vec<TcpListener> = ips
        .iter()
        .map(|ip| TcpListener::bind((*ip, 0)).expect("bind"))
        .collect();
    let addrs = ls.iter().map(|l| l.local_addr().expect("addr")).collect();
    (ls, addrs)
}

fn config(rank: usize, n: usize) -> CommConfig {
    let mut cfg = CommConfig::new(rank, n, "test-secret");
    cfg.connect_timeout = CONNECT_TIMEOUT;
    cfg
}

/// A rank that does not come (its listener bound, or closed as a dead process's is, at every
/// position): an abort from another thread ends every other rank's connect with
/// [`CommError::Aborted`] (or, for a rank whose peer was aborted an instant earlier, with
/// [`CommError::PeerLost`] as that peer's sockets close).
#[test]
fn an_abort_ends_a_connect_waiting_for_a_rank_that_never_comes() {
    for absent in 0..3 {
        for listener_open in [true, false] {
            let (mut ls, addrs) = listeners(&["127.0.0.1"; 3]);
            let absent_listener = ls.remove(absent);
            if !listener_open {
                drop(absent_listener);
            }
            let handles: Vec<AbortHandle> = (0..2).map(|_| AbortHandle::new()).collect();
            let started = Instant::now();
            let out = thread::scope(|s| {
                let ranks: Vec<_> = (0..3)
                    .filter(|&r| r != absent)
                    .zip(ls.iter().zip(&handles))
                    .map(|(rank, (l, h))| {
                        let addrs = &addrs;
                        s.spawn(move || {
                            let r = Communicator::connect_abortable(config(rank, 3), l, addrs, h);
                            (rank, r.map(|_| ()), started.elapsed())
                        })
                    })
                    .collect();
                thread::sleep(Duration::from_millis(300));
                let aborted_at = started.elapsed();
                for h in &handles {
                    h.abort("round 7 lost a member");
                }
                ranks
                    .into_iter()
                    .map(|t| (t.join().expect("rank thread"), aborted_at))
                    .collect::<Vec<_>>()
            });
            let mut aborted = 0;
            for ((rank, r, at), aborted_at) in out {
                let e = r.expect_err("the world cannot form");
                // A rank whose peer was aborted first may see that peer's sockets close first.
                match &e {
                    CommError::Aborted { reason } if reason.contains("round 7") => aborted += 1,
                    CommError::PeerLost { .. } => {}
                    _ => panic!("absent {absent}, listener open {listener_open}: rank {rank}: {e}"),
                }
                let took = at.saturating_sub(aborted_at);
                eprintln!(
                    "absent {absent} (listener open {listener_open}): rank {rank} returned {took:?} after the abort"
                );
                assert!(
                    took < PROMPT,
                    "rank {rank} returned {took:?} after the abort"
                );
            }
            assert!(
                aborted > 0,
                "absent {absent}, listener open {listener_open}"
            );
        }
    }
}

/// A handle aborted before the call fails it at once (the driver's abort reached the worker
/// before it started connecting).
#[test]
fn a_handle_aborted_before_connecting_fails_it_at_once() {
    let (ls, addrs) = listeners(&["127.0.0.1"; 2]);
    let h = AbortHandle::new();
    h.abort("already over");
    let t = Instant::now();
    let e = Communicator::connect_abortable(config(1, 2), &ls[1], &addrs, &h).unwrap_err();
    assert!(matches!(e, CommError::Aborted { .. }), "{e}");
    assert!(t.elapsed() < PROMPT, "{:?}", t.elapsed());
}

/// A rank that dies after connecting to a peer, while both wait for a third that never comes:
/// the peer notices the closed connection by itself, with no abort, and names the dead rank.
#[test]
fn a_peer_closing_its_connection_while_the_mesh_forms_fails_it_naming_the_peer() {
    let (ls, addrs) = listeners(&["127.0.0.1"; 3]);
    let dying = AbortHandle::new();
    let (tx, rx) = mpsc::channel();
    thread::scope(|s| {
        let (l0, l1, addrs) = (&ls[0], &ls[1], &addrs);
        let survivor = s.spawn(move || {
            let r = Communicator::connect(config(0, 3), l0, addrs);
            (r.map(|_| ()), Instant::now())
        });
        let dying2 = dying.clone();
        s.spawn(move || {
            let r = Communicator::connect_abortable(config(1, 3), l1, addrs, &dying2);
            tx.send(r.map(|_| ())).expect("send");
        });
        // By now rank 1 has dialed rank 0 and both wait for rank 2.
        thread::sleep(Duration::from_millis(300));
        let died = Instant::now();
        dying.abort("killed");
        let own = rx.recv_timeout(PROMPT).expect("the dying rank returns");
        assert!(matches!(own, Err(CommError::Aborted { .. })), "{own:?}");
        let (r, at) = survivor.join().expect("survivor");
        let took = at.saturating_duration_since(died);
        eprintln!("rank 0 noticed rank 1's closed connection {took:?} after it closed");
        match r {
            Err(CommError::PeerLost { rank: 1, .. }) => {}
            other => panic!("rank 0 should have lost rank 1: {other:?}"),
        }
        assert!(took < PROMPT, "took {took:?}");
    });
}

/// The same with the ranks' parts swapped: the rank that dies is the one dialed, and the
/// survivor, which dialed it, notices while it waits for the third to dial in.
#[test]
fn a_lower_rank_closing_its_connection_while_the_mesh_forms_fails_it_naming_the_peer() {
    let (ls, addrs) = listeners(&["127.0.0.1"; 3]);
    let dying = AbortHandle::new();
    let (tx, rx) = mpsc::channel();
    thread::scope(|s| {
        let (l0, l1, addrs) = (&ls[0], &ls[1], &addrs);
        let dying0 = dying.clone();
        s.spawn(move || {
            let r = Communicator::connect_abortable(config(0, 3), l0, addrs, &dying0);
            tx.send(r.map(|_| ())).expect("send");
        });
        let survivor = s.spawn(move || {
            let r = Communicator::connect(config(1, 3), l1, addrs);
            (r.map(|_| ()), Instant::now())
        });
        // By now rank 1 has dialed rank 0 and both wait for rank 2.
        thread::sleep(Duration::from_millis(300));
        let died = Instant::now();
        dying.abort("killed");
        let own = rx.recv_timeout(PROMPT).expect("the dying rank returns");
        assert!(matches!(own, Err(CommError::Aborted { .. })), "{own:?}");
        let (r, at) = survivor.join().expect("survivor");
        let took = at.saturating_duration_since(died);
        match r {
            Err(CommError::PeerLost { rank: 0, .. }) => {}
            other => panic!("rank 1 should have lost rank 0: {other:?}"),
        }
        assert!(took < PROMPT, "took {took:?}");
    });
}

/// A small deterministic generator (xorshift), so a failing run can be replayed by its seed.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

/// One rank of a world of four on two "hosts" (so the connecting includes the same-host
/// agreement and the hierarchical halves' mailbox exchange) dies at a random point of the
/// connecting: its sockets close and its listener goes, as a killed process's do. A moment
/// later the others are aborted, as an elastic driver does when it sees the death. Every
/// survivor's connect returns long before the connect timeout, many times over; a survivor that
/// completed its connect before the death finds the dead rank at its first collective.
#[test]
fn killing_a_rank_at_random_points_of_the_connect_phase_never_stalls_the_others() {
    const IPS: [&str; 4] = ["127.0.0.1", "127.0.0.1", "127.0.0.2", "127.0.0.2"];
    let seed = 0x5eed_c0ff_ee15_0002_u64;
    let mut rng = Rng(seed);
    let mut worst = Duration::ZERO;
    let mut by_peer = 0;
    let mut during_connect = 0;
    for round in 0..40 {
        let victim = rng.below(4) as usize;
        // The ranks start connecting up to 3 ms apart, so the connecting spans a few ms (one
        // takes well under 1 ms on loopback) and a death lands anywhere in it.
        let starts: Vec<Duration> = (0..4)
            .map(|_| Duration::from_micros(rng.below(3_000)))
            .collect();
        let die_after = Duration::from_micros(rng.below(4_000));
        let driver_after = Duration::from_millis(20);
        let (ls, addrs) = listeners(&IPS);
        let handles: Vec<AbortHandle> = (0..4).map(|_| AbortHandle::new()).collect();
        let out = thread::scope(|s| {
            let ranks: Vec<_> = ls
                .into_iter()
                .zip(&handles)
                .enumerate()
                .map(|(rank, (l, h))| {
                    let (addrs, start) = (&addrs, starts[rank]);
                    s.spawn(move || {
                        thread::sleep(start);
                        let mut cfg = config(rank, 4);
                        cfg.generation = round;
                        let r = Communicator::connect_abortable(cfg, &l, addrs, h);
                        // A dead process's listener goes with it.
                        drop(l);
                        let done = Instant::now();
                        let connected = r.is_ok();
                        let r = r.and_then(|mut c| c.barrier());
                        (r, done, connected)
                    })
                })
                .collect();
            thread::sleep(die_after);
            let died = Instant::now();
            handles[victim].abort("killed");
            thread::sleep(driver_after);
            for (r, h) in handles.iter().enumerate() {
                if r != victim {
                    h.abort(format!("round {round} lost rank {victim}"));
                }
            }
            let results: Vec<_> = ranks
                .into_iter()
                .map(|t| t.join().expect("rank thread"))
                .collect();
            (died, results)
        });
        let (died, results) = out;
        let mut failed_connecting = false;
        for (rank, (r, done, connected)) in results.into_iter().enumerate() {
            if rank == victim {
                continue;
            }
            failed_connecting |= !connected;
            let took = done.saturating_duration_since(died);
            worst = worst.max(took);
            if took < driver_after && r.is_err() {
                by_peer += 1;
            }
            assert!(
                took < PROMPT,
                "seed {seed:#x} round {round}: rank {rank} returned {took:?} after rank \
                 {victim} died {die_after:?} into the connect ({r:?})"
            );
            if let Err(e) = r {
                assert!(
                    e.is_fatal() && !matches!(e, CommError::Mismatch { .. }),
                    "round {round}: rank {rank}: {e}"
                );
            }
        }
        during_connect += usize::from(failed_connecting);
    }
    eprintln!(
        "40 deaths, {during_connect} of them while survivors were connecting: the slowest \
         survivor returned {worst:?} after the death; {by_peer} survivors failed from the \
         closed connections before the abort"
    );
    assert!(
        during_connect >= 10,
        "only {during_connect} deaths hit the connect phase: the random points miss it"
    );
}
