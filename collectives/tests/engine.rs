//! The background engine across in-process worlds: ops matched by name whatever order ranks
//! submit them in, fusion, mismatches and stalls named on every rank, failures that end every
//! pending op instead of hanging it.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test that cannot set up fails loudly

mod support;

use std::time::{Duration, Instant};

use hvd_collectives::{CommError, Engine, EngineConfig, ReduceOp};
use support::world;

fn engine(comm: &mut hvd_collectives::Communicator, cfg: EngineConfig) -> Engine {
    let comm = std::mem::replace(comm, hvd_collectives::Communicator::single());
    Engine::start(comm, cfg).expect("engine")
}

/// Ranks submit the same named tensors in different orders; every result is right.
fn burst(fusion_bytes: usize) {
    let results = world(4, |comm| {
        let r = comm.rank();
        let e = engine(
            comm,
            EngineConfig {
                fusion_bytes,
                ..EngineConfig::default()
            },
        );
        let mut order: Vec<usize> = (0..60).collect();
        order.rotate_left(r * 7);
        if r % 2 == 1 {
            order.reverse();
        }
        let mut handles = Vec::new();
        let mut ints = Vec::new();
        for i in order {
            let len = 1 + (i * 7919) % 50_000;
            if i % 5 == 0 {
                ints.push((
                    i,
                    e.allreduce_async(
                        &format!("int/{i}"),
                        vec![(r + i) as i64; len],
                        ReduceOp::Sum,
                    ),
                ));
            } else {
                handles.push((
                    i,
                    e.allreduce_async(
                        &format!("grad/{i}"),
                        vec![(r * i) as f32; len],
                        ReduceOp::Sum,
                    ),
                ));
            }
        }
        let floats_ok = handles.into_iter().all(|(i, h)| {
            let want = (0..4).map(|q| (q * i) as f32).sum::<f32>();
            h.wait().unwrap().iter().all(|&v| v == want)
        });
        let ints_ok = ints.into_iter().all(|(i, h)| {
            let want: i64 = (0..4).map(|q| (q + i) as i64).sum();
            h.wait().unwrap().iter().all(|&v| v == want)
        });
        floats_ok && ints_ok
    });
    assert_eq!(results, vec![true; 4]);
}

#[test]
fn a_burst_in_any_order_is_reduced_right_with_fusion() {
    burst(128 << 20);
}

#[test]
fn a_burst_in_any_order_is_reduced_right_without_fusion() {
    burst(0);
}

#[test]
fn a_mismatched_op_fails_on_every_rank_naming_both_sides() {
    let out = world(3, |comm| {
        let r = comm.rank();
        let e = engine(comm, EngineConfig::default());
        let len = if r == 2 { 5 } else { 4 };
        let bad = e
            .allreduce_async("w", vec![1.0f32; len], ReduceOp::Sum)
            .wait();
        let good = e.allreduce_async("v", vec![1i32; 3], ReduceOp::Sum).wait();
        (bad.unwrap_err().to_string(), good.unwrap())
    });
    for (err, good) in out {
        assert!(
            err.contains("'w' of 4 f32") && err.contains("'w' of 5 f32") && err.contains("rank 2"),
            "{err}"
        );
        assert_eq!(good, vec![3, 3, 3]);
    }
}

#[test]
fn an_op_one_rank_never_submits_is_reported_as_a_stall() {
    let out = world(3, |comm| {
        let r = comm.rank();
        let e = engine(
            comm,
            EngineConfig {
                stall_warning: Duration::from_millis(100),
                stall_shutdown: Duration::from_millis(300),
                ..EngineConfig::default()
            },
        );
        let t = Instant::now();
        let lonely = (r != 1).then(|| e.allreduce_async("lonely", vec![1u8; 8], ReduceOp::Max));
        let err = lonely.map(|h| h.wait().unwrap_err().to_string());
        if r == 1 {
            // Past the others' stall, so "after" is not itself left waiting too long.
            std::thread::sleep(Duration::from_millis(450));
        }
        let after = e
            .allreduce_async("after", vec![2.0f64], ReduceOp::Product)
            .wait()
            .unwrap();
        (err, t.elapsed(), after, e.status().stall_warnings)
    });
    for (r, (err, took, after, warnings)) in out.into_iter().enumerate() {
        // Warned (after 100 ms, again after 200) before it failed at 300.
        assert!(warnings >= 1, "rank {r}: {warnings} warnings");
        if r != 1 {
            let err = err.unwrap();
            assert!(
                err.contains("'lonely'")
                    && err.contains("[0, 2]")
                    && err.contains("not by ranks [1]"),
                "{err}"
            );
        }
        assert!(took < Duration::from_secs(5), "{took:?}");
        assert_eq!(after, vec![8.0], "the engine goes on after a stall");
    }
}

