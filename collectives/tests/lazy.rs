//! A world larger than `direct_open_max` connects, while it forms, only the pairs its rounds
//! need; the others connect when a call first needs them, through each communicator's own
//! listener, and a rank that is gone by then fails the others instead of stalling them.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test that cannot set up fails loudly

mod support;

use std::net::{SocketAddr, TcpListener};
use std::thread;
use std::time::{Duration, Instant};

use hvd_collectives::{CommConfig, Communicator, ReduceOp};
use support::world_with;

fn tcp(cfg: &mut CommConfig) {
    cfg.same_host_copy = false;
}

/// What rank `s` sends rank `p` in an alltoall: `split(s, p)` tagged values.
fn alltoall_checked(comm: &mut Communicator, salt: usize) {
    let (n, r) = (comm.size(), comm.rank());
    let split = |s: usize, p: usize| (s * 5 + p * 3 + salt) % 7 + 1;
    let tag = |s: usize, p: usize, i: usize| (s * 1000 + p * 10 + i + salt) as f32;
    let splits: Vec<usize> = (0..n).map(|p| split(r, p)).collect();
    let send: Vec<f32> = (0..n)
        .flat_map(|p| (0..split(r, p)).map(move |i| tag(r, p, i)))
        .collect();
    let (got, counts) = comm.alltoall(&send, &splits).expect("alltoall");
    let want: Vec<f32> = (0..n)
        .flat_map(|s| (0..split(s, r)).map(move |i| tag(s, r, i)))
        .collect();
    assert_eq!(counts, (0..n).map(|s| split(s, r)).collect::<Vec<_>>());
    assert_eq!(got, want, "rank {r}: alltoall {salt}");
}

#[test]
fn a_large_world_connects_the_rounds_pairs_then_the_rest_on_first_use() {
    let n = 16;
    let counts = world_with(n, tcp, |comm| {
        let r = comm.rank();
        let formed = comm.connected_peers();
        // The ring, the openings' rounds and a broadcast's chain need no other pair.
        let mut buf: Vec<f32> = (0..300_000).map(|i| (i % 7 + r) as f32).collect();
        comm.allreduce(&mut buf, ReduceOp::Sum).expect("allreduce");
        let want = |i: usize| (n * (i % 7) + n * (n - 1) / 2) as f32;
        assert!(buf.iter().enumerate().all(|(i, &v)| v == want(i)));
        let mut big = vec![r as f64; 200_000];
        comm.broadcast(&mut big, 5).expect("broadcast");
        assert!(big.iter().all(|&v| v == 5.0));
        let after_ring = comm.connected_peers();
        alltoall_checked(comm, 0);
        let after_alltoall = comm.connected_peers();
        // Connected once: a second alltoall and a large allgather over TCP reuse them.
        alltoall_checked(comm, 1);
        let rows: Vec<i32> = vec![r as i32; 20_000 * (r % 3 + 1)];
        let all = comm.allgather(&rows, 1).expect("allgather");
        let want: Vec<i32> = (0..n)
            .flat_map(|p| vec![p as i32; 20_000 * (p % 3 + 1)])
            .collect();
        assert_eq!(all, want);
        (formed, after_ring, after_alltoall, comm.connected_peers())
    });
    for (r, &(formed, after_ring, after_alltoall, last)) in counts.iter().enumerate() {
        // ±1, ±2, ±4 and 8 (which is −8): 7 of 15.
        assert_eq!(formed, 7, "rank {r} connected {formed} peers while forming");
        assert_eq!(after_ring, 7, "rank {r}");
        assert_eq!((after_alltoall, last), (n - 1, n - 1), "rank {r}");
    }
}

/// Two communicators of one world over the same listeners (a process set's and the world's)
/// run alltoalls at once on two threads of every rank: each connects its later pairs through
/// its own listener, so neither refuses the other's as a stranger.
#[test]
fn communicators_sharing_a_listener_connect_their_later_pairs_apart() {
    let n = 12;
    let ls: Vec<TcpListener> = (0..n)
        .map(|_| TcpListener::bind("127.0.0.1:0").expect("bind"))
        .collect();
    let addrs: Vec<SocketAddr> = ls.iter().map(|l| l.local_addr().expect("addr")).collect();
    let connect_all = |generation: u64| -> Vec<Communicator> {
        thread::scope(|s| {
            let ranks: Vec<_> = ls
                .iter()
                .enumerate()
                .map(|(rank, l)| {
                    let addrs = &addrs;
                    s.spawn(move || {
                        let mut cfg = CommConfig::new(rank, n, "test-secret");
                        cfg.generation = generation;
                        tcp(&mut cfg);
                        Communicator::connect(cfg, l, addrs).expect("connect")
                    })
                })
                .collect();
            ranks.into_iter().map(|h| h.join().expect("rank")).collect()
        })
    };
    let first = connect_all(1);
    let second = connect_all(2);
    thread::scope(|s| {
        for mut comm in first.into_iter().chain(second) {
            s.spawn(move || {
                for salt in 0..3 {
                    alltoall_checked(&mut comm, salt);
                }
                assert_eq!(comm.connected_peers(), n - 1);
            });
        }
    });
}

/// A rank that is gone (its communicator dropped, its sockets closed) before the others need
/// a pair they have not connected: they fail within a bounded time, not at the arrival
/// timeout, through its neighbours' closed connections.
#[test]
fn a_rank_gone_before_its_later_pairs_connect_fails_the_others_promptly() {
    let n = 12;
    let started = Instant::now();
    let results = world_with(
        n,
        |cfg| {
            tcp(cfg);
            cfg.arrival_timeout = Duration::from_secs(120);
        },
        |comm| {
            let r = comm.rank();
            let mut one = [1.0f32];
            comm.allreduce(&mut one, ReduceOp::Sum).expect("allreduce");
            if r == n - 1 {
                return None;
            }
            let splits = vec![1; n];
            let out = comm.alltoall(&vec![r as f32; n], &splits);
            Some((
                out.map(|_| ()).map_err(|e| e.to_string()),
                started.elapsed(),
            ))
        },
    );
    for (r, res) in results.into_iter().enumerate().take(n - 1) {
        let (out, after) = res.expect("a result");
        assert!(
            out.is_err(),
            "rank {r}: an alltoall without rank 11 succeeded"
        );
        assert!(
            after < Duration::from_secs(30),
            "rank {r} failed only after {after:?}: {out:?}"
        );
    }
}
