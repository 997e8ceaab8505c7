//! Mismatched calls fail on every rank naming both sides; dead, hung and aborted peers make
//! every other rank's call return within a bounded time; strangers are refused at connect.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test that cannot set up fails loudly

mod support;

use std::net::TcpListener;
use std::thread;
use std::time::{Duration, Instant};

use hvd_collectives::{CommConfig, CommError, Communicator, ReduceOp};
use support::{world, world_on, world_with};

#[test]
fn length_mismatch_names_both_sides_on_every_rank_and_comm_survives() {
    for len_of_2 in [12usize, 100_000] {
        let out = world(3, |comm| {
            let len = if comm.rank() == 2 { len_of_2 } else { 10 };
            let err = comm
                .allreduce(&mut vec![1.0f32; len], ReduceOp::Sum)
                .unwrap_err();
            // Nothing moved: the communicator still works.
            let mut ok = vec![1i32; 5];
            comm.allreduce(&mut ok, ReduceOp::Sum)
                .expect("allreduce after mismatch");
            assert_eq!(ok, vec![3; 5]);
            err.to_string()
        });
        for msg in &out {
            assert_eq!(msg, &out[0], "every rank reports the same mismatch");
            assert!(
                msg.contains("rank 0 called allreduce(f32[10], sum)"),
                "{msg}"
            );
            assert!(
                msg.contains(&format!("rank 2 called allreduce(f32[{len_of_2}], sum)")),
                "{msg}"
            );
        }
    }
}

#[test]
fn dtype_op_and_collective_mismatches_are_errors() {
    let out = world(2, |comm| {
        let r = comm.rank();
        let dtype = if r == 0 {
            comm.allreduce(&mut [1.0f32; 4], ReduceOp::Sum)
        } else {
            comm.allreduce(&mut [1.0f64; 4], ReduceOp::Sum)
        }
        .unwrap_err()
        .to_string();
        let op = comm
            .allreduce(
                &mut [1i64; 4],
                if r == 0 { ReduceOp::Min } else { ReduceOp::Max },
            )
            .unwrap_err()
            .to_string();
        let kind = if r == 0 {
            comm.broadcast(&mut [0u8; 4], 0).unwrap_err()
        } else {
            comm.allreduce(&mut [0u8; 4], ReduceOp::Sum).unwrap_err()
        }
        .to_string();
        let root = comm.broadcast(&mut [0u8; 4], r).unwrap_err().to_string();
        (dtype, op, kind, root)
    });
    for (dtype, op, kind, root) in out {
        assert!(
            dtype.contains("f32[4]") && dtype.contains("f64[4]"),
            "{dtype}"
        );
        assert!(op.contains("min") && op.contains("max"), "{op}");
        assert!(
            kind.contains("broadcast(u8[4], root 0)") && kind.contains("allreduce(u8[4], sum)"),
            "{kind}"
        );
        assert!(root.contains("root 0") && root.contains("root 1"), "{root}");
    }
}

#[test]
fn invalid_arguments_on_one_rank_fail_every_rank() {
    let out = world(3, |comm| {
        let splits = if comm.rank() == 1 {
            vec![1, 1, 5]
        } else {
            vec![1, 1, 1]
        };
        let err = comm.alltoall(&[0i32, 1, 2], &splits).unwrap_err();
        let ok = comm
            .alltoall(&[7i32, 8, 9], &[])
            .expect("alltoall after a refused call");
        (err, ok.1)
    });
    for (rank, (err, counts)) in out.iter().enumerate() {
        match (rank, err) {
            (1, CommError::InvalidArgument { detail, .. }) => {
                assert!(detail.contains("sum to 7"), "{detail}")
            }
            (
                _,
                CommError::RemoteInvalid {
                    rank: 1,
                    op: "alltoall",
                },
            ) if rank != 1 => {}
            other => panic!("unexpected {other:?}"),
        }
        assert_eq!(counts, &vec![1, 1, 1]);
    }
}