/// Runs 'late' on a world of 3 where rank 1 submits it 400 ms after the others; returns every
/// rank's result and stall warnings.
fn late_op(cfg: EngineConfig) -> Vec<(Result<Vec<f32>, String>, u64)> {
    world(3, |comm| {
        let r = comm.rank();
        let e = engine(comm, cfg.clone());
        if r == 1 {
            std::thread::sleep(Duration::from_millis(400));
        }
        let got = e
            .allreduce_async("late", vec![1.0f32], ReduceOp::Sum)
            .wait()
            .map_err(|e| e.to_string());
        (got, e.status().stall_warnings)
    })
}

#[test]
fn a_late_op_is_warned_of_but_not_failed_without_a_shutdown_time() {
    let cfg = EngineConfig {
        stall_warning: Duration::from_millis(100),
        ..EngineConfig::default()
    };
    let out = late_op(cfg);
    for (r, (got, warnings)) in out.into_iter().enumerate() {
        assert_eq!(got, Ok(vec![3.0]), "rank {r}");
        assert!(
            warnings >= 1,
            "rank {r}: the stall is warned of ({warnings})"
        );
        // Once per warning period, not every cycle (a 1 ms cycle would give hundreds).
        assert!(warnings <= 5, "rank {r}: {warnings} warnings");
    }
}

#[test]
fn a_disabled_stall_check_neither_warns_nor_fails() {
    let cfg = EngineConfig {
        stall_warning: Duration::from_millis(50),
        stall_shutdown: Duration::from_millis(100),
        stall_check: false,
        ..EngineConfig::default()
    };
    for (r, (got, warnings)) in late_op(cfg).into_iter().enumerate() {
        assert_eq!(got, Ok(vec![3.0]), "rank {r}");
        assert_eq!(warnings, 0, "rank {r}");
    }
}

#[test]
fn a_dead_peer_fails_every_pending_op_and_later_ones() {
    let out = world(3, |comm| {
        let r = comm.rank();
        if r == 2 {
            // Dies: its communicator closes without an engine ever running.
            let c = std::mem::replace(comm, hvd_collectives::Communicator::single());
            drop(c);
            return None;
        }
        let e = engine(comm, EngineConfig::default());
        let t = Instant::now();
        let first = e
            .allreduce_async("a", vec![1.0f32; 1000], ReduceOp::Sum)
            .wait();
        let later = e
            .allreduce_async("b", vec![1.0f32; 10], ReduceOp::Sum)
            .wait();
        Some((first.unwrap_err(), later.unwrap_err(), t.elapsed()))
    });
    for (first, later, took) in out.into_iter().flatten() {
        assert!(matches!(first, CommError::Broken { .. }), "{first}");
        assert!(matches!(later, CommError::Broken { .. }), "{later}");
        assert!(took < Duration::from_secs(5), "{took:?}");
    }
}

/// Ops submitted with a completion function, in different orders on different ranks: each
/// function is called once, with its own tensor reduced.
#[test]
fn completion_functions_get_each_result_once() {
    let out = world(3, |comm| {
        let r = comm.rank();
        let e = engine(comm, EngineConfig::default());
        let s = e.submitter();
        let (tx, rx) = std::sync::mpsc::channel();
        let mut order: Vec<usize> = (0..20).collect();
        if r == 1 {
            order.reverse();
        }
        for i in order {
            let tx = tx.clone();
            s.allreduce_then(
                &format!("t/{i}"),
                vec![(r + i) as f64; 1 + i * 100],
                ReduceOp::Sum,
                move |got| {
                    let _ = tx.send((i, got));
                },
            );
        }
        drop(tx);
        let mut seen: Vec<(usize, Vec<f64>)> = rx
            .iter()
            .map(|(i, got)| (i, got.expect("reduced")))
            .collect();
        seen.sort_by_key(|(i, _)| *i);
        let stopped = e.stop().is_some();
        (seen, stopped, r)
    });
    for (seen, stopped, _) in &out {
        assert!(stopped);
        assert_eq!(seen.len(), 20, "each function is called once");
        for (i, got) in seen {
            let want = (0..3).map(|q| (q + i) as f64).sum::<f64>();
            assert_eq!(got.len(), 1 + i * 100);
            assert!(got.iter().all(|&v| v == want), "t/{i}: {:?}", &got[..1]);
        }
    }
}

