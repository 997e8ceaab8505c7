//! Collective benchmark in the manner of nccl-tests' `all_reduce_perf`: sizes doubling from
//! `--min-bytes` to `--max-bytes`; per size, warm-up iterations, then `--iters` timed ones. Each
//! timed iteration fills its input, then starts after a barrier; every rank times its own call,
//! and the iteration's time is the slowest rank's. Rank 0 prints the median, algbw (bytes /
//! time) and busbw (algbw · 2(n−1)/n for allreduce, (n−1)/n for allgather, 1 for broadcast), as
//! a table or one JSON object per size. Every iteration's result is checked; a wrong one fails
//! the run.
//!
//! ```text
//! horovodrun -np 2 -H localhost:2 target/release/examples/allreduce_bench --max-bytes 67108864
//! ```
//! The last columns are rank 0's time for one plain memcpy of the same bytes, measured in the
//! same run, and its ratio to the collective's time (1.0 would be memcpy speed).
//! `examples/gloo_bench.py` measures PyTorch's Gloo backend the same way.

use std::time::Instant;

use anyhow::{Context, bail, ensure};
use clap::{Parser, ValueEnum};
use hvd::{Element, HugeBuffer, ReduceOp, bf16, f16};

#[derive(Clone, Copy, ValueEnum, PartialEq)]
enum Op {
    Allreduce,
    Broadcast,
    Allgather,
}

#[derive(Clone, Copy, ValueEnum)]
enum Dtype {
    U8,
    I32,
    I64,
    F16,
    Bf16,
    F32,
    F64,
}

/// Where the benchmark's buffers come from.
#[derive(Clone, Copy, ValueEnum, PartialEq)]
enum Alloc {
    /// `hvd::HugeBuffer`: its own mapping, advised as transparent huge pages.
    Huge,
    /// `Vec` from the process allocator (huge pages only if the allocator asks for them).
    Malloc,
}

#[derive(Parser)]
struct Args {
    #[arg(long, value_enum, default_value = "allreduce")]
    op: Op,
    #[arg(long, default_value_t = 4)]
    min_bytes: usize,
    #[arg(long, default_value_t = 256 << 20)]
    max_bytes: usize,
    #[arg(long, default_value_t = 20)]
    iters: usize,
    #[arg(long, default_value_t = 5)]
    warmup: usize,
    #[arg(long, value_enum, default_value = "f32")]
    dtype: Dtype,
    /// One JSON object per size instead of the table.
    #[arg(long)]
    json: bool,
    /// Buffers (and the memcpy reference's) as huge-page buffers or plain `Vec`s.
    #[arg(long, value_enum, default_value = "huge")]
    alloc: Alloc,
}

/// A benchmark buffer of either allocation.
enum Buf<T: Element> {
    Huge(HugeBuffer<T>),
    Malloc(Vec<T>),
}

impl<T: Element> Buf<T> {
    fn new(alloc: Alloc, len: usize) -> anyhow::Result<Self> {
        Ok(match alloc {
            Alloc::Huge => Buf::Huge(HugeBuffer::zeroed(len).context("a huge-page buffer")?),
            Alloc::Malloc => Buf::Malloc(vec![bytemuck::Zeroable::zeroed(); len]),
        })
    }
}

impl<T: Element> std::ops::Deref for Buf<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        match self {
            Buf::Huge(b) => b,
            Buf::Malloc(v) => v,
        }
    }
}

impl<T: Element> std::ops::DerefMut for Buf<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        match self {
            Buf::Huge(b) => b,
            Buf::Malloc(v) => v,
        }
    }
}

/// Element conversions the benchmark needs to fill and check buffers.
trait BenchElem: Element {
    fn of(v: f64) -> Self;
}
macro_rules! bench_elem {
    ($($t:ty => $e:expr),*) => {$(impl BenchElem for $t { fn of(v: f64) -> Self { $e(v) } })*};
}
bench_elem!(u8 => |v| v as u8, i32 => |v| v as i32, i64 => |v| v as i64, f32 => |v| v as f32,
            f64 => |v| v, f16 => f16::from_f64, bf16 => bf16::from_f64);

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    ensure!(
        args.min_bytes > 0 && args.min_bytes <= args.max_bytes,
        "need 0 < --min-bytes <= --max-bytes"
    );
    ensure!(args.iters > 0, "--iters must be at least 1");
    hvd::init().context("hvd::init")?;
    match args.dtype {
        Dtype::U8 => sweep::<u8>(&args),
        Dtype::I32 => sweep::<i32>(&args),
        Dtype::I64 => sweep::<i64>(&args),
        Dtype::F16 => sweep::<f16>(&args),
        Dtype::Bf16 => sweep::<bf16>(&args),
        Dtype::F32 => sweep::<f32>(&args),
        Dtype::F64 => sweep::<f64>(&args),
    }?;
    hvd::shutdown()?;
    Ok(())
}

