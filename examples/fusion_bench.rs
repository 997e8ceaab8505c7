//! A training step's gradients in a burst: 200 tensors of 64 KiB to 4 MiB (25 M f32 in all,
//! ResNet-50's size) submitted asynchronously to the background engine, against one
//! allreduce of the same bytes. Fusion should make the burst cost about as much as the one
//! big allreduce.
//!
//! ```text
//! horovodrun -np 4 -H localhost:4 target/release/examples/fusion_bench
//! ```
//!
//! With `--ranks N` the ranks are threads of this one process over loopback (no launcher):
//! the burst runs with the given knobs, or with `--tune` a sweep over a grid of fusion
//! thresholds and cycle times finds the best hand-tuned setting, and autotune, started from
//! deliberately bad knobs (no fusion, a 100 ms cycle), is compared with it:
//!
//! ```text
//! cargo run --release --example fusion_bench -- --ranks 2 --tune
//! ```

use std::time::{Duration, Instant};

use anyhow::Context;
use clap::{Parser, ValueEnum};
use std::net::TcpListener;

use hvd::{
    AutotuneConfig, Buffer, Communicator, Engine, EngineConfig, HugeBuffer, ReduceOp, Setting,
};
use hvd_collectives::CommConfig;

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
    /// Run this many ranks as threads of this process over loopback instead of under
    /// horovodrun.
    #[arg(long)]
    ranks: Option<usize>,
    /// With `--ranks`: sweep a grid of knobs, then autotune from bad knobs, and compare.
    #[arg(long)]
    tune: bool,
    /// Autotune's steps per sub-sample (`HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE`).
    #[arg(long, default_value_t = 2)]
    steps_per_sample: usize,
    /// Autotune's Bayesian samples (`HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES`).
    #[arg(long, default_value_t = 20)]
    max_samples: usize,
    /// Autotune's warm-up samples (`HOROVOD_AUTOTUNE_WARMUP_SAMPLES`).
    #[arg(long, default_value_t = 1)]
    warmup_samples: usize,
    /// Autotune's CSV log (`HOROVOD_AUTOTUNE_LOG`).
    #[arg(long)]
    autotune_log: Option<std::path::PathBuf>,
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
    hvd::install_logging("warn")?;
    if let Some(n) = args.ranks {
        return in_process(&args, n);
    }
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