#[test]
fn a_completion_function_gets_the_error_of_a_dead_peer_or_a_stopped_engine() {
    let out = world(2, |comm| {
        if comm.rank() == 1 {
            drop(std::mem::replace(
                comm,
                hvd_collectives::Communicator::single(),
            ));
            return None;
        }
        let e = engine(comm, EngineConfig::default());
        let s = e.submitter();
        let (tx, rx) = std::sync::mpsc::channel();
        let tx2 = tx.clone();
        s.allreduce_then("a", vec![1.0f32; 10], ReduceOp::Sum, move |got| {
            let _ = tx.send(got.map(|_| ()));
        });
        let first = rx.recv_timeout(Duration::from_secs(10)).expect("called");
        let _ = e.stop();
        s.allreduce_then("b", vec![1.0f32; 10], ReduceOp::Sum, move |got| {
            let _ = tx2.send(got.map(|_| ()));
        });
        let later = rx.recv_timeout(Duration::from_secs(10)).expect("called");
        Some((first.unwrap_err(), later.unwrap_err()))
    });
    let (first, later) = out.into_iter().flatten().next().expect("rank 0");
    assert!(matches!(first, CommError::Broken { .. }), "{first}");
    assert!(later.to_string().contains("'b'"), "{later}");
}

#[test]
fn fp16_compression_halves_the_wire_and_keeps_three_digits() {
    use hvd_collectives::Compression;
    let out = world(3, |comm| {
        let r = comm.rank();
        let e = engine(comm, EngineConfig::default());
        let x: Vec<f32> = (0..20_000)
            .map(|i| (i as f32 * 0.37 + r as f32).sin())
            .collect();
        let exact = e.allreduce_async_f32("exact", x.clone(), ReduceOp::Sum, Compression::None);
        let half = e.allreduce_async_f32("half", x, ReduceOp::Sum, Compression::Fp16);
        (exact.wait().unwrap(), half.wait().unwrap())
    });
    for (exact, half) in out {
        assert_eq!(exact.len(), half.len());
        for (a, b) in exact.iter().zip(&half) {
            assert!((a - b).abs() <= 0.01 + a.abs() * 3e-3, "{a} vs {b}");
        }
    }
}

/// Every collective, submitted asynchronously in a different order on every rank.
#[test]
fn every_collective_runs_async_in_any_order() {
    let out = world(3, |comm| {
        let r = comm.rank();
        let e = engine(comm, EngineConfig::default());
        let mut order: Vec<usize> = (0..5).collect();
        order.rotate_left(r * 2);
        let (mut ar, mut rs, mut bc, mut ag, mut a2a) = (None, None, None, None, None);
        for k in order {
            match k {
                0 => ar = Some(e.allreduce_async("ar", vec![r as f32 + 1.0; 10], ReduceOp::Max)),
                1 => rs = Some(e.reducescatter_async("rs", vec![r as i32; 7], ReduceOp::Sum)),
                2 => bc = Some(e.broadcast_async("bc", vec![r as u8; 5], 1)),
                3 => ag = Some(e.allgather_async("ag", vec![r as i64; 2 * (r + 1)], 2)),
                _ => {
                    // Rank r sends p + 1 copies of its rank to rank p.
                    let splits: Vec<usize> = (1..=3).collect();
                    let send: Vec<f64> = splits.iter().flat_map(|&k| vec![r as f64; k]).collect();
                    a2a = Some(e.alltoall_async("a2a", send, splits));
                }
            }
        }
        let (recv, counts) = a2a.unwrap().wait().unwrap();
        (
            ar.unwrap().wait().unwrap(),
            rs.unwrap().wait().unwrap(),
            bc.unwrap().wait().unwrap(),
            ag.unwrap().wait().unwrap(),
            recv,
            counts,
        )
    });
    for (r, (ar, rs, bc, ag, recv, counts)) in out.into_iter().enumerate() {
        assert_eq!(ar, vec![3.0; 10]);
        assert_eq!(rs, vec![3; if r == 0 { 3 } else { 2 }]);
        assert_eq!(bc, vec![1; 5]);
        assert_eq!(ag, vec![0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2]);
        assert_eq!(counts, vec![r + 1; 3]);
        let want: Vec<f64> = (0..3).flat_map(|s| vec![s as f64; r + 1]).collect();
        assert_eq!(recv, want);
    }
}

