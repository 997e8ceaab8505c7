//! Adasum across in-process worlds of 1 to 8 ranks, on one host (shared memory) and over TCP
//! (ranks on several 127.0.0.x hosts), every result compared with a plain f64 reference of the
//! same recursion computed here: single tensors, fused groups of tensors of unequal sizes (one
//! of them empty), through the communicator and through the background engine.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test that cannot set up fails loudly

mod support;

use hvd_collectives::{Communicator, Engine, EngineConfig, ReduceOp, bf16, f16};
use support::{TestElem, world_on};

/// Adasum of `a` and `b` in f64: `(1 − a·b/2‖a‖²)·a + (1 − a·b/2‖b‖²)·b`, a zero norm leaving
/// its coefficient at 1.
fn pair(a: &[f64], b: &[f64]) -> Vec<f64> {
    let dot: f64 = a.iter().zip(b).map(|(x, y)| x * y).sum();
    let na: f64 = a.iter().map(|x| x * x).sum();
    let nb: f64 = b.iter().map(|x| x * x).sum();
    let ca = if na > 0.0 {
        1.0 - dot / (2.0 * na)
    } else {
        1.0
    };
    let cb = if nb > 0.0 {
        1.0 - dot / (2.0 * nb)
    } else {
        1.0
    };
    a.iter().zip(b).map(|(x, y)| ca * x + cb * y).collect()
}

/// The tree: the first ⌈n/2⌉ ranks' result combined with the rest's.
fn tree(vs: &[Vec<f64>]) -> Vec<f64> {
    if vs.len() == 1 {
        return vs[0].clone();
    }
    let mid = vs.len().div_ceil(2);
    pair(&tree(&vs[..mid]), &tree(&vs[mid..]))
}

/// Rank `rank`'s element `i` of tensor `t`: different directions on every rank, so the
/// coefficients are far from both 1 and ½.
fn value(rank: usize, t: usize, i: usize) -> f64 {
    let h = (rank * 131 + t * 31 + i * 17) % 23;
    (h as f64 - 9.0) / 8.0 + if i.is_multiple_of(rank + 2) { 0.5 } else { 0.0 }
}

const LENS: [usize; 4] = [7, 0, 20_000, 300];

fn inputs<T: TestElem>(rank: usize) -> Vec<Vec<T>> {
    LENS.iter()
        .enumerate()
        .map(|(t, &len)| (0..len).map(|i| T::from_f64(value(rank, t, i))).collect())
        .collect()
}

/// The reference per tensor, from the inputs as `T` holds them.
fn reference<T: TestElem>(n: usize) -> Vec<Vec<f64>> {
    (0..LENS.len())
        .map(|t| {
            let per_rank: Vec<Vec<f64>> = (0..n)
                .map(|r| inputs::<T>(r)[t].iter().map(|v| v.to_f64()).collect())
                .collect();
            tree(&per_rank)
        })
        .collect()
}

/// `got` is `want` within `tol` of the largest magnitude of `want`.
fn assert_near<T: TestElem>(got: &[T], want: &[f64], tol: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let scale = want.iter().fold(1.0f64, |m, v| m.max(v.abs()));
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let g = g.to_f64();
        assert!(
            (g - w).abs() <= tol * scale,
            "{what}: element {i} is {g}, expected {w}"
        );
    }
}

/// Every rank's grouped Adasum and single-tensor Adasum against the reference.
fn check<T: TestElem>(ips: &[&str], tol: f64) {
    let n = ips.len();
    let want = reference::<T>(n);
    let results = world_on(
        ips,
        |_| {},
        |comm: &mut Communicator| {
            let mut group = inputs::<T>(comm.rank());
            let mut slices: Vec<&mut [T]> = group.iter_mut().map(|v| &mut v[..]).collect();
            comm.grouped_allreduce(&mut slices, ReduceOp::Adasum)
                .expect("grouped adasum");
            let mut single = inputs::<T>(comm.rank()).swap_remove(2);
            comm.allreduce(&mut single, ReduceOp::Adasum)
                .expect("adasum");
            (group, single)
        },
    );
    let first = &results[0];
    for (r, (group, single)) in results.iter().enumerate() {
        let what = format!(
            "{} on {n} ranks ({ips:?}), rank {r}",
            std::any::type_name::<T>()
        );
        for (t, got) in group.iter().enumerate() {
            assert_near(got, &want[t], tol, &format!("{what}, tensor {t}"));
        }
        assert_near(single, &want[2], tol, &format!("{what}, single"));
        // Every rank holds bit-identical results.
        assert!(
            group == &first.0 && single == &first.1,
            "{what}: differs from rank 0"
        );
    }
}

