//! A randomized differential test of every same-host and cross-host path: many rounds, each a
//! freshly built world (1–3 hosts of 1–4 ranks, some crowded onto one core), running a random
//! sequence of collectives (every op and dtype, sizes on both sides of the 32 KiB small-call
//! threshold, ranks that are late to post), every result compared with a reference computed
//! here. Communicators are torn down and rebuilt between rounds, so mailboxes and buffers of a
//! new round reuse the memory of the last; some rounds run two worlds at once in the same
//! process, their calls interleaved.
//!
//! `HVD_DIFF_SEED=N` replays one seed (the failure message names it); `HVD_DIFF_ROUNDS=N`
//! runs more rounds.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test that cannot set up fails loudly

mod support;

use std::thread;
use std::time::Duration;

use hvd_collectives::{Communicator, ReduceOp, bf16, f16};
use support::{TestElem, assert_close, reduced, world_on};

const OPS: [ReduceOp; 5] = [
    ReduceOp::Sum,
    ReduceOp::Average,
    ReduceOp::Min,
    ReduceOp::Max,
    ReduceOp::Product,
];

/// A small seeded generator (xorshift64*): the same seed gives every rank the same plan.
#[derive(Clone)]
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        Self(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// Rank `rank`'s element `i` of call `call`: small integers, so that every op is exact in
/// every type in any order (products stay within 2^3).
fn value(rank: usize, i: usize, call: usize, op: ReduceOp) -> f64 {
    let h = (rank * 7 + i * 3 + call * 11) % 5;
    if op == ReduceOp::Product {
        if rank < 3 { (h % 2 + 1) as f64 } else { 1.0 }
    } else {
        (h + 1) as f64
    }
}

fn input<T: TestElem>(rank: usize, len: usize, call: usize, op: ReduceOp) -> Vec<T> {
    (0..len)
        .map(|i| T::from_f64(value(rank, i, call, op)))
        .collect()
}

fn reference<T: TestElem>(n: usize, len: usize, call: usize, op: ReduceOp) -> Vec<T> {
    (0..len)
        .map(|i| reduced::<T>((0..n).map(|r| value(r, i, call, op)), n, op))
        .collect()
}

/// A length in elements of `elem` bytes: tiny, just under or over the 32 KiB threshold, or
/// a few times larger.
fn length(rng: &mut Rng, elem: usize) -> usize {
    let threshold = 32 * 1024 / elem;
    match rng.below(5) {
        0 => rng.below(40),
        1 => threshold - rng.below(8),
        2 => threshold + 1 + rng.below(8),
        3 => rng.below(threshold),
        _ => threshold + rng.below(6 * threshold),
    }
}

/// One call of the plan, on every rank; `what` names it (seed, call, world) for a failure.
fn call<T: TestElem>(comm: &mut Communicator, rng: &mut Rng, call: usize, what: &str) {
    let (n, r) = (comm.size(), comm.rank());
    let len = length(rng, std::mem::size_of::<T>());
    let op = OPS[rng.below(OPS.len())];
    let kind = rng.below(6);
    let what = format!("{what} {} len {len} {op:?} kind {kind}", T::DTYPE.name());
    match kind {
        0 => {
            let mut buf = input::<T>(r, len, call, op);
            comm.allreduce(&mut buf, op)
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            assert_close(&buf, &reference::<T>(n, len, call, op), &what);
        }
        1 => {
            // Grouped: three tensors, the first of the drawn length.
            let op = if op == ReduceOp::Product {
                ReduceOp::Sum
            } else {
                op
            };
            let lens = [len, len / 3 + 1, 7];
            let mut bufs: Vec<Vec<T>> = lens
                .iter()
                .enumerate()
                .map(|(k, &l)| input::<T>(r, l, call + k, op))
                .collect();
            let mut refs: Vec<&mut [T]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
            comm.grouped_allreduce(&mut refs, op)
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            for (k, (b, &l)) in bufs.iter().zip(&lens).enumerate() {
                assert_close(
                    b,
                    &reference::<T>(n, l, call + k, op),
                    &format!("{what} #{k}"),
                );
            }
        }
        2 => {
            let root = rng.below(n);
            let mut buf = if r == root {
                input::<T>(root, len, call, ReduceOp::Sum)
            } else {
                vec![T::from_f64(0.0); len]
            };
            comm.broadcast(&mut buf, root)
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            assert_close(&buf, &input::<T>(root, len, call, ReduceOp::Sum), &what);
        }
        3 => {
            // Rows of 2, a different number on every rank.
            let rows = |p: usize| (len / 2 + p * 5) % (len / 2 + 2);
            let got = comm
                .allgather(&input::<T>(r, rows(r) * 2, call, ReduceOp::Sum), 2)
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            let want: Vec<T> = (0..n)
                .flat_map(|p| input::<T>(p, rows(p) * 2, call, ReduceOp::Sum))
                .collect();
            assert_close(&got, &want, &what);
        }
        4 => {
            let got = comm
                .reducescatter(&input::<T>(r, len, call, op), op)
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            let full = reference::<T>(n, len, call, op);
            let (base, extra) = (len / n, len % n);
            let start = r * base + r.min(extra);
            assert_close(
                &got,
                &full[start..start + base + usize::from(r < extra)],
                &what,
            );
        }
        _ => comm.barrier().unwrap_or_else(|e| panic!("{what}: {e}")),
    }
}

/// Runs the plan of `seed` on this rank: every rank draws the same calls; one rank, drawn
/// per call, is late to post.
fn plan(comm: &mut Communicator, seed: u64, calls: usize, world: &str) {
    let mut rng = Rng::new(seed);
    for c in 0..calls {
        let late = rng.below(comm.size() * 3);
        if late == comm.rank() {
            thread::sleep(Duration::from_micros(200 + 100 * (seed % 20)));
        }
        let what = format!("seed {seed} call {c} {world} rank {}", comm.rank());
        match rng.below(7) {
            0 => call::<u8>(comm, &mut rng, c, &what),
            1 => call::<i32>(comm, &mut rng, c, &what),
            2 => call::<i64>(comm, &mut rng, c, &what),
            3 => call::<f16>(comm, &mut rng, c, &what),
            4 => call::<bf16>(comm, &mut rng, c, &what),
            5 => call::<f32>(comm, &mut rng, c, &what),
            _ => call::<f64>(comm, &mut rng, c, &what),
        }
    }
}

/// The world of `seed`: 1–3 hosts (127.0.0.x addresses; `first` tells worlds run at once
/// apart) of 1–4 ranks each, sometimes crowded onto one core.
fn world_of(seed: u64, first: u8) -> (Vec<String>, Option<usize>) {
    let mut rng = Rng::new(seed ^ 0x5EED);
    let hosts = 1 + rng.below(3);
    let even = rng.below(2) == 0;
    let per = 1 + rng.below(4);
    let mut ips = Vec::new();
    for h in 0..hosts {
        let k = if even { per } else { 1 + rng.below(4) };
        ips.extend((0..k).map(|_| format!("127.0.0.{}", first as usize + h)));
    }
    let cores = (rng.below(3) == 0).then_some(1);
    (ips, cores)
}

fn run(seed: u64, first: u8) {
    let (ips, cores) = world_of(seed, first);
    let ips: Vec<&str> = ips.iter().map(String::as_str).collect();
    let world = format!("{ips:?} cores {cores:?}");
    world_on(
        &ips,
        |cfg| {
            cfg.cores = cores;
            cfg.arrival_timeout = Duration::from_secs(30);
        },
        |comm| plan(comm, seed, 30, &world),
    );
}

#[test]
fn random_collectives_on_rebuilt_worlds_match_the_reference() {
    let env = |k: &str| std::env::var(k).ok().and_then(|v| v.parse::<u64>().ok());
    if let Some(seed) = env("HVD_DIFF_SEED") {
        run(seed, 20);
        return;
    }
    let rounds = env("HVD_DIFF_ROUNDS").unwrap_or(120);
    for round in 0..rounds {
        let seed = 1000 + round;
        if round % 4 == 3 {
            // Two worlds at once in this process: their calls interleave, each with its own
            // communicators, mailboxes and call numbers.
            thread::scope(|s| {
                s.spawn(|| run(seed, 20));
                s.spawn(|| run(seed + 500, 30));
            });
        } else {
            run(seed, 20);
        }
    }
}
