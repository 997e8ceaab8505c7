//! A training step's gradients in a burst: 200 tensors of 64 KiB to 4 MiB (25 M f32 in all,
//! ResNet-50's size) submitted asynchronously to the background engine, against one
//! allreduce of the same bytes. Fusion should make the burst cost about as much as the one
//! big allreduce.
//!
//! ```text
//! horovodrun -np 4 -H localhost:4 target/release/examples/fusion_bench
//! ```

use std::time::{Duration, Instant};

use anyhow::Context;
use clap::{Parser, ValueEnum};
use hvd::{Buffer, Engine, HugeBuffer, ReduceOp};

#[derive(Parser)]
struct Args {
    /// Number of tensors in the burst.
    #[arg(long, default_value_t = 200)]
    tensors: usize,
    /// Total f32 elements of the burst.
    #[arg(long, default_value_t = 25_000_000)]
    elems: usize,
    /// Also keep the engine idle this many seconds and report the CPU it used meanwhile.
    #[arg(long, default_value_t = 0.0)]
    idle_secs: f64,
    /// Timed repetitions (the median is reported).
    #[arg(long, default_value_t = 5)]
    iters: usize,
    /// Engine cycle in milliseconds (default: `HOROVOD_CYCLE_TIME`, else 1).
    #[arg(long)]
    cycle_ms: Option<f64>,
    /// Fusion buffer in MiB, 0 disables fusion (default: `HOROVOD_FUSION_THRESHOLD`, else 128).
    #[arg(long)]
    fusion_mb: Option<usize>,
    /// Tensors as `Vec`s from the process allocator, or `hvd::HugeBuffer`s (huge pages from
    /// 2 MiB on, as PyTorch's `THP_MEM_ALLOC_ENABLE=1` gives them).
    #[arg(long, value_enum, default_value = "malloc")]
    alloc: Alloc,
}

/// Where the tensors come from.
#[derive(Clone, Copy, ValueEnum, PartialEq)]
enum Alloc {
    Malloc,
    Huge,
}