fn one_host(n: usize) -> Vec<&'static str> {
    vec!["127.0.0.1"; n]
}

/// `n` ranks over two or more hosts, so the ranks talk over TCP.
fn hosts(n: usize) -> Vec<&'static str> {
    const IPS: [&str; 4] = ["127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5"];
    (0..n).map(|r| IPS[r % IPS.len()]).collect()
}

#[test]
fn adasum_matches_the_reference_recursion_on_one_host() {
    for n in [1, 2, 3, 4, 5, 8] {
        check::<f32>(&one_host(n), 1e-5);
        check::<f64>(&one_host(n), 1e-12);
    }
    for n in [2, 3, 5] {
        check::<f16>(&one_host(n), 2e-2);
        check::<bf16>(&one_host(n), 5e-2);
    }
}

#[test]
fn adasum_matches_the_reference_recursion_over_tcp() {
    for n in [2, 3, 4, 5, 8] {
        check::<f32>(&hosts(n), 1e-5);
    }
    check::<f64>(&hosts(3), 1e-12);
    check::<f16>(&hosts(4), 2e-2);
}

#[test]
fn identical_gradients_come_back_unchanged_and_orthogonal_ones_add() {
    let out = world_on(
        &one_host(4),
        |_| {},
        |comm| {
            let r = comm.rank();
            let mut same = vec![1.5f32, -2.0, 4.0];
            comm.allreduce(&mut same, ReduceOp::Adasum).unwrap();
            let mut basis = vec![0.0f64; 4];
            basis[r] = (r + 1) as f64;
            comm.allreduce(&mut basis, ReduceOp::Adasum).unwrap();
            (same, basis)
        },
    );
    for (same, basis) in out {
        assert_eq!(same, [1.5, -2.0, 4.0]);
        assert_eq!(basis, [1.0, 2.0, 3.0, 4.0]);
    }
}

#[test]
fn integer_tensors_and_reducescatter_are_refused_on_every_rank() {
    let out = world_on(
        &one_host(3),
        |_| {},
        |comm| {
            let mut ints = vec![1i32, 2, 3];
            let a = comm.allreduce(&mut ints, ReduceOp::Adasum).unwrap_err();
            let b = comm
                .reducescatter(&[1.0f32; 9], ReduceOp::Adasum)
                .unwrap_err();
            // The communicator is still good.
            let mut ok = vec![1.0f32];
            comm.allreduce(&mut ok, ReduceOp::Sum).unwrap();
            (a.to_string(), b.to_string(), ok[0])
        },
    );
    for (a, b, ok) in out {
        assert!(a.contains("floating-point"), "{a}");
        assert!(b.contains("Adasum is an allreduce only"), "{b}");
        assert_eq!(ok, 3.0);
    }
}

/// Through the engine, tensors submitted together fuse into one Adasum call and still
/// combine tensor by tensor.
#[test]
fn the_engine_fuses_adasum_tensors_and_keeps_them_apart() {
    for ips in [one_host(3), hosts(4)] {
        let n = ips.len();
        let want = reference::<f32>(n);
        let out = world_on(
            &ips,
            |_| {},
            |comm| {
                let r = comm.rank();
                let comm = std::mem::replace(comm, Communicator::single());
                let e = Engine::start(comm, EngineConfig::default()).expect("engine");
                let handles: Vec<_> = inputs::<f32>(r)
                    .into_iter()
                    .enumerate()
                    .map(|(t, v)| e.allreduce_async(&format!("g{t}"), v, ReduceOp::Adasum))
                    .collect();
                handles
                    .into_iter()
                    .map(|h| h.wait().expect("adasum"))
                    .collect::<Vec<_>>()
            },
        );
        for (r, got) in out.iter().enumerate() {
            for (t, g) in got.iter().enumerate() {
                assert_near(
                    g,
                    &want[t],
                    1e-5,
                    &format!("engine, {n} ranks, rank {r}, tensor {t}"),
                );
            }
        }
    }
}