fn sweep<T: BenchElem>(args: &Args) -> anyhow::Result<()> {
    let (rank, n) = (hvd::rank()?, hvd::size()?);
    let esize = size_of::<T>();
    let factor = match args.op {
        Op::Allreduce => 2.0 * (n as f64 - 1.0) / n as f64,
        Op::Allgather => (n as f64 - 1.0) / n as f64,
        Op::Broadcast => 1.0,
    };
    let name = match args.op {
        Op::Allreduce => "allreduce",
        Op::Broadcast => "broadcast",
        Op::Allgather => "allgather",
    };
    if rank == 0 && !args.json {
        println!(
            "# hvd {name}, {n} ranks, {}, median of {} iterations after {} warm-up",
            T::DTYPE,
            args.iters,
            args.warmup
        );
        println!(
            "{:>12} {:>12} {:>12} {:>10} {:>10} {:>12} {:>9}",
            "size(B)", "count", "time(us)", "algbw(GB/s)", "busbw(GB/s)", "memcpy(us)", "memcpy/op"
        );
    }
    let mut bytes = args.min_bytes;
    while bytes <= args.max_bytes {
        // Allgather moves `count` elements in all: each rank contributes count / n.
        let count = match args.op {
            Op::Allgather => (bytes / esize / n).max(1) * n,
            _ => (bytes / esize).max(1),
        };
        let size = count * esize;
        let mut times = Vec::with_capacity(args.iters);
        let mut buf = Buf::<T>::new(args.alloc, if args.op == Op::Allgather { 0 } else { count })?;
        let mut mine = Buf::<T>::new(
            args.alloc,
            if args.op == Op::Allgather {
                count / n
            } else {
                0
            },
        )?;
        let mut gathered: Vec<T> = Vec::new();
        for it in 0..args.warmup + args.iters {
            // Inputs are filled before the barrier (as gloo_bench.py does), so no rank's fill
            // is timed as another rank's wait.
            match args.op {
                Op::Allreduce => buf.fill(T::of(rank as f64 + 1.0)),
                Op::Broadcast => buf.fill(T::of(if rank == 0 { 7.0 } else { 0.0 })),
                Op::Allgather => mine.fill(T::of(rank as f64 + 1.0)),
            }
            hvd::barrier()?;
            let t0 = Instant::now();
            match args.op {
                Op::Allreduce => hvd::allreduce(&mut buf, ReduceOp::Sum)?,
                Op::Broadcast => hvd::broadcast(&mut buf, 0)?,
                Op::Allgather => gathered = hvd::allgather(&mine, 1)?,
            }
            let dt = t0.elapsed().as_secs_f64();
            if it >= args.warmup {
                times.push(dt);
            }
            let result: &[T] = if args.op == Op::Allgather {
                &gathered
            } else {
                &buf
            };
            check(args.op, result, count, n)?;
        }
        // The slowest rank's time per iteration.
        hvd::allreduce(&mut times, ReduceOp::Max)?;
        times.sort_by(f64::total_cmp);
        let median = times[times.len() / 2];
        let algbw = size as f64 / median / 1e9;
        if rank == 0 {
            // The ceiling: one plain copy of the same bytes on this machine, now.
            let memcpy = memcpy_time(args.alloc, size, args.iters.max(3))?;
            let frac = memcpy / median;
            if args.json {
                println!(
                    "{}",
                    serde_json::json!({"op": name, "impl": "hvd", "np": n, "dtype": T::DTYPE.name(), "size": size,
                        "count": count, "time_us": median * 1e6, "algbw_gbps": algbw, "busbw_gbps": algbw * factor,
                        "memcpy_us": memcpy * 1e6, "memcpy_fraction": frac})
                );
            } else {
                println!(
                    "{size:>12} {count:>12} {:>12.1} {algbw:>10.3} {:>10.3} {:>12.1} {frac:>9.2}",
                    median * 1e6,
                    algbw * factor,
                    memcpy * 1e6
                );
            }
        }
        bytes *= 2;
    }
    Ok(())
}

/// Median seconds of copying `bytes` from one buffer to another (both touched first), with
/// buffers of the same allocation as the benchmark's.
fn memcpy_time(alloc: Alloc, bytes: usize, iters: usize) -> anyhow::Result<f64> {
    let mut src = Buf::<u8>::new(alloc, bytes.max(1))?;
    src.fill(1);
    let mut dst = Buf::<u8>::new(alloc, bytes.max(1))?;
    dst.fill(0);
    let mut times: Vec<f64> = (0..iters)
        .map(|_| {
            let t = Instant::now();
            dst.copy_from_slice(&src);
            std::hint::black_box(&mut *dst);
            t.elapsed().as_secs_f64()
        })
        .collect();
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

fn check<T: BenchElem>(op: Op, buf: &[T], count: usize, n: usize) -> anyhow::Result<()> {
    if buf.len() != count {
        bail!("result has {} elements, expected {count}", buf.len());
    }
    let bad = match op {
        Op::Allreduce => {
            let want = T::of((n * (n + 1) / 2) as f64);
            buf.iter().position(|v| *v != want)
        }
        Op::Broadcast => buf.iter().position(|v| *v != T::of(7.0)),
        Op::Allgather => {
            let per = count / n;
            buf.iter()
                .enumerate()
                .position(|(i, v)| *v != T::of((i / per) as f64 + 1.0))
        }
    };
    if let Some(i) = bad {
        bail!("wrong result at element {i}: {:?}", buf[i]);
    }
    Ok(())
}