/// A rank that dies mid-allreduce (its sockets close, as when the process is killed) makes every
/// other rank's call fail fast, and every later call reports the communicator broken.
#[test]
fn peer_dying_mid_allreduce_fails_the_others_fast() {
    // One host; then two hosts (127.0.0.2 and .3) where allreduce runs hierarchically.
    // On a crowded host (2 cores for 4 ranks) ranks 0 and 1 reduce while 2 and 3 wait: a
    // reducer dies, then a waiter.
    let one: &[&str] = &["127.0.0.1"; 4];
    let two: &[&str] = &["127.0.0.2", "127.0.0.2", "127.0.0.3", "127.0.0.3"];
    for (ips, cores, dying) in [
        (one, None, 3),
        (two, None, 3),
        (one, Some(2), 0),
        (one, Some(2), 3),
    ] {
        let out = world_on(
            ips,
            |cfg| cfg.cores = cores,
            |comm| {
                if comm.rank() == dying {
                    let abort = comm.abort_handle();
                    let killer = thread::spawn(move || {
                        thread::sleep(Duration::from_millis(30));
                        abort.abort("simulated death");
                    });
                    // Loops until the abort lands inside a call.
                    while comm
                        .allreduce(&mut vec![1.0f32; 4 << 20], ReduceOp::Sum)
                        .is_ok()
                    {}
                    killer.join().expect("killer");
                    return None;
                }
                let started = Instant::now();
                let err = loop {
                    if let Err(e) = comm.allreduce(&mut vec![1.0f32; 4 << 20], ReduceOp::Sum) {
                        break e;
                    }
                };
                let failed_after = started.elapsed();
                let later = comm.allreduce(&mut [1.0f32], ReduceOp::Sum).unwrap_err();
                Some((err, failed_after, later))
            },
        );
        for (err, after, later) in out.into_iter().flatten() {
            assert!(
                matches!(err, CommError::PeerLost { .. }),
                "{ips:?} cores {cores:?} rank {dying} dies: {err}"
            );
            assert!(
                after < Duration::from_secs(3),
                "{ips:?} cores {cores:?} rank {dying} dies: took {after:?}"
            );
            assert!(
                matches!(later, CommError::Broken { .. }),
                "{ips:?} cores {cores:?} rank {dying} dies: {later}"
            );
        }
    }
}

#[test]
fn a_peer_that_never_arrives_times_out_naming_it() {
    let out = world_with(
        3,
        |cfg| cfg.arrival_timeout = Duration::from_millis(300),
        |comm| {
            if comm.rank() == 1 {
                thread::sleep(Duration::from_millis(1500));
                return None;
            }
            let t = Instant::now();
            let err = comm.allreduce(&mut [1u8; 3], ReduceOp::Sum).unwrap_err();
            Some((err, t.elapsed()))
        },
    );
    let mut named = false;
    for (err, took) in out.into_iter().flatten() {
        assert!(took < Duration::from_secs(2), "took {took:?}");
        // The first rank to time out names rank 1; the other may see that rank's closed sockets.
        named |= matches!(err, CommError::Timeout { rank: 1, .. });
        assert!(
            matches!(err, CommError::Timeout { .. } | CommError::PeerLost { .. }),
            "{err}"
        );
    }
    assert!(named);
}

#[test]
fn abort_from_another_thread_unblocks_a_waiting_call() {
    let out = world(2, |comm| {
        if comm.rank() == 1 {
            thread::sleep(Duration::from_millis(800));
            return None;
        }
        let abort = comm.abort_handle();
        thread::spawn(move || {
            thread::sleep(Duration::from_millis(100));
            abort.abort("membership changed");
        });
        let t = Instant::now();
        let err = comm.barrier().unwrap_err();
        Some((err, t.elapsed()))
    });
    let (err, took) = out.into_iter().flatten().next().expect("rank 0 result");
    assert!(
        err.to_string().contains("aborted: membership changed"),
        "{err}"
    );
    assert!(took < Duration::from_millis(700), "took {took:?}");
}

