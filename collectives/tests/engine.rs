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
                stall_timeout: Duration::from_millis(300),
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
        (err, t.elapsed(), after)
    });
    for (r, (err, took, after)) in out.into_iter().enumerate() {
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