/// Steps of the same named ops, with caches too small for them (entries evicted every step),
/// off, and large; a length that changes between steps is a new op, and a rank announcing a
/// cached name with another shape is a mismatch named on every rank.
#[test]
fn the_response_cache_keeps_every_step_right() {
    for cache_capacity in [0, 3, 1024] {
        let out = world(3, |comm| {
            let r = comm.rank();
            let e = engine(
                comm,
                EngineConfig {
                    cache_capacity,
                    ..EngineConfig::default()
                },
            );
            for step in 0..6usize {
                let mut hs = Vec::new();
                let mut order: Vec<usize> = (0..8).collect();
                order.rotate_left((r + step) % 8);
                for k in order {
                    let len = if step >= 3 && k == 2 { 11 } else { 3 + k };
                    let h = e.allreduce_async(
                        &format!("g{k}"),
                        vec![(r + k + step) as f32; len],
                        ReduceOp::Sum,
                    );
                    hs.push((k, len, h));
                }
                for (k, len, h) in hs {
                    let want = (0..3).map(|q| (q + k + step) as f32).sum::<f32>();
                    assert_eq!(
                        h.wait().unwrap(),
                        vec![want; len],
                        "cache {cache_capacity} step {step} g{k}"
                    );
                }
            }
            let len = if r == 1 { 4 } else { 3 };
            let err = e
                .allreduce_async("g0", vec![1.0f32; len], ReduceOp::Sum)
                .wait()
                .unwrap_err();
            let after = e
                .allreduce_async("g0", vec![1.0f32; 3], ReduceOp::Sum)
                .wait()
                .unwrap();
            (err.to_string(), after)
        });
        for (err, after) in out {
            assert!(
                err.contains("'g0' of 3 f32") && err.contains("'g0' of 4 f32"),
                "{err}"
            );
            assert_eq!(after, vec![3.0; 3]);
        }
    }
}

/// A collective's own argument check fails that op on every rank; the engine goes on. Ranks
/// disagreeing on which collective a name is fail it naming both.
#[test]
fn a_bad_op_fails_alone() {
    let out = world(3, |comm| {
        let r = comm.rank();
        let e = engine(comm, EngineConfig::default());
        // Rank 2's splits ask for more than it has.
        let splits = if r == 2 { vec![5, 5, 5] } else { vec![1, 1, 1] };
        let bad = e.alltoall_async("a2a", vec![1u8; 3], splits).wait();
        let which = if r == 1 {
            e.broadcast_async("x", vec![1.0f32; 4], 0).wait()
        } else {
            e.allreduce_async("x", vec![1.0f32; 4], ReduceOp::Sum)
                .wait()
        };
        let good = e.allgather_async("ok", vec![r as u8], 1).wait().unwrap();
        (
            bad.unwrap_err().to_string(),
            which.unwrap_err().to_string(),
            good,
        )
    });
    for (r, (bad, which, good)) in out.into_iter().enumerate() {
        let names = if r == 2 { "splits sum to 15" } else { "rank 2" };
        assert!(bad.contains(names), "rank {r}: {bad}");
        assert!(
            which.contains("allreduce 'x'") && which.contains("broadcast 'x'"),
            "{which}"
        );
        assert_eq!(good, vec![0, 1, 2]);
    }
}

/// `HugeBuffer`s go through the engine like `Vec`s, fused with them, on one host and over TCP,
/// and come back as `HugeBuffer`s.
#[test]
fn huge_buffers_are_reduced_and_handed_back() {
    use hvd_collectives::HugeBuffer;
    for same_host in [true, false] {
        let results = support::world_with(
            3,
            |cfg| cfg.same_host_copy = same_host,
            |comm| {
                let r = comm.rank();
                let e = engine(comm, EngineConfig::default());
                let mut big = HugeBuffer::<f32>::zeroed(3 << 20).unwrap(); // 12 MiB: advised
                big.fill(r as f32 + 1.0);
                let mut small = HugeBuffer::<i64>::zeroed(1000).unwrap();
                small.fill(r as i64);
                let a = e.allreduce_async("big", big, ReduceOp::Sum);
                let b = e.allreduce_async("small", small, ReduceOp::Max);
                let c = e.allreduce_async("vec", vec![2.0f32; 70_000], ReduceOp::Average);
                let mut root = HugeBuffer::<u8>::zeroed(5).unwrap();
                root.fill(if r == 1 { 9 } else { 0 });
                let d = e.broadcast_async("bcast", root, 1);
                let (big, small, v, root): (HugeBuffer<f32>, HugeBuffer<i64>, Vec<f32>, _) = (
                    a.wait().unwrap(),
                    b.wait().unwrap(),
                    c.wait().unwrap(),
                    d.wait().unwrap(),
                );
                big.iter().all(|&x| x == 6.0)
                    && big.len() == 3 << 20
                    && small.iter().all(|&x| x == 2)
                    && v.iter().all(|&x| x == 2.0)
                    && root[..] == [9; 5]
            },
        );
        assert_eq!(results, vec![true; 3], "same host: {same_host}");
    }
}