#[test]
fn a_peer_with_the_wrong_token_is_refused() {
    let l0 = TcpListener::bind("127.0.0.1:0").expect("bind");
    let l1 = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addrs = [
        l0.local_addr().expect("addr"),
        l1.local_addr().expect("addr"),
    ];
    let acceptor = thread::spawn(move || {
        let mut cfg = CommConfig::new(0, 2, "right");
        cfg.connect_timeout = Duration::from_millis(700);
        Communicator::connect(cfg, &l0, &addrs)
    });
    let mut cfg = CommConfig::new(1, 2, "wrong");
    cfg.connect_timeout = Duration::from_secs(5);
    let err = Communicator::connect(cfg, &l1, &addrs).unwrap_err();
    assert!(err.to_string().contains("wrong job token"), "{err}");
    let err0 = acceptor.join().expect("join").unwrap_err();
    assert!(err0.to_string().contains("did not connect"), "{err0}");
}

/// Grouped buffers of the same total but another layout would pair different tensors: on one
/// host, where ranks read each other's buffers, it is a mismatch on every rank.
#[test]
fn grouped_allreduce_layouts_must_agree() {
    let out = world(3, |comm| {
        let (a, b) = if comm.rank() == 1 {
            (7000, 5000)
        } else {
            (5000, 7000)
        };
        let (mut x, mut y) = (vec![1.0f32; a], vec![1.0f32; b]);
        comm.grouped_allreduce(&mut [&mut x, &mut y], ReduceOp::Sum)
    });
    for r in out {
        assert!(matches!(r, Err(CommError::Mismatch { .. })), "{r:?}");
    }
}

/// Across hosts (hierarchical allreduce), a rank whose call differs fails it on every rank of
/// every host, small or large, and the communicator goes on working.
#[test]
fn hierarchical_mismatches_fail_every_host_and_comm_survives() {
    let ips = ["127.0.0.2", "127.0.0.2", "127.0.0.3", "127.0.0.3"];
    // (odd rank, its length, everyone else's length)
    for (odd, theirs, others) in [
        (2, 12, 10),
        (3, 200_000, 10),
        (1, 150_000, 200_000),
        (0, 7, 90_000),
    ] {
        let out = world_on(
            &ips,
            |_| {},
            |comm| {
                assert!(comm.is_hierarchical());
                let len = if comm.rank() == odd { theirs } else { others };
                let err = comm
                    .allreduce(&mut vec![1.0f32; len], ReduceOp::Sum)
                    .unwrap_err();
                let mut ok = vec![1i32; 70_000];
                comm.allreduce(&mut ok, ReduceOp::Sum)
                    .expect("allreduce after mismatch");
                assert!(ok.iter().all(|&v| v == 4));
                err
            },
        );
        for (r, err) in out.iter().enumerate() {
            assert!(
                !err.is_fatal(),
                "rank {odd} with {theirs}: rank {r} got {err}"
            );
        }
    }
}

/// Ranks that disagree on the number of connections per peer are refused at connect, saying so.
#[test]
fn a_peer_with_another_stream_count_is_refused() {
    let l0 = TcpListener::bind("127.0.0.1:0").unwrap();
    let l1 = TcpListener::bind("127.0.0.1:0").unwrap();
    let addrs = [l0.local_addr().unwrap(), l1.local_addr().unwrap()];
    let acceptor = thread::spawn(move || {
        let mut cfg = CommConfig::new(0, 2, "t");
        cfg.connect_timeout = Duration::from_millis(800);
        cfg.streams = 2;
        Communicator::connect(cfg, &l0, &addrs)
    });
    let mut cfg = CommConfig::new(1, 2, "t");
    cfg.connect_timeout = Duration::from_secs(5);
    let err = Communicator::connect(cfg, &l1, &addrs).unwrap_err();
    assert!(
        err.to_string().contains("connections per peer differs"),
        "{err}"
    );
    assert!(acceptor.join().expect("join").is_err());
    let mut bad = CommConfig::new(0, 1, "t");
    bad.streams = 16;
    assert!(
        bad.validate()
            .unwrap_err()
            .contains("streams must be 1 to 15")
    );
}

