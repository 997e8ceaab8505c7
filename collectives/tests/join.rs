//! Horovod's `join` by a rank whose engine never started, across in-process worlds on one host
//! and over TCP: the others' direct calls end with `CommError::Joined` on every rank (the
//! communicator stays good), and the call, run again through engines, takes the joined rank's
//! part as zeros. Ranks that join at the same call finish at once.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test that cannot set up fails loudly

mod support;

use hvd_collectives::{CommError, Communicator, Engine, EngineConfig, ReduceOp};
use support::world_on;

fn engine(comm: &mut Communicator) -> Engine {
    let comm = std::mem::replace(comm, Communicator::single());
    Engine::start(comm, EngineConfig::default()).expect("engine")
}

/// Rank 0 joins at once; the others make a synchronous allreduce of `len` elements (small or
/// large), meet the join, and run it again through their engines.
fn joins_while_others_reduce(ips: &[&str], len: usize) {
    let n = ips.len();
    let out = world_on(
        ips,
        |_| {},
        |comm| {
            if comm.rank() == 0 {
                let met = comm.join().unwrap_err();
                assert!(
                    matches!(met, CommError::Joined { ref ranks, .. } if ranks == &[0]),
                    "{met}"
                );
                let e = engine(comm);
                let last = e.join().expect("join through the engine");
                return (last, Vec::new());
            }
            let mut buf = vec![1.0f32; len];
            let met = comm.allreduce(&mut buf, ReduceOp::Sum).unwrap_err();
            assert!(matches!(met, CommError::Joined { .. }), "{met}");
            assert!(!met.is_fatal());
            let e = engine(comm);
            let got = e
                .allreduce_async("again", vec![1.0f32; len], ReduceOp::Sum)
                .wait()
                .expect("the allreduce through the engine");
            let last = e.join().expect("join");
            (last, got)
        },
    );
    for (r, (last, got)) in out.into_iter().enumerate() {
        assert_eq!(last, n - 1, "rank {r}");
        if r > 0 {
            assert!(
                got.iter().all(|&v| v == (n - 1) as f32),
                "rank {r}: {:?}",
                &got[..4]
            );
        }
    }
}

#[test]
fn a_join_meets_small_and_large_allreduces_on_one_host() {
    joins_while_others_reduce(&["127.0.0.1"; 3], 3);
    joins_while_others_reduce(&["127.0.0.1"; 3], 100_000);
}

#[test]
fn a_join_meets_small_and_large_allreduces_over_tcp() {
    let ips = ["127.0.0.2", "127.0.0.3", "127.0.0.4"];
    joins_while_others_reduce(&ips, 3);
    joins_while_others_reduce(&ips, 100_000);
}

#[test]
fn ranks_that_join_at_the_same_call_finish_there() {
    for ips in [
        vec!["127.0.0.1"; 3],
        vec!["127.0.0.2", "127.0.0.3", "127.0.0.2"],
    ] {
        let out = world_on(
            &ips,
            |_| {},
            |comm| {
                let last = comm.join().expect("join");
                // The communicator goes on.
                let mut one = vec![1.0f64];
                comm.allreduce(&mut one, ReduceOp::Sum).unwrap();
                (last, one[0])
            },
        );
        assert_eq!(out, vec![(2, 3.0); 3]);
    }
}