/// A world of `n` ranks as threads of this process over loopback; `f` runs on each, and the
/// results come back by rank.
fn world<R: Send>(
    n: usize,
    f: impl Fn(Communicator) -> anyhow::Result<R> + Sync,
) -> anyhow::Result<Vec<R>> {
    let listeners = (0..n)
        .map(|_| TcpListener::bind(("127.0.0.1", 0)))
        .collect::<std::io::Result<Vec<_>>>()?;
    let addrs = listeners
        .iter()
        .map(TcpListener::local_addr)
        .collect::<std::io::Result<Vec<_>>>()?;
    std::thread::scope(|s| {
        let handles: Vec<_> = listeners
            .into_iter()
            .enumerate()
            .map(|(rank, l)| {
                let (addrs, f) = (&addrs, &f);
                s.spawn(move || {
                    let cfg = CommConfig::new(rank, n, "fusion-bench");
                    f(Communicator::connect(cfg, &l, addrs)?)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().map_err(|_| anyhow::anyhow!("a rank panicked"))?)
            .collect()
    })
}

/// The knobs of one hand-tuned setting.
fn knobs(fusion_mb: usize, cycle_ms: f64) -> EngineConfig {
    EngineConfig {
        fusion_bytes: fusion_mb << 20,
        cycle: Duration::from_secs_f64(cycle_ms / 1e3),
        ..EngineConfig::default()
    }
}

/// Runs `iters` bursts on a new engine over `comm`: every burst's time, and the communicator
/// back.
fn timed_all(
    comm: Communicator,
    cfg: EngineConfig,
    iters: usize,
    lens: &[usize],
) -> anyhow::Result<(Vec<Duration>, Communicator)> {
    let n = comm.size();
    let engine = Engine::start(comm, cfg)?;
    let b = bursts(&engine, iters, n, lens, |k| Ok(vec![1.0f32; k]))?;
    let comm = engine
        .stop()
        .ok_or_else(|| anyhow::anyhow!("the engine thread panicked"))?;
    Ok((b, comm))
}

/// [`timed_all`]'s median burst.
fn timed(
    comm: Communicator,
    cfg: EngineConfig,
    iters: usize,
    lens: &[usize],
) -> anyhow::Result<(Duration, Communicator)> {
    let (b, comm) = timed_all(comm, cfg, iters, lens)?;
    Ok((median(b), comm))
}

/// The engine knobs of an autotune setting.
fn knobs_of(s: &Setting) -> EngineConfig {
    EngineConfig {
        fusion_bytes: s.fusion_bytes,
        cycle: s.cycle,
        cache_capacity: if s.cache {
            EngineConfig::default().cache_capacity
        } else {
            0
        },
        ..EngineConfig::default()
    }
}

fn describe(s: &Setting) -> String {
    format!(
        "fusion {:.1} MiB, cycle {:.2} ms, cache {}",
        s.fusion_bytes as f64 / f64::from(1u32 << 20),
        s.cycle.as_secs_f64() * 1e3,
        if s.cache { "on" } else { "off" }
    )
}

/// `--ranks N`: the burst with the given knobs, or (`--tune`) the sweep against autotune.
fn in_process(args: &Args, n: usize) -> anyhow::Result<()> {
    let lens = sizes(args.tensors, args.elems);
    let gb = (args.elems * 4) as f64 / 1e9;
    let rate = |d: Duration| gb / d.as_secs_f64();
    let fusion_mb = args.fusion_mb.unwrap_or(128);
    let cycle_ms = args.cycle_ms.unwrap_or(1.0);
    if !args.tune {
        let out = world(n, |comm| {
            Ok(timed(comm, knobs(fusion_mb, cycle_ms), args.iters, &lens)?.0)
        })?;
        println!(
            "ranks {n}: burst of {} tensors, {} MB (fusion {fusion_mb} MiB, cycle {cycle_ms} ms): \
             {:.1} ms, {:.2} GB/s",
            args.tensors,
            args.elems * 4 / 1_000_000,
            out[0].as_secs_f64() * 1e3,
            rate(out[0])
        );
        return Ok(());
    }
    let grid_fusion = [0usize, 1, 4, 16, 64, 128];
    let grid_cycle = [0.5f64, 1.0, 5.0, 25.0, 100.0];
    let out = world(n, |mut comm| {
        let mut sweep = Vec::new();
        for &f in &grid_fusion {
            for &c in &grid_cycle {
                let (b, back) = timed(comm, knobs(f, c), args.iters, &lens)?;
                comm = back;
                sweep.push((f, c, b));
            }
        }
        // Autotune from bad knobs: no fusion, a 100 ms cycle.
        let cfg = EngineConfig {
            autotune: Some(AutotuneConfig {
                warmup_samples: args.warmup_samples,
                steps_per_sample: args.steps_per_sample,
                max_samples: args.max_samples,
                log: args.autotune_log.clone(),
                ..AutotuneConfig::default()
            }),
            ..knobs(0, 100.0)
        };
        let engine = Engine::start(comm, cfg)?;
        let started = Instant::now();
        let mut steps = 0usize;
        loop {
            bursts(&engine, 0, n, &lens, |k| Ok(vec![1.0f32; k]))?;
            steps += 1;
            let tuning = u8::from(engine.status().autotuning);
            let any = engine
                .allreduce_async(&format!("tuning/{steps}"), vec![tuning], ReduceOp::Max)
                .wait()?;
            if any[0] == 0 {
                break;
            }
        }
        let converged = started.elapsed();
        let setting = engine.status().setting;
        let mut comm = engine
            .stop()
            .ok_or_else(|| anyhow::anyhow!("the engine thread panicked"))?;
        // The best of the sweep against autotune's setting, in alternating rounds, so that
        // both see the same load on this machine.
        let (bf, bc, _) = best_of(&sweep)?;
        let (mut hand, mut tuned) = (Vec::new(), Vec::new());
        for _ in 0..ROUNDS {
            let (b, back) = timed_all(comm, knobs(bf, bc), args.iters, &lens)?;
            hand.extend(b);
            let (b, back) = timed_all(back, knobs_of(&setting), args.iters, &lens)?;
            tuned.extend(b);
            comm = back;
        }
        Ok((
            sweep,
            setting,
            steps,
            converged,
            median(hand),
            median(tuned),
        ))
    })?;
    let (sweep, setting, steps, converged, hand, tuned) = &out[0];
    println!(
        "ranks {n}: burst of {} tensors, {} MB; throughput = burst bytes / median burst time \
         over {} bursts",
        args.tensors,
        args.elems * 4 / 1_000_000,
        args.iters
    );
    for (f, c, b) in sweep {
        println!(
            "  hand-tuned fusion {f:>3} MiB, cycle {c:>5} ms: {:>7.1} ms, {:.3} GB/s",
            b.as_secs_f64() * 1e3,
            rate(*b)
        );
    }
    let (bf, bc, _) = best_of(sweep)?;
    println!(
        "autotune from fusion 0 MiB, cycle 100 ms: converged after {steps} bursts ({:.1} s) on \
         {}",
        converged.as_secs_f64(),
        describe(setting),
    );
    println!(
        "re-measured in {ROUNDS} alternating rounds of {} bursts each:",
        args.iters
    );
    println!(
        "  best hand-tuned (fusion {bf} MiB, cycle {bc} ms): {:.1} ms, {:.3} GB/s",
        hand.as_secs_f64() * 1e3,
        rate(*hand)
    );
    println!(
        "  autotune ({}): {:.1} ms, {:.3} GB/s",
        describe(setting),
        tuned.as_secs_f64() * 1e3,
        rate(*tuned)
    );
    println!(
        "autotune / best hand-tuned throughput: {:.3}",
        rate(*tuned) / rate(*hand)
    );
    Ok(())
}

/// Rounds of the final comparison.
const ROUNDS: usize = 3;

/// The sweep's fastest setting.
fn best_of(sweep: &[(usize, f64, Duration)]) -> anyhow::Result<(usize, f64, Duration)> {
    sweep
        .iter()
        .min_by_key(|(_, _, b)| *b)
        .copied()
        .ok_or_else(|| anyhow::anyhow!("empty sweep"))
}