/// Uneven work (Horovod's `join`): rank r runs 2r + 1 steps of named allreduces (of every
/// reduction and two dtypes, fused together), then joins; a joined rank takes part with
/// zeros, every join returns the rank that joined last, and the engine is usable after.
#[test]
fn joined_ranks_contribute_zeros_until_every_rank_joins() {
    let n = 4;
    let out = world(n, |comm| {
        let r = comm.rank();
        let e = engine(comm, EngineConfig::default());
        let mut sums = Vec::new();
        for step in 0..2 * r + 1 {
            let f = e.allreduce_async(
                &format!("f/{step}"),
                vec![1.0f32 + r as f32; 3],
                ReduceOp::Sum,
            );
            let i = e.allreduce_async(&format!("i/{step}"), vec![10i64; 2], ReduceOp::Sum);
            let avg = e.allreduce_async(&format!("a/{step}"), vec![8.0f64], ReduceOp::Average);
            sums.push((f.wait().unwrap(), i.wait().unwrap(), avg.wait().unwrap()));
        }
        let last = e.join().unwrap();
        // The world is whole again: ops run on every rank.
        let after = e
            .allreduce_async("after", vec![1u8; 4], ReduceOp::Sum)
            .wait()
            .unwrap();
        (sums, last, after)
    });
    for (r, (sums, last, after)) in out.into_iter().enumerate() {
        assert_eq!(
            last,
            n - 1,
            "rank {r}: the rank with the most steps joins last"
        );
        assert_eq!(after, vec![4; 4]);
        for (step, (f, i, avg)) in sums.into_iter().enumerate() {
            // Ranks with fewer than step + 1 steps have joined and count as zeros.
            let live: Vec<usize> = (0..n).filter(|&q| 2 * q + 1 > step).collect();
            let want_f: f32 = live.iter().map(|&q| 1.0 + q as f32).sum();
            assert_eq!(f, vec![want_f; 3], "rank {r} step {step}");
            assert_eq!(i, vec![10 * live.len() as i64; 2], "rank {r} step {step}");
            // An average divides by the whole world, as Horovod's does.
            assert_eq!(
                avg,
                vec![8.0 * live.len() as f64 / n as f64],
                "rank {r} step {step}"
            );
        }
    }
}

/// While a rank is joined, collectives other than allreduce fail on the ranks that submitted
/// them, naming the joined ranks; every rank gets the same last rank; a world of one joins
/// at once, as often as it likes.
#[test]
fn only_allreduce_runs_while_a_rank_is_joined() {
    let out = world(3, |comm| {
        let r = comm.rank();
        let e = engine(comm, EngineConfig::default());
        if r == 0 {
            return (Ok(0), e.join().map_err(|e| e.to_string()));
        }
        let bc = e.broadcast_async("bc", vec![r as u8; 5], 1).wait();
        let joined = e.join().map_err(|e| e.to_string());
        (bc.map(|v| v.len()).map_err(|e| e.to_string()), joined)
    });
    // Ranks 1 and 2 join in one cycle (the higher counts as last) or one after the other.
    let last = out[0].1.clone().unwrap();
    assert!(last == 1 || last == 2, "{last}");
    for (r, (bc, joined)) in out.into_iter().enumerate().skip(1) {
        let err = bc.unwrap_err();
        assert!(
            err.contains("broadcast 'bc'") && err.contains("ranks [0] have joined"),
            "rank {r}: {err}"
        );
        assert_eq!(joined, Ok(last), "rank {r}");
    }
    let one = Engine::start(
        hvd_collectives::Communicator::single(),
        EngineConfig::default(),
    )
    .unwrap();
    assert_eq!(one.join().unwrap(), 0);
    let s = one.submitter();
    let t = std::thread::spawn(move || s.join());
    assert_eq!(t.join().unwrap().unwrap(), 0);
}