/// On a crowded host one rank reduces and writes the result into every peer's buffer. A rank
/// that leaves such a call on a failure (here an abort landing as soon as the reducer's first
/// chunk reached it) must find its buffer untouched from the moment its call returns: the
/// memory is the caller's again, and a write landing after that would corrupt whatever it
/// holds by then.
#[test]
fn a_rank_leaving_a_crowded_call_gets_no_write_after_it_returns() {
    let out = world_with(
        4,
        |cfg| cfg.cores = Some(1),
        |comm| {
            let mut buf = vec![1.0f32; 8 << 20];
            if comm.rank() != 3 {
                let _ = comm.allreduce(&mut buf, ReduceOp::Sum);
                return None;
            }
            // Watches the buffer's first element (this process's own memory, read as a peer
            // would) and aborts when the reducer's first write lands.
            let abort = comm.abort_handle();
            let addr = buf.as_ptr() as usize;
            let watcher = thread::spawn(move || {
                let me = nix::unistd::Pid::this();
                let deadline = Instant::now() + Duration::from_secs(10);
                while Instant::now() < deadline {
                    let mut w = [0u8; 4];
                    let remote = [nix::sys::uio::RemoteIoVec { base: addr, len: 4 }];
                    let mut local = [std::io::IoSliceMut::new(&mut w)];
                    if nix::sys::uio::process_vm_readv(me, &mut local, &remote).is_ok()
                        && f32::from_ne_bytes(w) == 4.0
                    {
                        break;
                    }
                }
                abort.abort("simulated failure");
            });
            let result = comm.allreduce(&mut buf, ReduceOp::Sum);
            watcher.join().expect("watcher");
            let at_return = buf.clone();
            thread::sleep(Duration::from_millis(300));
            let changed = buf.iter().zip(&at_return).filter(|(a, b)| a != b).count();
            let ones = at_return.iter().filter(|&&x| x == 1.0).count();
            Some((result.is_err(), ones, changed))
        },
    );
    let (failed, ones, changed) = out.into_iter().flatten().next().expect("rank 3's result");
    assert!(failed, "the abort landed after the call");
    assert!(ones > 0, "every write had landed before the call returned");
    assert_eq!(changed, 0, "elements written after the call returned");
}

/// Calls opened in rounds fail as those opened directly: a mismatch names both sides on
/// every rank and leaves the communicator working, an invalid call on one rank fails every
/// rank naming it, and a rank that leaves fails the others fast.
#[test]
fn openings_in_rounds_fail_as_direct_ones_do() {
    let rounds = |cfg: &mut CommConfig| {
        cfg.same_host_copy = false;
        cfg.direct_open_max = 1;
        cfg.arrival_timeout = Duration::from_secs(20);
    };
    let out = world_with(6, rounds, |comm| {
        let len = if comm.rank() == 4 { 12 } else { 10 };
        let mismatch = comm
            .allreduce(&mut vec![1.0f32; len], ReduceOp::Sum)
            .unwrap_err()
            .to_string();
        let mut ok = vec![1i32; 5];
        comm.allreduce(&mut ok, ReduceOp::Sum)
            .expect("allreduce after a mismatch");
        assert_eq!(ok, vec![6; 5]);
        let root = if comm.rank() == 2 { 9 } else { 0 };
        let invalid = comm.broadcast(&mut [0u8; 4], root).unwrap_err();
        (mismatch, invalid)
    });
    for (rank, (mismatch, invalid)) in out.iter().enumerate() {
        assert!(
            mismatch.contains("rank 0 called allreduce(f32[10], sum)"),
            "{mismatch}"
        );
        assert!(
            mismatch.contains("rank 4 called allreduce(f32[12], sum)"),
            "{mismatch}"
        );
        match (rank, invalid) {
            (2, CommError::InvalidArgument { .. }) => {}
            (r, CommError::RemoteInvalid { rank: 2, .. }) if r != 2 => {}
            other => panic!("unexpected {other:?}"),
        }
    }
    let out = world_with(6, rounds, |comm| {
        if comm.rank() == 3 {
            comm.abort_handle().abort("simulated death");
            return None;
        }
        let started = Instant::now();
        let err = comm.allreduce(&mut [1.0f32; 4], ReduceOp::Sum).unwrap_err();
        Some((err, started.elapsed()))
    });
    for (err, after) in out.into_iter().flatten() {
        assert!(
            matches!(err, CommError::PeerLost { .. }),
            "rank 3 left: {err}"
        );
        assert!(
            after < Duration::from_secs(3),
            "rank 3 left: took {after:?}"
        );
    }
}