/// Tensor lengths between 16 Ki and 1 Mi elements (64 KiB to 4 MiB of f32), log-spread and
/// scaled to `total`; the same on every rank.
fn sizes(n: usize, total: usize) -> Vec<usize> {
    let raw: Vec<f64> = (0..n)
        .map(|i| {
            let x = ((i * 7919) % n) as f64 / n.max(1) as f64;
            (16_384f64).ln() + x * ((1_048_576f64).ln() - (16_384f64).ln())
        })
        .map(f64::exp)
        .collect();
    let sum: f64 = raw.iter().sum();
    let mut out: Vec<usize> = raw
        .iter()
        .map(|r| ((r / sum) * total as f64) as usize)
        .collect();
    let short = total - out.iter().sum::<usize>();
    if let Some(first) = out.first_mut() {
        *first += short;
    }
    out
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

/// Times `iters` bursts (after one untimed) of tensors of `lens` made by `make`, checking
/// every sum over `size` ranks.
fn bursts<B: Buffer<Elem = f32>>(
    engine: &Engine,
    iters: usize,
    size: usize,
    lens: &[usize],
    make: impl Fn(usize) -> anyhow::Result<B>,
) -> anyhow::Result<Vec<Duration>> {
    let mut burst = Vec::new();
    // The gradients live across steps, as a training loop's do: each step hands the engine
    // the buffers it gave back the step before, refilled.
    let mut tensors: Vec<B> = lens
        .iter()
        .map(|&n| make(n))
        .collect::<anyhow::Result<_>>()?;
    for i in 0..=iters {
        tensors.iter_mut().for_each(|t| t.fill(1.0));
        // Everyone starts together: a barrier through the engine itself.
        engine
            .allreduce_async(&format!("start/{i}"), vec![0u8], ReduceOp::Max)
            .wait()?;
        let t = Instant::now();
        let handles: Vec<_> = tensors
            .drain(..)
            .enumerate()
            // The same names every step, as a training loop's gradients have (the response
            // cache announces them by id after the first step).
            .map(|(k, v)| engine.allreduce_async(&format!("grad{k}"), v, ReduceOp::Sum))
            .collect();
        tensors = handles
            .into_iter()
            .map(hvd::Handle::wait)
            .collect::<Result<Vec<_>, _>>()?;
        let took = t.elapsed();
        anyhow::ensure!(
            tensors.iter().all(|t| t.iter().all(|&x| x == size as f32)),
            "wrong sum"
        );
        if i > 0 {
            burst.push(took);
        }
    }
    Ok(burst)
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    hvd::init().context("hvd::init")?;
    let (rank, size) = (hvd::rank()?, hvd::size()?);
    let lens = sizes(args.tensors, args.elems);
    let mut one: Box<dyn std::ops::DerefMut<Target = [f32]>> = match args.alloc {
        Alloc::Malloc => Box::new(vec![1.0f32; args.elems]),
        Alloc::Huge => Box::new(HugeBuffer::<f32>::zeroed(args.elems)?),
    };
    let mut single = Vec::new();
    for i in 0..=args.iters {
        one.fill(1.0);
        hvd::barrier()?;
        let t = Instant::now();
        hvd::allreduce(&mut one[..], ReduceOp::Sum)?;
        if i > 0 {
            single.push(t.elapsed());
        }
    }
    let mut cfg = hvd::engine_config()?;
    if let Some(ms) = args.cycle_ms {
        cfg.cycle = Duration::from_secs_f64(ms / 1000.0);
    }
    if let Some(mb) = args.fusion_mb {
        cfg.fusion_bytes = mb << 20;
    }
    let (cycle_ms, fusion_mb) = (cfg.cycle.as_secs_f64() * 1e3, cfg.fusion_bytes >> 20);
    let engine = hvd::start_engine(cfg)?;
    let burst = match args.alloc {
        Alloc::Malloc => bursts(&engine, args.iters, size, &lens, |n| Ok(vec![1.0f32; n]))?,
        Alloc::Huge => bursts(&engine, args.iters, size, &lens, |n| {
            Ok(HugeBuffer::<f32>::zeroed(n)?)
        })?,
    };
    let idle = if args.idle_secs > 0.0 {
        let before = cpu_ns();
        std::thread::sleep(Duration::from_secs_f64(args.idle_secs));
        let used = cpu_ns().saturating_sub(before) as f64 / 1e9;
        let mut share = [used / args.idle_secs];
        // Every rank's share, averaged: what an idle engine costs each rank.
        engine
            .allreduce_async("idle-cpu", share.to_vec(), ReduceOp::Average)
            .wait()
            .map(|v| share[0] = v[0])?;
        Some(share[0])
    } else {
        None
    };
    hvd::stop_engine(engine)?;
    let (s, b) = (median(single), median(burst));
    if rank == 0 {
        println!(
            "ranks {size}: one allreduce of {} MB: {:.1} ms; burst of {} tensors (fusion {} MiB, cycle {} ms): {:.1} ms; ratio {:.2}",
            args.elems * 4 / 1_000_000,
            s.as_secs_f64() * 1e3,
            args.tensors,
            fusion_mb,
            cycle_ms,
            b.as_secs_f64() * 1e3,
            b.as_secs_f64() / s.as_secs_f64()
        );
    }
    if let (Some(share), 0) = (idle, rank) {
        println!(
            "idle engine, cycle {cycle_ms} ms: {:.1}% of a core per rank",
            share * 100.0
        );
    }
    hvd::shutdown()?;
    Ok(())
}

/// CPU time all threads of this process have used, in nanoseconds (`/proc/self/stat`,
/// whose clock ticks are 1/100 s on Linux); 0 if unknown.
fn cpu_ns() -> u64 {
    let Ok(stat) = std::fs::read_to_string("/proc/self/stat") else {
        return 0;
    };
    let fields: Vec<u64> = stat
        .rsplit_once(')')
        .map(|(_, rest)| {
            rest.split_whitespace()
                .map(|f| f.parse().unwrap_or(0))
                .collect()
        })
        .unwrap_or_default();
    let ticks = fields.get(11).copied().unwrap_or(0) + fields.get(12).copied().unwrap_or(0);
    ticks * 10_000_000
}
